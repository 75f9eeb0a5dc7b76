// BatchNorm1d / BatchNorm2d: PyTorch's state-dict names and initial values, the running
// statistics after two training forwards against the update formula written out, eval
// mode normalising with them, num_batches_tracked, switching between modes, layers
// without affine parameters or running statistics, a bf16 module, float64
// finite-difference gradients, the fused forward_relu against the ops it fuses, and the
// messages for wrong input.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "engine/autograd.h"
#include "engine/ops.h"
#include "layers/batch_norm.h"
#include "tests/common/tensor_checks.h"
#include "tests/layers/gradcheck.h"

namespace loom::nn {
namespace {

// Per-channel mean and biased variance of an (N, C, ...) tensor, with plain loops.
struct ChannelStats {
  std::vector<double> mean, var;
};
ChannelStats channel_stats(const Tensor& x) {
  const int64_t n = x.size(0), c = x.size(1), s = x.numel() / (n * c);
  const std::vector<double> v = x.to(DType::f64).to_vector<double>();
  ChannelStats r{std::vector<double>(size_t(c), 0.0), std::vector<double>(size_t(c), 0.0)};
  for (int64_t ch = 0; ch < c; ++ch) {
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < s; ++j) r.mean[size_t(ch)] += v[size_t((i * c + ch) * s + j)] / double(n * s);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < s; ++j) {
        const double d = v[size_t((i * c + ch) * s + j)] - r.mean[size_t(ch)];
        r.var[size_t(ch)] += d * d / double(n * s);
      }
  }
  return r;
}

