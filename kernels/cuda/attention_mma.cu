// Flash attention on tensor cores, forward: bf16/f16 inputs, f32 accumulation, head_dim D in
// {32, 64, 80, 96, 128}, for sm_80 and later (Hopper runs it as is).
//
// The FlashAttention-2 scheme with warp-level mma.sync.m16n8k16 (wgmma would need sm_90a
// and hand-built shared-memory descriptors; mma.sync is what runs on every target), in the
// blocks of attention_mma_tiles.cuh. A block takes 64 MT query rows, loads its Q tile once
// (fragments then live in registers) and streams 64-key K/V tiles through double-buffered
// shared memory with cp.async. S = Q K^T comes out in mma accumulators; an online softmax
// (running max m and sum l per row, in exp2 form) rescales O; P is repacked from the S
// accumulators straight into A fragments of O += P V, never touching shared memory. Causal
// blocks stop at the diagonal tile, a warp skips the tiles its rows cannot see, and the grid
// runs the longest (last) query tiles first. The backward is attention_mma_backward.cu.
#include "kernels/cuda/attention_mma_tiles.cuh"

namespace loom::cuda::attention {
namespace {

using namespace mma_tiles;

constexpr float kLn2 = 0.6931471805599453f;

// ---- forward ---------------------------------------------------------------------------

template <class T, int D, int MT> constexpr size_t forward_smem() {
  return size_t(block_rows(MT) + 4 * kBlockN) * (D + 8) * sizeof(T);
}

template <class T, int D, int MT> __global__ void __launch_bounds__(kThreads) forward_kernel(const Params p) {
  constexpr int S = D + 8, NB = kBlockN / 8, BM = block_rows(MT), WR = 16 * MT;
  extern __shared__ __align__(16) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);  // (BM, S); O on the way out
  T* sK = sQ + BM * S;                 // 2 x (kBlockN, S)
  T* sV = sK + 2 * kBlockN * S;        // 2 x (kBlockN, S)

  const int warp = int(threadIdx.x / 32), lane = lane_id(), g = lane >> 2, t = lane & 3;
  const int64_t bh = blockIdx.x % p.heads;
  const int q0 = query_tile_start<BM>(p), n_tiles = key_tiles<BM>(p, q0);
  const AttentionLayout& st = p.strides;
  const T* q = static_cast<const T*>(p.q) + p.offset(st.q, bh);
  const T* k = static_cast<const T*>(p.k) + p.offset(st.k, bh);
  const T* v = static_cast<const T*>(p.v) + p.offset(st.v, bh);
  const float scale_log2 = float(p.scale_log2);
  const int w0 = q0 + warp * WR;  // this warp's first row; tile mt's thread rows: w0 + 16 mt + g (+ 8)

  load_rows<D, BM>(sQ, q, int(st.q.seq), q0, p.q_len);
  if (n_tiles > 0) {
    load_rows<D, kBlockN>(sK, k, int(st.k.seq), 0, p.kv_len);
    load_rows<D, kBlockN>(sV, v, int(st.v.seq), 0, p.kv_len);
  }
  cp_async_commit();

  uint32_t qf[MT][D / 16][4];
  float o[MT][D / 8][4] = {};
  float m[MT][2], l[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) m[mt][0] = m[mt][1] = -INFINITY, l[mt][0] = l[mt][1] = 0.f;

