// The CPU GEMM against a naive triple loop in f64, over a table of shapes that cross
// every blocking edge (1, odd sizes, past the MC/NC/KC blocks), every transpose, padded
// leading dimensions, batch broadcasting and alpha/beta, for each floating dtype, with
// each micro-kernel set this CPU runs (kernels/cpu/gemm_micro.h).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/cpu/gemm_micro.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/vector_isa.h"

namespace loom {
namespace {

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
      {"tall_m", 1030, 2, 9, 1, true, false},
      {"deep_k", 4, 6, 1027, 1, false, true},
      {"all_blocks", 200, 150, 300, 1, true, true},
      // 33 row blocks in one column block: tasks run several row blocks over one packed B
      // panel at any thread count up to 16, the last run short.
      {"long_runs", 3100, 40, 300, 1, false, true},
      {"alpha_beta", 33, 20, 40, 1, false, false, 0.5f, 2.f},
      {"minus_alpha_beta_one", 9, 12, 5, 1, true, false, -1.f, 1.f},
      {"padded_ld", 13, 11, 19, 1, false, true, 1.f, 0.f, false, false, 5},
      {"batch", 5, 9, 7, 4},
      {"batch_broadcast_a", 5, 9, 7, 3, false, true, 1.f, 0.f, true, false},
      {"batch_broadcast_b", 17, 10, 33, 3, true, false, 1.f, 0.5f, false, true},
      {"k_zero", 4, 5, 0, 1, false, false, 1.f, 3.f},
      {"alpha_in_memory", 33, 20, 40, 1, true, false, 0.375f, 0.f, false, false, 0, true},
      {"alpha_in_memory_batch", 5, 9, 7, 3, false, true, -2.5f, 0.f, false, false, 0, true},
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
std::vector<T> random_vector(size_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  std::vector<T> v(n);
  for (auto& x : v) x = T(dist(rng));
  return v;
}

// Runs one case through cpu::gemm and checks every element of C against the f64 loop.
// The tolerance is relative to alpha * sum_p |a||b| + |beta c|, the scale that bounds
// rounding in any summation order.
template <class T>
void check_case(const GemmCase& cs, double tol) {
  SCOPED_TRACE(cs.name);
  std::mt19937 rng(42);
  const int64_t a_rows = cs.trans_a ? cs.k : cs.m, a_cols = cs.trans_a ? cs.m : cs.k;
  const int64_t b_rows = cs.trans_b ? cs.n : cs.k, b_cols = cs.trans_b ? cs.k : cs.n;
  const int64_t lda = a_cols + cs.pad, ldb = b_cols + cs.pad, ldc = cs.n + cs.pad;
  const int64_t stride_a = cs.broadcast_a ? 0 : a_rows * lda, stride_b = cs.broadcast_b ? 0 : b_rows * ldb;
  const int64_t stride_c = cs.m * ldc;
  auto a = random_vector<T>(size_t(cs.broadcast_a ? a_rows * lda : stride_a * cs.batch), rng);
  auto b = random_vector<T>(size_t(cs.broadcast_b ? b_rows * ldb : stride_b * cs.batch), rng);
  auto c = random_vector<T>(size_t(stride_c * cs.batch), rng);
  const auto c_before = c;

  GemmArgs g;
  g.dtype = dtype_of<T>();
  g.trans_a = cs.trans_a, g.trans_b = cs.trans_b;
  g.m = cs.m, g.n = cs.n, g.k = cs.k, g.batch = cs.batch;
  g.a = a.data(), g.lda = lda, g.stride_a = stride_a;
  g.b = b.data(), g.ldb = ldb, g.stride_b = stride_b;
  g.c = c.data(), g.ldc = ldc, g.stride_c = stride_c;
  g.alpha = cs.alpha, g.beta = cs.beta;
  using A = std::conditional_t<std::is_same_v<T, double>, double, float>;  // alpha_ptr's type
  const A alpha_value = A(cs.alpha);
  if (cs.alpha_in_memory) g.alpha = 0.f, g.alpha_ptr = &alpha_value;  // the field's value must not be used
  cpu::gemm(g, nullptr);

  for (int64_t bi = 0; bi < cs.batch; ++bi)
    for (int64_t i = 0; i < cs.m; ++i)
      for (int64_t j = 0; j < cs.n; ++j) {
        double sum = 0, scale = 0;
        for (int64_t p = 0; p < cs.k; ++p) {
          const double x = as_double(a[bi * stride_a + (cs.trans_a ? p * lda + i : i * lda + p)]);
          const double y = as_double(b[bi * stride_b + (cs.trans_b ? j * ldb + p : p * ldb + j)]);
          sum += x * y;
          scale += std::abs(x * y);
        }
        const size_t at = size_t(bi * stride_c + i * ldc + j);
        const double c0 = as_double(c_before[at]);
        const double want = cs.alpha * sum + (cs.beta == 0 ? 0 : cs.beta * c0);
        const double bound = tol * (std::abs(cs.alpha) * scale + std::abs(cs.beta * c0) + 1e-30);
        ASSERT_NEAR(as_double(c[at]), want, bound) << "at batch " << bi << ", (" << i << ", " << j << ")";
      }
  // Padding between rows of C is not part of C and must be left alone.
  for (int64_t bi = 0; bi < cs.batch; ++bi)
    for (int64_t i = 0; i < cs.m; ++i)
      for (int64_t j = cs.n; j < ldc; ++j) {
        const size_t at = size_t(bi * stride_c + i * ldc + j);
        ASSERT_EQ(as_double(c[at]), as_double(c_before[at]));
      }
}

// Every case with every micro-kernel set, the one in use restored after.
template <class T>
void check_all_cases(double tol) {
  const cpu::gemm_micro::Kernels& before = cpu::gemm_micro::active();
  for (const cpu::gemm_micro::Kernels* k : cpu::gemm_micro::available()) {
    SCOPED_TRACE(k->name);
    cpu::gemm_micro::use(*k);
    for (const auto& cs : cases()) check_case<T>(cs, tol);
  }
  cpu::gemm_micro::use(before);
}

// The widest set this CPU runs is the one chosen (unless LOOM_CPU_GEMM names another).
TEST(MatmulCpu, TheWidestMicroKernelsAreChosen) {
  if (std::getenv("LOOM_CPU_GEMM")) GTEST_SKIP() << "LOOM_CPU_GEMM chooses the kernels";
  EXPECT_EQ(&cpu::gemm_micro::active(), cpu::gemm_micro::available().back());
  EXPECT_STREQ(cpu::gemm_micro::available().front()->name, "generic");
}

TEST(MatmulCpu, MatchesNaiveLoopF32) { check_all_cases<float>(1e-5); }
TEST(MatmulCpu, MatchesNaiveLoopF64) { check_all_cases<double>(1e-13); }
// 16-bit outputs round once, to 8 (bf16) or 11 (f16) bits: the accumulation is f32.
TEST(MatmulCpu, MatchesNaiveLoopBf16) { check_all_cases<bf16>(8e-3); }
TEST(MatmulCpu, MatchesNaiveLoopF16) { check_all_cases<f16>(1e-3); }

// The epilogue's loops, and the f32 packing of operands whose rows lie along memory, run as a
// baseline copy or an AVX2 copy (kernels/cpu/vector_isa.h), which must give the same bits:
// alpha, beta (from c_in) and bias, GELU with its aux output, and dGELU, with B as stored and
// transposed, over a shape that crosses a column block.
template <class T> void expect_product_copies_agree() {
  std::mt19937 rng(7);
  const int64_t m = 37, n = 150, k = 70;
  const std::vector<T> a = random_vector<T>(size_t(m * k), rng), b = random_vector<T>(size_t(k * n), rng),
                       c_in = random_vector<T>(size_t(m * n), rng), bias = random_vector<T>(size_t(n), rng),
                       pre = random_vector<T>(size_t(m * n), rng);
  for (GemmEpilogue epilogue : {GemmEpilogue::none, GemmEpilogue::gelu, GemmEpilogue::dgelu}) {
    for (bool trans_b : {false, true}) {
      SCOPED_TRACE(std::to_string(int(epilogue)) + (trans_b ? " B transposed" : ""));
      auto run = [&](bool avx2) {
        cpu::vector_isa::use_avx2(avx2);
        std::vector<T> c(size_t(m * n)), aux = pre;
        GemmArgs g;
        g.dtype = dtype_of<T>();
        g.m = m, g.n = n, g.k = k;
        g.trans_b = trans_b;
        g.a = a.data(), g.lda = k, g.b = b.data(), g.ldb = trans_b ? k : n, g.c = c.data(), g.ldc = n;
        g.bias = bias.data();
        g.epilogue = epilogue;
        if (epilogue == GemmEpilogue::none) g.alpha = 0.75f, g.beta = 0.5f, g.c_in = c_in.data();
        if (epilogue != GemmEpilogue::none) g.aux = aux.data(), g.ld_aux = n;
        cpu::gemm(g, nullptr);
        c.insert(c.end(), aux.begin(), aux.end());
        return c;
      };
      const std::vector<T> baseline = run(false), avx2 = run(true);
      for (size_t e = 0; e < baseline.size(); ++e)
        ASSERT_EQ(std::memcmp(&avx2[e], &baseline[e], sizeof(T)), 0)
            << "element " << e << " (C, then aux): " << as_double(avx2[e]) << " against " << as_double(baseline[e]);
    }
  }
}

TEST(MatmulCpu, Avx2AndBaselineCopiesGiveTheSameBits) {
  if (!cpu::vector_isa::cpu_has_avx2()) GTEST_SKIP() << "this CPU has no AVX2";
  expect_product_copies_agree<float>();
  expect_product_copies_agree<double>();
  expect_product_copies_agree<bf16>();
  expect_product_copies_agree<f16>();
  EXPECT_TRUE(cpu::vector_isa::avx2_copies_on());
}

TEST(MatmulCpu, BetaZeroIgnoresNanInC) {
  const int64_t m = 9, n = 21, k = 6;
  std::vector<float> a(size_t(m * k), 1.f), b(size_t(k * n), 2.f);
  std::vector<float> c(size_t(m * n), std::numeric_limits<float>::quiet_NaN());
  GemmArgs g;
  g.m = m, g.n = n, g.k = k;
  g.a = a.data(), g.lda = k, g.b = b.data(), g.ldb = n, g.c = c.data(), g.ldc = n;
  cpu::gemm(g, nullptr);
  for (float v : c) ASSERT_EQ(v, 12.f);
}

TEST(MatmulCpu, EmptyProductLeavesCUntouched) {
  std::vector<float> c = {7.f};
  GemmArgs g;
  g.m = 0, g.n = 1, g.k = 3, g.c = c.data(), g.ldc = 1;
  cpu::gemm(g, nullptr);
  EXPECT_EQ(c[0], 7.f);
}

}  // namespace
}  // namespace loom
