// Flash attention on tensor cores: bf16/f16 inputs, f32 accumulation, head_dim D in
// {32, 64, 80, 96, 128}, for sm_80 and later (Hopper runs it as is).
//
// The FlashAttention-2 scheme with warp-level mma.sync.m16n8k16 (wgmma would need sm_90a
// and hand-built shared-memory descriptors; mma.sync is what runs on every target). Blocks
// are 4 warps; every warp owns 16 rows of the block's output and keeps them in registers:
// - forward: a block takes 64 query rows, loads its Q tile once (fragments then live in
//   registers) and streams 64-key K/V tiles through double-buffered shared memory with
//   cp.async. S = Q K^T comes out in mma accumulators; an online softmax (running max m and
//   sum l per row, in exp2 form) rescales O; P is repacked from the S accumulators
//   straight into A fragments of O += P V, never touching shared memory. Causal blocks
//   stop at the diagonal tile, and the grid runs the longest (last) query tiles first.
// - backward: P is recomputed from the saved log-sum-exp, so nothing of size T x T is kept.
//   dK and dV: a block takes 64 keys and sweeps the query tiles that can see them (Q, dO,
//   lse and Di double-buffered), accumulating dV += P^T dO and dK += dS^T Q in registers.
//   dQ: a second kernel shaped like the forward recomputes S and dP per key tile and
//   accumulates dQ += dS K. This spends two extra products (QK^T and dO V^T, 7 instead of
//   5 per tile pair) to avoid f32 atomics and a dQ workspace, and is deterministic.
// Shared-memory rows are padded by 16 bytes, so the 8 rows an ldmatrix reads fall in 8
// different bank groups; rows past the sequence are zero-filled by cp.async, then masked.
// Global rows are addressed through the operands' strides (attention.cuh's Params): a head's
// base offset once per block, then row * seq stride; attention.cu sends only layouts whose
// every row is 16-byte aligned, as cp.async and the 16-byte stores need.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstring>
#include <type_traits>

#include "kernels/cuda/attention.cuh"

