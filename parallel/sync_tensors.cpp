// sync_tensors: packs of one dtype, one collective each (sync_tensors.h).
#include "parallel/sync_tensors.h"

#include <map>

#include "engine/autograd.h"
#include "engine/ops.h"

namespace loom::dist {

namespace {

// Tensors broadcast or averaged together (parameters at construction, buffers each step)
// are packed into flat buffers of at most this many bytes (PyTorch's broadcast bucket).
constexpr size_t kCoalesceBytes = size_t(250) << 20;

}  // namespace

void sync_tensors(ProcessGroup& group, const TensorList& tensors, SyncOp op) {
  NoGradGuard no_grad;
  struct Pack {
    TensorList members;
    size_t bytes = 0;
    Tensor flat;
    WorkPtr work;
  };
  std::vector<Pack> packs;
  std::map<DType, size_t> open;  // dtype -> the pack still taking tensors of it
  for (const Tensor& t : tensors) {
    if (t.numel() == 0) continue;
    auto it = open.find(t.dtype());
    if (it == open.end() || packs[it->second].bytes + t.nbytes() > kCoalesceBytes) {
      open[t.dtype()] = packs.size();
      packs.emplace_back();
    }
    Pack& pack = packs[open[t.dtype()]];
    pack.members.push_back(t);
    pack.bytes += t.nbytes();
  }
  for (Pack& pack : packs) {
    if (pack.members.size() == 1) {
      pack.flat = pack.members[0];
    } else {
      TensorList flat;
      for (const Tensor& t : pack.members) flat.push_back(t.reshape({t.numel()}));
      pack.flat = cat(flat, 0);
    }
    pack.work = op == SyncOp::average ? group.all_reduce(pack.flat, ReduceOp::avg) : group.broadcast(pack.flat, 0);
  }
  for (Pack& pack : packs) {
    pack.work->wait();
    if (pack.members.size() == 1) continue;
    int64_t offset = 0;
    for (const Tensor& t : pack.members) {
      copy_(t, pack.flat.slice(0, offset, offset + t.numel()).view(t.shape()));
      offset += t.numel();
    }
  }
}


}  // namespace loom::dist
