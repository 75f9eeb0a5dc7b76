// What the tensor-core attention kernels (attention_mma.cu, attention_mma_backward.cu, and
// attention_wgmma.cu for its softmax, fragments and loads) share:
// their block shape, the PTX they use (cp.async, ldmatrix, mma.sync.m16n8k16), fragment and
// tile movers between global memory, shared memory and registers, and the launch helpers.
//
// Blocks are 4 warps; every warp owns MT row tiles of 16 (32 rows for head_dim <= 64, where
// the registers allow it, else 16) and keeps their accumulators in registers. Each B fragment
// read from shared memory then feeds MT products, which halves the shared-memory traffic per
// product at head_dim 64, where ldmatrix bandwidth would otherwise bound the kernels.
// Shared-memory rows are padded by 16 bytes, so the 8 rows an ldmatrix reads fall in 8
// different bank groups; rows past the sequence are zero-filled by cp.async, then masked.
// Global rows are addressed through the operands' strides (attention.cuh's Params): a head's
// base offset once per block, then row * seq stride; attention.cu sends only layouts whose
// every row is 16-byte aligned, as cp.async and the 16-byte stores need.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstring>
#include <type_traits>

#include "kernels/cuda/attention.cuh"

namespace loom::cuda::attention::mma_tiles {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kBlockN = 64;  // keys of a streamed tile

// A warp owns MT row tiles of 16 (MT = 1 or 2; 2 only where the accumulators still fit in
// registers, head_dim <= 64). On an H200 at GPT-2's shapes two tiles make the backward
// kernels faster (fewer shared-memory reads per product) and the forward slower (255
// registers a thread halve the warps an SM holds), so the forward keeps one. Query rows of
// a forward / dq block, and keys of a dk/dv block:
constexpr int block_rows(int MT) { return 16 * kWarps * MT; }
static_assert(kRowPad % block_rows(2) == 0, "the workspace rows must cover every query tile");

// Query rows per tile of the dk/dv kernel: fewer where the warp's dK and dV accumulators are
// large (two key tiles, or D = 128), so the tile's S^T and dP^T still fit in registers.
template <int D, int MT> constexpr int dkdv_tile() { return MT > 1 || D > 96 ? 32 : 64; }

// ---- PTX wrappers ----------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

// 16 bytes from global to shared memory without a register round trip; zeros when !valid.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

// c (16 x 8, f32) += a (16 x 16) b (16 x 8). Fragment layouts (g = lane / 4, t = lane % 4):
// a[0..3] hold A(g, 2t..2t+1), A(g+8, 2t..), A(g, 2t+8..), A(g+8, 2t+8..); b[0], b[1] hold
// B(2t..2t+1, g) and B(2t+8.., g); c[0..3] hold C(g, 2t), C(g, 2t+1), C(g+8, 2t), C(g+8, 2t+1).
template <class T> __device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Two floats rounded to T, the first in the low half (the lower column of a fragment).
template <class T> __device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  uint32_t u;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    memcpy(&u, &h, 4);
  } else {
    const __half2 h = __floats2half2_rn(lo, hi);
    memcpy(&u, &h, 4);
  }
  return u;
}

// The two values pack2 rounded, back as floats (sums of what was stored).
template <class T> __device__ __forceinline__ float2 unpack2(uint32_t u) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return make_float2(__uint_as_float(u << 16), __uint_as_float(u & 0xffff0000u));
  } else {
    __half2 h;
    memcpy(&h, &u, 4);
    return __half22float2(h);
  }
}

// ---- fragments and tiles ---------------------------------------------------------------
// Tiles in shared memory are row-major with row stride S = D + 8 elements.

__device__ __forceinline__ int lane_id() { return int(threadIdx.x % 32); }

