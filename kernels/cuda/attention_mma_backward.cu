// Flash attention on tensor cores, backward (the forward and the block shape are in
// attention_mma.cu and attention_mma_tiles.cuh). P is recomputed from the saved log-sum-exp,
// so nothing of size T x T is kept.
// - dK and dV: a block takes 64 MT keys and sweeps the query tiles that can see them (Q, dO,
//   lse and Di double-buffered), accumulating dV += P^T dO and dK += dS^T Q in registers.
// - dQ, by default: the same kernel stages each dS^T tile in shared memory, multiplies it by
//   the block's K and adds the (queries x D) result into an f32 accumulator with atomics
//   (FlashAttention-2's way); a last kernel scales and rounds it into dq. 5 products per tile
//   pair, but the order of the additions varies from run to run.
// - dQ when AttentionArgs::deterministic asks: a second kernel shaped like the forward
//   recomputes S and dP per key tile and accumulates dQ += dS K in registers: 7 products per
//   tile pair, no accumulator in the workspace, and the same bits from run to run.
#include <algorithm>

#include "kernels/cuda/attention_mma_tiles.cuh"

namespace loom::cuda::attention {
namespace {

using namespace mma_tiles;

// ---- backward: dQ ----------------------------------------------------------------------

// lse2 = lse log2(e) (+inf for rows that see no key, and padding rows) and Di = rowsum(dout
// * out) (0 on padding rows) for every (head, row < q_pad). A row takes L lanes (D / 8
// rounded up to a power of two), each reading 16 bytes of dout and of out, so a warp covers
// 32 / L rows; a warp loads kPrepRows such groups before it reduces any, and the grid is
// sized to the GPU (blocks loop over the rows), so each block has many loads in flight
// rather than launching a block per 16 rows.
constexpr int kPrepRows = 4;

template <int D> constexpr int prep_lanes() { return D / 8 <= 4 ? 4 : D / 8 <= 8 ? 8 : 16; }

template <class T, int D>
__global__ void __launch_bounds__(256) prep_kernel(const Params p, const T* out, const float* lse) {
  constexpr int L = prep_lanes<D>(), R = 32 / L;
  static_assert(D / 8 <= L, "a row's 16-byte chunks must fit in its lanes");
  constexpr float kLog2e = 1.4426950408889634f;
  const int sub = lane_id() % L;
  const int64_t rows = p.heads * p.q_pad;
  const int64_t warp = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t warps = int64_t(gridDim.x) * blockDim.x / 32;
  float* lse2 = static_cast<float*>(const_cast<void*>(p.lse2));
  float* di = static_cast<float*>(const_cast<void*>(p.di));
  // Whole warps iterate together, so the shuffles below see all 32 lanes.
  for (int64_t first = warp * R * kPrepRows; first < rows; first += warps * R * kPrepRows) {
    uint4 a[kPrepRows], b[kPrepRows];
    float l[kPrepRows];
#pragma unroll
    for (int u = 0; u < kPrepRows; ++u) {
      const int64_t row = first + u * R + lane_id() / L, bh = row / p.q_pad;
      const int i = int(row - bh * p.q_pad);
      const bool real = row < rows && i < p.q_len;
      a[u] = b[u] = uint4{0, 0, 0, 0};
      l[u] = -INFINITY;
      if (real && sub < D / 8) {
        const int64_t col = sub * 8;
        a[u] = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.dout) + p.offset(p.strides.dout, bh) +
                                               int64_t(i) * p.strides.dout.seq + col);
        b[u] = *reinterpret_cast<const uint4*>(out + p.offset(p.strides.out, bh) + int64_t(i) * p.strides.out.seq +
                                               col);
      }
      if (real && sub == 0) l[u] = lse[bh * p.q_len + i];
    }
#pragma unroll
    for (int u = 0; u < kPrepRows; ++u) {
      const T* x = reinterpret_cast<const T*>(&a[u]);
      const T* y = reinterpret_cast<const T*>(&b[u]);
      float d = 0.f;
#pragma unroll
      for (int e = 0; e < 8; ++e) d += float(x[e]) * float(y[e]);
#pragma unroll
      for (int offset = L / 2; offset > 0; offset /= 2) d += __shfl_xor_sync(0xffffffffu, d, offset);
      const int64_t row = first + u * R + lane_id() / L;
      if (sub == 0 && row < rows) {
        lse2[row] = l[u] == -INFINITY ? INFINITY : l[u] * kLog2e;
        di[row] = d;
      }
    }
  }
}

template <class T, int D, int MT> constexpr size_t dq_smem() {
  return size_t(2 * block_rows(MT) + 4 * kBlockN) * (D + 8) * sizeof(T);
}