  for (int n = 0; n < n_tiles; ++n) {
    const int buf = n & 1;
    next_key_tile<D>(sK, sV, k, int(st.k.seq), v, int(st.v.seq), n, n_tiles, p.kv_len);
    if (n == 0) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) load_a<S>(qf[mt][ks], sQ, warp * WR + mt * 16, ks * 16);
    }
    const T* kt = sK + buf * kBlockN * S;
    const T* vt = sV + buf * kBlockN * S;
    const int j0 = n * kBlockN;
    // Causal: a warp whose rows all come before the tile's first key skips it (the tile
    // adds nothing to them). j0 is a multiple of 64 and w0 of the warp's 16 MT rows, so a
    // warp that goes on has every row see key j0.
    if (!p.causal || j0 < w0 + WR) {
      float s[MT][NB][4] = {};
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks)
#pragma unroll
        for (int np = 0; np < NB / 2; ++np) {
          uint32_t b[4];
          load_b_nk<S>(b, kt, np * 16, ks * 16);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma<T>(s[mt][2 * np], qf[mt][ks], b[0], b[1]);
            mma<T>(s[mt][2 * np + 1], qf[mt][ks], b[2], b[3]);
          }
        }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const int r0 = w0 + 16 * mt;
        const bool edge = j0 + kBlockN > p.kv_len || (p.causal && j0 + kBlockN - 1 > r0);
        scale_and_mask(s[mt], scale_log2, edge, r0 + g, j0, p.kv_len, p.causal);

        // Online softmax, per row r (the 4 threads of a quad share a row).
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float mx = -INFINITY;
#pragma unroll
          for (int nb = 0; nb < NB; ++nb) mx = fmaxf(mx, fmaxf(s[mt][nb][2 * r], s[mt][nb][2 * r + 1]));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          const float m_new = fmaxf(m[mt][r], mx);
          const float base = m_new == -INFINITY ? 0.f : m_new;  // a row that has seen no key yet stays at 0
          const float alpha = fast_exp2(m[mt][r] - base);
          m[mt][r] = m_new;
          float sum = 0.f;
#pragma unroll
          for (int nb = 0; nb < NB; ++nb) {
            s[mt][nb][2 * r] = fast_exp2(s[mt][nb][2 * r] - base);
            s[mt][nb][2 * r + 1] = fast_exp2(s[mt][nb][2 * r + 1] - base);
            sum += s[mt][nb][2 * r] + s[mt][nb][2 * r + 1];
          }
          l[mt][r] = l[mt][r] * alpha + sum;
#pragma unroll
          for (int db = 0; db < D / 8; ++db) {
            o[mt][db][2 * r] *= alpha;
            o[mt][db][2 * r + 1] *= alpha;
          }
        }
      }

      // O += P V, P straight from the S accumulators; each V fragment feeds every row tile.
      mma_acc_rows<D>(o, s, vt);
    }
    __syncthreads();  // every warp is done with buffer `buf` before it is refilled
  }
  cp_async_wait<0>();
  __syncthreads();

#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      l[mt][r] += __shfl_xor_sync(0xffffffffu, l[mt][r], 1);
      l[mt][r] += __shfl_xor_sync(0xffffffffu, l[mt][r], 2);
    }
    stage_rows<D>(sQ, o[mt], warp * WR + 16 * mt, l[mt][0] > 0.f ? 1.f / l[mt][0] : 0.f,
                  l[mt][1] > 0.f ? 1.f / l[mt][1] : 0.f);
    if (t == 0) {
      float* lse = static_cast<float*>(p.lse) + bh * p.q_len;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int i = w0 + 16 * mt + g + 8 * r;
        if (i < p.q_len) lse[i] = l[mt][r] > 0.f ? (m[mt][r] + log2f(l[mt][r])) * kLn2 : -INFINITY;
      }
    }
  }
  __syncthreads();
  store_rows<D, BM>(static_cast<T*>(p.out) + p.offset(st.out, bh), int(st.out.seq), sQ, q0, p.q_len);
}

}  // namespace

bool mma_supported(DType dtype, int64_t head_dim) {
  return (dtype == DType::bf16 || dtype == DType::f16) &&
         (head_dim == 32 || head_dim == 64 || head_dim == 80 || head_dim == 96 || head_dim == 128);
}

void mma_forward(const Params& p, DType dtype, cudaStream_t stream) {
  dispatch(dtype, p.head_dim, [&](auto tag, auto dim) {
    using T = decltype(tag);
    constexpr int D = decltype(dim)::value, MT = 1;
    launch(forward_kernel<T, D, MT>, p.heads * tiles(p.q_len, block_rows(MT)), forward_smem<T, D, MT>(), "forward", p,
           stream);
  });
}

}  // namespace loom::cuda::attention
