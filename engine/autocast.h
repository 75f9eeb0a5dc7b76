// Mixed precision by autocast, PyTorch's torch.autocast(dtype=torch.bfloat16) for the ops
// that carry a CNN or a transformer's arithmetic: inside an AutocastGuard, matmul and conv2d
// compute in the guard's dtype (bf16 or f16), casting their f32 operands on the way in.
// The casts are the differentiable to(dtype), so gradients flow back to f32 parameters in
// f32 — the "master weights" the optimizer updates — while the products run on 16-bit
// tensor cores. Every other op keeps its inputs' dtypes (a 16-bit activation meeting an f32
// tensor promotes to f32, as in PyTorch), so normalisation, softmax and losses stay exact.
//
// The guard is per thread and nests; AutocastGuard(std::nullopt) turns autocast off inside.
//
// Weight copies: the products that take f32 parameters straight (ops::param: linear,
// gelu_mlp, linear_cross_entropy) keep the 16-bit copy they read on the parameter and
// reuse it while the parameter's storage is unchanged (Storage::version), instead of
// casting every weight again at every forward. The optimizers write a fresh copy in the
// same kernel that updates the parameter (2 bytes more a element), so a training step
// makes no weight casts. A kept copy costs 2 bytes a parameter element for as long as the
// parameter lives; Options::autocast_weight_copies (engine/options.h) turns this off (a
// cast at every use, nothing kept).
//
// Gradient copies: the gradient an autocast product's backward reads in 16 bits (its f32
// residual output's: set_gradient_read_dtype, engine/autograd.h) is written a second time,
// rounded, by the LayerNorm backward that computes it, and kept on it the same way; the
// product takes it through cast_or_kept instead of a cast pass (in a GPT, two passes a
// block over (B T, C) f32). Options::autocast_gradient_copies turns this off. Values are
// the same either way: the copy is the stored f32 gradient rounded as the cast rounds it.
#pragma once

#include <optional>

#include "../kernels/core/dtype.h"

namespace loom {

class Tensor;

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

// x.to(dtype), or the copy kept on x (set_weight_copy) when it is still valid, has that
// dtype and no gradient needs to flow through the cast.
Tensor cast_or_kept(const Tensor& x, DType dtype);

// p in `dtype`, with no autograd node: p itself when it has that dtype; else p's kept copy
// while it is valid, else a new cast, kept on p when p is a parameter (a leaf that
// requires a gradient) and Options::autocast_weight_copies is on.
Tensor weight_copy(const Tensor& p, DType dtype);

// p's kept copy while it is valid (p's storage unchanged since), else undefined; makes none.
Tensor kept_weight_copy(const Tensor& p);

// For optimizers, which refresh copies as they update: the dtype of the copy p keeps
// (valid or not), if any; and `copy` recorded as p's copy of p's values as of now.
std::optional<DType> weight_copy_dtype(const Tensor& p);
void set_weight_copy(const Tensor& p, const Tensor& copy);

}  // namespace loom