template <class T, int D, int MT> __global__ void __launch_bounds__(kThreads) backward_dq_kernel(const Params p) {
  constexpr int S = D + 8, NB = kBlockN / 8, BM = block_rows(MT), WR = 16 * MT;
  extern __shared__ __align__(16) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);  // (BM, S); dQ on the way out
  T* sO = sQ + BM * S;                 // dO: (BM, S)
  T* sK = sO + BM * S;                 // 2 x (kBlockN, S)
  T* sV = sK + 2 * kBlockN * S;        // 2 x (kBlockN, S)

  const int warp = int(threadIdx.x / 32), lane = lane_id(), g = lane >> 2;
  const int64_t bh = blockIdx.x % p.heads;
  const int q0 = query_tile_start<BM>(p), n_tiles = key_tiles<BM>(p, q0);
  const AttentionLayout& st = p.strides;
  const HeadOperands<T> in(p, bh, true);
  const float scale_log2 = float(p.scale_log2);
  const int w0 = q0 + warp * WR;
  // Workspace rows are padded to kRowPad, a multiple of BM, so every row read is inside.
  float row_lse2[MT][2], row_di[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      row_lse2[mt][r] = in.lse2[w0 + 16 * mt + g + 8 * r];
      row_di[mt][r] = in.di[w0 + 16 * mt + g + 8 * r];
    }

  load_rows<D, BM>(sQ, in.q, int(st.q.seq), q0, p.q_len);
  load_rows<D, BM>(sO, in.dout, int(st.dout.seq), q0, p.q_len);
  if (n_tiles > 0) {
    load_rows<D, kBlockN>(sK, in.k, int(st.k.seq), 0, p.kv_len);
    load_rows<D, kBlockN>(sV, in.v, int(st.v.seq), 0, p.kv_len);
  }
  cp_async_commit();

  float dq[MT][D / 8][4] = {};
  for (int n = 0; n < n_tiles; ++n) {
    const int buf = n & 1;
    next_key_tile<D>(sK, sV, in.k, int(st.k.seq), in.v, int(st.v.seq), n, n_tiles, p.kv_len);
    const T* kt = sK + buf * kBlockN * S;
    const T* vt = sV + buf * kBlockN * S;
    const int j0 = n * kBlockN;
    if (!p.causal || j0 < w0 + WR) {  // as in the forward
      // dS = P (dP - Di) per row tile, P = exp2(S - lse2) recomputed, kept as A fragments.
      uint32_t ds[kBlockN / 16][MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const int r0 = w0 + 16 * mt;
        float s[1][NB][4] = {}, dp[1][NB][4] = {};
        scores_from_smem<D>(s, sQ, warp * WR + 16 * mt, kt);
        const bool edge = j0 + kBlockN > p.kv_len || (p.causal && j0 + kBlockN - 1 > r0);
        scale_and_mask(s[0], scale_log2, edge, r0 + g, j0, p.kv_len, p.causal);
        scores_from_smem<D>(dp, sO, warp * WR + 16 * mt, vt);
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            s[0][nb][e] = fast_exp2(s[0][nb][e] - row_lse2[mt][e >> 1]) * (dp[0][nb][e] - row_di[mt][e >> 1]);
#pragma unroll
        for (int kk = 0; kk < kBlockN / 16; ++kk) acc_to_a<T>(ds[kk][mt], s[0][2 * kk], s[0][2 * kk + 1]);
      }
      // dQ += dS K
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) mma_rows<D>(dq, ds[kk], kt, kk * 16);
    }
    __syncthreads();
  }
  cp_async_wait<0>();
  __syncthreads();
  const float scale = float(p.scale);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) stage_rows<D>(sQ, dq[mt], warp * WR + 16 * mt, scale, scale);
  __syncthreads();
  store_rows<D, BM>(static_cast<T*>(p.dq) + p.offset(st.dq, bh), int(st.dq.seq), sQ, q0, p.q_len);
}

// ---- backward: dK and dV ---------------------------------------------------------------

// With kDq the kernel also computes dQ: each tile's dS^T goes through shared memory (BK x
// (BQ + 8)) into dQ's tile = dS K, which is added to p.dq_acc with f32 atomics (FlashAttention-2's
// way: 5 products per tile pair instead of 7, in an order that varies from run to run).
template <class T, int D, int MT, bool kDq> constexpr size_t dkdv_smem() {
  constexpr int BQ = dkdv_tile<D, MT>(), BK = block_rows(MT);
  return size_t(2 * BK + 4 * BQ) * (D + 8) * sizeof(T) + 4 * BQ * sizeof(float) +
         (kDq ? size_t(BK) * (BQ + 8) * sizeof(T) : 0);
}

