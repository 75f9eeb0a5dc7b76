// The CPU gemm's micro-kernels (kernels/cpu/matmul.cpp): c (MR, NR; row stride ldc) += the
// product of an MR-row sliver of A and an NR-column panel of B, both packed k-major (a[p *
// MR + i], b[p * NR + j]). The blocking around them is the same for every kernel; only the
// register tile, and so the packing widths, differ.
//
// One set is chosen when the process first multiplies, from what the CPU runs:
//   avx512  x86-64 with AVX-512F: a 6 x 32 f32 (6 x 16 f64) tile of FMAs on 512-bit vectors
//   avx2    x86-64 with AVX2 and FMA: 6 x 16 f32 (6 x 8 f64) on 256-bit vectors
//   generic plain loops over a 4 x 8 f32 (4 x 4 f64) tile that -O3 vectorises for any target
// LOOM_CPU_GEMM=generic|avx2|avx512 asks for one (a name this CPU cannot run is an error).
// A kernel's sums run in the same order whatever the thread count, so results repeat bit for
// bit on one machine; the fused multiply-adds round once where the generic loops round twice.
#pragma once

#include <cstdint>
#include <vector>

namespace loom::cpu::gemm_micro {

template <class A>
using Fn = void (*)(int64_t kc, const A* a, const A* b, A* c, int64_t ldc);

template <class A>
struct Tile {
  int mr = 0, nr = 0;
  Fn<A> fn = nullptr;
};

struct Kernels {
  const char* name;
  Tile<float> f32;
  Tile<double> f64;
};

// Every set this CPU can run, the generic one first.
std::vector<const Kernels*> available();

// The set in use: chosen once (LOOM_CPU_GEMM, else the widest available).
const Kernels& active();

// Makes `k` (one of available()) the set in use; for tests that run each set.
void use(const Kernels& k);

}  // namespace loom::cpu::gemm_micro