namespace loom::cuda::attention {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kBlockM = 16 * kWarps;  // query rows of a forward / dq block
constexpr int kBlockN = 64;           // keys of a streamed tile, and of a dk/dv block
constexpr float kLn2 = 0.6931471805599453f;
static_assert(kRowPad % kBlockM == 0, "the workspace rows must cover every query tile");

// Query rows per tile of the dk/dv kernel: fewer for D = 128 keeps its accumulators
// (dK, dV, S^T, dP^T) in registers.
constexpr int dkdv_tile(int D) { return D <= 96 ? 64 : 32; }

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

// An A fragment from two accumulator n-blocks: lo covers columns 0..7 of the k-slice, hi 8..15.
template <class T> __device__ __forceinline__ void acc_to_a(uint32_t (&a)[4], const float (&lo)[4], const float (&hi)[4]) {
  a[0] = pack2<T>(lo[0], lo[1]);
  a[1] = pack2<T>(lo[2], lo[3]);
  a[2] = pack2<T>(hi[0], hi[1]);
  a[3] = pack2<T>(hi[2], hi[3]);
}

// acc (D / 8 n-blocks) += a (16 x 16k) times rows k0.. of a [k][n] tile holding D columns.
template <int D, class T>
__device__ __forceinline__ void mma_rows(float (&acc)[D / 8][4], const uint32_t (&a)[4], const T* s, int k0) {
#pragma unroll
  for (int dp = 0; dp < D / 16; ++dp) {
    uint32_t b[4];
    load_b_kn<D + 8>(b, s, k0, dp * 16);
    mma<T>(acc[2 * dp], a, b[0], b[1]);
    mma<T>(acc[2 * dp + 1], a, b[2], b[3]);
  }
}

// Rows [row0, row0 + R) of a (len, D) matrix whose rows are `ld` elements apart (16-byte
// aligned) into a tile, by cp.async; rows at or past len are zeros. Every thread of the
// block takes part. The tile's first row is found in int64 once; offsets inside the tile
// are int (attention.cu sends only 0 <= ld < 2^24 here), which keeps as few registers live
// as the contiguous kernels did.
template <int D, int R, class T>
__device__ __forceinline__ void load_rows(T* dst, const T* src, int ld, int row0, int len) {
  constexpr int kChunks = D / 8, kTotal = R * kChunks;
  const T* tile = src + int64_t(row0) * ld;
#pragma unroll
  for (int it = 0; it < (kTotal + kThreads - 1) / kThreads; ++it) {
    const int c = it * kThreads + int(threadIdx.x);
    if (c < kTotal) {
      const int r = c / kChunks, col = c % kChunks * 8;
      const bool valid = row0 + r < len;
      cp_async_16(dst + r * (D + 8) + col, valid ? tile + (r * ld + col) : src, valid);
    }
  }
}

// Rows of a tile back to global memory rows `ld` elements apart, 16 bytes per access; rows
// at or past len skipped. Offsets as in load_rows.
template <int D, int R, class T>
__device__ __forceinline__ void store_rows(T* dst, int ld, const T* src, int row0, int len) {
  constexpr int kChunks = D / 8, kTotal = R * kChunks;
  T* tile = dst + int64_t(row0) * ld;
#pragma unroll
  for (int it = 0; it < (kTotal + kThreads - 1) / kThreads; ++it) {
    const int c = it * kThreads + int(threadIdx.x);
    if (c < kTotal) {
      const int r = c / kChunks, col = c % kChunks * 8;
      if (row0 + r < len)
        *reinterpret_cast<uint4*>(tile + (r * ld + col)) = *reinterpret_cast<const uint4*>(src + r * (D + 8) + col);
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

// S (16 x 64) = rows r0.. of the A tile times the 64-row [n][k] tile, both D wide.
template <int D, class T>
__device__ __forceinline__ void scores_from_smem(float (&s)[kBlockN / 8][4], const T* a_tile, int r0, const T* b_tile) {
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    uint32_t a[4];
    load_a<D + 8>(a, a_tile, r0, ks * 16);
#pragma unroll
    for (int np = 0; np < kBlockN / 16; ++np) {
      uint32_t b[4];
      load_b_nk<D + 8>(b, b_tile, np * 16, ks * 16);
      mma<T>(s[2 * np], a, b[0], b[1]);
      mma<T>(s[2 * np + 1], a, b[2], b[3]);
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

// Tiles [0, n) of keys that the query rows [q0, q0 + kBlockM) can see.
__device__ __forceinline__ int key_tiles(const Params& p, int q0) {
  const int kv_end = p.causal ? min(p.kv_len, min(q0 + kBlockM, p.q_len)) : p.kv_len;
  return (kv_end + kBlockN - 1) / kBlockN;
}

// First row of this block's query tile: the grid is (query tiles) x (heads), heads fastest;
// causal grids run the longest tiles (the last ones) first.
__device__ __forceinline__ int query_tile_start(const Params& p) {
  const int tiles = (p.q_len + kBlockM - 1) / kBlockM, tile = int(blockIdx.x / p.heads);
  return (p.causal ? tiles - 1 - tile : tile) * kBlockM;
}

// ---- forward ---------------------------------------------------------------------------

template <class T, int D> constexpr size_t forward_smem() { return size_t(kBlockM + 4 * kBlockN) * (D + 8) * sizeof(T); }

template <class T, int D> __global__ void __launch_bounds__(kThreads) forward_kernel(const Params p) {
  constexpr int S = D + 8, NB = kBlockN / 8;
  extern __shared__ __align__(16) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);  // (kBlockM, S); O on the way out
  T* sK = sQ + kBlockM * S;            // 2 x (kBlockN, S)
  T* sV = sK + 2 * kBlockN * S;        // 2 x (kBlockN, S)

  const int warp = int(threadIdx.x / 32), lane = lane_id(), g = lane >> 2, t = lane & 3;
  const int64_t bh = blockIdx.x % p.heads;
  const int q0 = query_tile_start(p), n_tiles = key_tiles(p, q0);
  const AttentionLayout& st = p.strides;
  const T* q = static_cast<const T*>(p.q) + p.offset(st.q, bh);
  const T* k = static_cast<const T*>(p.k) + p.offset(st.k, bh);
  const T* v = static_cast<const T*>(p.v) + p.offset(st.v, bh);
  const float scale_log2 = float(p.scale_log2);
  const int i_lo = q0 + warp * 16 + g;  // this thread's rows: i_lo and i_lo + 8

  load_rows<D, kBlockM>(sQ, q, int(st.q.seq), q0, p.q_len);
  if (n_tiles > 0) {
    load_rows<D, kBlockN>(sK, k, int(st.k.seq), 0, p.kv_len);
    load_rows<D, kBlockN>(sV, v, int(st.v.seq), 0, p.kv_len);
  }
  cp_async_commit();

  uint32_t qf[D / 16][4];
  float o[D / 8][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

  for (int n = 0; n < n_tiles; ++n) {
    const int buf = n & 1;
    if (n + 1 < n_tiles) {
      load_rows<D, kBlockN>(sK + (buf ^ 1) * kBlockN * S, k, int(st.k.seq), (n + 1) * kBlockN, p.kv_len);
      load_rows<D, kBlockN>(sV + (buf ^ 1) * kBlockN * S, v, int(st.v.seq), (n + 1) * kBlockN, p.kv_len);
    }
    cp_async_commit();
    cp_async_wait<1>();  // tile n (and Q) landed; tile n + 1 may still be in flight
    __syncthreads();
    if (n == 0) {
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) load_a<S>(qf[ks], sQ, warp * 16, ks * 16);
    }
    const T* kt = sK + buf * kBlockN * S;
    const T* vt = sV + buf * kBlockN * S;

    float s[NB][4] = {};
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks)
#pragma unroll
      for (int np = 0; np < NB / 2; ++np) {
        uint32_t b[4];
        load_b_nk<S>(b, kt, np * 16, ks * 16);
        mma<T>(s[2 * np], qf[ks], b[0], b[1]);
        mma<T>(s[2 * np + 1], qf[ks], b[2], b[3]);
      }
    const int j0 = n * kBlockN;
    const bool edge = j0 + kBlockN > p.kv_len || (p.causal && j0 + kBlockN - 1 > q0 + warp * 16);
    scale_and_mask(s, scale_log2, edge, i_lo, j0, p.kv_len, p.causal);

    // Online softmax, per row r (the 4 threads of a quad share a row).
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = -INFINITY;
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) mx = fmaxf(mx, fmaxf(s[nb][2 * r], s[nb][2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m[r], mx);
      const float base = m_new == -INFINITY ? 0.f : m_new;  // a row that has seen no key yet stays at 0
      const float alpha = fast_exp2(m[r] - base);
      m[r] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) {
        s[nb][2 * r] = fast_exp2(s[nb][2 * r] - base);
        s[nb][2 * r + 1] = fast_exp2(s[nb][2 * r + 1] - base);
        sum += s[nb][2 * r] + s[nb][2 * r + 1];
      }
      l[r] = l[r] * alpha + sum;
#pragma unroll
      for (int db = 0; db < D / 8; ++db) {
        o[db][2 * r] *= alpha;
        o[db][2 * r + 1] *= alpha;
      }
    }

    // O += P V, P straight from the S accumulators.
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      uint32_t a[4];
      acc_to_a<T>(a, s[2 * kk], s[2 * kk + 1]);
      mma_rows<D>(o, a, vt, kk * 16);
    }
    __syncthreads();  // every warp is done with buffer `buf` before it is refilled
  }
  cp_async_wait<0>();
  __syncthreads();

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
      const int i = i_lo + 8 * r;
      if (i < p.q_len) lse[i] = l[r] > 0.f ? (m[r] + log2f(l[r])) * kLn2 : -INFINITY;
    }
  }
  __syncthreads();
  store_rows<D, kBlockM>(static_cast<T*>(p.out) + p.offset(st.out, bh), int(st.out.seq), sQ, q0, p.q_len);
}