template <class T, int D, int MT, bool kDq>
__global__ void __launch_bounds__(kThreads) backward_dkdv_kernel(const Params p) {
  constexpr int S = D + 8, BQ = dkdv_tile<D, MT>(), QB = BQ / 8, BK = block_rows(MT), WK = 16 * MT;
  constexpr int SS = BQ + 8;  // row stride of dS^T in shared memory
  extern __shared__ __align__(16) unsigned char smem[];
  T* sK = reinterpret_cast<T*>(smem);  // (BK, S); dK on the way out
  T* sV = sK + BK * S;                 // (BK, S); dV on the way out
  T* sQ = sV + BK * S;                 // 2 x (BQ, S)
  T* sO = sQ + 2 * BQ * S;             // dO: 2 x (BQ, S)
  float* sL = reinterpret_cast<float*>(sO + 2 * BQ * S);  // lse2: 2 x BQ
  float* sD = sL + 2 * BQ;                                // Di: 2 x BQ
  T* sS = reinterpret_cast<T*>(sD + 2 * BQ);              // with kDq, dS^T: (BK, SS)

  const int warp = int(threadIdx.x / 32), lane = lane_id(), g = lane >> 2, t = lane & 3;
  const int64_t bh = blockIdx.x % p.heads;
  const int k0 = int(blockIdx.x / p.heads) * BK;  // key tiles ascending: causal's longest first
  const int w0 = k0 + warp * WK;                  // this warp's first key; tile mt's thread keys: w0 + 16 mt + g (+ 8)
  const AttentionLayout& st = p.strides;
  const HeadOperands<T> in(p, bh, true);
  const float scale_log2 = float(p.scale_log2);
  // Query tiles that can see a key of this block: causal ones start at the diagonal.
  const int it_begin = p.causal ? k0 / BQ : 0, it_end = (p.q_len + BQ - 1) / BQ;

  // Query tile `it` into buffer `buf`: Q, dO, and their lse2 / Di rows (in bounds: padded).
  auto load_query_tile = [&](int buf, int it) {
    const int i0 = it * BQ;
    load_rows<D, BQ>(sQ + buf * BQ * S, in.q, int(st.q.seq), i0, p.q_len);
    load_rows<D, BQ>(sO + buf * BQ * S, in.dout, int(st.dout.seq), i0, p.q_len);
    const int c = int(threadIdx.x);
    if (c < BQ / 4) cp_async_16(sL + buf * BQ + 4 * c, in.lse2 + i0 + 4 * c, true);
    else if (c < BQ / 2) cp_async_16(sD + buf * BQ + 4 * (c - BQ / 4), in.di + i0 + 4 * (c - BQ / 4), true);
  };

  load_rows<D, BK>(sK, in.k, int(st.k.seq), k0, p.kv_len);
  load_rows<D, BK>(sV, in.v, int(st.v.seq), k0, p.kv_len);
  if (it_begin < it_end) load_query_tile(0, it_begin);
  cp_async_commit();

  float dk[MT][D / 8][4] = {}, dv[MT][D / 8][4] = {};
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

    // Causal: a warp whose keys all come after the tile's last query skips it.
    if (!p.causal || i0 + BQ > w0) {
      // S^T (16 keys x BQ queries per row tile) = K Q^T; each Q fragment feeds every row tile.
      float st[MT][QB][4] = {};
      scores_from_smem<D>(st, sK, warp * WK, qt);
      // P^T = exp2(S^T scale_log2 - lse2[i]); 0 where query i cannot see key j.
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const int j_lo = w0 + 16 * mt + g;
        const bool edge = (p.causal && i0 < w0 + 16 * mt + 15) || k0 + BK > p.kv_len;
#pragma unroll
        for (int nb = 0; nb < QB; ++nb) {
          const float2 l2 = *reinterpret_cast<const float2*>(lt + nb * 8 + 2 * t);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float x = fast_exp2(st[mt][nb][e] * scale_log2 - ((e & 1) ? l2.y : l2.x));
            if (edge) {
              const int i = i0 + nb * 8 + 2 * t + (e & 1), j = j_lo + (e >> 1) * 8;
              if (j >= p.kv_len || (p.causal && i < j)) x = 0.f;
            }
            st[mt][nb][e] = x;
          }
        }
      }
      // dV += P^T dO
      mma_acc_rows<D>(dv, st, ot);
      // dP^T = V dO^T
      float dpt[MT][QB][4] = {};
      scores_from_smem<D>(dpt, sV, warp * WK, ot);
      // dS^T = P^T (dP^T - Di[i]), in place of P^T
