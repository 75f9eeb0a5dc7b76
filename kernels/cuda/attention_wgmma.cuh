// What the attention kernels on Hopper's warpgroup products (attention_wgmma.cu's forward,
// the dK, dV and dQ of attention_wgmma_backward.cu at head_dim 64 and
// attention_wgmma_backward128.cu at 128) share: the PTX wrappers (wgmma with A from registers
// or from shared memory, its fences, matrix descriptors), the swizzled tiles they read (laid
// out as attention_wgmma.cu describes), the two products every kernel makes and the
// backward's P^T and dS^T.
// Device code for sm_90a alone: elsewhere LOOM_WGMMA_CODE is 0 and the kernels are empty.
#pragma once

#include "kernels/cuda/attention_mma_tiles.cuh"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define LOOM_WGMMA_CODE 1
#else
#define LOOM_WGMMA_CODE 0
#endif

#if LOOM_WGMMA_CODE

namespace loom::cuda::attention::wgmma_tiles {

using namespace mma_tiles;

// ---- PTX wrappers ----------------------------------------------------------------------

// A shared-memory matrix descriptor: the start and the two byte strides (leading, stride) of
// PTX's canonical layouts, each in 16-byte units, in the 128-byte swizzle (kSwizzle64: the
// 64-byte one).
enum Swizzle : uint64_t { kSwizzle128 = 1, kSwizzle64 = 2 };
__device__ __forceinline__ uint64_t descriptor(const void* start, uint32_t leading, uint32_t stride,
                                               Swizzle swizzle = kSwizzle128) {
  return uint64_t((smem_addr(start) & 0x3ffff) >> 4) | uint64_t((leading >> 4) & 0x3fff) << 16 |
         uint64_t((stride >> 4) & 0x3fff) << 32 | uint64_t(swizzle) << 62;
}

// d with its start `bytes` (a multiple of 16) further on. The start field is the address over
// 16, and shared-memory addresses, under 256 KB, leave that field room: one add, where
// descriptor() would convert, mask and shift again.
__device__ __forceinline__ uint64_t advanced(uint64_t d, uint32_t bytes) { return d + (bytes >> 4); }

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Shared memory written by cp.async (the generic proxy) made visible to wgmma's reads.
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Keeps the compiler from moving an accumulator's uses across an issue or a wait.
template <int N> __device__ __forceinline__ void fence_registers(float (&r)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(r[i][e])::"memory");
}

#define LOOM_ACC(i) "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])
#define LOOM_WGMMA_N64(TYPE)                                                                         \
  asm volatile(                                                                                      \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                                   \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " {"                               \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                       \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"               \
      "}, {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"                                             \
      : LOOM_ACC(0), LOOM_ACC(1), LOOM_ACC(2), LOOM_ACC(3),                                          \
        LOOM_ACC(4), LOOM_ACC(5), LOOM_ACC(6), LOOM_ACC(7)                                           \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(int(accumulate)), "n"(kTransB))

#define LOOM_WGMMA_N128(TYPE)                                                                        \
  asm volatile(                                                                                      \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                                   \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " {"                              \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                       \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "             \
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "             \
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"               \
      "}, {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"                                             \
      : LOOM_ACC(0), LOOM_ACC(1), LOOM_ACC(2), LOOM_ACC(3),                                          \
        LOOM_ACC(4), LOOM_ACC(5), LOOM_ACC(6), LOOM_ACC(7),                                          \
        LOOM_ACC(8), LOOM_ACC(9), LOOM_ACC(10), LOOM_ACC(11),                                        \
        LOOM_ACC(12), LOOM_ACC(13), LOOM_ACC(14), LOOM_ACC(15)                                       \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(int(accumulate)), "n"(kTransB))

// d (64 x N, f32; this thread's part, mma.sync's layout per warp) = a (64 x 16: this warp's
// rows as an m16n8k16 A fragment) times the 16 x N B at desc_b, plus d where accumulate.
// kTransB: B is MN-major (V); else K-major (K).
template <class T, int N, int kTransB>
__device__ __forceinline__ void wgmma(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t desc_b, bool accumulate) {
  static_assert(N == 64 || N == 128, "wgmma wrappers exist for N = 64 and 128");
  if constexpr (N == 64) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) LOOM_WGMMA_N64("bf16");
    else LOOM_WGMMA_N64("f16");
  } else {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) LOOM_WGMMA_N128("bf16");
    else LOOM_WGMMA_N128("f16");
  }
}

#undef LOOM_ACC
#undef LOOM_WGMMA_N64
#undef LOOM_WGMMA_N128

// d (64 x N, f32) = A (64 x 16 at desc_a) times B (16 x N at desc_b), plus d where
// accumulate; kTransA / kTransB: the operand is MN-major (read transposed), else K-major.
#define LOOM_ACC(i) "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])
#define LOOM_WGMMA_SS_N64(TYPE)                                                                      \
  asm volatile(                                                                                      \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                                   \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " {"                               \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                       \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"               \
      "}, %32, %33, p, 1, 1, %35, %36;\n}\n"                                                          \
      : LOOM_ACC(0), LOOM_ACC(1), LOOM_ACC(2), LOOM_ACC(3),                                          \
        LOOM_ACC(4), LOOM_ACC(5), LOOM_ACC(6), LOOM_ACC(7)                                           \
      : "l"(desc_a), "l"(desc_b), "r"(int(accumulate)), "n"(kTransA), "n"(kTransB))
