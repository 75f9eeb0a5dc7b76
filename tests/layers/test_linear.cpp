// Linear: PyTorch's initialisation bounds, y = x W^T + b against a hand computation, and
// its gradients (input, weight, bias) against float64 finite differences.
#include <gtest/gtest.h>

#include <cmath>

#include "engine/autograd.h"
#include "engine/ops.h"
#include "layers/linear.h"
#include "tests/layers/gradcheck.h"

namespace loom::nn {
namespace {

TEST(LinearInit, UniformWithinOneOverSqrtFanIn) {
  manual_seed(5);
  Linear layer(64, 32);
  EXPECT_EQ(layer.weight.shape(), (Shape{32, 64}));
  EXPECT_EQ(layer.bias.shape(), (Shape{32}));
  const double bound = 1.0 / 8.0;
  double lo = 1, hi = -1;
  for (float w : layer.weight.to_vector<float>()) lo = std::min(lo, double(w)), hi = std::max(hi, double(w));
  EXPECT_GE(lo, -bound);
  EXPECT_LE(hi, bound);
  EXPECT_LT(lo, -0.9 * bound);  // 2048 draws reach near both ends
  EXPECT_GT(hi, 0.9 * bound);
  for (float b : layer.bias.to_vector<float>()) EXPECT_LE(std::abs(b), bound);
  EXPECT_FALSE(Linear(3, 2, Bias::no).bias.defined());
}

TEST(LinearForward, MatchesHandComputation) {
  Linear layer(3, 2);
  {
    NoGradGuard no_grad;
    copy_(layer.weight, from_vector(std::vector<float>{1, 2, 3, -1, 0, 0.5f}, {2, 3}));
    copy_(layer.bias, from_vector(std::vector<float>{0.25f, -2}, {2}));
  }
  Tensor x = from_vector(std::vector<float>{1, 0, -1, 2, 1, 4}, {2, 3});
  // row 0: (1*1 + 0*2 - 1*3) + 0.25 = -1.75;  (-1 + 0 - 0.5) - 2 = -3.5
  // row 1: (2 + 2 + 12) + 0.25 = 16.25;       (-2 + 0 + 2) - 2 = -2
  EXPECT_EQ(layer.forward(x).to_vector<float>(), (std::vector<float>{-1.75f, -3.5f, 16.25f, -2.0f}));
  // Leading dimensions are carried through: (2, 1, 3) -> (2, 1, 2).
  EXPECT_EQ(layer.forward(x.reshape({2, 1, 3})).shape(), (Shape{2, 1, 2}));
}

TEST(LinearForward, RejectsTheWrongFeatureCountWithBothShapes) {
  Linear layer(784, 10);
  try {
    layer.forward(zeros({8, 28, 28}));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("expected input of shape (..., 784), got (8, 28, 28)"), std::string::npos)
        << e.what();
  }
}

TEST(LinearBackward, MatchesFiniteDifferencesInFloat64) {
  manual_seed(9);
  Linear layer(4, 3);
  layer.to(DType::f64);
  Tensor x = randn({5, 4}, DType::f64).set_requires_grad();
  test::expect_gradients_match_finite_differences([&] { return layer.forward(x); }, {x, layer.weight, layer.bias},
                                                  {"input", "weight", "bias"});
}

TEST(LinearBackward, WithoutBiasMatchesFiniteDifferences) {
  manual_seed(10);
  Linear layer(3, 2, Bias::no);
  layer.to(DType::f64);
  Tensor x = randn({2, 2, 3}, DType::f64).set_requires_grad();
  test::expect_gradients_match_finite_differences([&] { return layer.forward(x); }, {x, layer.weight},
                                                  {"input", "weight"});
}

}  // namespace
}  // namespace loom::nn
