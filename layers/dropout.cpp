// Dropout as a composite: a 0/1 mask scaled by 1/(1-p) multiplies the input, so the
// gradient (the same mask) comes from mul. A fused kernel may replace it where a
// measurement asks for one.
#include "layers/dropout.h"

#include "engine/ops.h"

namespace loom::nn {

Dropout::Dropout(double p) : p_(p) {
  LOOM_CHECK(p >= 0 && p <= 1, "Dropout(", p, "): p is a probability, in [0, 1]");
}

Tensor Dropout::forward(const Tensor& input) {
  if (!is_training() || p_ == 0) return input;
  if (p_ == 1) return mul(input, 0.0);
  // Keep where u < 1 - p: probability 1 - p, as torch's bernoulli_(1 - p).
  Tensor keep = lt(rand(input.shape(), DType::f32, input.device()), 1.0 - p_);
  return mul(input, mul(keep.to(input.dtype()), 1.0 / (1.0 - p_)));
}

}  // namespace loom::nn
