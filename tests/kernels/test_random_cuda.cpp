// The CUDA random kernels against the CPU ones: both run the Philox code of
// kernels/core/philox.h, so uniform samples must match to the bit in every dtype, and
// normal samples (whose log, sin and cos may differ by an ulp between the host's libm and
// CUDA's) must agree to 1e-6.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
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

template <class T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::f32; }
template <> constexpr DType dtype_of<double>() { return DType::f64; }
template <> constexpr DType dtype_of<bf16>() { return DType::bf16; }
template <> constexpr DType dtype_of<f16>() { return DType::f16; }

Strided contiguous(void* data, DType dtype, int64_t n) {
  Strided s;
  s.data = data;
  s.dtype = dtype;
  s.ndim = 1;
  s.shape[0] = n;
  s.strides[0] = 1;
  return s;
}

struct Draw {
  int64_t n;
  uint64_t seed, offset;
  double a, b;  // (lo, hi) for uniform, (mean, std) for normal
};

// Lengths that are not multiples of 4, a seed with both key words set, an offset whose
// blocks carry into the counter's second word, and a size that needs a grid-stride loop.
const Draw kDraws[] = {
    {1, 0, 0, 0, 1},
    {7, 42, 3, -1, 1},
    {1001, 0x0123456789abcdefull, 0xfffffff0ull, -2.5, 7},
    {(1 << 20) + 3, 1234, 99, 0, 1},
    {(1 << 22) + 1, 77, 1ull << 40, 3, 0.5},
};

template <class T>
std::vector<T> run_cuda(bool normal, const Draw& d) {
  DeviceBuffer<T> out(static_cast<size_t>(d.n));
  const Strided s = contiguous(out.get(), dtype_of<T>(), d.n);
  if (normal) cuda::normal(s, d.seed, d.offset, d.a, d.b, nullptr);
  else cuda::uniform(s, d.seed, d.offset, d.a, d.b, nullptr);
  return out.to_host();
}

template <class T>
std::vector<T> run_cpu(bool normal, const Draw& d) {
  std::vector<T> out(static_cast<size_t>(d.n));
  const Strided s = contiguous(out.data(), dtype_of<T>(), d.n);
  if (normal) cpu::normal(s, d.seed, d.offset, d.a, d.b, nullptr);
  else cpu::uniform(s, d.seed, d.offset, d.a, d.b, nullptr);
  return out;
}

template <class T>
void check_uniform_bitwise() {
  SCOPED_TRACE(std::string(dtype_name(dtype_of<T>())));
  for (const Draw& d : kDraws) {
    SCOPED_TRACE(testing::Message() << "n " << d.n << ", seed " << d.seed << ", offset " << d.offset);
    const auto got = run_cuda<T>(false, d), want = run_cpu<T>(false, d);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i)
      ASSERT_EQ(std::memcmp(&got[i], &want[i], sizeof(T)), 0)
          << "element " << i << ": cuda " << double(got[i]) << ", cpu " << double(want[i]);
  }
}

TEST(RandomCuda, UniformMatchesCpuBitwiseF32) {
  LOOM_REQUIRE_CUDA();
  check_uniform_bitwise<float>();
}
TEST(RandomCuda, UniformMatchesCpuBitwiseF64) {
  LOOM_REQUIRE_CUDA();
  check_uniform_bitwise<double>();
}
TEST(RandomCuda, UniformMatchesCpuBitwiseBf16) {
  LOOM_REQUIRE_CUDA();
  check_uniform_bitwise<bf16>();
}
TEST(RandomCuda, UniformMatchesCpuBitwiseF16) {
  LOOM_REQUIRE_CUDA();
  check_uniform_bitwise<f16>();
}

// rel: allowed difference relative to max(|cpu value|, 1); 16-bit outputs may land one
// of their own ulps apart when the two f64 results straddle a rounding boundary.
template <class T>
void check_normal_close(double rel) {
  SCOPED_TRACE(std::string(dtype_name(dtype_of<T>())));
  for (const Draw& d : kDraws) {
    SCOPED_TRACE(testing::Message() << "n " << d.n << ", seed " << d.seed << ", offset " << d.offset);
    const auto got = run_cuda<T>(true, d), want = run_cpu<T>(true, d);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      const double g = double(got[i]), w = double(want[i]);
      ASSERT_NEAR(g, w, rel * std::max(std::abs(w), 1.0)) << "element " << i;
    }
  }
}

TEST(RandomCuda, NormalMatchesCpuF32) {
  LOOM_REQUIRE_CUDA();
  check_normal_close<float>(1e-6);
}
TEST(RandomCuda, NormalMatchesCpuF64) {
  LOOM_REQUIRE_CUDA();
  check_normal_close<double>(1e-6);
}
TEST(RandomCuda, NormalMatchesCpuBf16) {
  LOOM_REQUIRE_CUDA();
  check_normal_close<bf16>(8e-3);
}
TEST(RandomCuda, NormalMatchesCpuF16) {
  LOOM_REQUIRE_CUDA();
  check_normal_close<f16>(1e-3);
}

}  // namespace
}  // namespace loom