// A fragment: rows r0..r0+15, columns c0..c0+15 of a row-major tile.
template <int S, class T> __device__ __forceinline__ void load_a(uint32_t (&a)[4], const T* s, int r0, int c0) {
  const int lane = lane_id();
  ldmatrix_x4(a, s + (r0 + (lane & 15)) * S + c0 + (lane >> 4) * 8);
}
// B fragments of two n-blocks (n0 and n0 + 8; b[0..1] and b[2..3]) over k0..k0+15, from a
// tile stored [n][k] (K for Q K^T, Q for K Q^T).
template <int S, class T> __device__ __forceinline__ void load_b_nk(uint32_t (&b)[4], const T* s, int n0, int k0) {
  const int lane = lane_id();
  ldmatrix_x4(b, s + (n0 + (lane & 7) + (lane >> 4) * 8) * S + k0 + ((lane >> 3) & 1) * 8);
}
// The same from a tile stored [k][n] (V for P V, dO for P^T dO), transposed on the way.
template <int S, class T> __device__ __forceinline__ void load_b_kn(uint32_t (&b)[4], const T* s, int k0, int n0) {
  const int lane = lane_id();
  ldmatrix_x4_trans(b, s + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * S + n0 + (lane >> 4) * 8);
}

// An A fragment (rows m0.., columns k0..) from a tile stored [k][m], transposed on the way.
template <int S, class T> __device__ __forceinline__ void load_a_km(uint32_t (&a)[4], const T* s, int m0, int k0) {
  const int lane = lane_id();
  ldmatrix_x4_trans(a, s + (k0 + (lane & 7) + (lane >> 4) * 8) * S + m0 + ((lane >> 3) & 1) * 8);
}

// An A fragment from two accumulator n-blocks: lo covers columns 0..7 of the k-slice, hi 8..15.
template <class T> __device__ __forceinline__ void acc_to_a(uint32_t (&a)[4], const float (&lo)[4], const float (&hi)[4]) {
  a[0] = pack2<T>(lo[0], lo[1]);
  a[1] = pack2<T>(lo[2], lo[3]);
  a[2] = pack2<T>(hi[0], hi[1]);
  a[3] = pack2<T>(hi[2], hi[3]);
}

// acc[mt] (D / 8 n-blocks) += a[mt] (16 x 16k) times rows k0.. of a [k][n] tile holding D
// columns; each B fragment feeds all MT row tiles.
template <int D, int MT, class T>
__device__ __forceinline__ void mma_rows(float (&acc)[MT][D / 8][4], const uint32_t (&a)[MT][4], const T* s, int k0) {
#pragma unroll
  for (int dp = 0; dp < D / 16; ++dp) {
    uint32_t b[4];
    load_b_kn<D + 8>(b, s, k0, dp * 16);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      mma<T>(acc[mt][2 * dp], a[mt], b[0], b[1]);
      mma<T>(acc[mt][2 * dp + 1], a[mt], b[2], b[3]);
    }
  }
}

// acc[mt] (D / 8 n-blocks) += p[mt] times the first 8 NB rows of a [k][n] tile, where p[mt]
// is a 16 x 8 NB accumulator (P of P V, P^T of P^T dO, dS^T of dS^T Q) rounded to T on the
// way into A fragments.
template <int D, int MT, int NB, class T>
__device__ __forceinline__ void mma_acc_rows(float (&acc)[MT][D / 8][4], const float (&p)[MT][NB][4], const T* s) {
#pragma unroll
  for (int kk = 0; kk < NB / 2; ++kk) {
    uint32_t a[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) acc_to_a<T>(a[mt], p[mt][2 * kk], p[mt][2 * kk + 1]);
    mma_rows<D>(acc, a, s, kk * 16);
  }
}

