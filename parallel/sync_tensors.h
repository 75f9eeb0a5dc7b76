// Tensors made equal on every rank of a group, in place: rank 0's values broadcast (DDP's and
// FSDP's start, DDP's buffers each step), or the ranks' values averaged (BatchNorm's running
// statistics under DDP's sync_buffers_average and FSDP's average_buffers). Tensors of one
// dtype are packed into flat buffers of at most 250 MiB (PyTorch's broadcast bucket), so that
// a model's many small tensors cost a few collectives; every rank packs the same list the
// same way, so the calls match. Every rank of the group calls it with the same list.
#pragma once

#include "../engine/tensor.h"
#include "process_group.h"

namespace loom::dist {

enum class SyncOp { broadcast_from_rank0, average };

void sync_tensors(ProcessGroup& group, const TensorList& tensors, SyncOp op);

}  // namespace loom::dist
