// The CPU convolution (im2col + gemm) and pooling kernels against the plain loops of
// conv_reference.h, on random data, over a table of shapes that covers padding, stride,
// dilation, groups (depthwise too), 1x1 (the no-im2col path), rectangular kernels, one
// sample (threads inside the gemm), more samples than the filter gradient's partials, and a
// batch that channels-last multiplies in several chunks of samples.
// Errors are measured against sum |a||b| (the f64 loop over magnitudes), the scale that
// bounds rounding in any summation order. Each case runs in both layouts: channels-last
// buffers are the same activations permuted to (N, H, W, C), the weight as it is.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <type_traits>
#include <vector>

#include "kernels/cpu/kernels.h"
#include "tests/kernels/conv_reference.h"

namespace loom {
namespace {

using test::ConvCase;
using test::PoolCase;

const std::vector<ConvCase>& conv_cases() {
  static const std::vector<ConvCase> table = {
      {"3x3_pad1", 2, 3, 8, 8, 4, 3, 3, 1, 1, 1, 1},
      {"3x3_stride2", 3, 4, 9, 7, 6, 3, 3, 2, 2, 1, 1},
      {"3x3_dilation2", 2, 3, 9, 9, 5, 3, 3, 1, 1, 2, 2, 2, 2},
      {"groups2", 2, 4, 6, 6, 6, 3, 3, 1, 1, 1, 1, 1, 1, 2},
      {"depthwise", 2, 4, 6, 6, 4, 3, 3, 1, 1, 1, 1, 1, 1, 4},
      {"1x1", 3, 5, 4, 4, 7, 1, 1},
      {"1x1_stride2", 2, 3, 5, 5, 4, 1, 1, 2, 2},
      {"1x1_groups2", 2, 4, 5, 5, 6, 1, 1, 1, 1, 0, 0, 1, 1, 2},
      {"rect_kernel_stride", 1, 2, 5, 9, 3, 2, 3, 1, 2, 0, 1},
      {"stride_past_kernel", 2, 2, 9, 9, 3, 2, 2, 3, 3},
      {"one_sample_wide", 1, 16, 12, 12, 24, 3, 3, 1, 1, 1, 1},
      {"many_samples", 19, 3, 6, 6, 4, 3, 3, 1, 1, 1, 1},
      // Small planes, many samples: the row-major passes put chunks of samples side by side.
      {"many_samples_groups", 40, 4, 7, 7, 6, 3, 3, 2, 2, 1, 1, 1, 1, 2},
      {"7x7_stride2_pad3", 2, 3, 16, 16, 8, 7, 7, 2, 2, 3, 3},
      // 2.3 MB of f32 windows a sample: channels-last runs it in chunks of 3 samples (the
      // filter gradient's parts of two samples in chunks of one).
      {"chunks", 10, 64, 32, 32, 8, 3, 3, 1, 1, 1, 1},
      // A filter gradient large enough to be one product a chunk: chunks of 7 and 3 samples.
      {"chunks_one_part", 10, 128, 16, 16, 32, 3, 3, 1, 1, 1, 1},
  };
  return table;
}

template <class T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::f32; }
template <> constexpr DType dtype_of<double>() { return DType::f64; }
template <> constexpr DType dtype_of<bf16>() { return DType::bf16; }
template <> constexpr DType dtype_of<f16>() { return DType::f16; }

template <class T>
double as_double(T v) {
  if constexpr (std::is_same_v<T, double>) return v;
  else return double(float(v));
}

// Random values of T and the same values (after rounding to T) in f64.
template <class T>
std::vector<T> random_values(int64_t n, std::mt19937& rng, std::vector<double>& exact) {
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  std::vector<T> v(static_cast<size_t>(n));
  exact.resize(static_cast<size_t>(n));
  for (size_t i = 0; i < v.size(); ++i) {
    v[i] = T(dist(rng));
    exact[i] = as_double(v[i]);
  }
  return v;
}

template <class T>
void expect_near_scaled(const std::vector<T>& got, const std::vector<double>& want, const std::vector<double>& scale,
                        double tol, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_NEAR(as_double(got[i]), want[i], tol * scale[i] + 1e-300) << what << " element " << i;
}

template <class T>
void check_conv(const ConvCase& c, double tol, ChannelLayout layout = ChannelLayout::channels_first) {
  SCOPED_TRACE(c.name);
  std::mt19937 rng(17);
  Conv2dArgs a = test::conv_args(c, dtype_of<T>());
  std::vector<double> xe, we, dye;
  auto x = random_values<T>(test::x_numel(a), rng, xe);
  auto w = random_values<T>(test::w_numel(a), rng, we);
  auto dy = random_values<T>(test::y_numel(a), rng, dye);
  const test::ConvReference want = test::conv_reference(a, xe, we, dye);
  const test::ConvReference scale = test::conv_reference(a, xe, we, dye, true);
  const bool cl = layout == ChannelLayout::channels_last;
  if (cl) {
    a.layout = layout;
    x = test::to_channels_last(x, a.n, a.c_in, a.h, a.w);
    dy = test::to_channels_last(dy, a.n, a.c_out, a.out_h, a.out_w);
  }

  EXPECT_EQ(cpu::conv2d_workspace_size(a, ConvPass::forward), 0u);
  // Outputs start at 7, so an output a kernel fails to write (or adds to) shows.
  std::vector<T> y(size_t(test::y_numel(a)), T(7.f)), dx(size_t(test::x_numel(a)), T(7.f)),
      dw(size_t(test::w_numel(a)), T(7.f));
  cpu::conv2d_forward(a, y.data(), x.data(), w.data(), nullptr);
  cpu::conv2d_backward_data(a, dx.data(), dy.data(), w.data(), nullptr);
  cpu::conv2d_backward_filter(a, dw.data(), x.data(), dy.data(), nullptr);
  {
    // Accumulating: dx += the gradient, rounded once (in f32 and f64 the sum of the two).
    Conv2dArgs acc = a;
    acc.accumulate = true;
    std::vector<double> unused;
    const std::vector<T> prior = random_values<T>(test::x_numel(a), rng, unused);
    std::vector<T> sum = prior;
    cpu::conv2d_backward_data(acc, sum.data(), dy.data(), w.data(), nullptr);
    for (size_t i = 0; i < sum.size(); ++i) {
      if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>)
        ASSERT_EQ(sum[i], prior[i] + dx[i]) << "accumulated dx element " << i;
      else
        ASSERT_NEAR(as_double(sum[i]), as_double(prior[i]) + as_double(dx[i]),
                    2 * tol * (std::abs(as_double(prior[i])) + std::abs(as_double(dx[i]))) + 1e-30)
            << "accumulated dx element " << i;
    }
  }
  if (cl) {
    y = test::from_channels_last(y, a.n, a.c_out, a.out_h, a.out_w);
    dx = test::from_channels_last(dx, a.n, a.c_in, a.h, a.w);
  }
  expect_near_scaled(y, want.y, scale.y, tol, "y");
  expect_near_scaled(dx, want.dx, scale.dx, tol, "dx");
  expect_near_scaled(dw, want.dw, scale.dw, tol, "dw");
}