// Rows [row0, row0 + R) of a (len, D) matrix whose rows are `ld` elements apart (16-byte
// aligned) into a tile, by cp.async; rows at or past len are zeros. Every thread of the
// block takes part. The tile's first row is found in int64 once; offsets inside the tile
// are int (attention.cu sends only 0 <= ld < 2^24 here), which keeps as few registers live
// as the contiguous kernels did. `thread`: this thread's index among the kThreads that load
// (a warpgroup's, in a block of several). With kStepped, when the threads cover whole rows, a
// thread's chunks are one column of rows kStepRows apart: its source and destination are
// found once and stepped, and a tile inside the matrix tests no rows. Without it each chunk
// finds its own row and column: the Hopper head_dim-64 backward keeps that form, which runs
// faster there.
template <int D, int R, bool kStepped = true, class T>
__device__ __forceinline__ void load_rows(T* dst, const T* src, int ld, int row0, int len,
                                          int thread = int(threadIdx.x)) {
  constexpr int kChunks = D / 8, kTotal = R * kChunks;
  if constexpr (kStepped && kThreads % kChunks == 0 && kTotal % kThreads == 0) {
    constexpr int kStepRows = kThreads / kChunks, kCalls = kTotal / kThreads;
    const int r = thread / kChunks, col = thread % kChunks * 8;
    const T* from = src + (int64_t(row0) + r) * ld + col;
    T* to = dst + r * (D + 8) + col;
    if (row0 + R <= len) {
#pragma unroll
      for (int it = 0; it < kCalls; ++it) cp_async_16(to + it * kStepRows * (D + 8), from + it * kStepRows * ld, true);
    } else {
#pragma unroll
      for (int it = 0; it < kCalls; ++it) {
        const bool valid = row0 + r + it * kStepRows < len;
        cp_async_16(to + it * kStepRows * (D + 8), valid ? from + it * kStepRows * ld : src, valid);
      }
    }
  } else {
    const T* tile = src + int64_t(row0) * ld;
#pragma unroll
    for (int it = 0; it < (kTotal + kThreads - 1) / kThreads; ++it) {
      const int c = it * kThreads + thread;
      if (c < kTotal) {
        const int r = c / kChunks, col = c % kChunks * 8;
        const bool valid = row0 + r < len;
        cp_async_16(dst + r * (D + 8) + col, valid ? tile + (r * ld + col) : src, valid);
      }
    }
  }
}

// Rows of a tile back to global memory rows `ld` elements apart, 16 bytes per access; rows
// at or past len skipped. Offsets, `thread` and kStepped as in load_rows.
template <int D, int R, bool kStepped = true, class T>
__device__ __forceinline__ void store_rows(T* dst, int ld, const T* src, int row0, int len,
                                           int thread = int(threadIdx.x)) {
  constexpr int kChunks = D / 8, kTotal = R * kChunks;
  if constexpr (kStepped && kThreads % kChunks == 0 && kTotal % kThreads == 0) {
    constexpr int kStepRows = kThreads / kChunks, kCalls = kTotal / kThreads;
    const int r = thread / kChunks, col = thread % kChunks * 8;
    T* to = dst + (int64_t(row0) + r) * ld + col;
    const T* from = src + r * (D + 8) + col;
    const bool full = row0 + R <= len;
#pragma unroll
    for (int it = 0; it < kCalls; ++it) {
      if (full || row0 + r + it * kStepRows < len)
        *reinterpret_cast<uint4*>(to + it * kStepRows * ld) =
            *reinterpret_cast<const uint4*>(from + it * kStepRows * (D + 8));
    }
  } else {
    T* tile = dst + int64_t(row0) * ld;
#pragma unroll
    for (int it = 0; it < (kTotal + kThreads - 1) / kThreads; ++it) {
      const int c = it * kThreads + thread;
      if (c < kTotal) {
        const int r = c / kChunks, col = c % kChunks * 8;
        if (row0 + r < len)
          *reinterpret_cast<uint4*>(tile + (r * ld + col)) = *reinterpret_cast<const uint4*>(src + r * (D + 8) + col);
      }
    }
  }
}

