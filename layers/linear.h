// Linear: y = x @ W^T + b, PyTorch's nn.Linear, with its default initialisation
// (kaiming_uniform_ with a = sqrt(5), which comes to U(-1/sqrt(in), 1/sqrt(in)) for the
// weight, and the same bound for the bias), so models start where PyTorch's would.
#pragma once

#include "module.h"

namespace loom::nn {

enum class Bias : bool { no = false, yes = true };

class Linear : public Module {
 public:
  Linear(int64_t in_features, int64_t out_features, Bias bias = Bias::yes);

  // (..., in) -> (..., out)
  Tensor forward(const Tensor& input) override;
  // residual + forward(input), the sum made by the product (linear's residual).
  Tensor forward(const Tensor& input, const Tensor& residual);
  std::string type_name() const override { return "Linear"; }

  int64_t in_features() const { return in_features_; }
  int64_t out_features() const { return out_features_; }

  Tensor weight;  // (out, in)
  Tensor bias;    // (out,); undefined with Bias::no

 private:
  int64_t in_features_, out_features_;
};

}  // namespace loom::nn
