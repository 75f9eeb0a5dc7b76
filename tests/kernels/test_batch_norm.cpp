// The CPU batch-norm kernels against plain double-precision loops written here: training
// (output, saved statistics, running-statistic update), evaluation and backward, in every
// floating dtype, over odd shapes (one sample, one channel, one value per row, rows longer
// than the pairwise leaf, many threads' worth of channels), with and without gamma/beta.
// The inputs are rounded to the tested dtype first, so the reference sees the same numbers;
// tolerances then cover only the output's own rounding. The channels-last (N, S, C) layout
// is checked against the row-major kernels on the same values transposed: bit for bit,
// since both add each channel's values in the same order.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/cpu/kernels.h"

namespace loom {
namespace {

template <class T> constexpr DType dtype_of() {
  if constexpr (std::is_same_v<T, float>) return DType::f32;
  else if constexpr (std::is_same_v<T, double>) return DType::f64;
  else if constexpr (std::is_same_v<T, bf16>) return DType::bf16;
  else return DType::f16;
}
template <class T> using acc_of = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <class T> double to_double(T v) {
  if constexpr (std::is_same_v<T, bf16> || std::is_same_v<T, f16>) return float(v);
  else return double(v);
}
template <class T> T from_double(double v) {
  if constexpr (std::is_same_v<T, bf16> || std::is_same_v<T, f16>) return T(float(v));
  else return T(v);
}

struct Shape3 {
  int64_t n, c, s;
};

std::string name_of(const Shape3& sh) {
  return "(" + std::to_string(sh.n) + ", " + std::to_string(sh.c) + ", " + std::to_string(sh.s) + ")";
}

const std::vector<Shape3>& shapes() {
  static const std::vector<Shape3> table = {{1, 3, 7}, {5, 1, 1}, {2, 7, 33}, {64, 16, 1025}, {3, 70, 2}};
  return table;
}

// Values of T with a different centre per channel, and the same numbers in double.
template <class T>
std::vector<T> channel_values(const Shape3& sh, double spread, double centre_step, std::mt19937& rng,
                              std::vector<double>& exact) {
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  std::vector<T> v(size_t(sh.n * sh.c * sh.s));
  exact.resize(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    const int64_t c = int64_t(i) / sh.s % sh.c;
    v[i] = from_double<T>(spread * u(rng) + centre_step * double(c) - 0.5);
    exact[i] = to_double(v[i]);
  }
  return v;
}

template <class A> std::vector<A> per_channel(int64_t c, double lo, double hi, std::mt19937& rng) {
  std::uniform_real_distribution<double> u(lo, hi);
  std::vector<A> v(static_cast<size_t>(c));
  for (auto& x : v) x = A(u(rng));
  return v;
}

// Plain loops: mean, biased variance and 1 / sqrt(var + eps) of each channel.
struct RefStats {
  std::vector<double> mean, var, invstd;
};
RefStats reference_stats(const Shape3& sh, const std::vector<double>& x, double eps) {
  RefStats r;
  const double m = double(sh.n * sh.s);
  for (int64_t c = 0; c < sh.c; ++c) {
    double sum = 0, sq = 0;
    for (int64_t n = 0; n < sh.n; ++n)
      for (int64_t s = 0; s < sh.s; ++s) sum += x[size_t((n * sh.c + c) * sh.s + s)];
    const double mean = sum / m;
    for (int64_t n = 0; n < sh.n; ++n)
      for (int64_t s = 0; s < sh.s; ++s) {
        const double d = x[size_t((n * sh.c + c) * sh.s + s)] - mean;
        sq += d * d;
      }
    r.mean.push_back(mean);
    r.var.push_back(sq / m);
    r.invstd.push_back(1.0 / std::sqrt(sq / m + eps));
  }
  return r;
}

// The output's own rounding, relative to max(1, |value|).
template <class T> double output_tol() {
  if constexpr (std::is_same_v<T, double>) return 1e-12;
  else if constexpr (std::is_same_v<T, float>) return 1e-6;
  else if constexpr (std::is_same_v<T, f16>) return 1e-3;
  else return 8e-3;
}
template <class A> double acc_tol() { return std::is_same_v<A, double> ? 1e-12 : 1e-6; }

template <class V>
void expect_close(const std::vector<V>& got, const std::vector<double>& want, double tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_NEAR(to_double(got[i]), want[i], tol * std::max(1.0, std::abs(want[i]))) << what << " element " << i;
}

enum class WithAffine { no, yes };

template <class T>
void check_training(const Shape3& sh, WithAffine affine) {
  using A = acc_of<T>;
  SCOPED_TRACE(name_of(sh) + (affine == WithAffine::yes ? " affine" : " plain"));
  std::mt19937 rng(3);
  std::vector<double> xe;
  const auto x = channel_values<T>(sh, 2.0, 0.3, rng, xe);
  const auto gamma = per_channel<A>(sh.c, 0.5, 1.5, rng), beta = per_channel<A>(sh.c, -1, 1, rng);
  auto running_mean = per_channel<A>(sh.c, -1, 1, rng), running_var = per_channel<A>(sh.c, 0.5, 2, rng);
  const auto rm0 = running_mean, rv0 = running_var;

  BatchNormArgs a;
  a.dtype = dtype_of<T>();
  a.n = sh.n, a.c = sh.c, a.s = sh.s, a.eps = 1e-3, a.momentum = 0.25;
  std::vector<T> y(x.size());
  std::vector<A> save_mean(size_t(sh.c)), save_invstd(size_t(sh.c));
  const bool with = affine == WithAffine::yes;
  cpu::batch_norm_forward_train(a, y.data(), save_mean.data(), save_invstd.data(), running_mean.data(),
                                running_var.data(), x.data(), with ? gamma.data() : nullptr,
                                with ? beta.data() : nullptr, nullptr, nullptr);

  const RefStats r = reference_stats(sh, xe, a.eps);
  const double m = double(sh.n * sh.s);
  std::vector<double> want_y(x.size()), want_rm, want_rv;
  for (int64_t c = 0; c < sh.c; ++c) {
    want_rm.push_back(0.75 * double(rm0[size_t(c)]) + 0.25 * r.mean[size_t(c)]);
    want_rv.push_back(0.75 * double(rv0[size_t(c)]) + 0.25 * r.var[size_t(c)] * m / (m - 1));
  }
  for (size_t i = 0; i < x.size(); ++i) {
    const size_t c = size_t(int64_t(i) / sh.s % sh.c);
    const double g = with ? double(gamma[c]) : 1.0, b = with ? double(beta[c]) : 0.0;
    want_y[i] = (xe[i] - r.mean[c]) * r.invstd[c] * g + b;
  }
  expect_close(y, want_y, output_tol<T>(), "y");
  expect_close(save_mean, r.mean, acc_tol<A>(), "save_mean");
  expect_close(save_invstd, r.invstd, acc_tol<A>(), "save_invstd");
  expect_close(running_mean, want_rm, acc_tol<A>(), "running_mean");
  expect_close(running_var, want_rv, acc_tol<A>(), "running_var");
}

template <class T>
void check_eval(const Shape3& sh, WithAffine affine) {
  using A = acc_of<T>;
  SCOPED_TRACE(name_of(sh) + (affine == WithAffine::yes ? " affine" : " plain"));
  std::mt19937 rng(5);
  std::vector<double> xe;
  const auto x = channel_values<T>(sh, 2.0, 0.3, rng, xe);
  const auto gamma = per_channel<A>(sh.c, 0.5, 1.5, rng), beta = per_channel<A>(sh.c, -1, 1, rng);
  const auto rm = per_channel<A>(sh.c, -1, 1, rng), rv = per_channel<A>(sh.c, 0.5, 2, rng);
  BatchNormArgs a;
  a.dtype = dtype_of<T>();
  a.n = sh.n, a.c = sh.c, a.s = sh.s, a.eps = 1e-5;
  const bool with = affine == WithAffine::yes;
  std::vector<T> y(x.size());
  cpu::batch_norm_forward_eval(a, y.data(), x.data(), with ? gamma.data() : nullptr, with ? beta.data() : nullptr,
                               rm.data(), rv.data(), nullptr);
  std::vector<double> want(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const size_t c = size_t(int64_t(i) / sh.s % sh.c);
    const double g = with ? double(gamma[c]) : 1.0, b = with ? double(beta[c]) : 0.0;
    want[i] = (xe[i] - double(rm[c])) / std::sqrt(double(rv[c]) + a.eps) * g + b;
  }
  expect_close(y, want, output_tol<T>(), "y");
}

template <class T>
void check_backward(const Shape3& sh, WithAffine affine) {
  using A = acc_of<T>;
  SCOPED_TRACE(name_of(sh) + (affine == WithAffine::yes ? " affine" : " plain"));
  std::mt19937 rng(7);
  std::vector<double> xe, dye;
  const auto x = channel_values<T>(sh, 2.0, 0.3, rng, xe);
  const auto dy = channel_values<T>(sh, 1.0, 0.1, rng, dye);
  const auto gamma = per_channel<A>(sh.c, 0.5, 1.5, rng);
  const RefStats r = reference_stats(sh, xe, 1e-5);
  std::vector<A> save_mean, save_invstd;
  for (int64_t c = 0; c < sh.c; ++c) {
    save_mean.push_back(A(r.mean[size_t(c)]));
    save_invstd.push_back(A(r.invstd[size_t(c)]));
  }
  BatchNormArgs a;
  a.dtype = dtype_of<T>();
  a.n = sh.n, a.c = sh.c, a.s = sh.s;
  const bool with = affine == WithAffine::yes;
  std::vector<T> dx(x.size());
  std::vector<A> dgamma(size_t(sh.c)), dbeta(size_t(sh.c));
  cpu::batch_norm_backward(a, dx.data(), dgamma.data(), dbeta.data(), dy.data(), x.data(),
                           with ? gamma.data() : nullptr, save_mean.data(), save_invstd.data(), nullptr, nullptr,
                           nullptr);

  // The reference works from the statistics as saved (rounded to A), as the kernel does.
  const double m = double(sh.n * sh.s);
  std::vector<double> want_dgamma(size_t(sh.c), 0.0), want_dbeta(size_t(sh.c), 0.0), want_dx(x.size());
  auto xhat = [&](size_t i, size_t c) { return (xe[i] - double(save_mean[c])) * double(save_invstd[c]); };
  for (size_t i = 0; i < x.size(); ++i) {
    const size_t c = size_t(int64_t(i) / sh.s % sh.c);
    want_dbeta[c] += dye[i];
    want_dgamma[c] += dye[i] * xhat(i, c);
  }
  for (size_t i = 0; i < x.size(); ++i) {
    const size_t c = size_t(int64_t(i) / sh.s % sh.c);
    const double g = with ? double(gamma[c]) : 1.0;
    want_dx[i] = g * double(save_invstd[c]) / m * (m * dye[i] - want_dbeta[c] - xhat(i, c) * want_dgamma[c]);
  }
  expect_close(dbeta, want_dbeta, acc_tol<A>() * 10, "dbeta");
  expect_close(dgamma, want_dgamma, acc_tol<A>() * 10, "dgamma");
  expect_close(dx, want_dx, output_tol<T>() * 2, "dx");
}

template <class T> void check_all() {
  for (const Shape3& sh : shapes())
    for (WithAffine affine : {WithAffine::no, WithAffine::yes}) {
      check_training<T>(sh, affine);
      check_eval<T>(sh, affine);
      check_backward<T>(sh, affine);
    }
}

TEST(BatchNormKernel, MatchesPlainLoopsF64) { check_all<double>(); }
TEST(BatchNormKernel, MatchesPlainLoopsF32) { check_all<float>(); }
TEST(BatchNormKernel, MatchesPlainLoopsBf16) { check_all<bf16>(); }
TEST(BatchNormKernel, MatchesPlainLoopsF16) { check_all<f16>(); }

// ---- channels-last ---------------------------------------------------------------------

// (N, C, S) values laid out (N, S, C).
template <class V> std::vector<V> to_channels_last(const Shape3& sh, const std::vector<V>& v) {
  std::vector<V> out(v.size());
  for (int64_t n = 0; n < sh.n; ++n)
    for (int64_t c = 0; c < sh.c; ++c)
      for (int64_t s = 0; s < sh.s; ++s)
        out[size_t((n * sh.s + s) * sh.c + c)] = v[size_t((n * sh.c + c) * sh.s + s)];
  return out;
}

template <class V>
void expect_same_bits(const std::vector<V>& got, const std::vector<V>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_EQ(std::memcmp(&got[i], &want[i], sizeof(V)), 0)
        << what << " element " << i << ": " << to_double(got[i]) << " vs " << to_double(want[i]);
}

// Shapes past those above: a tile of channels cut short (C = 37, 130), one value per row
// with odd C, one channel with long rows.
const std::vector<Shape3>& channels_last_shapes() {
  static const std::vector<Shape3> table = {{1, 3, 7},  {5, 1, 1},  {2, 7, 33},  {64, 16, 1025}, {3, 70, 2},
                                            {4, 37, 1}, {2, 1, 300}, {6, 130, 5}, {2, 33, 64}};
  return table;
}

// Training, evaluation and backward on (N, S, C) buffers give the row-major results, transposed.
template <class T>
void check_channels_last(const Shape3& sh, WithAffine affine) {
  using A = acc_of<T>;
  SCOPED_TRACE(name_of(sh) + (affine == WithAffine::yes ? " affine" : " plain"));
  std::mt19937 rng(13);
  std::vector<double> xe, dye;
  const auto x = channel_values<T>(sh, 2.0, 0.3, rng, xe), dy = channel_values<T>(sh, 1.0, 0.1, rng, dye);
  const auto gamma = per_channel<A>(sh.c, 0.5, 1.5, rng), beta = per_channel<A>(sh.c, -1, 1, rng);
  const auto rm0 = per_channel<A>(sh.c, -1, 1, rng), rv0 = per_channel<A>(sh.c, 0.5, 2, rng);
  const bool with = affine == WithAffine::yes;
  const A* g = with ? gamma.data() : nullptr;
  const A* b = with ? beta.data() : nullptr;
  const size_t c = size_t(sh.c);

  struct Run {
    std::vector<T> y, y_eval, dx;
    std::vector<A> mean, invstd, rm, rv, dgamma, dbeta;
  };
  auto run = [&](ChannelLayout layout, const std::vector<T>& xs, const std::vector<T>& dys) {
    BatchNormArgs a;
    a.dtype = dtype_of<T>();
    a.n = sh.n, a.c = sh.c, a.s = sh.s, a.eps = 1e-3, a.momentum = 0.25, a.layout = layout;
    Run r{std::vector<T>(xs.size()), std::vector<T>(xs.size()), std::vector<T>(xs.size()), std::vector<A>(c),
          std::vector<A>(c), rm0, rv0, std::vector<A>(c), std::vector<A>(c)};
    cpu::batch_norm_forward_train(a, r.y.data(), r.mean.data(), r.invstd.data(), r.rm.data(), r.rv.data(), xs.data(),
                                  g, b, nullptr, nullptr);
    cpu::batch_norm_forward_eval(a, r.y_eval.data(), xs.data(), g, b, rm0.data(), rv0.data(), nullptr);
    cpu::batch_norm_backward(a, r.dx.data(), r.dgamma.data(), r.dbeta.data(), dys.data(), xs.data(), g,
                             r.mean.data(), r.invstd.data(), nullptr, nullptr, nullptr);
    return r;
  };
  const Run rows = run(ChannelLayout::channels_first, x, dy);
  const Run last = run(ChannelLayout::channels_last, to_channels_last(sh, x), to_channels_last(sh, dy));
  expect_same_bits(last.y, to_channels_last(sh, rows.y), "y");
  expect_same_bits(last.mean, rows.mean, "save_mean");
  expect_same_bits(last.invstd, rows.invstd, "save_invstd");
  expect_same_bits(last.rm, rows.rm, "running_mean");
  expect_same_bits(last.rv, rows.rv, "running_var");
  expect_same_bits(last.y_eval, to_channels_last(sh, rows.y_eval), "y (eval)");
  expect_same_bits(last.dx, to_channels_last(sh, rows.dx), "dx");
  expect_same_bits(last.dgamma, rows.dgamma, "dgamma");
  expect_same_bits(last.dbeta, rows.dbeta, "dbeta");
}

template <class T> void check_channels_last_all() {
  for (const Shape3& sh : channels_last_shapes())
    for (WithAffine affine : {WithAffine::no, WithAffine::yes}) check_channels_last<T>(sh, affine);
}

TEST(BatchNormKernel, ChannelsLastEqualsRowMajorF64) { check_channels_last_all<double>(); }
TEST(BatchNormKernel, ChannelsLastEqualsRowMajorF32) { check_channels_last_all<float>(); }
TEST(BatchNormKernel, ChannelsLastEqualsRowMajorBf16) { check_channels_last_all<bf16>(); }
TEST(BatchNormKernel, ChannelsLastEqualsRowMajorF16) { check_channels_last_all<f16>(); }

// ---- edge cases ------------------------------------------------------------------------

TEST(BatchNormKernel, NullRunningStatisticsAreLeftAlone) {
  const Shape3 sh{4, 2, 3};
  std::mt19937 rng(9);
  std::vector<double> xe;
  const auto x = channel_values<float>(sh, 1.0, 0.5, rng, xe);
  BatchNormArgs a;
  a.n = sh.n, a.c = sh.c, a.s = sh.s;
  std::vector<float> y(x.size()), mean(2), invstd(2);
  cpu::batch_norm_forward_train(a, y.data(), mean.data(), invstd.data(), nullptr, nullptr, x.data(), nullptr, nullptr,
                                nullptr, nullptr);
  const RefStats r = reference_stats(sh, xe, a.eps);
  expect_close(mean, r.mean, 1e-6, "save_mean");
  expect_close(invstd, r.invstd, 1e-6, "save_invstd");
}

// A large common offset must not eat the variance: the statistics are two-pass.
TEST(BatchNormKernel, LargeMeanKeepsTheVariance) {
  const Shape3 sh{16, 2, 257};
  std::mt19937 rng(11);
  std::vector<double> xe;
  auto x = channel_values<float>(sh, 1.0, 0.0, rng, xe);
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] += 1e4f;
    xe[i] = double(x[i]);
  }
  BatchNormArgs a;
  a.n = sh.n, a.c = sh.c, a.s = sh.s;
  std::vector<float> y(x.size()), mean(2), invstd(2);
  cpu::batch_norm_forward_train(a, y.data(), mean.data(), invstd.data(), nullptr, nullptr, x.data(), nullptr, nullptr,
                                nullptr, nullptr);
  expect_close(invstd, reference_stats(sh, xe, a.eps).invstd, 1e-6, "save_invstd");
}

TEST(BatchNormKernel, EmptyBatchBackwardGivesZeroSums) {
  for (ChannelLayout layout : {ChannelLayout::channels_first, ChannelLayout::channels_last}) {
    BatchNormArgs a;
    a.n = 0, a.c = 3, a.s = 4, a.layout = layout;
    std::vector<float> dgamma(3, 7.f), dbeta(3, 7.f), mean(3, 0.f), invstd(3, 1.f);
    cpu::batch_norm_backward(a, nullptr, dgamma.data(), dbeta.data(), nullptr, nullptr, nullptr, mean.data(),
                             invstd.data(), nullptr, nullptr, nullptr);
    EXPECT_EQ(dgamma, std::vector<float>(3, 0.f));
    EXPECT_EQ(dbeta, std::vector<float>(3, 0.f));
  }
}

}  // namespace
}  // namespace loom
