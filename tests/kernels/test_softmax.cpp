// The CPU softmax, log-softmax and cross-entropy kernels against direct formulas in f64,
// and their backward kernels against f64 central finite differences.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/core/error.h"
#include "kernels/table.h"

namespace loom {
namespace {

const KernelTable& cpu_kernels() { return cpu_kernel_table(); }

struct Shape {
  int64_t outer, R, inner;
  int64_t numel() const { return outer * R * inner; }
  std::string str() const {
    return "(" + std::to_string(outer) + ", " + std::to_string(R) + ", " + std::to_string(inner) + ")";
  }
};

std::vector<double> random_values(int64_t n, uint32_t seed, double lo = -4, double hi = 4) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> dist(lo, hi);
  std::vector<double> x(n);
  for (auto& v : x) v = dist(gen);
  return x;
}

// softmax (or log_softmax) over the middle axis, directly in f64.
std::vector<double> naive_softmax(const std::vector<double>& x, Shape s, bool log) {
  std::vector<double> y(x.size());
  for (int64_t o = 0; o < s.outer; ++o)
    for (int64_t i = 0; i < s.inner; ++i) {
      auto at = [&](int64_t r) { return (o * s.R + r) * s.inner + i; };
      double m = -INFINITY, sum = 0;
      for (int64_t r = 0; r < s.R; ++r) m = std::max(m, x[at(r)]);
      for (int64_t r = 0; r < s.R; ++r) sum += std::exp(x[at(r)] - m);
      for (int64_t r = 0; r < s.R; ++r) y[at(r)] = log ? x[at(r)] - m - std::log(sum) : std::exp(x[at(r)] - m) / sum;
    }
  return y;
}

template <class T> std::vector<T> cast(const std::vector<double>& x) {
  std::vector<T> out(x.size());
  for (size_t k = 0; k < x.size(); ++k) out[k] = T(float(x[k]));
  return out;
}
template <> std::vector<double> cast(const std::vector<double>& x) { return x; }
template <class T> std::vector<double> widen(const std::vector<T>& x) {
  std::vector<double> out(x.size());
  for (size_t k = 0; k < x.size(); ++k) out[k] = double(float(x[k]));
  return out;
}
template <> std::vector<double> widen(const std::vector<double>& x) { return x; }

template <class T> std::vector<double> run_softmax(const std::vector<double>& x, DType dt, Shape s, bool log) {
  auto in = cast<T>(x);
  std::vector<T> out(in.size());
  cpu_kernels().softmax(out.data(), in.data(), dt, s.outer, s.R, s.inner, log, nullptr);
  return widen(out);
}

void expect_near_all(const std::vector<double>& got, const std::vector<double>& want, double rtol, double atol) {
  ASSERT_EQ(got.size(), want.size());
  int bad = 0;
  for (size_t k = 0; k < got.size() && bad < 5; ++k) {
    if (!(std::abs(got[k] - want[k]) <= rtol * std::abs(want[k]) + atol)) {
      ++bad;
      ADD_FAILURE() << "element " << k << ": got " << got[k] << ", want " << want[k];
    }
  }
}

const Shape kShapes[] = {{1, 7, 1}, {7, 1, 1}, {1, 1, 7}, {3, 1025, 1}, {2, 7, 5}, {1, 33, 1025}, {5, 1025, 7}};

TEST(SoftmaxCpu, MatchesTheDirectFormulaAndRowsSumToOne) {
  for (Shape s : kShapes) {
    SCOPED_TRACE("shape " + s.str());
    auto x = random_values(s.numel(), uint32_t(s.numel()));
    auto y = run_softmax<double>(x, DType::f64, s, false);
    expect_near_all(y, naive_softmax(x, s, false), 1e-13, 1e-300);
    expect_near_all(run_softmax<float>(x, DType::f32, s, false), naive_softmax(widen(cast<float>(x)), s, false),
                    2e-6, 1e-30);
    for (int64_t o = 0; o < s.outer; ++o)
      for (int64_t i = 0; i < s.inner; ++i) {
        double sum = 0;
        for (int64_t r = 0; r < s.R; ++r) sum += y[(o * s.R + r) * s.inner + i];
        EXPECT_NEAR(sum, 1.0, 1e-12) << "row o = " << o << ", i = " << i;
      }
  }
}

TEST(SoftmaxCpu, LogSoftmaxIsTheLogOfSoftmax) {
  for (Shape s : kShapes) {
    SCOPED_TRACE("shape " + s.str());
    auto x = random_values(s.numel(), uint32_t(s.numel()) + 7);
    auto y = run_softmax<double>(x, DType::f64, s, false);
    auto ly = run_softmax<double>(x, DType::f64, s, true);
    for (auto& v : y) v = std::log(v);
    expect_near_all(ly, y, 1e-12, 1e-12);
    expect_near_all(run_softmax<float>(x, DType::f32, s, true), naive_softmax(widen(cast<float>(x)), s, true), 2e-6,
                    2e-6);
  }
}

TEST(SoftmaxCpu, SixteenBitFloatsAccumulateInF32) {
  Shape s{4, 300, 3};
  auto x = widen(cast<bf16>(random_values(s.numel(), 5)));
  for (bool log : {false, true}) {
    auto want = naive_softmax(x, s, log);
    expect_near_all(run_softmax<bf16>(x, DType::bf16, s, log), want, 1.0 / 128, 1e-30);
    expect_near_all(run_softmax<f16>(widen(cast<f16>(x)), DType::f16, s, log), want, 1.0 / 512, 1e-7);
  }
}

TEST(SoftmaxCpu, HugeLogitsStayFiniteAndMaskedEntriesGetZero) {
  auto y = run_softmax<float>({1000, 1001, 1002}, DType::f32, {1, 3, 1}, false);
  expect_near_all(y, naive_softmax({0, 1, 2}, {1, 3, 1}, false), 1e-6, 0);
  auto masked = run_softmax<float>({-INFINITY, 0, -INFINITY, 0}, DType::f32, {1, 4, 1}, false);
  EXPECT_EQ(masked, (std::vector<double>{0, 0.5, 0, 0.5}));
  auto log_masked = run_softmax<float>({-INFINITY, 0}, DType::f32, {1, 2, 1}, true);
  EXPECT_EQ(log_masked[0], -INFINITY);
  EXPECT_EQ(log_masked[1], 0.0);
  // A +inf logit has no finite softmax: the whole row is NaN, as in PyTorch.
  for (double v : run_softmax<float>({1, INFINITY, 2}, DType::f32, {1, 3, 1}, false)) EXPECT_TRUE(std::isnan(v));
}

// d/dx of sum(w * f(x)), by central differences in f64.
std::vector<double> finite_difference(const std::function<std::vector<double>(const std::vector<double>&)>& f,
                                      std::vector<double> x, const std::vector<double>& w, double h = 1e-5) {
  std::vector<double> g(x.size());
  auto dot = [&](const std::vector<double>& y) {
    double s = 0;
    for (size_t k = 0; k < y.size(); ++k) s += w[k] * y[k];
    return s;
  };
  for (size_t k = 0; k < x.size(); ++k) {
    double keep = x[k];
    x[k] = keep + h;
    double up = dot(f(x));
    x[k] = keep - h;
    double down = dot(f(x));
    x[k] = keep;
    g[k] = (up - down) / (2 * h);
  }
  return g;
}

TEST(SoftmaxCpu, BackwardMatchesFiniteDifferences) {
  for (Shape s : {Shape{2, 5, 3}, Shape{3, 6, 1}, Shape{1, 1, 4}}) {
    for (bool log : {false, true}) {
      SCOPED_TRACE("shape " + s.str() + (log ? " log_softmax" : " softmax"));
      auto x = random_values(s.numel(), 3);
      auto w = random_values(s.numel(), 4, -1, 1);
      auto forward = [&](const std::vector<double>& in) { return run_softmax<double>(in, DType::f64, s, log); };
      auto y = forward(x);
      std::vector<double> gi(x.size());
      cpu_kernels().softmax_backward(gi.data(), w.data(), y.data(), DType::f64, s.outer, s.R, s.inner, log, nullptr);
      expect_near_all(gi, finite_difference(forward, x, w), 1e-6, 1e-8);
    }
  }
}

// Cross-entropy written out: -(1 - eps) log p_t - eps / C sum_c log p_c, 0 on ignored rows.
struct CeResult {
  std::vector<double> loss, lse;
};
CeResult naive_ce(const std::vector<double>& x, const std::vector<int64_t>& t, int64_t C, int64_t ignore, double eps) {
  int64_t N = int64_t(t.size());
  CeResult r{std::vector<double>(N), std::vector<double>(N)};
  auto logp = naive_softmax(x, {N, C, 1}, true);
  for (int64_t n = 0; n < N; ++n) {
    r.lse[n] = x[n * C] - logp[n * C];
    if (t[n] == ignore) continue;
    double mean_logp = 0;
    for (int64_t c = 0; c < C; ++c) mean_logp += logp[n * C + c] / double(C);
    r.loss[n] = -(1 - eps) * logp[n * C + t[n]] - eps * mean_logp;
  }
  return r;
}

template <class T>
CeResult run_ce(const std::vector<double>& x, DType dt, const std::vector<int64_t>& t, int64_t C, int64_t ignore,
                double eps) {
  auto in = cast<T>(x);
  using A = std::conditional_t<std::is_same_v<T, double>, double, float>;  // the kernel's accumulation type
  std::vector<A> loss(t.size()), lse(t.size());
  cpu_kernels().cross_entropy(loss.data(), lse.data(), in.data(), dt, t.data(), int64_t(t.size()), C, ignore, eps,
                              nullptr, 0, nullptr);
  return {widen(loss), widen(lse)};
}

const std::vector<int64_t> kTargets{0, 4, -100, 2, 1, -100, 3};
constexpr int64_t kC = 5;

TEST(CrossEntropyCpu, MatchesTheDirectFormulaWithIgnoredRowsAndLabelSmoothing) {
  auto x = random_values(int64_t(kTargets.size()) * kC, 9);
  for (double eps : {0.0, 0.1}) {
    SCOPED_TRACE("label_smoothing " + std::to_string(eps));
    auto want = naive_ce(x, kTargets, kC, -100, eps);
    auto got = run_ce<double>(x, DType::f64, kTargets, kC, -100, eps);
    expect_near_all(got.loss, want.loss, 1e-6, 1e-7);
    expect_near_all(got.lse, want.lse, 1e-6, 1e-7);
    EXPECT_EQ(got.loss[2], 0.0);
    EXPECT_EQ(got.loss[5], 0.0);
    auto xf = widen(cast<float>(x));
    auto wf = naive_ce(xf, kTargets, kC, -100, eps);
    auto gf = run_ce<float>(x, DType::f32, kTargets, kC, -100, eps);
    expect_near_all(gf.loss, wf.loss, 1e-5, 1e-6);
    auto xb = widen(cast<bf16>(x));
    auto wb = naive_ce(xb, kTargets, kC, -100, eps);
    expect_near_all(run_ce<bf16>(xb, DType::bf16, kTargets, kC, -100, eps).loss, wb.loss, 1e-5, 1e-6);
  }
  // An ignore_index inside [0, C) ignores the rows that name it.
  const std::vector<int64_t> targets{0, 4, 2, 2, 1, 2, 3};
  auto in_range = run_ce<double>(x, DType::f64, targets, kC, 2, 0.1);
  expect_near_all(in_range.loss, naive_ce(x, targets, kC, 2, 0.1).loss, 1e-6, 1e-7);
  EXPECT_EQ(in_range.loss[3], 0.0);
  EXPECT_GT(in_range.loss[0], 0.0);
}

TEST(CrossEntropyCpu, BackwardMatchesFiniteDifferencesOfTheFormula) {
  const int64_t N = int64_t(kTargets.size());
  auto x = random_values(N * kC, 10);
  auto grad_row = random_values(N, 11, 0.5, 1.5);
  for (double eps : {0.0, 0.1}) {
    SCOPED_TRACE("label_smoothing " + std::to_string(eps));
    auto fwd = run_ce<double>(x, DType::f64, kTargets, kC, -100, eps);
    const std::vector<double>& lse = fwd.lse;
    std::vector<double> grad(x.size(), -1);
    cpu_kernels().cross_entropy_backward(grad.data(), x.data(), lse.data(), kTargets.data(), grad_row.data(),
                                         DType::f64, N, kC, -100, eps, nullptr);
    auto loss = [&](const std::vector<double>& in) { return naive_ce(in, kTargets, kC, -100, eps).loss; };
    expect_near_all(grad, finite_difference(loss, x, grad_row), 1e-5, 1e-6);
    for (int64_t c = 0; c < kC; ++c) EXPECT_EQ(grad[2 * kC + c], 0.0) << "ignored row 2, class " << c;
  }
}

// The forward asked for the gradient writes what the backward writes with grad_row = 1,
// into a buffer of its own or over the logits, and the same losses as without it.
template <class T> void check_forward_gradient(DType dt, double eps) {
  SCOPED_TRACE(std::string(dtype_name(dt)) + " label_smoothing " + std::to_string(eps));
  using A = std::conditional_t<std::is_same_v<T, double>, double, float>;
  const int64_t N = int64_t(kTargets.size());
  auto x = cast<T>(random_values(N * kC, 13));
  std::vector<A> loss(N), lse(N), loss_g(N), lse_g(N), loss_i(N), lse_i(N), ones(N, A(1));
  cpu_kernels().cross_entropy(loss.data(), lse.data(), x.data(), dt, kTargets.data(), N, kC, -100, eps, nullptr, 0,
                              nullptr);
  std::vector<T> want(x.size()), grad(x.size()), in_place = x;
  cpu_kernels().cross_entropy_backward(want.data(), x.data(), lse.data(), kTargets.data(), ones.data(), dt, N, kC,
                                       -100, eps, nullptr);
  cpu_kernels().cross_entropy(loss_g.data(), lse_g.data(), x.data(), dt, kTargets.data(), N, kC, -100, eps,
                              grad.data(), 0, nullptr);
  cpu_kernels().cross_entropy(loss_i.data(), lse_i.data(), in_place.data(), dt, kTargets.data(), N, kC, -100, eps,
                              in_place.data(), 0, nullptr);
  for (int64_t n = 0; n < N; ++n) {
    EXPECT_EQ(loss_g[n], loss[n]) << "row " << n;
    EXPECT_EQ(loss_i[n], loss[n]) << "row " << n;
    EXPECT_EQ(lse_i[n], lse[n]) << "row " << n;
  }
  for (size_t k = 0; k < want.size(); ++k) {
    EXPECT_EQ(double(grad[k]), double(want[k])) << "element " << k;
    EXPECT_EQ(double(in_place[k]), double(want[k])) << "element " << k << ", in place";
  }
}

TEST(CrossEntropyCpu, ForwardWritesTheGradientOfUnitRowsInPlaceOrNot) {
  for (double eps : {0.0, 0.1}) {
    check_forward_gradient<double>(DType::f64, eps);
    check_forward_gradient<float>(DType::f32, eps);
    check_forward_gradient<bf16>(DType::bf16, eps);
  }
}

// A row of -inf only has a log-sum-exp of -inf (log of an empty sum) and, ignored, a loss
// and gradient of 0; a row holding +inf is NaN throughout, and so is one holding a NaN
// among -inf (no finite maximum, but not an empty sum either). A masked logit elsewhere in
// the row leaves the loss without label smoothing finite.
TEST(CrossEntropyCpu, FullyMaskedAndInfiniteRows) {
  const double inf = INFINITY, nan = NAN;
  const std::vector<double> x{-inf, -inf, -inf, 1, inf, 2, -inf, nan, -inf, 0, -inf, 0};
  const std::vector<int64_t> t{-100, 0, 1, 0};
  std::vector<double> loss(4), lse(4), grad(12, -1), grad_row(4, 1.0);
  cpu_kernels().cross_entropy(loss.data(), lse.data(), x.data(), DType::f64, t.data(), 4, 3, -100, 0.0, nullptr, 0,
                              nullptr);
  EXPECT_EQ(lse[0], -inf);
  EXPECT_EQ(loss[0], 0.0);
  EXPECT_TRUE(std::isnan(lse[1]));
  EXPECT_TRUE(std::isnan(loss[1]));
  EXPECT_TRUE(std::isnan(lse[2]));
  EXPECT_TRUE(std::isnan(loss[2]));
  EXPECT_NEAR(loss[3], std::log(2.0), 1e-15);  // row 3 is {0, -inf, 0}, target 0 (its first entry)
  cpu_kernels().cross_entropy_backward(grad.data(), x.data(), lse.data(), t.data(), grad_row.data(), DType::f64, 4, 3,
                                       -100, 0.0, nullptr);
  for (int c = 0; c < 3; ++c) {
    EXPECT_EQ(grad[c], 0.0) << "ignored row, class " << c;
    EXPECT_TRUE(std::isnan(grad[3 + c])) << "class " << c;
    EXPECT_TRUE(std::isnan(grad[6 + c])) << "class " << c;
  }
  EXPECT_NEAR(grad[9], -0.5, 1e-15);
  EXPECT_EQ(grad[10], 0.0);
  EXPECT_NEAR(grad[11], 0.5, 1e-15);
}

TEST(CrossEntropyCpu, ATargetOutsideTheClassesNamesItsValueAndRow) {
  auto x = random_values(3 * kC, 12);
  std::vector<double> loss(3), lse(3), grad_row(3, 1.0);
  std::vector<double> grad(x.size());
  for (int64_t bad : {int64_t(7), int64_t(-3), kC}) {
    std::vector<int64_t> t{0, bad, 1};
    try {
      cpu_kernels().cross_entropy(loss.data(), lse.data(), x.data(), DType::f64, t.data(), 3, kC, -100, 0.0, nullptr,
                                  0, nullptr);
      ADD_FAILURE() << "target " << bad << " did not throw";
    } catch (const Error& e) {
      std::string what = e.what();
      EXPECT_NE(what.find("target " + std::to_string(bad)), std::string::npos) << what;
      EXPECT_NE(what.find("row 1"), std::string::npos) << what;
    }
    EXPECT_THROW(cpu_kernels().cross_entropy_backward(grad.data(), x.data(), lse.data(), t.data(), grad_row.data(),
                                                      DType::f64, 3, kC, -100, 0.0, nullptr),
                 Error);
  }
}

}  // namespace
}  // namespace loom