// ---- backward: dQ ----------------------------------------------------------------------

template <class T, int D> constexpr size_t dq_smem() { return size_t(2 * kBlockM + 4 * kBlockN) * (D + 8) * sizeof(T); }

template <class T, int D> __global__ void __launch_bounds__(kThreads) backward_dq_kernel(const Params p) {
  constexpr int S = D + 8, NB = kBlockN / 8;
  extern __shared__ __align__(16) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);  // (kBlockM, S); dQ on the way out
  T* sO = sQ + kBlockM * S;            // dO: (kBlockM, S)
  T* sK = sO + kBlockM * S;            // 2 x (kBlockN, S)
  T* sV = sK + 2 * kBlockN * S;        // 2 x (kBlockN, S)

  const int warp = int(threadIdx.x / 32), lane = lane_id(), g = lane >> 2;
  const int64_t bh = blockIdx.x % p.heads;
  const int q0 = query_tile_start(p), n_tiles = key_tiles(p, q0);
  const AttentionLayout& st = p.strides;
  const T* q = static_cast<const T*>(p.q) + p.offset(st.q, bh);
  const T* dout = static_cast<const T*>(p.dout) + p.offset(st.dout, bh);
  const T* k = static_cast<const T*>(p.k) + p.offset(st.k, bh);
  const T* v = static_cast<const T*>(p.v) + p.offset(st.v, bh);
  const float scale_log2 = float(p.scale_log2);
  const int i_lo = q0 + warp * 16 + g;
  // Workspace rows are padded to kRowPad, so i_lo + 8 is always inside.
  const float* lse2 = static_cast<const float*>(p.lse2) + bh * p.q_pad;
  const float* di = static_cast<const float*>(p.di) + bh * p.q_pad;
  const float row_lse2[2] = {lse2[i_lo], lse2[i_lo + 8]}, row_di[2] = {di[i_lo], di[i_lo + 8]};

  load_rows<D, kBlockM>(sQ, q, int(st.q.seq), q0, p.q_len);
  load_rows<D, kBlockM>(sO, dout, int(st.dout.seq), q0, p.q_len);
  if (n_tiles > 0) {
    load_rows<D, kBlockN>(sK, k, int(st.k.seq), 0, p.kv_len);
    load_rows<D, kBlockN>(sV, v, int(st.v.seq), 0, p.kv_len);
  }
  cp_async_commit();

  float dq[D / 8][4] = {};
  for (int n = 0; n < n_tiles; ++n) {
    const int buf = n & 1;
    if (n + 1 < n_tiles) {
      load_rows<D, kBlockN>(sK + (buf ^ 1) * kBlockN * S, k, int(st.k.seq), (n + 1) * kBlockN, p.kv_len);
      load_rows<D, kBlockN>(sV + (buf ^ 1) * kBlockN * S, v, int(st.v.seq), (n + 1) * kBlockN, p.kv_len);
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const T* kt = sK + buf * kBlockN * S;
    const T* vt = sV + buf * kBlockN * S;

    float s[NB][4] = {};
    scores_from_smem<D>(s, sQ, warp * 16, kt);
    const int j0 = n * kBlockN;
    const bool edge = j0 + kBlockN > p.kv_len || (p.causal && j0 + kBlockN - 1 > q0 + warp * 16);
    scale_and_mask(s, scale_log2, edge, i_lo, j0, p.kv_len, p.causal);
    float dp[NB][4] = {};
    scores_from_smem<D>(dp, sO, warp * 16, vt);
    // P = exp2(S - lse2), then dS = P (dP - Di), in place of S.
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nb][e] = fast_exp2(s[nb][e] - row_lse2[e >> 1]) * (dp[nb][e] - row_di[e >> 1]);
    // dQ += dS K
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      uint32_t a[4];
      acc_to_a<T>(a, s[2 * kk], s[2 * kk + 1]);
      mma_rows<D>(dq, a, kt, kk * 16);
    }
    __syncthreads();
  }
  cp_async_wait<0>();
  __syncthreads();
  const float scale = float(p.scale);
  stage_rows<D>(sQ, dq, warp * 16, scale, scale);
  __syncthreads();
  store_rows<D, kBlockM>(static_cast<T*>(p.dq) + p.offset(st.dq, bh), int(st.dq.seq), sQ, q0, p.q_len);
}

