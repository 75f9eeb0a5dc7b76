// CPU loops compiled twice: for the baseline instruction set the library is built for, and
// for AVX2, which runs where the CPU has it. AVX2 without FMA: the same operations in the same
// order on wider vectors, so both copies give the same bits (tests/kernels/test_attention.cpp
// compares them). A kernel writes its loops once in a LOOM_INLINE function and calls it from
// two thin wrappers, one of them LOOM_AVX2; everything the loops call must be LOOM_INLINE (or
// inlined anyway), so that it too is compiled into each copy.
//
// Used by the attention kernels (kernels/cpu/attention.cpp) and the matrix product's epilogue
// (kernels/cpu/matmul.cpp).
#pragma once

#define LOOM_INLINE [[gnu::always_inline]] inline
#define LOOM_AVX2 [[gnu::target("avx2")]]

namespace loom::cpu::vector_isa {

// Whether this CPU runs AVX2.
bool cpu_has_avx2();
// Whether the AVX2 copies run: cpu_has_avx2(), unless use_avx2(false) said otherwise.
bool avx2();
// Runs the baseline copies (false) or, where the CPU has AVX2, the AVX2 ones (true): for tests
// that compare the two. Not for use while kernels run on other threads.
void use_avx2(bool on);

}  // namespace loom::cpu::vector_isa
