// Learning-rate schedules at chosen steps against torch.optim.lr_scheduler's formulas
// (values worked out from the formulas in the comments), the scheduler driving an
// optimizer, and clip_grad_norm_.
#include <gtest/gtest.h>

#include <cmath>

#include "engine/ops.h"
#include "layers/optim/clip.h"
#include "layers/optim/schedule.h"
#include "layers/optim/sgd.h"

namespace loom::optim {
namespace {

TEST(ScheduleStepLR, DecaysByGammaEveryStepSize) {
  Schedule s = step_lr(30, 0.1);  // 0.1 * 0.1^floor(step / 30)
  EXPECT_DOUBLE_EQ(s(0, 0.1), 0.1);
  EXPECT_DOUBLE_EQ(s(29, 0.1), 0.1);
  EXPECT_DOUBLE_EQ(s(30, 0.1), 0.01);
  EXPECT_DOUBLE_EQ(s(65, 0.1), 0.001);
}

TEST(ScheduleCosine, FollowsHalfACosineToEtaMin) {
  Schedule s = cosine_annealing(100, 0.001);  // 0.001 + 0.099 * (1 + cos(pi * step / 100)) / 2
  EXPECT_DOUBLE_EQ(s(0, 0.1), 0.1);
  EXPECT_DOUBLE_EQ(s(25, 0.1), 0.0855017856687341);  // 0.001 + 0.099 * (1 + 1/sqrt(2)) / 2
  EXPECT_DOUBLE_EQ(s(50, 0.1), 0.0505);
  EXPECT_DOUBLE_EQ(s(100, 0.1), 0.001);
}

TEST(ScheduleLinearWarmup, RisesLinearlyThenHolds) {
  Schedule s = linear_lr(0.25, 1.0, 4);  // 0.2 * (0.25 + 0.75 * min(step, 4) / 4)
  EXPECT_DOUBLE_EQ(s(0, 0.2), 0.05);
  EXPECT_DOUBLE_EQ(s(1, 0.2), 0.0875);
  EXPECT_DOUBLE_EQ(s(4, 0.2), 0.2);
  EXPECT_DOUBLE_EQ(s(10, 0.2), 0.2);
  EXPECT_DOUBLE_EQ(linear_lr()(0, 0.3), 0.1);  // torch's default start_factor 1/3
}

TEST(ScheduleOneCycle, TwoPhasesCosine) {
  // max_lr 1, 100 steps: initial 1/25 = 0.04 and min 0.04/1e4; the rise ends at 0.3*100 - 1 = 29.
  Schedule s = one_cycle({.max_lr = 1.0, .total_steps = 100});
  EXPECT_NEAR(s(0, 0), 0.04, 1e-15);  // 1 + (0.04 - 1)/2 * 2 rounds to 0.04 + 3.6e-17, in torch too
  EXPECT_DOUBLE_EQ(s(10, 0), 0.29516394846410077);  // 1 + (0.04 - 1)/2 * (cos(pi*10/29) + 1)
  EXPECT_DOUBLE_EQ(s(29, 0), 1.0);
  EXPECT_DOUBLE_EQ(s(64, 0), 0.500002);  // half way down from 1 to 4e-6
  EXPECT_DOUBLE_EQ(s(99, 0), 4e-6);
  EXPECT_THROW(s(101, 0), Error);
}

TEST(ScheduleOneCycle, LinearAndThreePhase) {
  Schedule linear = one_cycle({.max_lr = 1.0, .total_steps = 100, .anneal = Anneal::linear});
  EXPECT_DOUBLE_EQ(linear(10, 0), 0.37103448275862067);  // 0.04 + 0.96 * 10/29
  // Three phases end at 29, 58 (= 2*30 - 2) and 99.
  Schedule three = one_cycle({.max_lr = 1.0, .total_steps = 100, .three_phase = ThreePhase::yes});
  EXPECT_DOUBLE_EQ(three(29, 0), 1.0);
  EXPECT_DOUBLE_EQ(three(40, 0), 0.697666314563159);  // 0.04 + 0.48 * (cos(pi*11/29) + 1)
  EXPECT_DOUBLE_EQ(three(58, 0), 0.04);
  EXPECT_DOUBLE_EQ(three(80, 0), 0.017708560858882793);  // 4e-6 + (0.04 - 4e-6)/2 * (cos(pi*22/41) + 1)
}

TEST(ScheduleSequential, WarmupThenCosine) {
  Schedule s = sequential(linear_lr(0.1, 1.0, 10), 10, cosine_annealing(20));
  EXPECT_DOUBLE_EQ(s(0, 1.0), 0.1);
  EXPECT_DOUBLE_EQ(s(5, 1.0), 0.55);
  EXPECT_DOUBLE_EQ(s(10, 1.0), 1.0);
  EXPECT_DOUBLE_EQ(s(20, 1.0), 0.5);
  EXPECT_NEAR(s(30, 1.0), 0.0, 1e-15);
}

TEST(ScheduleScheduler, DrivesTheOptimizerAndResumes) {
  TensorList ps = {zeros({2}).set_requires_grad()};
  SGD sgd(ps, {.lr = 0.1});
  LRScheduler scheduler(sgd, step_lr(2, 0.5));
  EXPECT_DOUBLE_EQ(sgd.param_groups()[0].lr, 0.1);
  scheduler.step();
  scheduler.step();
  scheduler.step();
  EXPECT_EQ(scheduler.last_step(), 3);
  EXPECT_DOUBLE_EQ(scheduler.last_lr()[0], 0.05);

  SGD other(ps, {.lr = 0.1});
  LRScheduler resumed(other, step_lr(2, 0.5));
  resumed.load_state_dict(scheduler.state_dict());
  resumed.step();
  EXPECT_DOUBLE_EQ(other.param_groups()[0].lr, 0.025);
}

TEST(OptimClipGradNorm, ScalesOnlyAboveMaxNorm) {
  Tensor a = zeros({2}).set_requires_grad(), b = zeros({1}).set_requires_grad(), c = zeros({3}).set_requires_grad();
  a.set_grad(from_vector(std::vector<float>{3, 4}, {2}));
  b.set_grad(from_vector(std::vector<float>{12}, {1}));
  // c has no gradient: skipped.  Total norm sqrt(9 + 16 + 144) = 13.
  const Tensor norm = clip_grad_norm_({a, b, c}, 100.0);
  EXPECT_EQ(norm.dtype(), DType::f64);
  EXPECT_EQ(norm.numel(), 1);
  EXPECT_NEAR(norm.item(), 13.0, 1e-6);
  EXPECT_EQ(a.grad().to_vector<float>(), (std::vector<float>{3, 4}));
  EXPECT_NEAR(clip_grad_norm_({a, b, c}, 6.5).item(), 13.0, 1e-6);
  // The factor is computed in f64 and rounded to f32 once, as a scalar multiply rounds it.
  const float coef = float(6.5 / (13.0 + 1e-6));
  EXPECT_EQ(a.grad().to_vector<float>(), (std::vector<float>{3 * coef, 4 * coef}));
  EXPECT_EQ(b.grad().to_vector<float>(), (std::vector<float>{12 * coef}));
  EXPECT_NEAR(clip_grad_norm_({a, b}, 100.0).item(), 6.5, 1e-5);
  EXPECT_EQ(clip_grad_norm_({c}, 1.0).item(), 0.0);
}

// bf16 and f64 gradients: a 16-bit one multiplied in f32 by the factor and rounded once, as a
// multiply by a host scalar computes it; an f64 one in f64.
TEST(OptimClipGradNorm, EachGradientIsScaledAsAScalarMultiplyWould) {
  Tensor h = zeros({2}, DType::bf16).set_requires_grad(), d = zeros({2}, DType::f64).set_requires_grad();
  h.set_grad(from_vector(std::vector<float>{3, 4}, {2}).to(DType::bf16));
  d.set_grad(from_vector(std::vector<double>{12, 0}, {2}));
  EXPECT_NEAR(clip_grad_norm_({h, d}, 1.0).item(), 13.0, 1e-6);
  const double coef = 1.0 / (13.0 + 1e-6);
  const std::vector<float> want =
      mul(from_vector(std::vector<float>{3, 4}, {2}).to(DType::bf16), coef).to(DType::f32).to_vector<float>();
  EXPECT_EQ(h.grad().dtype(), DType::bf16);
  EXPECT_EQ(h.grad().to(DType::f32).to_vector<float>(), want);
  EXPECT_EQ(d.grad().to_vector<double>(), (std::vector<double>{12 * coef, 0}));
}

// A blown-up norm: f16 gradients of 60000 over 100,000 elements (norm 1.9e7) scaled to norm 1
// keep their values (about 3.2e-3 each), though the factor (5e-8) is below f16's range.
TEST(OptimClipGradNorm, AFactorBelowHalfPrecisionStillScalesHalfGradients) {
  Tensor h = zeros({100000}, DType::f16).set_requires_grad();
  h.set_grad(full({100000}, 60000.0, DType::f16));
  clip_grad_norm_({h}, 1.0);
  const std::vector<float> g = h.grad().to(DType::f32).to_vector<float>();
  EXPECT_NEAR(g[0], 1.0 / std::sqrt(1e5), 1e-5);
  EXPECT_NEAR(g[99999], 1.0 / std::sqrt(1e5), 1e-5);
}

// A scalar (0-dim) parameter's gradient is clipped like any other.
TEST(OptimClipGradNorm, AScalarParameterIsClippedToo) {
  Tensor s = zeros({}).set_requires_grad(), v = zeros({1}).set_requires_grad();
  s.set_grad(full({}, 3.0, DType::f32));
  v.set_grad(from_vector(std::vector<float>{4}, {1}));
  EXPECT_NEAR(clip_grad_norm_({s, v}, 1.0).item(), 5.0, 1e-6);
  EXPECT_EQ(s.grad().dim(), 0);
  EXPECT_NEAR(s.grad().item(), 3.0 / 5.0, 1e-6);
  EXPECT_NEAR(v.grad().item(), 4.0 / 5.0, 1e-6);
}

// A NaN norm (an overflowed gradient) makes every gradient NaN, as torch's clipping does,
// so the step that follows shows it instead of hiding it.
TEST(OptimClipGradNorm, ANanNormSpreadsToEveryGradient) {
  Tensor a = zeros({2}).set_requires_grad(), b = zeros({1}).set_requires_grad();
  a.set_grad(from_vector(std::vector<float>{NAN, 1}, {2}));
  b.set_grad(from_vector(std::vector<float>{2}, {1}));
  EXPECT_TRUE(std::isnan(clip_grad_norm_({a, b}, 1.0).item()));
  EXPECT_TRUE(std::isnan(b.grad().to_vector<float>()[0]));
}

}  // namespace
}  // namespace loom::optim