TEST(ConvCpu, MatchesDirectLoopF64) {
  for (const auto& c : conv_cases()) check_conv<double>(c, 1e-12);
}
TEST(ConvCpu, MatchesDirectLoopF32) {
  for (const auto& c : conv_cases()) check_conv<float>(c, 1e-5);
}
// 16-bit buffers are computed in f32 and rounded once: within a 16-bit rounding of the scale.
TEST(ConvCpu, MatchesDirectLoopBf16) {
  for (const auto& c : conv_cases()) check_conv<bf16>(c, 1e-2);
}
TEST(ConvCpu, MatchesDirectLoopF16) {
  for (const auto& c : conv_cases()) check_conv<f16>(c, 2e-3);
}

TEST(ConvCpu, ChannelsLastMatchesDirectLoopF64) {
  for (const auto& c : conv_cases()) check_conv<double>(c, 1e-12, ChannelLayout::channels_last);
}
TEST(ConvCpu, ChannelsLastMatchesDirectLoopF32) {
  for (const auto& c : conv_cases()) check_conv<float>(c, 1e-5, ChannelLayout::channels_last);
}
TEST(ConvCpu, ChannelsLastMatchesDirectLoopBf16) {
  for (const auto& c : conv_cases()) check_conv<bf16>(c, 1e-2, ChannelLayout::channels_last);
}
TEST(ConvCpu, ChannelsLastMatchesDirectLoopF16) {
  for (const auto& c : conv_cases()) check_conv<f16>(c, 2e-3, ChannelLayout::channels_last);
}

