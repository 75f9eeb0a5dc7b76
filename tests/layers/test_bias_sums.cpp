// Bias gradients summed by LayerNorm's and packed attention's backward (tests/layers/bias_sums.h)
// on the CPU, and float64 finite-difference checks through a linear layer whose output a
// LayerNorm normalises, or attention reads as qkv, where the bias's gradient comes from
// those sums.
#include "tests/layers/bias_sums.h"
#include "tests/layers/gradcheck.h"

namespace loom::test {
namespace {

const Device kCpu = Device::cpu();

TEST(BiasSums, LinearTakesTheSumsKeptOnItsOutputGradient) { expect_linear_takes_kept_sums(kCpu); }

TEST(BiasSums, LayerNormKeepsSumsOnlyWhenDeclaredInTheDtypeItWrites) { expect_layer_norm_keeps_declared_sums(kCpu); }

TEST(BiasSums, AttentionKeepsSumsOnlyWhenDeclaredInTheDtypeItComputesIn) {
  expect_attention_keeps_declared_sums(kCpu);
}

TEST(BiasSums, GptGradientsAndTrainingAgreeWithAndWithoutThem) { expect_gpt_unchanged_by_fused_sums(kCpu); }

// y = layer_norm_tee(linear(x, w, b, residual)) and then an MLP-like gelu_mlp with its own
// residual into a plain layer_norm: both products' bias gradients come from LayerNorm's sums
// (declared in f64, the dtype the kernel writes), checked against finite differences.
TEST(BiasSums, GradientsThroughTheSumsMatchFiniteDifferences) {
  OptionWith on(&Options::fused_bias_sums, true);
  manual_seed(23);
  auto leaf = [](Shape s, double scale) { return mul(randn(s, DType::f64), scale).set_requires_grad(); };
  Tensor x = leaf({5, 6}, 1), w = leaf({4, 6}, 0.4), b = leaf({4}, 0.5), residual = leaf({5, 4}, 1);
  Tensor w1 = leaf({8, 4}, 0.4), b1 = leaf({8}, 0.5), w2 = leaf({4, 8}, 0.4), b2 = leaf({4}, 0.5);
  Tensor g1 = leaf({4}, 1), g2 = leaf({4}, 1);
  auto f = [&] {
    Tensor h = linear(x, w, b, residual);
    if (h.grad_fn()) EXPECT_EQ(gradient_sums_read(h), DType::f64);
    TensorList t = layer_norm_tee(h, g1, Tensor());
    Tensor z = gelu_mlp(t[1], w1, b1, w2, b2, t[0]);
    return layer_norm(z, g2, Tensor());
  };
  expect_gradients_match_finite_differences(f, {x, w, b, residual, w1, b1, w2, b2, g1, g2},
                                            {"x", "w", "b", "residual", "w1", "b1", "w2", "b2", "g1", "g2"});
}

// packed_self_attention over linear(x, w, b), causal and not: the projection's bias
// gradient comes from the attention backward's column sums (declared in f64).
TEST(BiasSums, GradientsThroughAttentionSumsMatchFiniteDifferences) {
  OptionWith on(&Options::fused_bias_sums, true);
  for (const bool causal : {true, false}) {
    SCOPED_TRACE(causal ? "causal" : "not causal");
    manual_seed(24);
    auto leaf = [](Shape s, double scale) { return mul(randn(s, DType::f64), scale).set_requires_grad(); };
    Tensor x = leaf({2, 3, 4}, 1), w = leaf({12, 4}, 0.5), b = leaf({12}, 0.5);
    auto f = [&] {
      Tensor qkv = linear(x, w, b);
      if (qkv.grad_fn()) EXPECT_EQ(gradient_sums_read(qkv), DType::f64);
      return packed_self_attention(qkv, 2, causal);
    };
    expect_gradients_match_finite_differences(f, {x, w, b}, {"x", "w", "b"});
  }
}

}  // namespace
}  // namespace loom::test