// ---- backward: dK and dV ---------------------------------------------------------------

template <class T, int D> constexpr size_t dkdv_smem() {
  constexpr int BQ = dkdv_tile(D);
  return size_t(2 * kBlockN + 4 * BQ) * (D + 8) * sizeof(T) + 4 * BQ * sizeof(float);
}

template <class T, int D> __global__ void __launch_bounds__(kThreads) backward_dkdv_kernel(const Params p) {
  constexpr int S = D + 8, BQ = dkdv_tile(D), QB = BQ / 8;
  extern __shared__ __align__(16) unsigned char smem[];
  T* sK = reinterpret_cast<T*>(smem);  // (kBlockN, S); dK on the way out
  T* sV = sK + kBlockN * S;            // (kBlockN, S); dV on the way out
  T* sQ = sV + kBlockN * S;            // 2 x (BQ, S)
  T* sO = sQ + 2 * BQ * S;             // dO: 2 x (BQ, S)
  float* sL = reinterpret_cast<float*>(sO + 2 * BQ * S);  // lse2: 2 x BQ
  float* sD = sL + 2 * BQ;                                // Di: 2 x BQ

  const int warp = int(threadIdx.x / 32), lane = lane_id(), g = lane >> 2, t = lane & 3;
  const int64_t bh = blockIdx.x % p.heads;
  const int k0 = int(blockIdx.x / p.heads) * kBlockN;  // key tiles ascending: causal's longest first
  const AttentionLayout& st = p.strides;
  const T* q = static_cast<const T*>(p.q) + p.offset(st.q, bh);
  const T* dout = static_cast<const T*>(p.dout) + p.offset(st.dout, bh);
  const T* k = static_cast<const T*>(p.k) + p.offset(st.k, bh);
  const T* v = static_cast<const T*>(p.v) + p.offset(st.v, bh);
  const float* lse2 = static_cast<const float*>(p.lse2) + bh * p.q_pad;
  const float* di = static_cast<const float*>(p.di) + bh * p.q_pad;
  const float scale_log2 = float(p.scale_log2);
  const int j_lo = k0 + warp * 16 + g;  // this thread's keys: j_lo and j_lo + 8
  // Query tiles that can see a key of this block: causal ones start at the diagonal.
  const int it_begin = p.causal ? k0 / BQ : 0, it_end = (p.q_len + BQ - 1) / BQ;

  // Query tile `it` into buffer `buf`: Q, dO, and their lse2 / Di rows (in bounds: padded).
  auto load_query_tile = [&](int buf, int it) {
    const int i0 = it * BQ;
    load_rows<D, BQ>(sQ + buf * BQ * S, q, int(st.q.seq), i0, p.q_len);
    load_rows<D, BQ>(sO + buf * BQ * S, dout, int(st.dout.seq), i0, p.q_len);
    const int c = int(threadIdx.x);
    if (c < BQ / 4) cp_async_16(sL + buf * BQ + 4 * c, lse2 + i0 + 4 * c, true);
    else if (c < BQ / 2) cp_async_16(sD + buf * BQ + 4 * (c - BQ / 4), di + i0 + 4 * (c - BQ / 4), true);
  };

  load_rows<D, kBlockN>(sK, k, int(st.k.seq), k0, p.kv_len);
  load_rows<D, kBlockN>(sV, v, int(st.v.seq), k0, p.kv_len);
  if (it_begin < it_end) load_query_tile(0, it_begin);
  cp_async_commit();

  float dk[D / 8][4] = {}, dv[D / 8][4] = {};
  for (int it = it_begin; it < it_end; ++it) {
    const int buf = (it - it_begin) & 1;
    if (it + 1 < it_end) load_query_tile(buf ^ 1, it + 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const T* qt = sQ + buf * BQ * S;
    const T* ot = sO + buf * BQ * S;
    const float* lt = sL + buf * BQ;
    const float* dt = sD + buf * BQ;
    const int i0 = it * BQ;

    // S^T (16 keys x BQ queries) = K Q^T
    float st[QB][4] = {};
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t a[4];
      load_a<S>(a, sK, warp * 16, ks * 16);
#pragma unroll
      for (int np = 0; np < QB / 2; ++np) {
        uint32_t b[4];
        load_b_nk<S>(b, qt, np * 16, ks * 16);
        mma<T>(st[2 * np], a, b[0], b[1]);
        mma<T>(st[2 * np + 1], a, b[2], b[3]);
      }
    }
    // P^T = exp2(S^T scale_log2 - lse2[i]); 0 where query i cannot see key j.
    const bool edge = (p.causal && i0 < k0 + warp * 16 + 15) || k0 + kBlockN > p.kv_len;
#pragma unroll
    for (int nb = 0; nb < QB; ++nb) {
      const float2 l2 = *reinterpret_cast<const float2*>(lt + nb * 8 + 2 * t);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = fast_exp2(st[nb][e] * scale_log2 - ((e & 1) ? l2.y : l2.x));
        if (edge) {
          const int i = i0 + nb * 8 + 2 * t + (e & 1), j = j_lo + (e >> 1) * 8;
          if (j >= p.kv_len || (p.causal && i < j)) x = 0.f;
        }
        st[nb][e] = x;
      }
    }
    // dV += P^T dO
#pragma unroll
    for (int kk = 0; kk < BQ / 16; ++kk) {
      uint32_t a[4];
      acc_to_a<T>(a, st[2 * kk], st[2 * kk + 1]);
      mma_rows<D>(dv, a, ot, kk * 16);
    }
    // dP^T = V dO^T
    float dpt[QB][4] = {};
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t a[4];
      load_a<S>(a, sV, warp * 16, ks * 16);
#pragma unroll
      for (int np = 0; np < QB / 2; ++np) {
        uint32_t b[4];
        load_b_nk<S>(b, ot, np * 16, ks * 16);
        mma<T>(dpt[2 * np], a, b[0], b[1]);
        mma<T>(dpt[2 * np + 1], a, b[2], b[3]);
      }
    }
    // dS^T = P^T (dP^T - Di[i]), in place of P^T
