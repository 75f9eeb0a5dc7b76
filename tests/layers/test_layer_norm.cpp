// LayerNorm: the forward against its formula written out per row, gradients (input,
// weight, bias) against float64 finite differences, and the output dtypes of forward() and
// forward_for_product() with and without autocast.
#include <gtest/gtest.h>

#include <cmath>

#include "engine/autocast.h"
#include "engine/autograd.h"
#include "engine/ops.h"
#include "layers/layer_norm.h"
#include "tests/layers/gradcheck.h"

namespace loom::nn {
namespace {

TEST(LayerNormForward, MatchesFormulaPerRow) {
  manual_seed(4);
  const int64_t rows = 6, dim = 5;
  LayerNorm norm(dim, 1e-5);
  {
    NoGradGuard no_grad;
    normal_(norm.weight, 1.0, 0.5);
    normal_(norm.bias, 0.0, 0.5);
  }
  Tensor x = mul(randn({2, 3, dim}), 3.0);
  std::vector<float> xs = x.to_vector<float>(), y = norm.forward(x).to_vector<float>();
  std::vector<float> w = norm.weight.to_vector<float>(), b = norm.bias.to_vector<float>();
  for (int64_t r = 0; r < rows; ++r) {
    double mean = 0, var = 0;
    for (int64_t j = 0; j < dim; ++j) mean += xs[r * dim + j] / double(dim);
    for (int64_t j = 0; j < dim; ++j) var += (xs[r * dim + j] - mean) * (xs[r * dim + j] - mean) / double(dim);
    for (int64_t j = 0; j < dim; ++j) {
      double expected = (xs[r * dim + j] - mean) / std::sqrt(var + 1e-5) * w[j] + b[j];
      EXPECT_NEAR(y[r * dim + j], expected, 1e-5) << "row " << r << ", column " << j;
    }
  }
}

TEST(LayerNormForward, WithoutAffineHasZeroMeanUnitVariance) {
  LayerNorm norm(8, 0.0, Affine::no);
  EXPECT_EQ(norm.num_parameters(), 0);
  std::vector<float> y = norm.forward(from_vector(std::vector<float>{1, 2, 3, 4, 5, 6, 7, 9}, {1, 8})).to_vector<float>();
  double mean = 0, sq = 0;
  for (float v : y) mean += v / 8.0, sq += double(v) * v / 8.0;
  EXPECT_NEAR(mean, 0, 1e-6);
  EXPECT_NEAR(sq, 1, 1e-5);
}

TEST(LayerNormBackward, MatchesFiniteDifferencesInFloat64) {
  manual_seed(12);
  LayerNorm norm(6, 1e-5);
  norm.to(DType::f64);
  {
    NoGradGuard no_grad;
    normal_(norm.weight, 1.0, 0.5);
    normal_(norm.bias, 0.0, 0.5);
  }
  Tensor x = randn({3, 6}, DType::f64).set_requires_grad();
  test::expect_gradients_match_finite_differences([&] { return norm.forward(x); }, {x, norm.weight, norm.bias},
                                                  {"input", "weight", "bias"});
}

TEST(LayerNormForProduct, GivesTheAutocastDtypeOnlyForF32InputUnderAutocast) {
  manual_seed(9);
  LayerNorm norm(8);
  Tensor x = randn({3, 8});
  EXPECT_EQ(norm.forward_for_product(x).dtype(), DType::f32);
  {
    AutocastGuard autocast(DType::bf16);
    EXPECT_EQ(norm.forward(x).dtype(), DType::f32);
    EXPECT_EQ(norm.forward_for_product(x).dtype(), DType::bf16);
    EXPECT_EQ(norm.forward_for_product(x.to(DType::f16)).dtype(), DType::f16);
    EXPECT_EQ(norm.forward_for_product(x.to(DType::f64)).dtype(), DType::f64);
  }
  AutocastGuard autocast(DType::f16);
  EXPECT_EQ(norm.forward_for_product(x).dtype(), DType::f16);
}

TEST(LayerNormForProduct, MatchesForwardRoundedAndTrainsF32Parameters) {
  manual_seed(10);
  LayerNorm norm(16);
  Tensor x = randn({4, 16}).set_requires_grad();
  std::vector<float> want = norm.forward(x).to_vector<float>();
  AutocastGuard autocast(DType::bf16);
  Tensor y = norm.forward_for_product(x);
  std::vector<float> got = y.to_vector<float>();
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 8e-3 * (1 + std::abs(want[i]))) << i;
  sum(y.to(DType::f32)).backward();
  ASSERT_TRUE(norm.weight.grad().defined());
  EXPECT_EQ(norm.weight.grad().dtype(), DType::f32);
  EXPECT_EQ(x.grad().dtype(), DType::f32);
}

}  // namespace
}  // namespace loom::nn
