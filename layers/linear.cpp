// Linear: PyTorch's initialisation and a forward through the linear op (one GEMM with the
// bias in its epilogue).
#include "layers/linear.h"

#include <cmath>

#include "engine/ops.h"

namespace loom::nn {

Linear::Linear(int64_t in_features, int64_t out_features, Bias with_bias)
    : in_features_(in_features), out_features_(out_features) {
  LOOM_CHECK(in_features > 0 && out_features > 0, "Linear(", in_features, ", ", out_features,
             "): the feature counts must be positive");
  // kaiming_uniform_(a = sqrt(5)): gain sqrt(2 / (1 + 5)), bound gain * sqrt(3 / fan_in) = 1 / sqrt(fan_in).
  const double bound = 1.0 / std::sqrt(double(in_features));
  weight = Tensor::empty({out_features, in_features});
  uniform_(weight, -bound, bound);
  register_parameter("weight", weight);
  if (with_bias == Bias::yes) {
    bias = Tensor::empty({out_features});
    uniform_(bias, -bound, bound);
    register_parameter("bias", bias);
  }
}

Tensor Linear::forward(const Tensor& input) { return forward(input, Tensor()); }

Tensor Linear::forward(const Tensor& input, const Tensor& residual) {
  LOOM_CHECK(input.dim() >= 1 && input.size(-1) == in_features_, "Linear(", in_features_, ", ", out_features_,
             "): expected input of shape (..., ", in_features_, "), got ", shape_str(input.shape()));
  return linear(input, weight, bias, residual);
}

}  // namespace loom::nn
