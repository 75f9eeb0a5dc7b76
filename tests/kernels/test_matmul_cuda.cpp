// The cuBLAS GEMM against the CPU GEMM on the same inputs. Errors are measured against
// alpha * (|A| @ |B|) + |beta C|, the scale that bounds rounding in any summation order:
// TF32 keeps 10 bits of each f32 input, so f32 is held to ~1e-3 of that scale; bf16 and
// f16 outputs round to 8 and 11 bits; f64 must agree closely. Autotuning (GemmArgs::autotune)
// is flipped within the process on shapes of its own.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "kernels/cpu/kernels.h"
#include "kernels/cuda/kernels.h"
#include "tests/common/device_buffer.h"
#include "tests/common/gpu.h"

namespace loom {
namespace {

using test::DeviceBuffer;

struct GemmCase {
  std::string name;
  int64_t m, n, k, batch = 1;
  bool trans_a = false, trans_b = false;
  float alpha = 1.f, beta = 0.f;
  bool broadcast_a = false, broadcast_b = false;
  int64_t pad = 0;  // extra elements on every leading dimension
  bool alpha_in_memory = false;  // alpha given through alpha_ptr (beta must be 0)
};

const std::vector<GemmCase>& cases() {
  static const std::vector<GemmCase> table = {
      {"one", 1, 1, 1},
      {"odd", 7, 33, 17},
      {"odd_ta", 7, 33, 17, 1, true, false},
      {"odd_tb", 7, 33, 17, 1, false, true},
      {"odd_ta_tb", 7, 33, 17, 1, true, true},
      {"wide_n", 3, 1025, 5},
      {"deep_k", 4, 6, 1027, 1, false, true},
      {"square", 256, 384, 512, 1, false, false},
      {"alpha_beta", 33, 20, 40, 1, false, false, 0.5f, 2.f},
      {"padded_ld", 13, 11, 19, 1, true, true, 1.f, 1.f, false, false, 5},
      {"batch", 5, 9, 7, 4},
      {"batch_broadcast_a", 64, 48, 32, 3, false, true, 1.f, 0.f, true, false},
      {"batch_broadcast_b", 17, 10, 33, 3, true, false, 1.f, 0.5f, false, true},
      {"k_zero", 4, 5, 0, 2, false, false, 1.f, 3.f},
      {"alpha_in_memory", 33, 20, 40, 1, true, false, 0.375f, 0.f, false, false, 0, true},
      {"alpha_in_memory_batch", 5, 9, 7, 3, false, true, -2.5f, 0.f, false, false, 0, true},
      {"alpha_in_memory_k_zero", 4, 5, 0, 1, false, false, 2.f, 0.f, false, false, 0, true},
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

template <class T>
std::vector<T> random_vector(int64_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  std::vector<T> v(static_cast<size_t>(n));
  for (auto& x : v) x = T(dist(rng));
  return v;
}

template <class T>
void check_case(const GemmCase& cs, double tol) {
  SCOPED_TRACE(cs.name);
  std::mt19937 rng(7);
  const int64_t a_rows = cs.trans_a ? cs.k : cs.m, a_cols = cs.trans_a ? cs.m : cs.k;
  const int64_t b_rows = cs.trans_b ? cs.n : cs.k, b_cols = cs.trans_b ? cs.k : cs.n;
  GemmArgs g;
  g.dtype = dtype_of<T>();
  g.trans_a = cs.trans_a, g.trans_b = cs.trans_b;
  g.m = cs.m, g.n = cs.n, g.k = cs.k, g.batch = cs.batch;
  g.lda = a_cols + cs.pad, g.ldb = b_cols + cs.pad, g.ldc = cs.n + cs.pad;
  g.stride_a = cs.broadcast_a ? 0 : a_rows * g.lda;
  g.stride_b = cs.broadcast_b ? 0 : b_rows * g.ldb;
  g.stride_c = cs.m * g.ldc;
  g.alpha = cs.alpha, g.beta = cs.beta;
  const auto a = random_vector<T>(cs.broadcast_a ? a_rows * g.lda : g.stride_a * cs.batch, rng);
  const auto b = random_vector<T>(cs.broadcast_b ? b_rows * g.ldb : g.stride_b * cs.batch, rng);
  const auto c0 = random_vector<T>(g.stride_c * cs.batch, rng);

  // Reference on the CPU, and the scale alpha |A| @ |B| + |beta C| in f64.
  auto want = c0;
  GemmArgs ref = g;
  ref.a = a.data(), ref.b = b.data(), ref.c = want.data();
  cpu::gemm(ref, nullptr);
  std::vector<double> abs_a(a.size()), abs_b(b.size()), scale(c0.size());
  for (size_t i = 0; i < a.size(); ++i) abs_a[i] = std::abs(as_double(a[i]));
  for (size_t i = 0; i < b.size(); ++i) abs_b[i] = std::abs(as_double(b[i]));
  for (size_t i = 0; i < c0.size(); ++i) scale[i] = std::abs(cs.beta * as_double(c0[i]));
  GemmArgs sg = g;
  sg.dtype = DType::f64, sg.a = abs_a.data(), sg.b = abs_b.data(), sg.c = scale.data();
  sg.alpha = std::abs(cs.alpha), sg.beta = cs.beta == 0 ? 0.f : 1.f;
  cpu::gemm(sg, nullptr);

  // alpha through alpha_ptr: a device scalar of the accumulation type, the field set wrong.
  using A = std::conditional_t<std::is_same_v<T, double>, double, float>;
  DeviceBuffer<A> d_alpha(std::vector<A>{A(cs.alpha)});
  if (cs.alpha_in_memory) g.alpha = 0.f, g.alpha_ptr = d_alpha.get();
  DeviceBuffer<T> da(a), db(b), dc(c0);
  g.a = da.get(), g.b = db.get(), g.c = dc.get();
  cuda::gemm(g, nullptr);
  const auto got = dc.to_host();
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_NEAR(as_double(got[i]), as_double(want[i]), tol * scale[i] + 1e-30) << "element " << i;
}

template <class T>
void check_all_cases(double tol) {
  for (const auto& cs : cases()) check_case<T>(cs, tol);
}

TEST(MatmulCuda, MatchesCpuF32OnTf32) {
  LOOM_REQUIRE_CUDA();
  check_all_cases<float>(5e-3);
}
TEST(MatmulCuda, MatchesCpuF64) {
  LOOM_REQUIRE_CUDA();
  check_all_cases<double>(1e-12);
}
TEST(MatmulCuda, MatchesCpuBf16) {
  LOOM_REQUIRE_CUDA();
  check_all_cases<bf16>(2e-2);
}
TEST(MatmulCuda, MatchesCpuF16) {
  LOOM_REQUIRE_CUDA();
  check_all_cases<f16>(5e-3);
}

TEST(MatmulCuda, BetaZeroIgnoresNanInC) {
  LOOM_REQUIRE_CUDA();
  const int64_t m = 9, n = 21, k = 6;
  DeviceBuffer<float> a(std::vector<float>(size_t(m * k), 1.f)), b(std::vector<float>(size_t(k * n), 2.f));
  DeviceBuffer<float> c(std::vector<float>(size_t(m * n), std::numeric_limits<float>::quiet_NaN()));
  GemmArgs g;
  g.m = m, g.n = n, g.k = k;
  g.a = a.get(), g.lda = k, g.b = b.get(), g.ldb = n, g.c = c.get(), g.ldc = n;
  cuda::gemm(g, nullptr);
  for (float v : c.to_host()) ASSERT_EQ(v, 12.f);
}

// One product of a fresh shape (no plan for it yet) with autotuning off, on, then off again:
// off takes the heuristic's first choice, the same bits both times, though the plan was
// tuned in between; on takes the fastest candidate timing finds, within the rounding of
// the first. A weight gradient's shape (small output, long k: split-K candidates) and a
// square one.
template <class T>
void check_autotune_flips(int64_t m, int64_t n, int64_t k, bool trans_a, double tol) {
  SCOPED_TRACE("(" + std::to_string(m) + ", " + std::to_string(n) + ", " + std::to_string(k) + ") " +
               std::string(dtype_name(dtype_of<T>())));
  std::mt19937 rng(11);
  GemmArgs g;
  g.dtype = dtype_of<T>();
  g.trans_a = trans_a;
  g.m = m, g.n = n, g.k = k;
  g.lda = trans_a ? m : k, g.ldb = n, g.ldc = n;
  const auto a = random_vector<T>(m * k, rng), b = random_vector<T>(k * n, rng);
  DeviceBuffer<T> da(a), db(b);
  auto run = [&](bool autotune) {
    DeviceBuffer<T> dc(size_t(m * n));
    GemmArgs call = g;
    call.a = da.get(), call.b = db.get(), call.c = dc.get(), call.autotune = autotune;
    cuda::gemm(call, nullptr);
    return dc.to_host();
  };
  const std::vector<T> first = run(false), tuned = run(true), again = run(false);
  ASSERT_EQ(first.size(), again.size());
  for (size_t i = 0; i < first.size(); ++i)
    ASSERT_EQ(as_double(first[i]), as_double(again[i])) << "the first choice changed, element " << i;
  // The scale check_case holds products to, sum |a||b| over k, is about k / 4 here (values
  // uniform in [-1, 1)).
  for (size_t i = 0; i < first.size(); ++i)
    ASSERT_NEAR(as_double(tuned[i]), as_double(first[i]), tol * double(k) / 4) << "element " << i;
}

TEST(MatmulCuda, AutotuneOffRepeatsTheFirstChoiceAndAgreesWithTuned) {
  LOOM_REQUIRE_CUDA();
  check_autotune_flips<bf16>(192, 160, 8192, true, 2e-2);
  check_autotune_flips<bf16>(320, 320, 320, false, 2e-2);
  check_autotune_flips<float>(192, 160, 8192, true, 5e-3);
  check_autotune_flips<float>(320, 320, 320, false, 5e-3);
}

// The handle is shared by every host thread: concurrent callers (on one stream, so the
// GPU work itself is ordered) must each get their own product.
TEST(MatmulCuda, ConcurrentHostThreadsShareTheHandleSafely) {
  LOOM_REQUIRE_CUDA();
  const int64_t n = 64;
  const int threads = 4;
  DeviceBuffer<float> a(std::vector<float>(size_t(n * n), 1.f));
  std::vector<std::vector<float>> b_host;
  for (int t = 0; t < threads; ++t) b_host.emplace_back(size_t(n * n), float(t + 1));
  std::vector<std::unique_ptr<DeviceBuffer<float>>> b, c;
  for (int t = 0; t < threads; ++t) {
    b.push_back(std::make_unique<DeviceBuffer<float>>(b_host[size_t(t)]));
    c.push_back(std::make_unique<DeviceBuffer<float>>(size_t(n * n)));
  }
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      GemmArgs g;
      g.m = g.n = g.k = n;
      g.a = a.get(), g.lda = n, g.b = b[size_t(t)]->get(), g.ldb = n, g.c = c[size_t(t)]->get(), g.ldc = n;
      for (int rep = 0; rep < 20; ++rep) cuda::gemm(g, nullptr);
    });
  for (auto& th : pool) th.join();
  for (int t = 0; t < threads; ++t)
    for (float v : c[size_t(t)]->to_host()) ASSERT_EQ(v, float(n * (t + 1)));
}

}  // namespace
}  // namespace loom
