// LayerNorm over the last dimension, PyTorch's nn.LayerNorm(dim, eps):
//   y = (x - mean) / sqrt(var + eps) * weight + bias,
// mean and the biased variance (correction 0) taken over the last dimension of each row.
// It calls the fused layer_norm op (one kernel forward, one fused backward); the parameters
// keep their own dtype (f32 unless the module is converted) whatever the activations' dtype.
//
// forward() returns x's dtype, under autocast too: for the f32 residual stream of a
// mixed-precision model that is PyTorch's f32 (its autocast runs layer_norm in f32; a 16-bit
// x stays 16-bit here). A caller whose next step is a matrix product (a transformer block's
// attention or MLP input) calls forward_for_product() instead: under autocast it gets the
// 16-bit compute dtype straight from the kernel, so the product need not cast an f32 copy
// first; outside autocast the two are the same.
#pragma once

#include "module.h"

namespace loom::nn {

enum class Affine : bool { no = false, yes = true };

class LayerNorm : public Module {
 public:
  explicit LayerNorm(int64_t normalized_dim, double eps = 1e-5, Affine affine = Affine::yes);

  // (..., dim) -> (..., dim), in x's dtype
  Tensor forward(const Tensor& input) override;
  // (..., dim) -> (..., dim), in the autocast compute dtype when autocast is on and the input
  // is f32, else in x's dtype.
  Tensor forward_for_product(const Tensor& input);
  // {input, forward_for_product(input)} through layer_norm_tee: a pre-norm residual block
  // adds the first back as its residual, and the two gradients of input meet in the kernel.
  TensorList tee_for_product(const Tensor& input);
  std::string type_name() const override { return "LayerNorm"; }

  Tensor weight;  // (dim,), ones; undefined with Affine::no
  Tensor bias;    // (dim,), zeros; undefined with Affine::no

 private:
  Tensor run(const Tensor& input, DType out_dtype);

  int64_t dim_;
  double eps_;
};

}  // namespace loom::nn