TEST(ConvCpu, FilterGradientOfAnEmptyBatchIsZero) {
  for (ChannelLayout layout : {ChannelLayout::channels_first, ChannelLayout::channels_last}) {
    Conv2dArgs a = test::conv_args({"empty", 0, 2, 4, 4, 3, 3, 3, 1, 1, 1, 1}, DType::f32);
    a.layout = layout;
    std::vector<float> dw(size_t(test::w_numel(a)), 7.f);
    cpu::conv2d_backward_filter(a, dw.data(), nullptr, nullptr, nullptr);
    for (float v : dw) ASSERT_EQ(v, 0.f);
  }
}

TEST(ConvCpu, FilterGradientIsBitwiseReproducible) {
  const Conv2dArgs a = test::conv_args({"repro", 13, 3, 7, 7, 5, 3, 3, 1, 1, 1, 1}, DType::f32);
  std::mt19937 rng(3);
  std::vector<double> unused;
  const auto x = random_values<float>(test::x_numel(a), rng, unused);
  const auto dy = random_values<float>(test::y_numel(a), rng, unused);
  std::vector<float> first(size_t(test::w_numel(a))), second(first.size());
  cpu::conv2d_backward_filter(a, first.data(), x.data(), dy.data(), nullptr);
  cpu::conv2d_backward_filter(a, second.data(), x.data(), dy.data(), nullptr);
  EXPECT_EQ(first, second);
}

// ---- pooling --------------------------------------------------------------------------

const std::vector<PoolCase>& pool_cases() {
  static const std::vector<PoolCase> table = {
      {"2x2", 2, 3, 8, 6, 2, 2, 2, 2},
      {"3x3_stride2_pad1", 2, 2, 9, 8, 3, 3, 2, 2, 1, 1},
      {"3x3_stride1_pad1", 1, 3, 5, 6, 3, 3, 1, 1, 1, 1},
      {"rect_2x3_pad", 2, 2, 7, 9, 2, 3, 1, 2, 1, 1},
      {"odd_input_floor", 1, 2, 7, 7, 2, 2, 2, 2},
      {"stride_past_kernel", 1, 2, 10, 10, 2, 2, 3, 3},
  };
  return table;
}

// The pooling kernels' outputs in the row-major order of the reference, whatever the layout.
template <class T>
struct PoolResults {
  std::vector<T> y, dx;
  std::vector<int64_t> idx;
};

// Runs the max (or average) pooling kernels on row-major x and dy, in a's layout.
template <class T>
PoolResults<T> run_pools(Pool2dArgs a, ChannelLayout layout, bool max, std::vector<T> x, std::vector<T> dy) {
  const bool cl = layout == ChannelLayout::channels_last;
  a.layout = layout;
  if (cl) {
    x = test::to_channels_last(x, a.n, a.c, a.h, a.w);
    dy = test::to_channels_last(dy, a.n, a.c, a.out_h, a.out_w);
  }
  PoolResults<T> r{std::vector<T>(dy.size()), std::vector<T>(x.size(), T(123.f)), std::vector<int64_t>(dy.size())};
  if (max) {
    cpu::max_pool2d_forward(a, r.y.data(), r.idx.data(), x.data(), nullptr);
    cpu::max_pool2d_backward(a, r.dx.data(), dy.data(), r.idx.data(), nullptr);
  } else {
    cpu::avg_pool2d_forward(a, r.y.data(), x.data(), nullptr);
    cpu::avg_pool2d_backward(a, r.dx.data(), dy.data(), nullptr);
  }
  if (cl) {
    r.y = test::from_channels_last(r.y, a.n, a.c, a.out_h, a.out_w);
    r.idx = test::from_channels_last(r.idx, a.n, a.c, a.out_h, a.out_w);
    r.dx = test::from_channels_last(r.dx, a.n, a.c, a.h, a.w);
  }
  return r;
}

