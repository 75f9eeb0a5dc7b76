// Gradient clipping by global norm, torch.nn.utils.clip_grad_norm_: the L2 norm of all
// gradients taken together; when it exceeds max_norm every gradient is scaled by
// max_norm / (norm + 1e-6). Parameters without a gradient are skipped.
//
// Everything happens on the gradients' device and nothing is read on the host: the norm is
// returned as a tensor, and the scale factor, min(1, max_norm / (norm + 1e-6)), is a tensor
// every gradient is multiplied by in place, in f32 (f64 for f64 gradients) and rounded once
// to the gradient's dtype, as a multiply by a host scalar computes it (by exactly 1 when the
// norm is within max_norm, which changes no value). So clipping costs a training step no host synchronisation, and a step
// that clips can be captured as a CUDA graph (layers/optim/captured_step.h).
#pragma once

#include "../../engine/tensor.h"

namespace loom::optim {

// Returns the total norm before clipping: a one-element f64 tensor on the first gradient's
// device (the CPU when no parameter has a gradient). The squares are summed in f32 (f64 for
// f64 gradients) on each gradient's device. Read it with .item() where the number is
// wanted; that read waits for the device.
Tensor clip_grad_norm_(const TensorList& params, double max_norm);

// The two halves of clip_grad_norm_, for a norm taken over several processes (FSDP's shards,
// a pipeline's stages): the sum of the squares of the gradients of `params`, as a one-element
// f64 tensor on `device`, not read (the caller sums it over ranks); and the scaling of every
// gradient once the total norm (a one-element f64 tensor, as sqrt of that sum) is known.
Tensor grad_squared_sum(const TensorList& params, Device device);
void scale_grads_to_norm(const TensorList& params, const Tensor& norm, double max_norm);

}  // namespace loom::optim
