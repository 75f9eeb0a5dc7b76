// Mixed precision by autocast, PyTorch's torch.autocast(dtype=torch.bfloat16) for the ops
// that carry a CNN or a transformer's arithmetic: inside an AutocastGuard, matmul and conv2d
// compute in the guard's dtype (bf16 or f16), casting their f32 operands on the way in.
// The casts are the differentiable to(dtype), so gradients flow back to f32 parameters in
// f32 — the "master weights" the optimizer updates — while the products run on 16-bit
// tensor cores. Every other op keeps its inputs' dtypes (a 16-bit activation meeting an f32
// tensor promotes to f32, as in PyTorch), so normalisation, softmax and losses stay exact.
//
// The guard is per thread and nests; AutocastGuard(std::nullopt) turns autocast off inside.
#pragma once

#include <optional>

#include "kernels/core/dtype.h"

namespace loom {

class AutocastGuard {
 public:
  explicit AutocastGuard(std::optional<DType> dtype);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  std::optional<DType> previous_;
};

// The dtype autocast computes in on this thread, if any.
std::optional<DType> autocast_dtype();

// The dtype an autocast op computes in given its operands' promoted dtype `t`: the autocast
// dtype for f32 under a guard, else `t` unchanged (f64 stays f64, as in PyTorch).
DType autocast_compute_dtype(DType t);

}  // namespace loom
