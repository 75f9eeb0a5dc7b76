// Each performance option (engine/options.h) flipped within one process, through the ops
// as a program calls them: both ways give the same values within their rounding, and the
// deterministic attention backward and GEMMs without autotuning repeat bit for bit.
#include <gtest/gtest.h>

#include <array>
#include <string>
#include <tuple>
#include <vector>

#include "engine/autograd.h"
#include "engine/ops.h"
#include "engine/options.h"
#include "tests/common/gpu.h"
#include "tests/common/tensor_checks.h"

namespace loom {
namespace {

const Device kGpu = Device::cuda(0);

// The options in force with one change, for an OptionsGuard.
Options with(bool Options::*option, bool value) {
  Options o = options();
  o.*option = value;
  return o;
}

std::vector<float> values(const Tensor& t) { return t.to(Device::cpu()).to(DType::f32).to_vector<float>(); }

void expect_same_bits(const Tensor& a, const Tensor& b, const std::string& what) {
  const std::vector<float> va = values(a), vb = values(b);
  ASSERT_EQ(va.size(), vb.size()) << what;
  for (size_t i = 0; i < va.size(); ++i) ASSERT_EQ(va[i], vb[i]) << what << ", element " << i;
}

// The gradient of a weighted sum of packed_self_attention over a GPT-2-shaped qkv (tensor
// cores: bf16, head_dim 64), under the options in force as the backward runs.
Tensor attention_gradient(const Tensor& qkv_value, const Tensor& weights) {
  Tensor qkv = qkv_value.detach().set_requires_grad();
  Tensor out = packed_self_attention(qkv, 4, true);
  out.backward(weights);
  return qkv.grad();
}

TEST(OptionsCuda, DeterministicAttentionBackwardRepeatsAndAgreesWithAtomics) {
  LOOM_REQUIRE_CUDA();
  manual_seed(1);
  const Tensor qkv = randn({2, 1024, 3 * 256}).to(DType::bf16).to(kGpu);
  const Tensor w = randn({2, 1024, 256}).to(DType::bf16).to(kGpu);
  const Tensor atomics = attention_gradient(qkv, w);
  OptionsGuard guard(with(&Options::deterministic, true));
  const Tensor first = attention_gradient(qkv, w), second = attention_gradient(qkv, w);
  expect_same_bits(first, second, "two deterministic backwards");
  test::expect_close_to_scale(first, atomics.to(Device::cpu()), 4e-2, "deterministic against atomics");
}

TEST(OptionsCuda, GemmWithoutAutotuningRepeatsAndAgreesWithTuned) {
  LOOM_REQUIRE_CUDA();
  manual_seed(2);
  // A shape of its own, so its plan is made here: (dY^T X) of a weight gradient over a long k.
  const Tensor a = randn({6144, 136}).to(DType::bf16).to(kGpu), b = randn({6144, 200}).to(DType::bf16).to(kGpu);
  auto product = [&] { return matmul(a.t(), b); };
  Tensor first, again;
  {
    OptionsGuard guard(with(&Options::gemm_autotuning, false));
    first = product();
  }
  const Tensor tuned = product();
  {
    OptionsGuard guard(with(&Options::gemm_autotuning, false));
    again = product();
  }
  expect_same_bits(first, again, "the heuristic's first choice, before and after tuning");
  test::expect_close_to_scale(tuned, first.to(Device::cpu()), 2e-2, "tuned against the first choice");
}

// A convolution's output and its two gradients, from one forward and backward.
struct ConvResult {
  Tensor y, dx, dw;
};
ConvResult conv_step(const Tensor& x, const Tensor& w, const Tensor& gy, std::array<int, 2> stride,
                     std::array<int, 2> padding) {
  Tensor xi = x.detach().set_requires_grad(), wi = w.detach().set_requires_grad();
  Tensor y = conv2d(xi, wi, Tensor(), stride, padding);
  y.backward(gy);
  return ConvResult{y, xi.grad(), wi.grad()};
}

TEST(OptionsCuda, ConvolutionsAgreeWithAndWithoutTheGraphApi) {
  LOOM_REQUIRE_CUDA();
  manual_seed(3);
  const Tensor x = randn({8, 16, 20, 20}).to(kGpu), w = mul(randn({32, 16, 3, 3}), 0.2).to(kGpu);
  const Tensor gy = randn({8, 32, 10, 10}).to(kGpu);
  auto run = [&] { return conv_step(x, w, gy, {2, 2}, {1, 1}); };
  const ConvResult graph = run();
  OptionsGuard guard(with(&Options::cudnn_graph_api, false));
  const ConvResult legacy = run();
  test::expect_close_to_scale(legacy.y, graph.y.to(Device::cpu()), 5e-3, "y");
  test::expect_close_to_scale(legacy.dx, graph.dx.to(Device::cpu()), 5e-3, "dx");
  test::expect_close_to_scale(legacy.dw, graph.dw.to(Device::cpu()), 5e-3, "dw");
}

// Autotuned convolutions (the fastest of cuDNN's candidate plans, timed on the first call of
// each shape) agree with the heuristics' first choice within TF32's rounding, and the first
// choice is still what runs with the option off after timing has chosen: the same bits.
// Deterministic engines only, so that one plan gives one result. A shape of SimpleCNN's
// second layer at a training batch, where cuDNN offers several plans.
TEST(OptionsCuda, AutotunedConvolutionsAgreeAndLeaveTheFirstChoiceAsItWas) {
  LOOM_REQUIRE_CUDA();
  OptionsGuard deterministic(with(&Options::deterministic, true));
  manual_seed(4);
  const Tensor x = randn({64, 32, 15, 15}).to(kGpu), w = mul(randn({64, 32, 3, 3}), 0.1).to(kGpu);
  const Tensor gy = randn({64, 64, 13, 13}).to(kGpu);
  auto run = [&] { return conv_step(x, w, gy, {1, 1}, {0, 0}); };
  ConvResult first, again;
  {
    OptionsGuard guard(with(&Options::conv_autotuning, false));
    first = run();
  }
  const ConvResult tuned = run(), tuned_again = run();
  {
    OptionsGuard guard(with(&Options::conv_autotuning, false));
    again = run();
  }
  for (auto [a, b, what] : {std::tuple{first.y, again.y, "y"}, {first.dx, again.dx, "dx"}, {first.dw, again.dw, "dw"}})
    expect_same_bits(a, b, std::string("the first choice before and after tuning, ") + what);
  for (auto [a, b, what] :
       {std::tuple{tuned.y, tuned_again.y, "y"}, {tuned.dx, tuned_again.dx, "dx"}, {tuned.dw, tuned_again.dw, "dw"}})
    expect_same_bits(a, b, std::string("the tuned choice, kept: ") + what);
  test::expect_close_to_scale(tuned.y, first.y.to(Device::cpu()), 5e-3, "y");
  test::expect_close_to_scale(tuned.dx, first.dx.to(Device::cpu()), 5e-3, "dx");
  test::expect_close_to_scale(tuned.dw, first.dw.to(Device::cpu()), 5e-3, "dw");
}

}  // namespace
}  // namespace loom
