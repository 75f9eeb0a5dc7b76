// Gradient clipping by global norm, torch.nn.utils.clip_grad_norm_: the L2 norm of all
// gradients taken together; when it exceeds max_norm every gradient is scaled by
// max_norm / (norm + 1e-6). Parameters without a gradient are skipped.
#pragma once

#include "../../engine/tensor.h"

namespace loom::optim {

// Returns the total norm before clipping. The squares are summed in f32 (f64 for f64
// gradients) on each gradient's device; reading the total costs one host sync.
double clip_grad_norm_(const TensorList& params, double max_norm);

}  // namespace loom::optim
