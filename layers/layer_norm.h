// LayerNorm over the last dimension, PyTorch's nn.LayerNorm(dim, eps):
//   y = (x - mean) / sqrt(var + eps) * weight + bias,
// mean and the biased variance (correction 0) taken over the last dimension of each row.
// Built from engine ops as a composite, so its gradient needs no code of its own; a fused
// kernel may replace it later and will be tested against this one.
#pragma once

#include "layers/module.h"

namespace loom::nn {

enum class Affine : bool { no = false, yes = true };

class LayerNorm : public Module {
 public:
  explicit LayerNorm(int64_t normalized_dim, double eps = 1e-5, Affine affine = Affine::yes);

  // (..., dim) -> (..., dim)
  Tensor forward(const Tensor& input) override;
  std::string type_name() const override { return "LayerNorm"; }

  Tensor weight;  // (dim,), ones; undefined with Affine::no
  Tensor bias;    // (dim,), zeros; undefined with Affine::no

 private:
  int64_t dim_;
  double eps_;
};

}  // namespace loom::nn