// A warp's 16 x D accumulator rows (tile rows r0..r0+15) into a tile as T, rows g scaled
// by mul_lo and rows g + 8 by mul_hi.
template <int D, class T>
__device__ __forceinline__ void stage_rows(T* s, const float (&acc)[D / 8][4], int r0, float mul_lo, float mul_hi) {
  const int lane = lane_id(), g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int db = 0; db < D / 8; ++db) {
    const int col = db * 8 + 2 * t;
    *reinterpret_cast<uint32_t*>(s + (r0 + g) * (D + 8) + col) = pack2<T>(acc[db][0] * mul_lo, acc[db][1] * mul_lo);
    *reinterpret_cast<uint32_t*>(s + (r0 + g + 8) * (D + 8) + col) = pack2<T>(acc[db][2] * mul_hi, acc[db][3] * mul_hi);
  }
}

// acc[mt] (16 x 8 NB) += rows r0 + 16 mt.. of the A tile times the (8 NB)-row [n][k] tile,
// both D wide (S = Q K^T, dP = dO V^T and their transposes); each B fragment feeds all MT
// row tiles.
template <int D, int MT, int NB, class T>
__device__ __forceinline__ void scores_from_smem(float (&acc)[MT][NB][4], const T* a_tile, int r0, const T* b_tile) {
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    uint32_t a[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) load_a<D + 8>(a[mt], a_tile, r0 + 16 * mt, ks * 16);
#pragma unroll
    for (int np = 0; np < NB / 2; ++np) {
      uint32_t b[4];
      load_b_nk<D + 8>(b, b_tile, np * 16, ks * 16);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma<T>(acc[mt][2 * np], a[mt], b[0], b[1]);
        mma<T>(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
      }
    }
  }
}

// Scales scores to the exp2 domain and sets those of invisible (query, key) pairs to
// -inf. Element e of n-block nb is query row i_lo (+8 for e >= 2), key j0 + nb*8 + 2t + e%2.
__device__ __forceinline__ void scale_and_mask(float (&s)[kBlockN / 8][4], float scale_log2, bool edge, int i_lo,
                                               int j0, int kv_len, bool causal) {
  const int t = lane_id() & 3;
#pragma unroll
  for (int nb = 0; nb < kBlockN / 8; ++nb)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[nb][e] *= scale_log2;
      if (edge) {
        const int j = j0 + nb * 8 + 2 * t + (e & 1), i = i_lo + (e >> 1) * 8;
        if (j >= kv_len || (causal && j > i)) s[nb][e] = -INFINITY;
      }
    }
}

// Sets the scores of invisible (query, key) pairs to -inf, unscaled; elements as in
// scale_and_mask.
__device__ __forceinline__ void mask_scores(float (&s)[kBlockN / 8][4], int i_lo, int j0, int kv_len, bool causal) {
  const int t = lane_id() & 3;
#pragma unroll
  for (int nb = 0; nb < kBlockN / 8; ++nb)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int j = j0 + nb * 8 + 2 * t + (e & 1), i = i_lo + (e >> 1) * 8;
      if (j >= kv_len || (causal && j > i)) s[nb][e] = -INFINITY;
    }
}

