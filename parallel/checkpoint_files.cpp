// The generation agreement and the row reader shared by the sharded and the pipeline
// checkpoints (checkpoint_files.h).
#include "parallel/checkpoint_files.h"

#include <algorithm>
#include <filesystem>
#include <vector>

#include "engine/ops.h"

namespace loom::dist {

int64_t agree_on_generation(const std::string& dir, const std::string& index, ProcessGroup& group, Device device,
                            const std::function<int64_t(const std::string&)>& read_generation,
                            const std::string& what) {
  int64_t generation = 1;
  std::string refusal;
  if (group.rank() == 0 && std::filesystem::exists(index)) {
    try {
      generation = read_generation(index) + 1;
    } catch (const Error& e) {
      refusal = e.what();
      generation = 0;  // stands for the refusal on the other ranks
    }
  }
  Tensor g = from_vector(std::vector<int64_t>{generation}, {1}).to(device);
  group.broadcast(g, 0)->wait();
  generation = int64_t(g.item());
  LOOM_CHECK(generation > 0, what, ": ",
             group.rank() == 0 ? refusal
                               : "rank 0 could not read the index in " + dir + " and saved nothing (its message says why)");
  return generation;
}

void copy_saved_rows(const std::string& key, const Shape& full, RowRange range, int world,
                     const std::function<const Tensor*(int)>& saved, const std::function<std::string(int)>& file,
                     const Tensor& dst) {
  const int64_t n = rows_of(full), row_numel = n == 0 ? 0 : shape_numel(full) / n;
  Tensor into = dst.reshape({range.count, row_numel});
  for (int r = 0; r < world; ++r) {
    const RowRange theirs = shard_rows(n, world, r);
    const int64_t lo = std::max(theirs.start, range.start);
    const int64_t hi = std::min(theirs.start + theirs.count, range.start + range.count);
    if (lo >= hi) continue;
    const Tensor* src = saved(r);
    LOOM_CHECK(src != nullptr, "checkpoint: ", file(r), " has no ", key);
    LOOM_CHECK(src->numel() == theirs.count * row_numel, "checkpoint: ", key, " in ", file(r), " has ", src->numel(),
               " elements, expected ", theirs.count * row_numel);
    copy_(into.slice(0, lo - range.start, hi - range.start),
          src->reshape({theirs.count, row_numel}).slice(0, lo - theirs.start, hi - theirs.start));
  }
}

}  // namespace loom::dist