#pragma unroll
      for (int nb = 0; nb < QB; ++nb) {
        const float2 d2 = *reinterpret_cast<const float2*>(dt + nb * 8 + 2 * t);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int e = 0; e < 4; ++e) st[mt][nb][e] *= dpt[mt][nb][e] - ((e & 1) ? d2.y : d2.x);
      }
      // dK += dS^T Q
      mma_acc_rows<D>(dk, st, qt);
      if constexpr (kDq) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int nb = 0; nb < QB; ++nb) {
            T* row = sS + (warp * WK + 16 * mt + g) * SS + nb * 8 + 2 * t;
            *reinterpret_cast<uint32_t*>(row) = pack2<T>(st[mt][nb][0], st[mt][nb][1]);
            *reinterpret_cast<uint32_t*>(row + 8 * SS) = pack2<T>(st[mt][nb][2], st[mt][nb][3]);
          }
      }
    } else if constexpr (kDq) {
      // This warp's keys see none of the tile's queries: their rows of dS^T are 0.
#pragma unroll
      for (int c = lane; c < WK * BQ / 8; c += 32)
        *reinterpret_cast<uint4*>(sS + (warp * WK + c / (BQ / 8)) * SS + c % (BQ / 8) * 8) = make_uint4(0, 0, 0, 0);
    }
    if constexpr (kDq) {
      // dQ's tile (BQ x D) = dS (BQ x BK) K (BK x D) in units of 16 rows x 16 columns, spread
      // over the warps; A = dS read transposed from dS^T, B = this block's K.
      constexpr int kColUnits = D / 16, kUnits = (BQ / 16) * kColUnits, kPerWarp = kUnits / kWarps;
      static_assert(kUnits % kWarps == 0, "dQ's tile must split evenly over the warps");
      __syncthreads();
      float acc[kPerWarp][2][4] = {};
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk)
#pragma unroll
        for (int u = 0; u < kPerWarp; ++u) {
          const int unit = warp * kPerWarp + u, mi = unit / kColUnits, ni = unit % kColUnits;
          uint32_t a[4], b[4];
          load_a_km<SS>(a, sS, mi * 16, kk * 16);
          load_b_kn<S>(b, sK, kk * 16, ni * 16);
          mma<T>(acc[u][0], a, b[0], b[1]);
          mma<T>(acc[u][1], a, b[2], b[3]);
        }
      float* dq_acc = p.dq_acc + bh * p.q_pad * D;
#pragma unroll
      for (int u = 0; u < kPerWarp; ++u) {
        const int unit = warp * kPerWarp + u, mi = unit / kColUnits, ni = unit % kColUnits;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int i = i0 + mi * 16 + g + 8 * r;
          if (i >= p.q_len) continue;
#pragma unroll
          for (int h = 0; h < 2; ++h)
            add_pair(dq_acc + int64_t(i) * D + ni * 16 + h * 8 + 2 * t, acc[u][h][2 * r], acc[u][h][2 * r + 1]);
        }
      }
    }
    __syncthreads();
  }
  cp_async_wait<0>();
  __syncthreads();
  const float scale = float(p.scale);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    stage_rows<D>(sK, dk[mt], warp * WK + 16 * mt, scale, scale);
    stage_rows<D>(sV, dv[mt], warp * WK + 16 * mt, 1.f, 1.f);
  }
  __syncthreads();
  store_rows<D, BK>(static_cast<T*>(p.dk) + p.offset(st.dk, bh), int(st.dk.seq), sK, k0, p.kv_len);
  store_rows<D, BK>(static_cast<T*>(p.dv) + p.offset(st.dv, bh), int(st.dv.seq), sV, k0, p.kv_len);
}

// ---- backward: dQ from its accumulator -------------------------------------------------

