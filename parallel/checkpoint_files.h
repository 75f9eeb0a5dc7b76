// What the sharded checkpoints (sharded_checkpoint.h) and the pipeline checkpoints
// (pipeline_checkpoint.h) do alike with their folders: agree on the generation of a save
// before any rank writes, and read a tensor's rows back from the files of the ranks that
// saved them, whatever the number of those ranks.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "../engine/tensor.h"
#include "fsdp.h"
#include "process_group.h"

namespace loom::dist {

// The generation of a save into the folder `dir`: one more than the finished checkpoint's,
// whose index rank 0 of `group` reads with read_generation(index path) when the index exists
// (it throws when the index is of another kind or unreadable), sent to every rank on `device`.
// A refusal stops every rank before anything is written: rank 0's error is "<what>: " and the
// reason, the other ranks' says that rank 0 could not read the index. Every rank calls it.
int64_t agree_on_generation(const std::string& dir, const std::string& index, ProcessGroup& group, Device device,
                            const std::function<int64_t(const std::string&)>& read_generation,
                            const std::string& what);

// The rows of a tensor of `shape` as fsdp.h cuts it, seen as (rows, row_numel): a scalar is
// one row.
inline int64_t rows_of(const Shape& shape) { return shape.empty() ? 1 : shape[0]; }

// Rows [range.start, range.start + range.count) of a tensor of full shape `full` saved as
// `world` row shards (saved rank r's rows are shard_rows(n, world, r), as fsdp.h cuts them),
// copied into dst (range.count rows, any shape of that size). saved(r) gives rank r's saved
// tensor, null when it has none; file(r) names where it was looked for, in errors. Only the
// ranks whose rows overlap the range are asked.
void copy_saved_rows(const std::string& key, const Shape& full, RowRange range, int world,
                     const std::function<const Tensor*(int)>& saved, const std::function<std::string(int)>& file,
                     const Tensor& dst);

}  // namespace loom::dist
