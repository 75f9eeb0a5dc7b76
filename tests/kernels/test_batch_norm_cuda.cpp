// The CUDA batch-norm kernels against the CPU kernels on the same inputs, in f32, bf16,
// f16 and f64, over shapes that take every launch path: rows that are and are not a whole
// number of 16-byte vectors, one value per row (BatchNorm1d), one block per channel
// (ResNet-18's last stage), channels split over many blocks with partials combined
// (ResNet-18's first stage, few channels with long rows, one channel), and buffers that are
// not 16-byte aligned. The channels-last (N, S, C) kernels are checked the same way against
// the CPU's channels-last kernels, over ResNet-18's four stages at batch 256 and over channel
// counts that do and do not fill whole vectors and tiles. Also: repeated runs give identical
// bits, a large common offset leaves the variance intact, and the fused ReLU (with and without
// a residual) is the plain kernels followed by the add and the ReLU, to the bit.
//
// Tolerances: per-channel statistics are f32 sums on the GPU and pairwise f64 on the CPU,
// so they agree to a few f32 roundings of the sum of magnitudes; outputs may differ by an
// ulp of their dtype on top.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/cpu/kernels.h"
#include "kernels/cuda/kernels.h"
#include "tests/common/device_buffer.h"
#include "tests/common/gpu.h"

