// Optimizers against a second, independent implementation: torch.optim's documented update
// rules written out per element on std::vector<double> below. Three steps over two f64
// parameters whose gradients depend on the current values (as a real loss's do); the second
// parameter has no gradient at step 2, so it must be skipped there (its step count too).
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <memory>

#include "engine/autograd.h"
#include "engine/ops.h"
#include "layers/optim/adam.h"
#include "layers/optim/sgd.h"

namespace loom::optim {
namespace {

const std::vector<Shape> kShapes = {{2, 3}, {4}};
constexpr int kSteps = 3;

bool has_grad(size_t param, int step) { return !(param == 1 && step == 2); }

std::vector<double> initial(size_t param) {
  std::vector<double> v(size_t(shape_numel(kShapes[param])));
  for (size_t i = 0; i < v.size(); ++i) v[i] = 0.3 * std::cos(double(i) + 2.0 * param) + 0.05 * i;
  return v;
}

// The gradient of sum((x - 0.1 i)^2) plus a step-dependent wobble.
std::vector<double> gradient(const std::vector<double>& x, int step, size_t param) {
  std::vector<double> g(x.size());
  for (size_t i = 0; i < x.size(); ++i) g[i] = 2 * (x[i] - 0.1 * i) + 0.1 * std::sin(double(i) + 3.0 * step + param);
  return g;
}

// ---- the reference: torch's rules, one element at a time ------------------------------
struct Ref {
  std::vector<double> x, buf, m, v;
  int step = 0;
};

struct SgdCase {
  std::string name;
  SGDOptions options;
};

std::vector<std::vector<double>> reference_sgd(const SGDOptions& o) {
  std::vector<Ref> ps;
  for (size_t k = 0; k < kShapes.size(); ++k) ps.push_back({initial(k), {}, {}, {}, 0});
  for (int t = 1; t <= kSteps; ++t)
    for (size_t k = 0; k < ps.size(); ++k) {
      if (!has_grad(k, t)) continue;
      Ref& p = ps[k];
      std::vector<double> g = gradient(p.x, t, k);
      const bool first = p.buf.empty();
      if (first) p.buf.assign(p.x.size(), 0.0);
      for (size_t i = 0; i < p.x.size(); ++i) {
        double d = g[i] + o.weight_decay * p.x[i];
        if (o.momentum != 0) {
          p.buf[i] = first ? d : o.momentum * p.buf[i] + (1 - o.dampening) * d;
          d = o.nesterov == Nesterov::yes ? d + o.momentum * p.buf[i] : p.buf[i];
        }
        p.x[i] -= o.lr * d;
      }
    }
  std::vector<std::vector<double>> out;
  for (const Ref& p : ps) out.push_back(p.x);
  return out;
}

struct AdamCase {
  std::string name;
  AdamOptions options;
  WeightDecay decay;
};

std::vector<std::vector<double>> reference_adam(const AdamOptions& o, WeightDecay decay) {
  std::vector<Ref> ps;
  for (size_t k = 0; k < kShapes.size(); ++k) {
    size_t n = shape_numel(kShapes[k]);
    ps.push_back({initial(k), {}, std::vector<double>(n, 0.0), std::vector<double>(n, 0.0), 0});
  }
  for (int t = 1; t <= kSteps; ++t)
    for (size_t k = 0; k < ps.size(); ++k) {
      if (!has_grad(k, t)) continue;
      Ref& p = ps[k];
      std::vector<double> g = gradient(p.x, t, k);
      const int s = ++p.step;
      for (size_t i = 0; i < p.x.size(); ++i) {
        double gi = g[i];
        if (decay == WeightDecay::l2) gi += o.weight_decay * p.x[i];
        else p.x[i] -= o.lr * o.weight_decay * p.x[i];
        p.m[i] = o.beta1 * p.m[i] + (1 - o.beta1) * gi;
        p.v[i] = o.beta2 * p.v[i] + (1 - o.beta2) * gi * gi;
        const double m_hat = p.m[i] / (1 - std::pow(o.beta1, s));
        const double v_hat = p.v[i] / (1 - std::pow(o.beta2, s));
        p.x[i] -= o.lr * m_hat / (std::sqrt(v_hat) + o.eps);
      }
    }
  std::vector<std::vector<double>> out;
  for (const Ref& p : ps) out.push_back(p.x);
  return out;
}

// ---- Loom ------------------------------------------------------------------------------
TensorList make_params() {
  TensorList ps;
  for (size_t k = 0; k < kShapes.size(); ++k) ps.push_back(from_vector(initial(k), kShapes[k]).set_requires_grad());
  return ps;
}

void set_gradients(TensorList& ps, int step) {
  for (size_t k = 0; k < ps.size(); ++k) {
    if (has_grad(k, step)) ps[k].set_grad(from_vector(gradient(ps[k].to_vector<double>(), step, k), ps[k].shape()));
    else ps[k].zero_grad();
  }
}

void run_steps(Optimizer& opt, TensorList& ps, int from, int to) {
  for (int t = from; t <= to; ++t) {
    set_gradients(ps, t);
    opt.step();
  }
}

void expect_params_near(const TensorList& ps, const std::vector<std::vector<double>>& expected) {
  for (size_t k = 0; k < ps.size(); ++k) {
    std::vector<double> got = ps[k].to_vector<double>();
    ASSERT_EQ(got.size(), expected[k].size());
    for (size_t i = 0; i < got.size(); ++i)
      EXPECT_NEAR(got[i], expected[k][i], 1e-12 + 1e-12 * std::abs(expected[k][i])) << "param " << k << "[" << i << "]";
  }
}

class SgdMatchesTorchRules : public ::testing::TestWithParam<SgdCase> {};

TEST_P(SgdMatchesTorchRules, OverThreeSteps) {
  TensorList ps = make_params();
  SGD sgd(ps, GetParam().options);
  run_steps(sgd, ps, 1, kSteps);
  expect_params_near(ps, reference_sgd(GetParam().options));
}

INSTANTIATE_TEST_SUITE_P(
    Sgd, SgdMatchesTorchRules,
    ::testing::Values(SgdCase{"plain", {.lr = 0.1}}, SgdCase{"momentum", {.lr = 0.1, .momentum = 0.9}},
                      SgdCase{"dampening", {.lr = 0.05, .momentum = 0.9, .dampening = 0.3}},
                      SgdCase{"nesterov", {.lr = 0.1, .momentum = 0.9, .nesterov = Nesterov::yes}},
                      SgdCase{"weight_decay", {.lr = 0.1, .weight_decay = 0.05}},
                      SgdCase{"all", {.lr = 0.07, .momentum = 0.8, .weight_decay = 0.05, .nesterov = Nesterov::yes}}),
    [](const auto& info) { return info.param.name; });

class AdamMatchesTorchRules : public ::testing::TestWithParam<AdamCase> {};

TEST_P(AdamMatchesTorchRules, OverThreeSteps) {
  const AdamCase& c = GetParam();
  TensorList ps = make_params();
  const AdamOptions& o = c.options;
  std::unique_ptr<Optimizer> opt;
  if (c.decay == WeightDecay::l2) opt = std::make_unique<Adam>(ps, o);
  else opt = std::make_unique<AdamW>(ps, AdamWOptions{o.lr, o.beta1, o.beta2, o.eps, o.weight_decay});
  run_steps(*opt, ps, 1, kSteps);
  expect_params_near(ps, reference_adam(o, c.decay));
  EXPECT_EQ(opt->state(ps[0])->step, 3);
  EXPECT_EQ(opt->state(ps[1])->step, 2);  // skipped at step 2
}

INSTANTIATE_TEST_SUITE_P(
    Adam, AdamMatchesTorchRules,
    ::testing::Values(AdamCase{"adam", {.lr = 0.01}, WeightDecay::l2},
                      AdamCase{"adam_l2", {.lr = 0.01, .beta1 = 0.8, .beta2 = 0.95, .eps = 1e-3, .weight_decay = 0.1},
                               WeightDecay::l2},
                      AdamCase{"adamw", {.lr = 0.01, .weight_decay = 0.1}, WeightDecay::decoupled},
                      AdamCase{"adamw_big_eps", {.lr = 0.05, .beta1 = 0.5, .beta2 = 0.6, .eps = 0.1, .weight_decay = 0.3},
                               WeightDecay::decoupled}),
    [](const auto& info) { return info.param.name; });

TEST(OptimDefaults, AdamWDecaysByDefaultAndAdamDoesNot) {
  TensorList a = make_params(), b = make_params();
  EXPECT_EQ(Adam(a, {}).param_groups()[0].weight_decay, 0.0);
  EXPECT_EQ(AdamW(b, {}).param_groups()[0].weight_decay, 0.01);
}

TEST(OptimStateDict, ResumedOptimizerTakesTheSameThirdStep) {
  TensorList ps = make_params();
  AdamW first(ps, {.lr = 0.02, .weight_decay = 0.1});
  run_steps(first, ps, 1, 2);
  OptimizerState saved = first.state_dict();
  EXPECT_EQ(saved.scalars.at("state.0.step"), 2.0);
  EXPECT_EQ(saved.scalars.at("param_groups.0.lr"), 0.02);
  EXPECT_EQ(saved.tensors.size(), 4u);  // exp_avg and exp_avg_sq of both parameters

  TensorList resumed;
  for (const Tensor& p : ps) resumed.push_back(p.detach().clone().set_requires_grad());
  AdamW second(resumed, {.lr = 0.5});  // hyper-parameters come from the checkpoint
  second.load_state_dict(saved);
  EXPECT_EQ(second.param_groups()[0].lr, 0.02);
  run_steps(first, ps, 3, 3);
  run_steps(second, resumed, 3, 3);
  for (size_t k = 0; k < ps.size(); ++k) EXPECT_EQ(ps[k].to_vector<double>(), resumed[k].to_vector<double>());
}

TEST(OptimStateDict, RefusesAnotherOptimizersState) {
  TensorList ps = make_params();
  Adam adam(ps, {});
  run_steps(adam, ps, 1, 1);
  TensorList other = make_params();
  SGD sgd(other, {.lr = 0.1, .momentum = 0.9});
  EXPECT_THROW(sgd.load_state_dict(adam.state_dict()), Error);
  SGD single(TensorList{other[0]}, {.lr = 0.1});
  EXPECT_THROW(single.load_state_dict(sgd.state_dict()), Error);
}

TEST(OptimGroups, EachGroupHasItsOwnLearningRate) {
  TensorList ps = make_params();
  SGD sgd(TensorList{ps[0]}, {.lr = 0.1});
  sgd.add_param_group(TensorList{ps[1]}, {.lr = 0.0});
  EXPECT_THROW(sgd.add_param_group(TensorList{ps[1]}, {.lr = 0.1}), Error);  // already in a group
  std::vector<double> frozen = ps[1].to_vector<double>();
  set_gradients(ps, 1);
  sgd.step();
  EXPECT_EQ(ps[1].to_vector<double>(), frozen);
  EXPECT_NE(ps[0].to_vector<double>(), initial(0));
  sgd.set_lr(0.3);
  EXPECT_EQ(sgd.param_groups()[1].lr, 0.3);
  sgd.zero_grad();
  EXPECT_FALSE(ps[0].grad().defined());
}

// A group may mix dtypes (each (device, dtype) part is its own fused call, gradients
// converted to their parameter's dtype) and hold a non-contiguous parameter (updated
// through a contiguous copy written back into its storage): the steps are still torch's.
TensorList mixed_params() {
  const std::vector<double> v0 = initial(0);  // param 0 (2, 3) is the transpose of a (3, 2) base
  std::vector<double> transposed(v0.size());
  for (size_t i = 0; i < 2; ++i)
    for (size_t j = 0; j < 3; ++j) transposed[j * 2 + i] = v0[i * 3 + j];
  TensorList ps;
  ps.push_back(from_vector(transposed, {3, 2}).t().set_requires_grad());
  ps.push_back(from_vector(initial(1), kShapes[1]).to(DType::f32).set_requires_grad());
  return ps;
}

struct MixedCase {
  std::string name;
  std::function<std::unique_ptr<Optimizer>(const TensorList&)> make;
  std::function<std::vector<std::vector<double>>()> reference;
};

class MixedGroup : public ::testing::TestWithParam<MixedCase> {};

TEST_P(MixedGroup, FollowsTorchRules) {
  TensorList ps = mixed_params();
  ASSERT_FALSE(ps[0].is_contiguous());
  std::unique_ptr<Optimizer> opt = GetParam().make(ps);
  run_steps(*opt, ps, 1, kSteps);
  const std::vector<std::vector<double>> expected = GetParam().reference();
  const double tol[] = {1e-12, 1e-5};  // f64, f32
  for (size_t k = 0; k < ps.size(); ++k) {
    std::vector<double> got = ps[k].to_vector<double>();
    ASSERT_EQ(got.size(), expected[k].size());
    for (size_t i = 0; i < got.size(); ++i)
      EXPECT_NEAR(got[i], expected[k][i], tol[k] * (1 + std::abs(expected[k][i]))) << "param " << k << "[" << i << "]";
  }
  EXPECT_EQ(ps[1].dtype(), DType::f32);
}

const SGDOptions kMixedSgd = {.lr = 0.07, .momentum = 0.8, .weight_decay = 0.05, .nesterov = Nesterov::yes};
const AdamOptions kMixedAdam = {.lr = 0.01, .weight_decay = 0.1};

INSTANTIATE_TEST_SUITE_P(
    Optim, MixedGroup,
    ::testing::Values(
        MixedCase{"sgd", [](const TensorList& ps) { return std::make_unique<SGD>(ps, kMixedSgd); },
                  [] { return reference_sgd(kMixedSgd); }},
        MixedCase{"adam", [](const TensorList& ps) { return std::make_unique<Adam>(ps, kMixedAdam); },
                  [] { return reference_adam(kMixedAdam, WeightDecay::l2); }},
        MixedCase{"adamw",
                  [](const TensorList& ps) {
                    return std::make_unique<AdamW>(ps, AdamWOptions{.lr = kMixedAdam.lr, .weight_decay = 0.1});
                  },
                  [] { return reference_adam(kMixedAdam, WeightDecay::decoupled); }}),
    [](const auto& info) { return info.param.name; });

TEST(OptimFusedOps, RejectMismatchedLists) {
  NoGradGuard no_grad;
  TensorList ps = {zeros({2, 3}), zeros({4})};
  TensorList grads = {zeros({2, 3}), zeros({4})};
  TensorList bufs(2);
  EXPECT_THROW(sgd_update_fused(ps, {grads[0]}, bufs, 0.1, 0.9, 0, 0, false), Error);       // lengths
  EXPECT_THROW(sgd_update_fused(ps, {grads[0], zeros({5})}, bufs, 0.1, 0, 0, 0, false), Error);  // sizes
  EXPECT_THROW(sgd_update_fused(ps, {grads[0], zeros({4}, DType::f64)}, bufs, 0.1, 0, 0, 0, false), Error);
  EXPECT_THROW(sgd_update_fused({ps[0], zeros({3, 2}).t()}, {grads[0], zeros({2, 3})}, bufs, 0.1, 0, 0, 0, false),
               Error);  // not contiguous
  EXPECT_THROW(sgd_update_fused(ps, {grads[0], Tensor()}, bufs, 0.1, 0, 0, 0, false), Error);
  TensorList ms = {zeros({2, 3}), zeros({4})}, vs = {zeros({2, 3}), zeros({4})};
  EXPECT_THROW(adam_update_fused(ps, grads, ms, vs, {1, 0}, 0.1, 0.9, 0.999, 1e-8, 0, false), Error);  // step 0
  EXPECT_THROW(adam_update_fused(ps, grads, ms, {vs[0]}, {1, 1}, 0.1, 0.9, 0.999, 1e-8, 0, false), Error);
  try {
    sgd_update_fused(ps, {grads[0], zeros({5})}, bufs, 0.1, 0, 0, 0, false);
    ADD_FAILURE() << "expected an error naming grads[1]";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("grads[1] has shape (5,) but params[1] has shape (4,)"), std::string::npos)
        << e.what();
  }
}

TEST(OptimFusedOps, SgdCreatesMissingBuffersAndEmptyListsAreNoOps) {
  NoGradGuard no_grad;
  TensorList none;
  sgd_update_fused(none, none, none, 0.1, 0.9, 0, 0, false);
  adam_update_fused(none, none, none, none, {}, 0.1, 0.9, 0.999, 1e-8, 0, false);
  TensorList ps = {ones({3})}, grads = {full({3}, 2.0)}, bufs(1);
  sgd_update_fused(ps, grads, bufs, 0.5, 0.9, 0, 0, false);
  ASSERT_TRUE(bufs[0].defined());
  EXPECT_EQ(bufs[0].to_vector<double>(), std::vector<double>(3, 2.0));  // a new buffer is the gradient
  EXPECT_EQ(ps[0].to_vector<double>(), std::vector<double>(3, 0.0));    // 1 - 0.5 * 2
  TensorList no_bufs;  // momentum 0 needs no buffers
  sgd_update_fused(ps, grads, no_bufs, 0.5, 0, 0, 0, false);
  EXPECT_EQ(ps[0].to_vector<double>(), std::vector<double>(3, -1.0));
}

TEST(OptimChecks, RejectInvalidSettings) {
  TensorList ps = make_params();
  EXPECT_THROW(SGD(ps, {.lr = 0.1, .nesterov = Nesterov::yes}), Error);  // Nesterov without momentum
  EXPECT_THROW(SGD(ps, {.lr = -1}), Error);
  EXPECT_THROW(Adam(ps, {.beta1 = 1.0}), Error);
  EXPECT_THROW(SGD(TensorList{ps[0].to(DType::i64)}, {.lr = 0.1}), Error);
}

}  // namespace
}  // namespace loom::optim
