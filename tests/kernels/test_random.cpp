// The Philox generator against Random123's known answers, the (seed, offset) to counter
// mapping of the random kernels, reproducibility, and the moments of 1M samples.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels/core/error.h"
#include "kernels/core/philox.h"
#include "kernels/cpu/kernels.h"

namespace loom {
namespace {

template <class T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::f32; }
template <> constexpr DType dtype_of<double>() { return DType::f64; }
template <> constexpr DType dtype_of<bf16>() { return DType::bf16; }
template <> constexpr DType dtype_of<f16>() { return DType::f16; }

template <class T>
Strided contiguous(std::vector<T>& v) {
  Strided s;
  s.data = v.data();
  s.dtype = dtype_of<T>();
  s.ndim = 1;
  s.shape[0] = int64_t(v.size());
  s.strides[0] = 1;
  return s;
}

template <class T>
std::vector<T> uniform(size_t n, uint64_t seed, uint64_t offset, double lo, double hi) {
  std::vector<T> v(n);
  cpu::uniform(contiguous(v), seed, offset, lo, hi, nullptr);
  return v;
}

template <class T>
std::vector<T> normal(size_t n, uint64_t seed, uint64_t offset, double mean, double std) {
  std::vector<T> v(n);
  cpu::normal(contiguous(v), seed, offset, mean, std, nullptr);
  return v;
}

// The three philox4x32-10 lines of Random123's tests/kat_vectors: counter, key, output.
TEST(RandomCpu, PhiloxMatchesRandom123KnownAnswers) {
  struct Kat {
    philox::Block ctr;
    uint32_t k0, k1;
    philox::Block want;
  };
  const Kat kats[] = {
      {{{0, 0, 0, 0}}, 0, 0, {{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}}},
      {{{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}}, 0xffffffff, 0xffffffff,
       {{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}}},
      {{{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}}, 0xa4093822, 0x299f31d0,
       {{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}}},
  };
  for (const auto& kat : kats) {
    const philox::Block got = philox::philox4x32_10(kat.ctr, kat.k0, kat.k1);
    for (int j = 0; j < 4; ++j) EXPECT_EQ(got.w[j], kat.want.w[j]) << "word " << j;
  }
}

// With lo = 0 and hi = 2^24 an f64 sample is exactly word >> 8, which exposes the mapping
// from (seed, offset, i) to (key, counter, word) through the public kernel.
TEST(RandomCpu, UniformTakesWordIModFourOfCounterOffsetPlusIDivFour) {
  const auto zero = uniform<double>(4, 0, 0, 0, 0x1p24);
  const uint32_t kat[4] = {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8};
  for (int j = 0; j < 4; ++j) EXPECT_EQ(zero[j], double(kat[j] >> 8)) << "word " << j;

  // An offset just below 2^32 makes the counter carry into its second word.
  const uint64_t seed = 0x0123456789abcdefull, offset = 0xfffffffeull;
  const auto got = uniform<double>(13, seed, offset, 0, 0x1p24);
  for (size_t i = 0; i < got.size(); ++i) {
    const philox::Block w = philox::block(seed, offset + i / 4);
    EXPECT_EQ(got[i], double(w.w[i % 4] >> 8)) << "element " << i;
  }
  const philox::Block carried =
      philox::philox4x32_10({{0, 1, 0, 0}}, uint32_t(seed), uint32_t(seed >> 32));  // counter 2^32
  EXPECT_EQ(got[8], double(carried.w[0] >> 8));
}

TEST(RandomCpu, SameSeedAndOffsetGiveSameNumbers) {
  EXPECT_EQ(uniform<float>(1001, 7, 3, -1, 1), uniform<float>(1001, 7, 3, -1, 1));
  EXPECT_EQ(normal<float>(1001, 7, 3, 0, 1), normal<float>(1001, 7, 3, 0, 1));
  EXPECT_NE(uniform<float>(1001, 7, 3, -1, 1), uniform<float>(1001, 8, 3, -1, 1));
}

// Element i uses counter offset + i / 4, so a tensor of n elements occupies counters
// [offset, offset + ceil(n / 4)): a run at a later offset continues the stream exactly
// and advancing the offset by ceil(n / 4) never reuses a block.
TEST(RandomCpu, OffsetsAddressDisjointBlocksOfOneStream) {
  const size_t n = 4000;
  const auto whole = uniform<float>(2 * n, 11, 0, 0, 1);
  const auto first = uniform<float>(n, 11, 0, 0, 1);
  const auto second = uniform<float>(n, 11, n / 4, 0, 1);
  EXPECT_EQ(std::vector<float>(whole.begin(), whole.begin() + n), first);
  EXPECT_EQ(std::vector<float>(whole.begin() + n, whole.end()), second);
  size_t equal = 0;
  for (size_t i = 0; i < n; ++i) equal += first[i] == second[i];
  EXPECT_LT(equal, 5u) << "offset 0 and offset n/4 should be unrelated draws";

  const auto normal_whole = normal<float>(2 * n, 11, 0, 0, 1);
  const auto normal_second = normal<float>(n, 11, n / 4, 0, 1);
  EXPECT_EQ(std::vector<float>(normal_whole.begin() + n, normal_whole.end()), normal_second);
}

TEST(RandomCpu, LengthNotAMultipleOfFourIsAPrefix) {
  const auto seven = normal<float>(7, 5, 9, 0, 1), eight = normal<float>(8, 5, 9, 0, 1);
  EXPECT_EQ(seven, std::vector<float>(eight.begin(), eight.begin() + 7));
}

template <class T>
void check_uniform_moments(double lo, double hi) {
  const size_t n = 1 << 20;
  const auto v = uniform<T>(n, 1234, 0, lo, hi);
  double sum = 0, sum_sq = 0;
  for (T t : v) {
    const double x = double(t);
    ASSERT_GE(x, lo);
    ASSERT_LT(x, hi);
    sum += x;
    sum_sq += x * x;
  }
  const double mean = sum / n, var = sum_sq / n - mean * mean, width = hi - lo;
  // The sample mean's standard deviation is width / sqrt(12 n) = 2.8e-4 width: 6 sigma.
  EXPECT_NEAR(mean, lo + width / 2, 2e-3 * width);
  EXPECT_NEAR(var, width * width / 12, 2e-3 * width * width);
}

TEST(RandomCpu, UniformMomentsF32) { check_uniform_moments<float>(0, 1); }
TEST(RandomCpu, UniformMomentsShiftedF64) { check_uniform_moments<double>(-2, 3); }
// bf16 has 8 bits: u close to 1 rounds onto hi, which the kernel must map back into range.
TEST(RandomCpu, UniformStaysBelowHiInBf16) {
  const auto v = uniform<bf16>(1 << 20, 99, 0, 0, 1);
  for (bf16 x : v) ASSERT_LT(float(x), 1.f);
  check_uniform_moments<bf16>(0, 1);
}
TEST(RandomCpu, UniformMomentsF16) { check_uniform_moments<f16>(-1, 1); }

template <class T>
void check_normal_moments(double mean, double std) {
  const size_t n = 1 << 20;
  const auto v = normal<T>(n, 4321, 17, mean, std);
  double sum = 0, sum_sq = 0;
  for (T t : v) {
    const double z = (double(t) - mean) / std;
    // u1 >= 2^-24 bounds |z| by sqrt(-2 ln 2^-24) = 5.77.
    ASSERT_LT(std::abs(z), 5.8);
    sum += z;
    sum_sq += z * z;
  }
  const double m = sum / n, var = sum_sq / n - m * m;
  // Standard deviations of the estimates: 1e-3 for the mean, 1.4e-3 for the variance.
  EXPECT_NEAR(m, 0, 6e-3);
  EXPECT_NEAR(var, 1, 1e-2);
}

TEST(RandomCpu, NormalMomentsF32) { check_normal_moments<float>(0, 1); }
TEST(RandomCpu, NormalMomentsScaledF64) { check_normal_moments<double>(3, 2); }
TEST(RandomCpu, NormalMomentsBf16) { check_normal_moments<bf16>(0, 1); }

TEST(RandomCpu, IntegerOutputIsRejected) {
  std::vector<int32_t> v(4);
  Strided s;
  s.data = v.data(), s.dtype = DType::i32, s.ndim = 1, s.shape[0] = 4, s.strides[0] = 1;
  EXPECT_THROW(cpu::uniform(s, 0, 0, 0, 1, nullptr), Error);
}

}  // namespace
}  // namespace loom
