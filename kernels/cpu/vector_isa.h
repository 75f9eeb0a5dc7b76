// CPU loops compiled twice: for the baseline instruction set the library is built for, and
// for AVX2, which runs where the CPU has it. AVX2 without FMA: the same operations in the same
// order on wider vectors, so the two copies give the same bits as each other
// (tests/kernels/test_attention.cpp and test_matmul.cpp compare them). A kernel writes its loops
// once in a LOOM_INLINE function and hands run_copy a LOOM_INLINE_LAMBDA that calls it; what
// the loops call is inlined into each copy (small inline functions are, at -O2 and above;
// LOOM_INLINE makes sure of the larger ones), so that it too is compiled for both. Off x86-64 GCC and clang there is one copy: LOOM_AVX2_NO_FMA is empty and
// cpu_has_avx2() false.
//
// Used by the attention kernels (kernels/cpu/attention.cpp) and the matrix product's epilogue
// (kernels/cpu/matmul.cpp), whose f32 packing also has an AVX2 path of its own (intrinsics,
// values moved only) behind avx2_copies_on().
#pragma once

#ifdef __FAST_MATH__
#error "kernels/cpu/vector_isa.h: -ffast-math lets the compiler reorder sums, and the two copies would differ"
#endif

#define LOOM_INLINE [[gnu::always_inline]] inline
#define LOOM_INLINE_LAMBDA __attribute__((always_inline))
#if defined(__x86_64__) && defined(__GNUC__)
#define LOOM_AVX2_NO_FMA [[gnu::target("avx2")]]
#else
#define LOOM_AVX2_NO_FMA
#endif

namespace loom::cpu::vector_isa {

// Whether this CPU runs AVX2 (false off x86-64).
bool cpu_has_avx2();
// Whether the AVX2 copies run: cpu_has_avx2(), unless use_avx2(false) said otherwise.
bool avx2_copies_on();
// Runs the baseline copies (false) or, where the CPU has AVX2, the AVX2 ones (true): for tests
// that compare the two. Not for use while kernels run on other threads.
void use_avx2(bool on);

template <class Body> LOOM_AVX2_NO_FMA void run_avx2_copy(const Body& body) { body(); }
template <class Body> void run_baseline_copy(const Body& body) { body(); }

// Runs body() (a LOOM_INLINE_LAMBDA) compiled into the AVX2 copy when avx2_copies_on(), else
// into the baseline copy.
template <class Body> void run_copy(const Body& body) {
  if (avx2_copies_on()) {
    run_avx2_copy(body);
  } else {
    run_baseline_copy(body);
  }
}

}  // namespace loom::cpu::vector_isa