// dq = scale * dq_acc, rounded to T and written through dq's strides. A block takes rows of
// one head kSumRows at a time, a thread 8 columns of a row; with p.sum_partials it also adds
// up the columns of the tile as stored (rounded to T), through shared memory, into the tile's
// partial sums.
constexpr int kConvertThreads = 256;
template <class T, int D> __global__ void __launch_bounds__(kConvertThreads) dq_convert_kernel(const Params p) {
  constexpr int kChunks = D / 8, kRows = kConvertThreads / kChunks;  // rows a pass
  __shared__ float sums[kRows][D];
  const int tiles = (p.q_len + kSumRows - 1) / kSumRows, chunk = int(threadIdx.x) % kChunks,
            r = int(threadIdx.x) / kChunks, col = chunk * 8;
  const float scale = float(p.scale);
  for (int64_t block = blockIdx.x; block < p.heads * tiles; block += gridDim.x) {
    const int64_t bh = block / tiles;
    const int tile = int(block - bh * tiles), row0 = tile * kSumRows, rows = min(kSumRows, p.q_len - row0);
    const float* src = p.dq_acc + (bh * p.q_pad + row0) * D + col;
    T* dq = static_cast<T*>(p.dq) + p.offset(p.strides.dq, bh) + int64_t(row0) * p.strides.dq.seq + col;
    float sum[8] = {};
    for (int i = r; r < kRows && i < rows; i += kRows) {
      const float4 a = *reinterpret_cast<const float4*>(src + i * D), b = *reinterpret_cast<const float4*>(src + i * D + 4);
      const uint4 out{pack2<T>(a.x * scale, a.y * scale), pack2<T>(a.z * scale, a.w * scale),
                      pack2<T>(b.x * scale, b.y * scale), pack2<T>(b.z * scale, b.w * scale)};
      *reinterpret_cast<uint4*>(dq + int64_t(i) * p.strides.dq.seq) = out;
      const uint32_t words[4] = {out.x, out.y, out.z, out.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 stored = unpack2<T>(words[e]);
        sum[2 * e] += stored.x;
        sum[2 * e + 1] += stored.y;
      }
    }
    if (!p.sum_partials) continue;  // the same for every block
    if (r < kRows)
#pragma unroll
      for (int e = 0; e < 8; ++e) sums[r][col + e] = sum[e];
    __syncthreads();
    if (threadIdx.x < D) {
      float total = 0;
      for (int i = 0; i < kRows; ++i) total += sums[i][threadIdx.x];
      sum_partial<float>(p, bh, tile, 0)[threadIdx.x] = total;
    }
    __syncthreads();  // sums is refilled by the next tile
  }
}
}  // namespace

bool dq_by_atomics(const AttentionArgs& args) {
  return !args.deterministic && mma_supported(args.dtype, args.head_dim);
}

int mma_backward(const Params& p, const void* out, const void* lse, DType dtype, bool atomics, bool hopper,
                 cudaStream_t stream) {
  LOOM_ASSERT(!atomics || p.q_len == 0 || p.dq_acc != nullptr, "attention: the backward's dQ accumulator is missing");
  int summed = 0;
  dispatch(dtype, p.head_dim, [&](auto tag, auto dim) {
    using T = decltype(tag);
    constexpr int D = decltype(dim)::value, MT = D <= 64 ? 2 : 1;
    const int64_t rows = p.heads * p.q_pad;
    if (rows > 0) {
      constexpr int64_t rows_per_block = 256 / prep_lanes<D>() * kPrepRows;
      const int64_t blocks = std::min<int64_t>((rows + rows_per_block - 1) / rows_per_block, int64_t(sm_count()) * 8);
      prep_kernel<T, D><<<unsigned(blocks), 256, 0, stream>>>(
          p, static_cast<const T*>(out), static_cast<const float*>(lse));
      LOOM_CUDA_LAUNCH();
    }
    const int64_t key_blocks = p.heads * tiles(p.kv_len, block_rows(MT));
    if (!atomics) {
      launch(backward_dkdv_kernel<T, D, MT, false>, key_blocks, dkdv_smem<T, D, MT, false>(), "backward dk/dv", p,
             stream);
      launch(backward_dq_kernel<T, D, MT>, p.heads * tiles(p.q_len, block_rows(MT)), dq_smem<T, D, MT>(),
             "backward dq", p, stream);
      return;
    }
    const int64_t chunks = p.heads * p.q_len * (D / 8);
    if (chunks > 0) LOOM_CUDA(cudaMemsetAsync(p.dq_acc, 0, size_t(p.heads) * p.q_pad * D * sizeof(float), stream));
    if (hopper && wgmma_backward_supported(dtype, D)) {
      wgmma_dkdv_dq(p, dtype, stream);
      summed |= 2 | 4;  // the kernel sums dK's and dV's tiles as it stores them
    } else {
      launch(backward_dkdv_kernel<T, D, MT, true>, key_blocks, dkdv_smem<T, D, MT, true>(), "backward dk/dv/dq", p,
             stream);
    }
    if (chunks == 0) return;
    const int64_t blocks = p.heads * tiles(p.q_len, kSumRows);
    dq_convert_kernel<T, D><<<unsigned(std::min<int64_t>(blocks, int64_t(1) << 20)), kConvertThreads, 0, stream>>>(p);
    LOOM_CUDA_LAUNCH();
    summed |= 1;
  });
  return summed;
}

}  // namespace loom::cuda::attention
