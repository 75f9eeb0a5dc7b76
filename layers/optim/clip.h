// Gradient clipping by global norm, torch.nn.utils.clip_grad_norm_: the L2 norm of all
// gradients taken together; when it exceeds max_norm every gradient is scaled by
// max_norm / (norm + 1e-6). Parameters without a gradient are skipped.
#pragma once

#include "../../engine/tensor.h"

namespace loom::optim {

// Returns the total norm before clipping. The squares are summed in f32 (f64 for f64
// gradients) on each gradient's device; reading the total costs one host sync.
double clip_grad_norm_(const TensorList& params, double max_norm);

// The two halves of clip_grad_norm_, for a norm taken over several processes (FSDP's shards,
// a pipeline's stages): the sum of the squares of the gradients of `params`, as a one-element
// f64 tensor on `device`, not read (the caller sums it over ranks, then reads it once); and
// the scaling of every gradient once the total norm is known.
Tensor grad_squared_sum(const TensorList& params, Device device);
void scale_grads_to_norm(const TensorList& params, double norm, double max_norm);

}  // namespace loom::optim