namespace loom {
namespace {

using test::DeviceBuffer;

template <class T> constexpr DType dtype_of() {
  if constexpr (std::is_same_v<T, float>) return DType::f32;
  else if constexpr (std::is_same_v<T, double>) return DType::f64;
  else if constexpr (std::is_same_v<T, bf16>) return DType::bf16;
  else return DType::f16;
}
template <class T> using acc_of = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <class T> double to_double(T v) {
  if constexpr (std::is_same_v<T, double>) return v;
  else return double(float(v));
}

struct Case {
  const char* name;
  int64_t n, c, s;
};

constexpr ChannelLayout kFirst = ChannelLayout::channels_first, kLast = ChannelLayout::channels_last;

const std::vector<Case>& cases() {
  static const std::vector<Case> table = {
      {"tiny_odd", 1, 3, 7},
      {"one_channel_one_value_rows", 5, 1, 1},
      {"odd_rows", 2, 7, 33},
      {"long_odd_rows_split", 64, 16, 1025},
      {"bn1d_rows", 300, 40, 1},
      {"resnet_stage1_split", 128, 64, 1024},
      {"resnet_stage3", 128, 256, 64},
      {"resnet_stage4_block_per_channel", 128, 512, 16},
      {"few_channels_long_rows", 2, 3, 300000},
      {"one_channel_many_blocks", 512, 1, 64},
  };
  return table;
}

// For (N, S, C): C sets the vector width (16 bytes' worth of channels or single values) and
// how full the last tile of channels is.
const std::vector<Case>& channels_last_cases() {
  static const std::vector<Case> table = {
      {"tiny_odd", 1, 3, 7},
      {"one_channel_one_value_rows", 5, 1, 1},
      {"odd_channels", 2, 7, 33},
      {"bn1d_rows", 300, 40, 1},
      {"one_channel_many_blocks", 3, 1, 5000},
      {"part_vectors", 8, 36, 49},  // f32: 9 vectors; bf16, f16: single values
      {"few_vectors", 16, 24, 100},
      {"last_tile_short", 4, 1000, 3},
      {"resnet_stage1", 256, 64, 1024},
      {"resnet_stage2", 256, 128, 256},
      {"resnet_stage3", 256, 256, 64},
      {"resnet_stage4", 256, 512, 16},
  };
  return table;
}

// The channel of element i of a buffer laid out as `layout`.
size_t channel_of(const Case& k, ChannelLayout layout, size_t i) {
  return size_t(layout == kLast ? int64_t(i) % k.c : int64_t(i) / k.s % k.c);
}

// Values of T with a different centre per channel.
template <class T>
std::vector<T> channel_values(const Case& k, double spread, double centre_step, double offset, std::mt19937& rng,
                              ChannelLayout layout = kFirst) {
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  std::vector<T> v(size_t(k.n * k.c * k.s));
  for (size_t i = 0; i < v.size(); ++i) {
    const size_t c = channel_of(k, layout, i);
    v[i] = T(float(spread * u(rng) + centre_step * double(c % 11) + offset));
  }
  return v;
}

template <class A> std::vector<A> per_channel(int64_t c, double lo, double hi, std::mt19937& rng) {
  std::uniform_real_distribution<double> u(lo, hi);
  std::vector<A> v(static_cast<size_t>(c));
  for (auto& x : v) x = A(u(rng));
  return v;
}

template <class V>
void expect_close(const std::vector<V>& got, const std::vector<V>& want, const std::vector<double>& scale, double tol,
                  const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_NEAR(to_double(got[i]), to_double(want[i]), tol * scale[i]) << what << " element " << i;
}

template <class V> std::vector<double> one_plus_abs(const std::vector<V>& v) {
  std::vector<double> s(v.size());
  for (size_t i = 0; i < v.size(); ++i) s[i] = 1 + std::abs(to_double(v[i]));
  return s;
}

template <class T> double output_tol() {
  if constexpr (std::is_same_v<T, double>) return 1e-12;
  else if constexpr (std::is_same_v<T, float>) return 2e-5;
  else if constexpr (std::is_same_v<T, f16>) return 2e-3;
  else return 1e-2;
}
template <class T> double stat_tol() { return std::is_same_v<T, double> ? 1e-12 : 2e-5; }

enum class WithAffine { no, yes };

// Runs forward (training and eval) and backward on both devices and compares everything.
// `misalign` shifts every buffer one element off its allocation, so nothing is 16-byte aligned.
template <class T>
void check_case(const Case& k, ChannelLayout layout, WithAffine affine, int misalign = 0) {
  using A = acc_of<T>;
  SCOPED_TRACE(std::string(k.name) + (layout == kLast ? " channels-last" : "") +
               (affine == WithAffine::yes ? " affine" : " plain") + (misalign ? " misaligned" : ""));
  std::mt19937 rng(19);
  const auto x = channel_values<T>(k, 2.0, 0.3, -1.0, rng, layout),
             dy = channel_values<T>(k, 1.0, 0.05, -0.2, rng, layout);
  const auto gamma = per_channel<A>(k.c, 0.5, 1.5, rng), beta = per_channel<A>(k.c, -1, 1, rng);
  const auto rm0 = per_channel<A>(k.c, -1, 1, rng), rv0 = per_channel<A>(k.c, 0.5, 2, rng);
  const bool with = affine == WithAffine::yes;
  BatchNormArgs a;
  a.dtype = dtype_of<T>();
  a.n = k.n, a.c = k.c, a.s = k.s, a.eps = 1e-5, a.momentum = 0.1, a.layout = layout;
  const size_t numel = x.size(), c = size_t(k.c);

  // CPU reference.
  std::vector<T> y(numel), y_eval(numel), dx(numel);
  std::vector<A> mean(c), invstd(c), rm = rm0, rv = rv0, dgamma(c), dbeta(c);
  cpu::batch_norm_forward_train(a, y.data(), mean.data(), invstd.data(), rm.data(), rv.data(), x.data(),
                                with ? gamma.data() : nullptr, with ? beta.data() : nullptr, nullptr, nullptr);
  cpu::batch_norm_forward_eval(a, y_eval.data(), x.data(), with ? gamma.data() : nullptr,
                               with ? beta.data() : nullptr, rm0.data(), rv0.data(), nullptr);
  cpu::batch_norm_backward(a, dx.data(), dgamma.data(), dbeta.data(), dy.data(), x.data(),
                           with ? gamma.data() : nullptr, mean.data(), invstd.data(), nullptr, nullptr, nullptr);

  // GPU, with buffers `misalign` elements into their allocations.
  auto padded = [&](const std::vector<T>& v) {
    std::vector<T> p(v.size() + size_t(misalign));
    std::copy(v.begin(), v.end(), p.begin() + misalign);
    return p;
  };
  DeviceBuffer<T> gx(padded(x)), gdy(padded(dy)), gy(numel + misalign), gye(numel + misalign), gdx(numel + misalign);
  DeviceBuffer<A> ggamma(gamma), gbeta(beta), gmean(c), ginvstd(c), grm(rm0), grv(rv0), grm0(rm0), grv0(rv0),
      gdgamma(c), gdbeta(c), gsave_mean(mean), gsave_invstd(invstd);
  const A* gg = with ? ggamma.get() : nullptr;
  const A* gb = with ? gbeta.get() : nullptr;
  cuda::batch_norm_forward_train(a, gy.get() + misalign, gmean.get(), ginvstd.get(), grm.get(), grv.get(),
                                 gx.get() + misalign, gg, gb, nullptr, nullptr);
  cuda::batch_norm_forward_eval(a, gye.get() + misalign, gx.get() + misalign, gg, gb, grm0.get(), grv0.get(), nullptr);
  // The backward takes the CPU's saved statistics, so it is compared on its own.
  cuda::batch_norm_backward(a, gdx.get() + misalign, gdgamma.get(), gdbeta.get(), gdy.get() + misalign,
                            gx.get() + misalign, gg, gsave_mean.get(), gsave_invstd.get(), nullptr, nullptr, nullptr);
  auto unpad = [&](const DeviceBuffer<T>& b) {
    std::vector<T> h = b.to_host();
    return std::vector<T>(h.begin() + misalign, h.end());
  };

  const double st = stat_tol<T>(), ot = output_tol<T>();
  expect_close(gmean.to_host(), mean, one_plus_abs(mean), st, "save_mean");
  expect_close(ginvstd.to_host(), invstd, one_plus_abs(invstd), st, "save_invstd");
  expect_close(grm.to_host(), rm, one_plus_abs(rm), st, "running_mean");
  expect_close(grv.to_host(), rv, one_plus_abs(rv), st, "running_var");
  expect_close(unpad(gy), y, one_plus_abs(y), ot, "y");
  expect_close(unpad(gye), y_eval, one_plus_abs(y_eval), ot, "y (eval)");

  // Gradient scales: the sums of magnitudes bound any summation order's rounding.
  const double m = double(k.n * k.s);
  std::vector<double> abs_dy(c, 0.0), abs_dy_xhat(c, 0.0), dx_scale(numel);
  auto xhat = [&](size_t i, size_t ch) { return (to_double(x[i]) - double(mean[ch])) * double(invstd[ch]); };
  for (size_t i = 0; i < numel; ++i) {
    const size_t ch = channel_of(k, layout, i);
    abs_dy[ch] += std::abs(to_double(dy[i]));
    abs_dy_xhat[ch] += std::abs(to_double(dy[i]) * xhat(i, ch));
  }
  for (size_t i = 0; i < numel; ++i) {
    const size_t ch = channel_of(k, layout, i);
    const double g = with ? std::abs(double(gamma[ch])) : 1.0;
    dx_scale[i] = g * double(invstd[ch]) *
                      (std::abs(to_double(dy[i])) + std::abs(xhat(i, ch)) * abs_dy_xhat[ch] / m + abs_dy[ch] / m) +
                  1e-30;
  }
  expect_close(gdbeta.to_host(), dbeta, abs_dy, st, "dbeta");
  expect_close(gdgamma.to_host(), dgamma, abs_dy_xhat, st, "dgamma");
  expect_close(unpad(gdx), dx, dx_scale, ot, "dx");
}

template <class T> void check_all(WithAffine affine) {
  for (const Case& k : cases()) check_case<T>(k, kFirst, affine);
}
template <class T> void check_all_channels_last(WithAffine affine) {
  for (const Case& k : channels_last_cases()) check_case<T>(k, kLast, affine);
}

TEST(BatchNormCuda, MatchesCpuF32) {
  LOOM_REQUIRE_CUDA();
  check_all<float>(WithAffine::yes);
  check_all<float>(WithAffine::no);
}
TEST(BatchNormCuda, MatchesCpuBf16) {
  LOOM_REQUIRE_CUDA();
  check_all<bf16>(WithAffine::yes);
  check_all<bf16>(WithAffine::no);
}
TEST(BatchNormCuda, MatchesCpuF16) {
  LOOM_REQUIRE_CUDA();
  check_all<f16>(WithAffine::yes);
}
TEST(BatchNormCuda, MatchesCpuF64) {
  LOOM_REQUIRE_CUDA();
  check_all<double>(WithAffine::yes);
}

TEST(BatchNormCuda, ChannelsLastMatchesCpuF32) {
  LOOM_REQUIRE_CUDA();
  check_all_channels_last<float>(WithAffine::yes);
  check_all_channels_last<float>(WithAffine::no);
}
TEST(BatchNormCuda, ChannelsLastMatchesCpuBf16) {
  LOOM_REQUIRE_CUDA();
  check_all_channels_last<bf16>(WithAffine::yes);
  check_all_channels_last<bf16>(WithAffine::no);
}
TEST(BatchNormCuda, ChannelsLastMatchesCpuF16) {
  LOOM_REQUIRE_CUDA();
  check_all_channels_last<f16>(WithAffine::yes);
}
TEST(BatchNormCuda, ChannelsLastMatchesCpuF64) {
  LOOM_REQUIRE_CUDA();
  check_all_channels_last<double>(WithAffine::yes);
}

TEST(BatchNormCuda, UnalignedBuffersTakeTheScalarPath) {
  LOOM_REQUIRE_CUDA();
  for (const Case& k : cases()) {
    check_case<float>(k, kFirst, WithAffine::yes, 1);
    check_case<bf16>(k, kFirst, WithAffine::yes, 1);  // 2 bytes off: too misaligned for f32 partials too
  }
  // Channels-last partials start at the output's first address aligned for them.
  for (const Case& k : channels_last_cases()) {
    check_case<float>(k, kLast, WithAffine::yes, 1);
    check_case<bf16>(k, kLast, WithAffine::yes, 1);
  }
}

// Two runs of one call write the same bits: outputs, statistics and gradients.
template <class T> void check_repeatable(const Case& k, ChannelLayout layout) {
  using A = acc_of<T>;
  SCOPED_TRACE(std::string(k.name) + (layout == kLast ? " channels-last" : ""));
  std::mt19937 rng(23);
  const auto x = channel_values<T>(k, 2.0, 0.3, 0.0, rng, layout),
             dy = channel_values<T>(k, 1.0, 0.0, 0.0, rng, layout);
  BatchNormArgs a;
  a.dtype = dtype_of<T>();
  a.n = k.n, a.c = k.c, a.s = k.s, a.layout = layout;
  const size_t c = size_t(k.c);
  DeviceBuffer<T> gx(x), gdy(dy), gy(x.size()), gdx(x.size());
  DeviceBuffer<A> gmean(c), ginvstd(c), gdg(c), gdb(c);
  std::vector<unsigned char> runs[2];
  auto append = [](std::vector<unsigned char>& bytes, const auto& v) {
    const auto* p = reinterpret_cast<const unsigned char*>(v.data());
    bytes.insert(bytes.end(), p, p + v.size() * sizeof(v[0]));
  };
  for (auto& bytes : runs) {
    cuda::batch_norm_forward_train(a, gy.get(), gmean.get(), ginvstd.get(), nullptr, nullptr, gx.get(), nullptr,
                                   nullptr, nullptr, nullptr);
    cuda::batch_norm_backward(a, gdx.get(), gdg.get(), gdb.get(), gdy.get(), gx.get(), nullptr, gmean.get(),
                              ginvstd.get(), nullptr, nullptr, nullptr);
    append(bytes, gy.to_host());
    append(bytes, gdx.to_host());
    for (const auto& part : {gmean.to_host(), ginvstd.to_host(), gdg.to_host(), gdb.to_host()}) append(bytes, part);
  }
  ASSERT_EQ(runs[0].size(), runs[1].size());
  EXPECT_EQ(std::mismatch(runs[0].begin(), runs[0].end(), runs[1].begin()).first - runs[0].begin(),
            std::ptrdiff_t(runs[0].size()))
      << "first differing byte";
}

TEST(BatchNormCuda, RepeatedRunsGiveIdenticalBits) {
  LOOM_REQUIRE_CUDA();
  check_repeatable<float>({"resnet_stage1_split", 128, 64, 1024}, kFirst);
  for (const Case& k : {Case{"resnet_stage1", 256, 64, 1024}, Case{"resnet_stage4", 256, 512, 16}}) {
    check_repeatable<float>(k, kLast);
    check_repeatable<bf16>(k, kLast);
  }
}

// x = 1000 + U(-1, 1): a sum-of-squares variance would lose every digit in f32.
TEST(BatchNormCuda, LargeMeanKeepsTheVariance) {
  LOOM_REQUIRE_CUDA();
  for (ChannelLayout layout : {kFirst, kLast})
    for (const Case& k : {Case{"split", 64, 2, 1024}, Case{"block_per_channel", 16, 600, 36}}) {
      SCOPED_TRACE(std::string(k.name) + (layout == kLast ? " channels-last" : ""));
      std::mt19937 rng(29);
      const auto x = channel_values<float>(k, 1.0, 0.0, 1000.0, rng, layout);
      BatchNormArgs a;
      a.n = k.n, a.c = k.c, a.s = k.s, a.layout = layout;
      const size_t c = size_t(k.c);
      std::vector<float> y(x.size()), mean(c), invstd(c);
      cpu::batch_norm_forward_train(a, y.data(), mean.data(), invstd.data(), nullptr, nullptr, x.data(), nullptr,
                                    nullptr, nullptr, nullptr);
      DeviceBuffer<float> gx(x), gy(x.size()), gmean(c), ginvstd(c);
      cuda::batch_norm_forward_train(a, gy.get(), gmean.get(), ginvstd.get(), nullptr, nullptr, gx.get(), nullptr,
                                     nullptr, nullptr, nullptr);
      std::vector<double> rel(c);
      for (size_t i = 0; i < c; ++i) rel[i] = std::abs(double(invstd[i]));
      expect_close(ginvstd.to_host(), invstd, rel, 1e-4, "save_invstd");
      expect_close(gy.to_host(), y, one_plus_abs(y), 1e-3, "y");
    }
}

TEST(BatchNormCuda, EmptyBatchBackwardGivesZeroSums) {
  LOOM_REQUIRE_CUDA();
  for (ChannelLayout layout : {kFirst, kLast}) {
    BatchNormArgs a;
    a.n = 0, a.c = 3, a.s = 4, a.layout = layout;
    DeviceBuffer<float> dg(std::vector<float>(3, 7.f)), db(std::vector<float>(3, 7.f)), mean(3), invstd(3);
    cuda::batch_norm_backward(a, nullptr, dg.get(), db.get(), nullptr, nullptr, nullptr, mean.get(), invstd.get(),
                              nullptr, nullptr, nullptr);
    EXPECT_EQ(dg.to_host(), std::vector<float>(3, 0.f));
    EXPECT_EQ(db.to_host(), std::vector<float>(3, 0.f));
  }
}

// The fused ReLU (BatchNormArgs::relu) against the plain kernels with the epilogue done on the
// host: y = relu(plain y + residual) and, backward, the plain kernels fed dy masked by that y,
// to the bit; the residual's gradient is the masked dy. Residual values of the outputs' size
// make many sums cross zero.
template <class T> T host_add_relu(T v, const T* residual) {
  using A = acc_of<T>;
  if (residual) v = T(A(v) + A(*residual));
  return A(v) < A(0) ? T(A(0)) : v;
}

template <class V> void expect_same_bits(const std::vector<V>& got, const std::vector<V>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_EQ(std::memcmp(&got[i], &want[i], sizeof(V)), 0)
        << what << " element " << i << ": " << to_double(got[i]) << " against " << to_double(want[i]);
}

template <class T> void check_fused(const Case& k, ChannelLayout layout, bool with_residual) {
  using A = acc_of<T>;
  SCOPED_TRACE(std::string(k.name) + (layout == kLast ? " channels-last" : "") +
               (with_residual ? " with a residual" : ""));
  std::mt19937 rng(31);
  const auto x = channel_values<T>(k, 2.0, 0.3, -1.0, rng, layout), dy = channel_values<T>(k, 1.0, 0.0, 0.0, rng, layout),
             residual = channel_values<T>(k, 1.0, 0.0, 0.0, rng, layout);
  const auto gamma = per_channel<A>(k.c, 0.5, 1.5, rng), beta = per_channel<A>(k.c, -1, 1, rng);
  BatchNormArgs a;
  a.dtype = dtype_of<T>();
  a.n = k.n, a.c = k.c, a.s = k.s, a.layout = layout;
  const size_t numel = x.size(), c = size_t(k.c);
  DeviceBuffer<T> gx(x), gdy(dy), gres(residual), gy(numel), gyf(numel), gdx(numel), gdxf(numel), gdres(numel);
  DeviceBuffer<A> ggamma(gamma), gbeta(beta), gmean(c), ginvstd(c), gdg(c), gdb(c), gdgf(c), gdbf(c);
  const T* r = with_residual ? gres.get() : nullptr;

  cuda::batch_norm_forward_train(a, gy.get(), gmean.get(), ginvstd.get(), nullptr, nullptr, gx.get(), ggamma.get(),
                                 gbeta.get(), nullptr, nullptr);
  BatchNormArgs f = a;
  f.relu = true;
  cuda::batch_norm_forward_train(f, gyf.get(), gmean.get(), ginvstd.get(), nullptr, nullptr, gx.get(), ggamma.get(),
                                 gbeta.get(), r, nullptr);
  std::vector<T> want = gy.to_host();
  for (size_t i = 0; i < numel; ++i) want[i] = host_add_relu(want[i], with_residual ? &residual[i] : nullptr);
  const std::vector<T> yf = gyf.to_host();
  expect_same_bits(yf, want, "y");

  std::vector<T> masked = dy;
  for (size_t i = 0; i < numel; ++i)
    if (!(A(yf[i]) > A(0))) masked[i] = T(A(0));
  DeviceBuffer<T> gmasked(masked);
  cuda::batch_norm_backward(a, gdx.get(), gdg.get(), gdb.get(), gmasked.get(), gx.get(), ggamma.get(), gmean.get(),
                            ginvstd.get(), nullptr, nullptr, nullptr);
  cuda::batch_norm_backward(f, gdxf.get(), gdgf.get(), gdbf.get(), gdy.get(), gx.get(), ggamma.get(), gmean.get(),
                            ginvstd.get(), gyf.get(), with_residual ? gdres.get() : nullptr, nullptr);
  expect_same_bits(gdxf.to_host(), gdx.to_host(), "dx");
  expect_same_bits(gdgf.to_host(), gdg.to_host(), "dgamma");
  expect_same_bits(gdbf.to_host(), gdb.to_host(), "dbeta");
  if (with_residual) expect_same_bits(gdres.to_host(), masked, "dresidual");
}

template <class T> void check_fused_all() {
  for (bool with_residual : {false, true}) {
    for (const Case& k : cases()) check_fused<T>(k, kFirst, with_residual);
    for (const Case& k : channels_last_cases()) check_fused<T>(k, kLast, with_residual);
  }
}

TEST(BatchNormCuda, FusedReluIsThePlainKernelsThenTheEpilogueF32) {
  LOOM_REQUIRE_CUDA();
  check_fused_all<float>();
}
TEST(BatchNormCuda, FusedReluIsThePlainKernelsThenTheEpilogueBf16) {
  LOOM_REQUIRE_CUDA();
  check_fused_all<bf16>();
}
TEST(BatchNormCuda, FusedReluIsThePlainKernelsThenTheEpilogueF64) {
  LOOM_REQUIRE_CUDA();
  check_fused<double>({"resnet_stage3", 128, 256, 64}, kFirst, true);
  check_fused<double>({"resnet_stage3", 256, 256, 64}, kLast, true);
}

}  // namespace
}  // namespace loom