void expect_near_all(const Tensor& got, const std::vector<double>& want, double tol, const char* what) {
  const std::vector<double> g = got.to(DType::f64).to_vector<double>();
  ASSERT_EQ(g.size(), want.size()) << what;
  for (size_t i = 0; i < g.size(); ++i) EXPECT_NEAR(g[i], want[i], tol * (1 + std::abs(want[i]))) << what << "[" << i << "]";
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(BatchNormLayer, StateDictHasPytorchNamesAndInitialValues) {
  BatchNorm2d bn(3);
  const NamedTensors state = bn.state_dict();
  ASSERT_EQ(state.size(), 5u);
  const std::vector<std::string> names = {"weight", "bias", "running_mean", "running_var", "num_batches_tracked"};
  for (size_t i = 0; i < names.size(); ++i) EXPECT_EQ(state[i].first, names[i]);
  EXPECT_EQ(bn.weight.to_vector<float>(), std::vector<float>(3, 1.f));
  EXPECT_EQ(bn.bias.to_vector<float>(), std::vector<float>(3, 0.f));
  EXPECT_EQ(bn.running_mean.to_vector<float>(), std::vector<float>(3, 0.f));
  EXPECT_EQ(bn.running_var.to_vector<float>(), std::vector<float>(3, 1.f));
  EXPECT_EQ(bn.num_batches_tracked.dtype(), DType::i64);
  EXPECT_EQ(bn.num_batches_tracked.shape(), Shape{});
  EXPECT_EQ(bn.num_batches_tracked.item(), 0.0);
  EXPECT_EQ(bn.parameters().size(), 2u);
  EXPECT_EQ(bn.buffers().size(), 3u);
}

TEST(BatchNormLayer, WithoutAffineOrTrackingLeavesThoseOutOfTheStateDict) {
  EXPECT_EQ(BatchNorm2d(3, 1e-5, 0.1, Affine::no).state_dict().size(), 3u);
  BatchNorm1d plain(3, 1e-5, 0.1, Affine::no, TrackRunningStats::no);
  EXPECT_TRUE(plain.state_dict().empty());
  EXPECT_EQ(BatchNorm1d(3, 1e-5, 0.1, Affine::yes, TrackRunningStats::no).state_dict().size(), 2u);
}

TEST(BatchNormLayer, TrainingNormalisesEachChannelWithTheBatchStatistics) {
  manual_seed(3);
  BatchNorm2d bn(4);
  Tensor x = add(mul(randn({6, 4, 3, 5}), 3.0), 2.0);
  Tensor y = bn.forward(x);
  const ChannelStats s = channel_stats(y);
  expect_near_all(from_vector(s.mean, {4}), std::vector<double>(4, 0.0), 1e-5, "mean");
  expect_near_all(from_vector(s.var, {4}), std::vector<double>(4, 1.0), 1e-4, "variance");
}

TEST(BatchNormLayer, RunningStatisticsAfterTwoForwardsFollowTheUpdateFormula) {
  manual_seed(5);
  const double momentum = 0.2;
  BatchNorm2d bn(3, 1e-5, momentum);
  Tensor x1 = add(randn({4, 3, 2, 5}), 1.0), x2 = mul(randn({4, 3, 2, 5}), 2.0);
  bn.forward(x1);
  bn.forward(x2);
  const ChannelStats s1 = channel_stats(x1), s2 = channel_stats(x2);
  const double unbias = 40.0 / 39.0;  // M / (M - 1), M = N * H * W
  std::vector<double> want_mean, want_var;
  for (size_t c = 0; c < 3; ++c) {
    const double m1 = momentum * s1.mean[c], v1 = (1 - momentum) * 1.0 + momentum * s1.var[c] * unbias;
    want_mean.push_back((1 - momentum) * m1 + momentum * s2.mean[c]);
    want_var.push_back((1 - momentum) * v1 + momentum * s2.var[c] * unbias);
  }
  expect_near_all(bn.running_mean, want_mean, 1e-5, "running_mean");
  expect_near_all(bn.running_var, want_var, 1e-5, "running_var");
  EXPECT_EQ(bn.num_batches_tracked.item(), 2.0);
}

TEST(BatchNormLayer, EvalNormalisesWithTheRunningStatisticsAndCountsNothing) {
  manual_seed(7);
  BatchNorm2d bn(2, 1e-3);
  {
    NoGradGuard no_grad;
    copy_(bn.running_mean, from_vector(std::vector<float>{0.5f, -1.f}, {2}));
    copy_(bn.running_var, from_vector(std::vector<float>{4.f, 0.25f}, {2}));
    copy_(bn.weight, from_vector(std::vector<float>{2.f, 3.f}, {2}));
    copy_(bn.bias, from_vector(std::vector<float>{0.1f, -0.2f}, {2}));
  }
  bn.eval();
  Tensor x = randn({3, 2, 2, 2});
  const std::vector<float> xs = x.to_vector<float>(), y = bn.forward(x).to_vector<float>();
  const double rm[] = {0.5, -1}, rv[] = {4, 0.25}, w[] = {2, 3}, b[] = {0.1, -0.2};
  for (size_t i = 0; i < xs.size(); ++i) {
    const size_t c = i / 4 % 2;
    EXPECT_NEAR(y[i], (xs[i] - rm[c]) / std::sqrt(rv[c] + 1e-3) * w[c] + b[c], 1e-5) << i;
  }
  EXPECT_EQ(bn.num_batches_tracked.item(), 0.0);
  EXPECT_EQ(bn.running_mean.to_vector<float>(), (std::vector<float>{0.5f, -1.f}));
}

TEST(BatchNormLayer, SwitchingModesSwitchesStatistics) {
  manual_seed(9);
  BatchNorm1d bn(3);
  Tensor x = add(mul(randn({8, 3}), 2.0), 5.0);
  Tensor y_train = bn.forward(x);  // batch statistics: mean 0 per channel
  bn.eval();
  Tensor y_eval = bn.forward(x);  // running statistics after one update: far from normalised
  bn.train();
  Tensor y_again = bn.forward(x);
  const ChannelStats train = channel_stats(y_train), eval = channel_stats(y_eval);
  for (size_t c = 0; c < 3; ++c) {
    EXPECT_NEAR(train.mean[c], 0.0, 1e-5);
    EXPECT_GT(std::abs(eval.mean[c]), 1.0);
  }
  EXPECT_EQ(y_again.to_vector<float>(), y_train.to_vector<float>());
  EXPECT_EQ(bn.num_batches_tracked.item(), 2.0);
}

TEST(BatchNormLayer, WithoutRunningStatisticsEvalUsesTheBatch) {
  manual_seed(10);
  BatchNorm1d bn(2, 1e-5, 0.1, Affine::yes, TrackRunningStats::no);
  bn.eval();
  Tensor x = add(randn({5, 2, 7}), 3.0);
  const ChannelStats s = channel_stats(bn.forward(x));
  expect_near_all(from_vector(s.mean, {2}), {0.0, 0.0}, 1e-5, "mean");
}

TEST(BatchNorm1dLayer, TakesTwoAndThreeDimensionalInput) {
  manual_seed(11);
  BatchNorm1d bn(4);
  EXPECT_EQ(bn.forward(randn({6, 4})).shape(), (Shape{6, 4}));
  EXPECT_EQ(bn.forward(randn({2, 4, 9})).shape(), (Shape{2, 4, 9}));
  EXPECT_EQ(bn.num_batches_tracked.item(), 2.0);
}

TEST(BatchNormLayer, GradientsMatchFiniteDifferencesInFloat64) {
  manual_seed(12);
  for (bool training : {true, false}) {
    SCOPED_TRACE(training ? "training" : "eval");
    BatchNorm2d bn(3);
    bn.to(DType::f64);
    {
      NoGradGuard no_grad;
      normal_(bn.weight, 1.0, 0.5);
      normal_(bn.bias, 0.0, 0.5);
      uniform_(bn.running_var, 0.5, 2.0);
    }
    bn.train(training);
    Tensor x = randn({2, 3, 2, 3}, DType::f64).set_requires_grad();
    test::expect_gradients_match_finite_differences([&] { return bn.forward(x); }, {x, bn.weight, bn.bias},
                                                    {"input", "weight", "bias"});
  }
}

// forward_relu(x, r) against forward, add and relu run one after another: the same output,
// running statistics and gradients (input, residual, weight, bias), bit for bit, in every
// dtype and layout, training and eval. The residual's scale makes many sums cross zero.
TEST(BatchNormLayer, ForwardReluIsForwardAddAndReluBitForBit) {
  for (DType dtype : {DType::f32, DType::bf16, DType::f64})
    for (MemoryFormat format : {MemoryFormat::contiguous, MemoryFormat::channels_last})
      for (bool with_residual : {false, true})
        for (bool training : {true, false}) {
          SCOPED_TRACE(std::string(dtype_name(dtype)) + (format == MemoryFormat::contiguous ? "" : " channels-last") +
                       (with_residual ? " with a residual" : "") + (training ? " training" : " eval"));
          manual_seed(17);
          BatchNorm2d fused(3), apart(3);
          if (dtype == DType::f64) {
            fused.to(DType::f64);
            apart.to(DType::f64);
          }
          {
            NoGradGuard no_grad;
            normal_(fused.weight, 1.0, 0.5);
            normal_(fused.bias, 0.0, 0.5);
            uniform_(fused.running_var, 0.5, 2.0);
            for (auto [to, from] : {std::pair{apart.weight, fused.weight}, std::pair{apart.bias, fused.bias},
                                    std::pair{apart.running_var, fused.running_var}})
              copy_(to, from);
          }
          fused.train(training);
          apart.train(training);
          Tensor x0 = randn({4, 3, 5, 5}).to(dtype).contiguous(format);
          Tensor r0 = randn({4, 3, 5, 5}).to(dtype).contiguous(format);
          Tensor g = randn({4, 3, 5, 5}).to(dtype);
          auto run = [&](BatchNorm2d& bn, bool fuse) {
            Tensor x = x0.detach().set_requires_grad(), r = r0.detach().set_requires_grad();
            Tensor y = fuse ? bn.forward_relu(x, with_residual ? r : Tensor())
                            : relu(with_residual ? add(bn.forward(x), r) : bn.forward(x));
            sum(mul(y, g)).backward();
            std::vector<Tensor> out{y.detach(), bn.running_mean, bn.running_var, x.grad(), bn.weight.grad(),
                                    bn.bias.grad()};
            if (with_residual) out.push_back(r.grad());
            return out;
          };
          const std::vector<Tensor> a = run(fused, true), b = run(apart, false);
          const char* names[] = {"output", "running_mean", "running_var", "input gradient", "weight gradient",
                                 "bias gradient", "residual gradient"};
          for (size_t i = 0; i < a.size(); ++i) {
            ASSERT_TRUE(a[i].defined() && b[i].defined()) << names[i];
            EXPECT_EQ(a[i].memory_format(), b[i].memory_format()) << names[i];
            test::expect_same_bits(a[i], b[i], names[i]);
          }
        }
}

// Its gradients against finite differences, with and without a residual.
TEST(BatchNormLayer, ForwardReluGradientsMatchFiniteDifferencesInFloat64) {
  manual_seed(18);
  BatchNorm2d bn(3);
  bn.to(DType::f64);
  {
    NoGradGuard no_grad;
    normal_(bn.weight, 1.0, 0.5);
    normal_(bn.bias, 0.0, 0.5);
  }
  Tensor x = randn({2, 3, 2, 3}, DType::f64).set_requires_grad();
  Tensor r = randn({2, 3, 2, 3}, DType::f64).set_requires_grad();
  test::expect_gradients_match_finite_differences([&] { return bn.forward_relu(x, r); }, {x, r, bn.weight, bn.bias},
                                                  {"input", "residual", "weight", "bias"});
  test::expect_gradients_match_finite_differences([&] { return bn.forward_relu(x); }, {x, bn.weight, bn.bias},
                                                  {"input", "weight", "bias"});
}

TEST(BatchNormLayer, Bf16ModuleComputesInF32AndKeepsItsDtypes) {
  manual_seed(13);
  BatchNorm2d ref(3), bn(3);
  bn.to(DType::bf16);
  Tensor x = randn({4, 3, 3, 3}).to(DType::bf16);
  Tensor y_ref = ref.forward(x.to(DType::f32)), y = bn.forward(x);
  EXPECT_EQ(y.dtype(), DType::bf16);
  expect_near_all(y, y_ref.to(DType::f64).to_vector<double>(), 1e-2, "output");
  EXPECT_EQ(bn.running_mean.dtype(), DType::bf16);
  expect_near_all(bn.running_mean, ref.running_mean.to(DType::f64).to_vector<double>(), 1e-2, "running_mean");
  expect_near_all(bn.running_var, ref.running_var.to(DType::f64).to_vector<double>(), 1e-2, "running_var");
  EXPECT_EQ(bn.num_batches_tracked.dtype(), DType::i64);
  sum(y.to(DType::f32)).backward();
  ASSERT_TRUE(bn.weight.grad().defined());
  EXPECT_EQ(bn.weight.grad().dtype(), DType::bf16);
  EXPECT_EQ(bn.bias.grad().to_vector<float>(), std::vector<float>(3, 36.f));  // N * H * W
  bn.eval();
  EXPECT_EQ(bn.forward(x).dtype(), DType::bf16);
}

TEST(BatchNormLayer, WrongChannelCountSaysWhatWasExpected) {
  BatchNorm2d bn(3);
  const std::string msg = error_of([&] { bn.forward(randn({2, 4, 5, 5})); });
  EXPECT_NE(msg.find("BatchNorm2d(3) expects input (N, C, H, W) with C = 3, got (2, 4, 5, 5)"), std::string::npos)
      << msg;
  const std::string last = error_of([&] { bn.forward(randn({2, 5, 5, 3})); });
  EXPECT_NE(last.find("channels-last"), std::string::npos) << last;
  EXPECT_EQ(bn.num_batches_tracked.item(), 0.0);
}

TEST(BatchNormLayer, WrongRankSaysWhatWasExpected) {
  const std::string msg = error_of([] { BatchNorm2d(3).forward(randn({2, 3, 5})); });
  EXPECT_NE(msg.find("BatchNorm2d(3) expects input (N, C, H, W), got (2, 3, 5)"), std::string::npos) << msg;
  const std::string msg1 = error_of([] { BatchNorm1d(3).forward(randn({2, 3, 5, 5})); });
  EXPECT_NE(msg1.find("BatchNorm1d(3) expects input (N, C) or (N, C, L), got (2, 3, 5, 5)"), std::string::npos)
      << msg1;
}

TEST(BatchNormLayer, TrainingOnOneValuePerChannelThrowsAsPytorch) {
  BatchNorm1d bn(3);
  const std::string msg = error_of([&] { bn.forward(randn({1, 3})); });
  EXPECT_NE(msg.find("Expected more than 1 value per channel when training"), std::string::npos) << msg;
  bn.eval();
  EXPECT_EQ(bn.forward(randn({1, 3})).shape(), (Shape{1, 3}));
}

}  // namespace
}  // namespace loom::nn