#define LOOM_WGMMA_SS_N128(TYPE)                                                                     \
  asm volatile(                                                                                      \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                                   \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " {"                              \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                       \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "             \
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "             \
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"               \
      "}, %64, %65, p, 1, 1, %67, %68;\n}\n"                                                          \
      : LOOM_ACC(0), LOOM_ACC(1), LOOM_ACC(2), LOOM_ACC(3),                                          \
        LOOM_ACC(4), LOOM_ACC(5), LOOM_ACC(6), LOOM_ACC(7),                                          \
        LOOM_ACC(8), LOOM_ACC(9), LOOM_ACC(10), LOOM_ACC(11),                                        \
        LOOM_ACC(12), LOOM_ACC(13), LOOM_ACC(14), LOOM_ACC(15)                                       \
      : "l"(desc_a), "l"(desc_b), "r"(int(accumulate)), "n"(kTransA), "n"(kTransB))
#define LOOM_WGMMA_SS_N32(TYPE)                                                                      \
  asm volatile(                                                                                      \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"                                                   \
      "wgmma.mma_async.sync.aligned.m64n32k16.f32." TYPE "." TYPE " {"                               \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"                         \
      "}, %16, %17, p, 1, 1, %19, %20;\n}\n"                                                          \
      : LOOM_ACC(0), LOOM_ACC(1), LOOM_ACC(2), LOOM_ACC(3)                                           \
      : "l"(desc_a), "l"(desc_b), "r"(int(accumulate)), "n"(kTransA), "n"(kTransB))

template <class T, int kTransA, int kTransB, int NB>
__device__ __forceinline__ void wgmma_ss(float (&d)[NB][4], uint64_t desc_a, uint64_t desc_b, bool accumulate) {
  static_assert(NB == 4 || NB == 8 || NB == 16, "shared-memory wgmma wrappers exist for N = 32, 64 and 128");
  constexpr bool bf16 = std::is_same_v<T, __nv_bfloat16>;
  if constexpr (NB == 16) {
    if constexpr (bf16) LOOM_WGMMA_SS_N128("bf16");
    else LOOM_WGMMA_SS_N128("f16");
  } else if constexpr (NB == 8) {
    if constexpr (bf16) LOOM_WGMMA_SS_N64("bf16");
    else LOOM_WGMMA_SS_N64("f16");
  } else {
    if constexpr (bf16) LOOM_WGMMA_SS_N32("bf16");
    else LOOM_WGMMA_SS_N32("f16");
  }
}

#undef LOOM_ACC
#undef LOOM_WGMMA_SS_N64
#undef LOOM_WGMMA_SS_N128
#undef LOOM_WGMMA_SS_N32

// ---- tiles -----------------------------------------------------------------------------

// Rows [row0, row0 + kBlockN) of a (len, D) matrix, rows ld apart, into a swizzled tile
// (the layout attention_wgmma.cu describes) by cp.async; rows at or past len are zeros. 8
// neighbouring threads take the 8 chunks of one row of a 64-column block. `thread`: this
// thread's index among the kThreads that load (a warpgroup's, in a block of several). A tile
// of kTileRows rows takes them from its row first_row on.
// A thread's chunks are rows r, r + 16, r + 32, r + 48 of each block (r = thread / 8), all
// the same chunk of their rows, so one source and one destination address a call serve
// them all, each chunk at a constant step from them; a tile inside the matrix (every tile
// but the last) skips the test of each row.
template <int D, class T, int kTileRows = kBlockN>
__device__ __forceinline__ void load_swizzled(T* dst, const T* src, int ld, int row0, int len,
                                              int thread = int(threadIdx.x), int first_row = 0) {
  constexpr int kStepRows = kThreads / 8, kSteps = kBlockN / kStepRows, kCalls = kBlockN * D / 8 / kThreads;
  static_assert(kThreads % 8 == 0 && kBlockN % kStepRows == 0 && kCalls == kSteps * (D / 64),
                "a thread's chunks are one chunk of rows kStepRows apart in each 64-column block");
  const int chunk = thread % 8, r = thread / 8, row = first_row + r;  // rows 16 apart: one row % 8
  const T* from = src + (int64_t(row0) + r) * ld + chunk * 8;
  T* to = dst + row * 64 + (chunk ^ (row % 8)) * 8;
  const int64_t step = int64_t(kStepRows) * ld;
  auto at = [&](int it) { return from + (it % kSteps) * step + it / kSteps * 64; };
  auto to_at = [&](int it) { return to + it / kSteps * kTileRows * 64 + it % kSteps * kStepRows * 64; };
  if (row0 + kBlockN <= len) {
#pragma unroll
    for (int it = 0; it < kCalls; ++it) cp_async_16(to_at(it), at(it), true);
  } else {
#pragma unroll
    for (int it = 0; it < kCalls; ++it) {
      const bool valid = row0 + r + it % kSteps * kStepRows < len;
      cp_async_16(to_at(it), valid ? at(it) : src, valid);
    }
  }
}

// acc (64 rows x kBlockN) = a (64 x D, this warp's rows as A fragments) times tile^T, tile
// a swizzled (kBlockN, D) tile (S = Q K^T in the forward, S^T = K Q^T and dP^T = V dO^T in
// the backward): issued and committed, not waited for.
template <class T, int D>
__device__ __forceinline__ void issue_times_transposed(float (&s)[kBlockN / 8][4], const uint32_t (&qf)[D / 16][4],
                                                       const T* kt) {
  const uint64_t b = descriptor(kt, 16, 1024);
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks)  // columns 16 ks.. : block ks / 4, 32 bytes a step inside it
    wgmma<T, kBlockN, 0>(s, qf[ks], advanced(b, (ks / 4 * kBlockN * 64 + ks % 4 * 16) * sizeof(T)), ks > 0);
  wgmma_commit();
}