// One key tile's step of the online softmax for a warp's 16 rows (the 4 threads of a quad
// share a row): masks the scores s, raises the running max m (in the exp2 domain), rescales
// the sum l and the output o by the change, and leaves P = exp2(s scale_log2 - m) in s.
// kFused (the Hopper forward): with a positive scale the raw scores' max gives the scaled
// one, each score is scaled and shifted by one fma, and an edge tile is masked behind one
// branch; any other scale goes through scale_and_mask first. Without kFused (the sm_80
// kernels, held at 128 registers a thread, which the fused form makes spill): scale_and_mask,
// then the shift.
template <int D, bool kFused = false>
__device__ __forceinline__ void online_softmax(float (&s)[kBlockN / 8][4], float (&o)[D / 8][4], float (&m)[2],
                                               float (&l)[2], float scale_log2, bool edge, int i_lo, int j0,
                                               const Params& p) {
  constexpr int NB = kBlockN / 8;
  const bool fused = kFused && scale_log2 > 0.f;
  const float k = fused ? scale_log2 : 1.f;  // the scale still to apply
  if (fused) {
    if (edge) mask_scores(s, i_lo, j0, p.kv_len, p.causal);
  } else {
    scale_and_mask(s, scale_log2, edge, i_lo, j0, p.kv_len, p.causal);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = -INFINITY;
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) mx = fmaxf(mx, fmaxf(s[nb][2 * r], s[nb][2 * r + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m[r], mx * k);
    const float base = m_new == -INFINITY ? 0.f : m_new;  // a row that has seen no key yet stays at 0
    const float alpha = fast_exp2(m[r] - base);
    m[r] = m_new;
    float sum = 0.f;
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      if constexpr (kFused) {  // (an fma by k = 1 stays an fma: the sm_80 kernels keep the subtraction)
        s[nb][2 * r] = fast_exp2(fmaf(s[nb][2 * r], k, -base));
        s[nb][2 * r + 1] = fast_exp2(fmaf(s[nb][2 * r + 1], k, -base));
      } else {
        s[nb][2 * r] = fast_exp2(s[nb][2 * r] - base);
        s[nb][2 * r + 1] = fast_exp2(s[nb][2 * r + 1] - base);
      }
      sum += s[nb][2 * r] + s[nb][2 * r + 1];
    }
    l[r] = l[r] * alpha + sum;
#pragma unroll
    for (int db = 0; db < D / 8; ++db) {
      o[db][2 * r] *= alpha;
      o[db][2 * r + 1] *= alpha;
    }
  }
}

// A forward block's first two cp.async groups, {Q, K(0)} and then {V(0), K(1)}; its loop then
// commits one {V(n + 1), K(n + 2)} a step. load_k(n) and load_v(n) load key tile n.
template <class LoadQ, class LoadK, class LoadV>
__device__ __forceinline__ void forward_prologue(int n_tiles, LoadQ&& load_q, LoadK&& load_k, LoadV&& load_v) {
  load_q();
  if (n_tiles > 0) load_k(0);
  cp_async_commit();
  if (n_tiles > 0) load_v(0);
  if (n_tiles > 1) load_k(1);
  cp_async_commit();
}

// A forward block's end, once every warp's products are done: each row's O divided by its
// sum l, staged as T in the tile sQ (the block's BM rows, padded) and stored to out; each
// row's log-sum-exp (ln, from m and l in exp2 form) to lse, -inf for a row that saw no key.
template <int D, int BM, class T>
__device__ __forceinline__ void finish_forward(const Params& p, const float (&o)[D / 8][4], const float (&m)[2],
                                               float (&l)[2], T* sQ, int64_t bh, int q0) {
  constexpr float kLn2 = 0.6931471805599453f;
  const int warp = int(threadIdx.x / 32), lane = lane_id(), g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
  }
  stage_rows<D>(sQ, o, warp * 16, l[0] > 0.f ? 1.f / l[0] : 0.f, l[1] > 0.f ? 1.f / l[1] : 0.f);
  if (t == 0) {
    float* lse = static_cast<float*>(p.lse) + bh * p.q_len;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int i = q0 + warp * 16 + g + 8 * r;
      if (i < p.q_len) lse[i] = l[r] > 0.f ? (m[r] + log2f(l[r])) * kLn2 : -INFINITY;
    }
  }
  __syncthreads();
  store_rows<D, BM>(static_cast<T*>(p.out) + p.offset(p.strides.out, bh), int(p.strides.out.seq), sQ, q0, p.q_len);
}

// Adds two neighbouring floats (8-byte aligned) into global memory: one vector atomic on
// sm_90 and later, two scalar ones before (float2 atomics start at sm_90). Each element's sum is
// the same either way; only the order between blocks varies.
__device__ __forceinline__ void add_pair(float* p, float a, float b) {
#if __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(p), make_float2(a, b));
#else
  atomicAdd(p, a);
  atomicAdd(p + 1, b);
#endif
}