#pragma unroll
    for (int nb = 0; nb < QB; ++nb) {
      const float2 d2 = *reinterpret_cast<const float2*>(dt + nb * 8 + 2 * t);
#pragma unroll
      for (int e = 0; e < 4; ++e) st[nb][e] *= dpt[nb][e] - ((e & 1) ? d2.y : d2.x);
    }
    // dK += dS^T Q
#pragma unroll
    for (int kk = 0; kk < BQ / 16; ++kk) {
      uint32_t a[4];
      acc_to_a<T>(a, st[2 * kk], st[2 * kk + 1]);
      mma_rows<D>(dk, a, qt, kk * 16);
    }
    __syncthreads();
  }
  cp_async_wait<0>();
  __syncthreads();
  const float scale = float(p.scale);
  stage_rows<D>(sK, dk, warp * 16, scale, scale);
  stage_rows<D>(sV, dv, warp * 16, 1.f, 1.f);
  __syncthreads();
  store_rows<D, kBlockN>(static_cast<T*>(p.dk) + p.offset(st.dk, bh), int(st.dk.seq), sK, k0, p.kv_len);
  store_rows<D, kBlockN>(static_cast<T*>(p.dv) + p.offset(st.dv, bh), int(st.dv.seq), sV, k0, p.kv_len);
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