// acc (64 rows x kBlockN) = a times tile^T, both in shared memory and read K-major: a, 64
// rows of a swizzled (kARows, D) tile (its 64-column blocks kARows rows apart), tile a
// swizzled (kBlockN, D) tile. Issued, neither fenced nor committed: the caller brackets its
// products with wgmma_fence and wgmma_commit.
template <class T, int D, int kARows = 64>
__device__ __forceinline__ void times_transposed_ss(float (&s)[kBlockN / 8][4], const T* a, const T* kt) {
  const uint64_t da = descriptor(a, 16, 1024), db = descriptor(kt, 16, 1024);
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {  // columns 16 ks..: block ks / 4, 32 bytes a step inside it
    const int at = ks / 4 * kARows * 64 + ks % 4 * 16, bt = ks / 4 * kBlockN * 64 + ks % 4 * 16;
    wgmma_ss<T, 0, 0>(s, advanced(da, at * sizeof(T)), advanced(db, bt * sizeof(T)), ks > 0);
  }
}

// issue_times_transposed with a in shared memory too: qt, a swizzled (64, D) tile read
// K-major (Q in the forward).
template <class T, int D>
__device__ __forceinline__ void issue_times_transposed(float (&s)[kBlockN / 8][4], const T* qt, const T* kt) {
  wgmma_fence();
  times_transposed_ss<T, D>(s, qt, kt);
  wgmma_commit();
}

// acc (64 rows x D) += p (64 x kBlockN as A fragments) times tile, a swizzled (kBlockN, D)
// tile (O += P V in the forward, dV += P^T dO and dK += dS^T Q in the backward): issued and
// committed.
template <class T, int D>
__device__ __forceinline__ void issue_times(float (&o)[D / 8][4], const uint32_t (&pa)[kBlockN / 16][4], const T* vt) {
  const uint64_t b = descriptor(vt, kBlockN * 128, 1024);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kBlockN / 16; ++kk)  // keys 16 kk.. : 16 rows of 128 bytes on
    wgmma<T, D, 1>(o, pa[kk], advanced(b, kk * 16 * 64 * sizeof(T)), true);
  wgmma_commit();
}

// The backward's scores of a (64 keys, kBlockN queries) tile in a warpgroup's accumulators,
// transposed (row = key, column = query): s, holding S^T, becomes P^T = exp2(S^T scale_log2
// - lse2[i]), 0 where query i cannot see key j, and dp, holding dP^T, becomes dS^T = P^T
// (dP^T - Di[i]). lse2 and di are the tile's kBlockN values from query i0 on; w0 is this
// warp's first key, g and t the lane's row and column in the fragments (lane / 4, lane % 4).
// `edge` (tested by the caller, once a tile) asks for the mask: keys at or past kv_len, and
// with `causal` keys past the query.
__device__ __forceinline__ void backward_scores(float (&s)[kBlockN / 8][4], float (&dp)[kBlockN / 8][4],
                                                const float* lse2, const float* di, float scale_log2, bool edge,
                                                int i0, int w0, int g, int t, int kv_len, bool causal) {
  constexpr int NB = kBlockN / 8;
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
    const float2 l2 = *reinterpret_cast<const float2*>(lse2 + nb * 8 + 2 * t);
#pragma unroll
    for (int e = 0; e < 4; ++e) s[nb][e] = fast_exp2(fmaf(s[nb][e], scale_log2, -((e & 1) ? l2.y : l2.x)));
  }
  if (edge) {
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = i0 + nb * 8 + 2 * t + (e & 1), j = w0 + g + (e >> 1) * 8;
        if (j >= kv_len || (causal && i < j)) s[nb][e] = 0.f;
      }
  }
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
    const float2 d2 = *reinterpret_cast<const float2*>(di + nb * 8 + 2 * t);
#pragma unroll
    for (int e = 0; e < 4; ++e) dp[nb][e] = s[nb][e] * (dp[nb][e] - ((e & 1) ? d2.y : d2.x));
  }
}

}  // namespace loom::cuda::attention::wgmma_tiles

#endif  // LOOM_WGMMA_CODE