// Key tile n + 1 of k and v (rows ld apart) into the buffers sK, sV do not read in step n,
// if there is one, then waits until tile n (and what was loaded before it) has landed for
// the whole block. The buffers hold 2 x (kBlockN, D + 8).
template <int D, class T>
__device__ __forceinline__ void next_key_tile(T* sK, T* sV, const T* k, int ldk, const T* v, int ldv, int n,
                                              int n_tiles, int kv_len) {
  if (n + 1 < n_tiles) {
    const int other = ((n & 1) ^ 1) * kBlockN * (D + 8);
    load_rows<D, kBlockN>(sK + other, k, ldk, (n + 1) * kBlockN, kv_len);
    load_rows<D, kBlockN>(sV + other, v, ldv, (n + 1) * kBlockN, kv_len);
  }
  cp_async_commit();
  cp_async_wait<1>();
  __syncthreads();
}

// A block's operands at its (batch, head) bh: each tensor's first row, through its strides,
// and (backward) the workspace's lse2 and Di rows of that head.
template <class T> struct HeadOperands {
  const T *q, *k, *v, *dout = nullptr;
  const float *lse2 = nullptr, *di = nullptr;
  __device__ __forceinline__ HeadOperands(const Params& p, int64_t bh, bool backward)
      : q(static_cast<const T*>(p.q) + p.offset(p.strides.q, bh)),
        k(static_cast<const T*>(p.k) + p.offset(p.strides.k, bh)),
        v(static_cast<const T*>(p.v) + p.offset(p.strides.v, bh)) {
    if (!backward) return;
    dout = static_cast<const T*>(p.dout) + p.offset(p.strides.dout, bh);
    lse2 = static_cast<const float*>(p.lse2) + bh * p.q_pad;
    di = static_cast<const float*>(p.di) + bh * p.q_pad;
  }
};

// Tiles [0, n) of keys that the query rows [q0, q0 + BM) can see.
template <int BM> __device__ __forceinline__ int key_tiles(const Params& p, int q0) {
  const int kv_end = p.causal ? min(p.kv_len, min(q0 + BM, p.q_len)) : p.kv_len;
  return (kv_end + kBlockN - 1) / kBlockN;
}

// First row of this block's query tile: the grid is (query tiles) x (heads), heads fastest;
// causal grids run the longest tiles (the last ones) first.
template <int BM> __device__ __forceinline__ int query_tile_start(const Params& p) {
  const int tiles = (p.q_len + BM - 1) / BM, tile = int(blockIdx.x / p.heads);
  return (p.causal ? tiles - 1 - tile : tile) * BM;
}

// ---- launchers -------------------------------------------------------------------------

template <class Kernel> void launch(Kernel kernel, int64_t blocks, size_t smem, const char* what, const Params& p,
                                    cudaStream_t stream) {
  if (blocks == 0) return;
  LOOM_CHECK(blocks < (int64_t(1) << 31), "attention: ", blocks, " thread blocks exceed CUDA's grid limit; ",
             "split the batch");
  allow_shared_memory(kernel, smem, what);
  kernel<<<unsigned(blocks), kThreads, smem, stream>>>(p);
  LOOM_CUDA_LAUNCH();
}

inline int64_t tiles(int64_t len, int64_t tile) { return (len + tile - 1) / tile; }

// Calls f(T{}, integral_constant<int, D>{}) for the dtype and head_dim.
template <class F> void dispatch(DType dtype, int64_t head_dim, F&& f) {
  auto with_dim = [&](auto tag) {
    switch (head_dim) {
      case 32: return f(tag, std::integral_constant<int, 32>{});
      case 64: return f(tag, std::integral_constant<int, 64>{});
      case 80: return f(tag, std::integral_constant<int, 80>{});
      case 96: return f(tag, std::integral_constant<int, 96>{});
      case 128: return f(tag, std::integral_constant<int, 128>{});
    }
    LOOM_ASSERT(false, "attention: no tensor-core kernel for head_dim ", head_dim);
  };
  if (dtype == DType::bf16) with_dim(__nv_bfloat16{});
  else if (dtype == DType::f16) with_dim(__half{});
  else LOOM_ASSERT(false, "attention: no tensor-core kernel for ", dtype_name(dtype));
}

}  // namespace loom::cuda::attention::mma_tiles
