// The CPU gemm's micro-kernels: plain loops for any target, and FMA tiles for x86-64's AVX2
// and AVX-512 (gemm_micro.h), compiled for those instruction sets with function target
// attributes and chosen at run time, so one build runs on every x86-64 CPU.
#include "kernels/cpu/gemm_micro.h"

#include <atomic>
#include <cstdlib>
#include <string>

#include "kernels/core/error.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define LOOM_GEMM_X86 1
#include <immintrin.h>
#endif

namespace loom::cpu::gemm_micro {
namespace {

// Plain loops over compile-time sizes, which -O3 unrolls and vectorises.
template <class A, int MR, int NR>
void generic(int64_t kc, const A* __restrict a, const A* __restrict b, A* __restrict c, int64_t ldc) {
  A acc[MR][NR] = {};
  for (int64_t p = 0; p < kc; ++p, a += MR, b += NR)
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) acc[i][j] += a[i] * b[j];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) c[i * ldc + j] += acc[i][j];
}

constexpr Kernels kGeneric{"generic", {4, 8, generic<float, 4, 8>}, {4, 4, generic<double, 4, 4>}};

#if LOOM_GEMM_X86
// Six rows of two vectors: 12 accumulators, two B vectors and one broadcast A value, within
// AVX2's 16 registers (and AVX-512's 32). Each step of k is one broadcast and two FMAs a row.
constexpr int kRows = 6;

#define LOOM_AVX2 __attribute__((target("avx2,fma")))
LOOM_AVX2 inline __m256 load256(const float* p) { return _mm256_loadu_ps(p); }
LOOM_AVX2 inline __m256d load256(const double* p) { return _mm256_loadu_pd(p); }
LOOM_AVX2 inline void store(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
LOOM_AVX2 inline void store(double* p, __m256d v) { _mm256_storeu_pd(p, v); }
LOOM_AVX2 inline __m256 splat256(float v) { return _mm256_set1_ps(v); }
LOOM_AVX2 inline __m256d splat256(double v) { return _mm256_set1_pd(v); }
LOOM_AVX2 inline __m256 fma(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
LOOM_AVX2 inline __m256d fma(__m256d a, __m256d b, __m256d c) { return _mm256_fmadd_pd(a, b, c); }
LOOM_AVX2 inline __m256 add(__m256 a, __m256 b) { return _mm256_add_ps(a, b); }
LOOM_AVX2 inline __m256d add(__m256d a, __m256d b) { return _mm256_add_pd(a, b); }

template <class A>
LOOM_AVX2 void avx2(int64_t kc, const A* a, const A* b, A* c, int64_t ldc) {
  using V = decltype(splat256(A(0)));
  constexpr int W = int(sizeof(V) / sizeof(A));
  V acc[kRows][2];
  for (int i = 0; i < kRows; ++i) acc[i][0] = acc[i][1] = splat256(A(0));
  for (int64_t p = 0; p < kc; ++p, a += kRows, b += 2 * W) {
    const V b0 = load256(b), b1 = load256(b + W);
    for (int i = 0; i < kRows; ++i) {
      const V ai = splat256(a[i]);
      acc[i][0] = fma(ai, b0, acc[i][0]);
      acc[i][1] = fma(ai, b1, acc[i][1]);
    }
  }
  for (int i = 0; i < kRows; ++i) {
    A* row = c + i * ldc;
    store(row, add(load256(row), acc[i][0]));
    store(row + W, add(load256(row + W), acc[i][1]));
  }
}

#define LOOM_AVX512 __attribute__((target("avx512f")))
LOOM_AVX512 inline __m512 load512(const float* p) { return _mm512_loadu_ps(p); }
LOOM_AVX512 inline __m512d load512(const double* p) { return _mm512_loadu_pd(p); }
LOOM_AVX512 inline void store(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
LOOM_AVX512 inline void store(double* p, __m512d v) { _mm512_storeu_pd(p, v); }
LOOM_AVX512 inline __m512 splat512(float v) { return _mm512_set1_ps(v); }
LOOM_AVX512 inline __m512d splat512(double v) { return _mm512_set1_pd(v); }
LOOM_AVX512 inline __m512 fma(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
LOOM_AVX512 inline __m512d fma(__m512d a, __m512d b, __m512d c) { return _mm512_fmadd_pd(a, b, c); }
LOOM_AVX512 inline __m512 add(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }
LOOM_AVX512 inline __m512d add(__m512d a, __m512d b) { return _mm512_add_pd(a, b); }

template <class A>
LOOM_AVX512 void avx512(int64_t kc, const A* a, const A* b, A* c, int64_t ldc) {
  using V = decltype(splat512(A(0)));
  constexpr int W = int(sizeof(V) / sizeof(A));
  V acc[kRows][2];
  for (int i = 0; i < kRows; ++i) acc[i][0] = acc[i][1] = splat512(A(0));
  for (int64_t p = 0; p < kc; ++p, a += kRows, b += 2 * W) {
    const V b0 = load512(b), b1 = load512(b + W);
    for (int i = 0; i < kRows; ++i) {
      const V ai = splat512(a[i]);
      acc[i][0] = fma(ai, b0, acc[i][0]);
      acc[i][1] = fma(ai, b1, acc[i][1]);
    }
  }
  for (int i = 0; i < kRows; ++i) {
    A* row = c + i * ldc;
    store(row, add(load512(row), acc[i][0]));
    store(row + W, add(load512(row + W), acc[i][1]));
  }
}

constexpr Kernels kAvx2{"avx2", {kRows, 16, avx2<float>}, {kRows, 8, avx2<double>}};
constexpr Kernels kAvx512{"avx512", {kRows, 32, avx512<float>}, {kRows, 16, avx512<double>}};
#endif

const Kernels* chosen() {
  const std::vector<const Kernels*> all = available();
  const char* env = std::getenv("LOOM_CPU_GEMM");
  if (!env || !*env) return all.back();
  std::string names;
  for (const Kernels* k : all) {
    if (std::string(env) == k->name) return k;
    names += names.empty() ? k->name : std::string(", ") + k->name;
  }
  LOOM_FAIL("LOOM_CPU_GEMM=", env, " is not a gemm kernel this CPU runs; it runs ", names,
            " (unset LOOM_CPU_GEMM for the widest)");
}

std::atomic<const Kernels*>& in_use() {
  static std::atomic<const Kernels*> k{chosen()};
  return k;
}

}  // namespace

std::vector<const Kernels*> available() {
  std::vector<const Kernels*> all{&kGeneric};
#if LOOM_GEMM_X86
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) all.push_back(&kAvx2);
  if (__builtin_cpu_supports("avx512f")) all.push_back(&kAvx512);
#endif
  return all;
}

const Kernels& active() { return *in_use().load(std::memory_order_acquire); }

void use(const Kernels& k) { in_use().store(&k, std::memory_order_release); }

}  // namespace loom::cpu::gemm_micro