int64_t tiles(int64_t len, int64_t tile) { return (len + tile - 1) / tile; }

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

}  // namespace

bool mma_supported(DType dtype, int64_t head_dim) {
  return (dtype == DType::bf16 || dtype == DType::f16) &&
         (head_dim == 32 || head_dim == 64 || head_dim == 80 || head_dim == 96 || head_dim == 128);
}

void mma_forward(const Params& p, DType dtype, cudaStream_t stream) {
  dispatch(dtype, p.head_dim, [&](auto tag, auto dim) {
    using T = decltype(tag);
    constexpr int D = decltype(dim)::value;
    launch(forward_kernel<T, D>, p.heads * tiles(p.q_len, kBlockM), forward_smem<T, D>(), "forward", p, stream);
  });
}

void mma_backward(const Params& p, DType dtype, cudaStream_t stream) {
  dispatch(dtype, p.head_dim, [&](auto tag, auto dim) {
    using T = decltype(tag);
    constexpr int D = decltype(dim)::value;
    launch(backward_dkdv_kernel<T, D>, p.heads * tiles(p.kv_len, kBlockN), dkdv_smem<T, D>(), "backward dk/dv", p,
           stream);
    launch(backward_dq_kernel<T, D>, p.heads * tiles(p.q_len, kBlockM), dq_smem<T, D>(), "backward dq", p, stream);
  });
}

}  // namespace loom::cuda::attention
