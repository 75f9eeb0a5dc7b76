// A float64 central finite-difference check for layer tests: the gradient of
// L = sum(f() * w), w a fixed random weight, with respect to each f64 leaf, against
// (L(x + h) - L(x - h)) / 2h element by element. f reads the leaves itself (module
// parameters or inputs), so perturbing a leaf's data in place is seen by the next call.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>

#include "engine/autograd.h"
#include "engine/ops.h"

namespace loom::test {

inline void expect_gradients_match_finite_differences(const std::function<Tensor()>& f, const TensorList& leaves,
                                                      const std::vector<std::string>& names) {
  for (const Tensor& t : leaves) {
    ASSERT_EQ(t.dtype(), DType::f64);
    ASSERT_TRUE(t.is_contiguous() && t.requires_grad());
    Tensor(t).zero_grad();
  }
  Tensor out = f();
  manual_seed(11);
  const Tensor weight = randn(out.shape(), DType::f64);
  sum(mul(out, weight)).backward();
  auto loss = [&] {
    NoGradGuard no_grad;
    return sum(mul(f(), weight)).item();
  };
  constexpr double h = 1e-6;
  for (size_t k = 0; k < leaves.size(); ++k) {
    ASSERT_TRUE(leaves[k].grad().defined()) << names[k] << " got no gradient";
    std::vector<double> analytic = leaves[k].grad().to_vector<double>();
    double* x = leaves[k].data<double>();
    for (int64_t i = 0; i < leaves[k].numel(); ++i) {
      const double saved = x[i];
      x[i] = saved + h;
      const double up = loss();
      x[i] = saved - h;
      const double down = loss();
      x[i] = saved;
      const double numeric = (up - down) / (2 * h);
      EXPECT_NEAR(analytic[i], numeric, 1e-6 + 1e-5 * std::abs(numeric)) << names[k] << ", element " << i;
    }
  }
}

}  // namespace loom::test
