// LayerNorm as a call of the fused layer_norm op; the shape check is the layer's, so its
// message names the layer's configured size.
#include "layers/layer_norm.h"

#include "engine/autocast.h"
#include "engine/ops.h"

namespace loom::nn {

LayerNorm::LayerNorm(int64_t normalized_dim, double eps, Affine affine) : dim_(normalized_dim), eps_(eps) {
  LOOM_CHECK(normalized_dim > 0, "LayerNorm(", normalized_dim, "): the normalised size must be positive");
  LOOM_CHECK(eps >= 0, "LayerNorm: eps must not be negative, got ", eps);
  if (affine == Affine::yes) {
    weight = register_parameter("weight", ones({normalized_dim}));
    bias = register_parameter("bias", zeros({normalized_dim}));
  }
}

Tensor LayerNorm::forward(const Tensor& input) { return run(input, input.dtype()); }

Tensor LayerNorm::forward_for_product(const Tensor& input) {
  return run(input, input.dtype() == DType::f32 ? autocast_compute_dtype(DType::f32) : input.dtype());
}

TensorList LayerNorm::tee_for_product(const Tensor& input) {
  LOOM_CHECK(input.dim() >= 1 && input.size(-1) == dim_, "LayerNorm(", dim_, "): expected input of shape (..., ",
             dim_, "), got ", shape_str(input.shape()));
  const DType out = input.dtype() == DType::f32 ? autocast_compute_dtype(DType::f32) : input.dtype();
  return layer_norm_tee(input, weight, bias, eps_, out);
}

Tensor LayerNorm::run(const Tensor& input, DType out_dtype) {
  LOOM_CHECK(input.dim() >= 1 && input.size(-1) == dim_, "LayerNorm(", dim_, "): expected input of shape (..., ",
             dim_, "), got ", shape_str(input.shape()));
  return layer_norm(input, weight, bias, eps_, out_dtype);
}

}  // namespace loom::nn
