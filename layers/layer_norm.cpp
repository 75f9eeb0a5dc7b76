// LayerNorm as a composite of mean, mul, rsqrt and add over the last dimension.
#include "layers/layer_norm.h"

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

Tensor LayerNorm::forward(const Tensor& input) {
  LOOM_CHECK(input.dim() >= 1 && input.size(-1) == dim_, "LayerNorm(", dim_, "): expected input of shape (..., ",
             dim_, "), got ", shape_str(input.shape()));
  Tensor centred = sub(input, mean(input, {-1}, true));           // (..., dim)
  Tensor variance = mean(mul(centred, centred), {-1}, true);       // (..., 1), correction 0
  Tensor y = mul(centred, rsqrt(add(variance, eps_)));             // (..., dim)
  return weight.defined() ? add(mul(y, weight), bias) : y;
}

}  // namespace loom::nn