template <class T>
void check_pools(const PoolCase& p, double tol, ChannelLayout layout = ChannelLayout::channels_first) {
  SCOPED_TRACE(p.name);
  std::mt19937 rng(5);
  const Pool2dArgs a = test::pool_args(p, dtype_of<T>());
  const int64_t nx = a.n * a.c * a.h * a.w, ny = a.n * a.c * a.out_h * a.out_w;
  std::vector<double> xe, dye;
  const auto x = random_values<T>(nx, rng, xe);
  const auto dy = random_values<T>(ny, rng, dye);
  std::vector<double> ones_y(static_cast<size_t>(ny), 1.0), ones_x(static_cast<size_t>(nx), 1.0);

  const test::MaxPoolReference mref = test::max_pool_reference(a, xe, dye);
  const PoolResults<T> m = run_pools(a, layout, true, x, dy);
  EXPECT_EQ(m.idx, mref.indices);
  expect_near_scaled(m.y, mref.y, ones_y, 0.0, "max y");
  expect_near_scaled(m.dx, mref.dx, ones_x, tol, "max dx");

  const test::AvgPoolReference aref = test::avg_pool_reference(a, xe, dye);
  const PoolResults<T> v = run_pools(a, layout, false, x, dy);
  expect_near_scaled(v.y, aref.y, ones_y, tol, "avg y");
  expect_near_scaled(v.dx, aref.dx, ones_x, tol, "avg dx");

  if (layout == ChannelLayout::channels_last) {  // the same bits as the row-major kernels
    const PoolResults<T> m0 = run_pools(a, ChannelLayout::channels_first, true, x, dy);
    const PoolResults<T> v0 = run_pools(a, ChannelLayout::channels_first, false, x, dy);
    EXPECT_EQ(0, std::memcmp(m.y.data(), m0.y.data(), m.y.size() * sizeof(T)));
    EXPECT_EQ(0, std::memcmp(m.dx.data(), m0.dx.data(), m.dx.size() * sizeof(T)));
    EXPECT_EQ(0, std::memcmp(v.y.data(), v0.y.data(), v.y.size() * sizeof(T)));
    EXPECT_EQ(0, std::memcmp(v.dx.data(), v0.dx.data(), v.dx.size() * sizeof(T)));
  }
}

TEST(PoolCpu, MatchesLoopsF64) {
  for (const auto& p : pool_cases()) check_pools<double>(p, 1e-14);
}
TEST(PoolCpu, MatchesLoopsF32) {
  for (const auto& p : pool_cases()) check_pools<float>(p, 1e-6);
}
TEST(PoolCpu, MatchesLoopsBf16) {
  for (const auto& p : pool_cases()) check_pools<bf16>(p, 1e-2);
}

TEST(PoolCpu, ChannelsLastMatchesLoopsAndTheRowMajorKernelsF64) {
  for (const auto& p : pool_cases()) check_pools<double>(p, 1e-14, ChannelLayout::channels_last);
}
TEST(PoolCpu, ChannelsLastMatchesLoopsAndTheRowMajorKernelsF32) {
  for (const auto& p : pool_cases()) check_pools<float>(p, 1e-6, ChannelLayout::channels_last);
}
TEST(PoolCpu, ChannelsLastMatchesLoopsAndTheRowMajorKernelsBf16) {
  for (const auto& p : pool_cases()) check_pools<bf16>(p, 1e-2, ChannelLayout::channels_last);
}

TEST(PoolCpu, MaxPoolPropagatesNan) {
  const Pool2dArgs a = test::pool_args({"nan", 1, 1, 2, 4, 2, 2, 2, 2}, DType::f32);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> x = {1, nan, 5, 6, 3, 4, 7, 8};
  std::vector<float> y(2);
  std::vector<int64_t> idx(2);
  cpu::max_pool2d_forward(a, y.data(), idx.data(), x.data(), nullptr);
  EXPECT_TRUE(std::isnan(y[0]));
  EXPECT_EQ(idx[0], 1);
  EXPECT_EQ(y[1], 8.f);
  EXPECT_EQ(idx[1], 7);
}

TEST(PoolCpu, MaxPoolTiesGoToTheFirstInWindowOrder) {
  const Pool2dArgs a = test::pool_args({"ties", 1, 1, 2, 2, 2, 2, 2, 2}, DType::f32);
  const std::vector<float> x = {1, 3, 3, 3};
  std::vector<float> y(1), dx(4), dy = {2};
  std::vector<int64_t> idx(1);
  cpu::max_pool2d_forward(a, y.data(), idx.data(), x.data(), nullptr);
  cpu::max_pool2d_backward(a, dx.data(), dy.data(), idx.data(), nullptr);
  EXPECT_EQ(idx[0], 1);
  EXPECT_EQ(dx, (std::vector<float>{0, 2, 0, 0}));
}

}  // namespace
}  // namespace loom
