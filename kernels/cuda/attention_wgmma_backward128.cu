// Flash attention backward on Hopper's warpgroup products at head_dim 128: dK, dV and dQ,
// bf16/f16, dQ summed by f32 atomics into the workspace's accumulator, between
// attention_mma_backward.cu's row preparation (lse2, Di) and dQ's conversion, as
// attention_wgmma_backward.cu does at 64.
//
// The block is that kernel's: two warpgroups, 128 keys, warpgroup w keys 64 w to 64 w + 63
// and warp v of it 16 v to 16 v + 15 of those, both sweeping the 64-query tiles that see the
// block's keys, Q and dO in three swizzled buffers as at 64 (the first warpgroup loads Q and
// lse2, the second dO and Di). What changes is where the operands live: at 128 columns a
// warpgroup's dK and dV accumulators alone take 128 registers a thread, so K and V stay in
// shared memory (swizzled (128, 128) tiles, each two 64-column blocks of 128 rows) and every
// product reads both operands from there:
//   S^T = K Q^T and dP^T = V dO^T (A: the warpgroup's K or V rows, K-major; B: the Q or dO
//   tile, K-major), issued together;
//   P^T and dS^T in registers, as at 64, then stored as swizzled (64 keys, 64 queries) tiles
//   (dS^T in two buffers), where the score registers die;
//   dV += P^T dO and dK += dS^T Q (A: the P^T or dS^T tile, K-major; B: the dO or Q tile read
//   transposed, N = 128);
//   dQ's columns 64 w to 64 w + 63 of the tile = dS K over all 128 keys (A: both warpgroups'
//   dS^T tiles read transposed; B: K's 64-column block w read transposed).
// The next tile's S^T and dP^T are issued behind dQ's product, and one barrier a tile
// separates the P^T / dS^T stores from the products that read them, as at 64. dQ is added by
// float2 atomics, each thread its part (2 rows x 8 columns; a bulk reduction, as at 64, would
// need two 32 KB f32 tiles more in shared memory than the block has left). The padding they
// add into and the groups of heads are attention_wgmma_backward.cu's (the code both kernels
// share: attention_wgmma_backward.cuh).
#include "kernels/config.h"
#include "kernels/cuda/attention_wgmma_backward.cuh"

namespace loom::cuda::attention {
namespace {

using namespace mma_tiles;
using namespace wgmma_backward;
#if LOOM_WGMMA_CODE
using namespace wgmma_tiles;
#endif

constexpr int kD = 128;                            // the head size this kernel takes
constexpr int kScoreTile = kGroupKeys * kQueries;  // a warpgroup's P^T or dS^T tile, elements

// kBuffers Q and dO tiles, K and V, each warpgroup's P^T and (twice) dS^T, lse2 and Di
// kBuffers times, and room to align the tiles to 1024 bytes. After the sweep the Q and dO
// tiles stage dK and K's tile dV, each (kKeys, kD + 8).
template <class T> constexpr size_t backward128_smem() {
  return size_t(2 * kBuffers * kQueries * kD + 2 * kKeys * kD + 3 * kGroups * kScoreTile) * sizeof(T) +
         2 * kBuffers * kQueries * sizeof(float) + 1024;
}
static_assert(kKeys * (kD + 8) <= 2 * kBuffers * kQueries * kD && kKeys * (kD + 8) <= 2 * kKeys * kD,
              "dK and dV are staged in the Q / dO tiles and in K and V's");

#if LOOM_WGMMA_CODE
// A thread's part of a warpgroup's dQ tile (its rows i and i + 8, kCols columns in
// accumulator layout) added into the accumulator rows, D floats apart, by float2 atomics.
template <int D, int kCols>
__device__ __forceinline__ void add_dq(float* dq_acc, const float (&dq)[kCols / 8][4], int i, int t) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
#pragma unroll
    for (int c = 0; c < kCols / 8; ++c)
      add_pair(dq_acc + int64_t(i + 8 * r) * D + c * 8 + 2 * t, dq[c][2 * r], dq[c][2 * r + 1]);
  }
}

// A warp's part of a (64 keys, 64 queries) accumulator into a swizzled tile as T: row = key
// (this thread's g and g + 8 of its warp's 16), column = query; chunk nb of a row sits at
// chunk nb ^ (row % 8), the same for both rows.
template <class T>
__device__ __forceinline__ void store_scores(T* tile, const float (&acc)[kQueries / 8][4], int warp, int g, int t) {
  const int r = warp * 16 + g;
#pragma unroll
  for (int nb = 0; nb < kQueries / 8; ++nb) {
    T* at = tile + r * 64 + (nb ^ (r % 8)) * 8 + 2 * t;
    *reinterpret_cast<uint32_t*>(at) = pack2<T>(acc[nb][0], acc[nb][1]);
    *reinterpret_cast<uint32_t*>(at + 8 * 64) = pack2<T>(acc[nb][2], acc[nb][3]);
  }
}
#endif

template <class T> __global__ void __launch_bounds__(kBlockThreads, 1) wgmma_dkdv_dq128_kernel(const Params p) {
#if LOOM_WGMMA_CODE
  constexpr int D = kD, S = D + 8, NB = kQueries / 8, kTile = kQueries * D;
  extern __shared__ __align__(128) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem + (-smem_addr(smem) & 1023u));  // kBuffers swizzled tiles; dK on the way out
  T* sO = sQ + kBuffers * kTile;                                     // dO: kBuffers swizzled tiles
  T* sK = sO + kBuffers * kTile;                                     // (kKeys, D) swizzled; dV on the way out
  T* sV = sK + kKeys * D;                                            // (kKeys, D) swizzled
  T* sP = sV + kKeys * D;                                            // P^T of each warpgroup, swizzled
  T* sS = sP + kGroups * kScoreTile;                                 // dS^T of each warpgroup, swizzled, twice
  float* sL = reinterpret_cast<float*>(sS + 2 * kGroups * kScoreTile);  // lse2: kBuffers x kQueries
  float* sD = sL + kBuffers * kQueries;                                 // Di: kBuffers x kQueries
  const int group = int(threadIdx.x / kThreads), tid = int(threadIdx.x % kThreads);

  const int warp = tid / 32, lane = lane_id(), g = lane >> 2, t = lane & 3;
  const GridPlace place = grouped_block(p, (p.kv_len + kKeys - 1) / kKeys);
  const int64_t bh = place.bh;
  const int k0 = place.index * kKeys;
  const int kg = k0 + group * kGroupKeys;  // this warpgroup's first key
  const int w0 = kg + warp * 16;           // this warp's first key; a thread's: w0 + g and w0 + g + 8
  const AttentionLayout& st = p.strides;
  const HeadOperands<T> in(p, bh, true);
  float* dq_acc = p.dq_acc + bh * p.q_pad * D + group * 64;
  const float scale_log2 = float(p.scale_log2);
  const int it_begin = p.causal ? k0 / kQueries : 0, it_end = (p.q_len + kQueries - 1) / kQueries;

  // Query tile `it` into buffer `buf`: Q and its lse2 rows by the first warpgroup, dO and its
  // Di rows by the second (in bounds: padded).
  auto load_query_tile = [&](int buf, int it) {
    const int i0 = it * kQueries;
    constexpr int kChunks = kQueries / 4;  // 16-byte chunks of a tile's lse2 (or Di)
    if (group == 0) {
      load_swizzled<D>(sQ + buf * kTile, in.q, int(st.q.seq), i0, p.q_len, tid);
      if (tid < kChunks) cp_async_16(sL + buf * kQueries + 4 * tid, in.lse2 + i0 + 4 * tid, true);
    } else {
      load_swizzled<D>(sO + buf * kTile, in.dout, int(st.dout.seq), i0, p.q_len, tid);
      if (tid < kChunks) cp_async_16(sD + buf * kQueries + 4 * tid, in.di + i0 + 4 * tid, true);
    }
  };

  load_swizzled<D, T, kKeys>(sK, in.k, int(st.k.seq), kg, p.kv_len, tid, group * kGroupKeys);
  load_swizzled<D, T, kKeys>(sV, in.v, int(st.v.seq), kg, p.kv_len, tid, group * kGroupKeys);
  if (it_begin < it_end) load_query_tile(0, it_begin);
  if (it_begin + 1 < it_end) load_query_tile(1, it_begin + 1);
  cp_async_commit();
  cp_async_wait<0>();
  fence_async_shared();
  __syncthreads();

  // This warpgroup's K and V rows as the A of S^T and dP^T: 16 columns a step, block ks / 4.
  const T* kA = sK + group * kGroupKeys * 64;
  const T* vA = sV + group * kGroupKeys * 64;
  T* sPg = sP + group * kScoreTile;

  // S^T = K Q^T and dP^T = V dO^T of the tile in buffer `buf`, issued a tile ahead.
  float s[NB][4], dp[NB][4];
  auto issue_scores = [&](int buf) {
    wgmma_fence();
    times_transposed_ss<T, D, kKeys>(s, kA, sQ + buf * kTile);   // S^T = K Q^T
    times_transposed_ss<T, D, kKeys>(dp, vA, sO + buf * kTile);  // dP^T = V dO^T
    wgmma_commit();
  };
  if (it_begin < it_end) issue_scores(0);

  float dk[D / 8][4] = {}, dv[D / 8][4] = {};
  for (int it = it_begin; it < it_end; ++it) {
    const int n = it - it_begin, buf = n % kBuffers;
    const T* qt = sQ + buf * kTile;
    const T* ot = sO + buf * kTile;
    const float* lt = sL + buf * kQueries;
    const float* dt = sD + buf * kQueries;
    T* sSn = sS + (n & 1) * kGroups * kScoreTile;  // this tile's dS^T, both warpgroups'
    const int i0 = it * kQueries;
    wgmma_wait<0>();
    fence_registers(s);
    fence_registers(dp);

    // P^T and dS^T in place of S^T and dP^T, masked where a query of the tile may not see a
    // key of the warp's, or a key is past the end.
    const bool edge = (p.causal && i0 < w0 + 15) || kg + kGroupKeys > p.kv_len;
    backward_scores(s, dp, lt, dt, scale_log2, edge, i0, w0, g, t, p.kv_len, p.causal);
    store_scores(sPg, s, warp, g, t);
    store_scores(sSn + group * kScoreTile, dp, warp, g, t);
    cp_async_wait<0>();    // the next tile has landed, for this thread
    fence_async_shared();  // it and the stores, for wgmma's reads
    __syncthreads();       // both warpgroups': dQ reads all 128 keys; the tile before this one has
                           // been read by every product, so its buffer is free
    if (it + 2 < it_end) load_query_tile((n + 2) % kBuffers, it + 2);
    cp_async_commit();

    const uint64_t pg = descriptor(sPg, 16, 1024), od = descriptor(ot, kQueries * 128, 1024),
                   sg = descriptor(sSn + group * kScoreTile, 16, 1024), qd = descriptor(qt, kQueries * 128, 1024);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kQueries / 16; ++kk) {  // queries 16 kk..: 32 bytes on in P^T, 16 rows in dO
      wgmma_ss<T, 0, 1>(dv, advanced(pg, kk * 16 * sizeof(T)), advanced(od, kk * 16 * 64 * sizeof(T)), true);
      wgmma_ss<T, 0, 1>(dk, advanced(sg, kk * 16 * sizeof(T)), advanced(qd, kk * 16 * 64 * sizeof(T)), true);
    }
    wgmma_commit();
    // dQ's tile (queries x this warpgroup's 64 columns) = dS K over the block's keys: A = dS^T
    // read transposed (keys 16 kk..: 16 rows on, 128 bytes a row), B = K's block `group` read
    // transposed.
    float dq[8][4];
    const uint64_t ds = descriptor(sSn, kQueries * 128, 1024),
                   kd = descriptor(sK + group * kKeys * 64, kKeys * 128, 1024);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk)
      wgmma_ss<T, 1, 1>(dq, advanced(ds, (kk / 4 * kScoreTile + kk % 4 * 16 * 64) * sizeof(T)),
                        advanced(kd, kk * 16 * 64 * sizeof(T)), kk > 0);
    wgmma_commit();
    if (it + 1 < it_end) {  // the next tile's scores queue behind dQ's product
      issue_scores((n + 1) % kBuffers);
      wgmma_wait<1>();
    } else {
      wgmma_wait<0>();
    }
    fence_registers(dq);
    fence_registers(dk);
    fence_registers(dv);
    add_dq<D, 64>(dq_acc, dq, i0 + warp * 16 + g, t);
  }
  wgmma_wait<0>();  // every product is done; waited for here, ptxas injects no wait of its own
  cp_async_wait<0>();
  __syncthreads();  // every product is done: the Q / dO and K tiles stage dK and dV
  T* sdK = sQ + group * kGroupKeys * S;
  T* sdV = sK + group * kGroupKeys * S;
  stage_rows<D>(sdK, dk, warp * 16, float(p.scale), float(p.scale));
  stage_rows<D>(sdV, dv, warp * 16, 1.f, 1.f);
  __syncthreads();
  store_rows<D, kGroupKeys>(static_cast<T*>(p.dk) + p.offset(st.dk, bh), int(st.dk.seq), sdK, kg, p.kv_len, tid);
  store_rows<D, kGroupKeys>(static_cast<T*>(p.dv) + p.offset(st.dv, bh), int(st.dv.seq), sdV, kg, p.kv_len, tid);
  sum_group_rows<D>(p, bh, kg, sdK, sdV, tid);
#endif
}

}  // namespace

void wgmma_dkdv_dq128(const Params& p, DType dtype, cudaStream_t stream) {
  constexpr const char* what = "Hopper backward (head_dim 128)";
  if (dtype == DType::bf16)
    launch_blocks(wgmma_dkdv_dq128_kernel<__nv_bfloat16>, backward128_smem<__nv_bfloat16>(), what, p, stream);
  else
    launch_blocks(wgmma_dkdv_dq128_kernel<__half>, backward128_smem<__half>(), what, p, stream);
}

}  // namespace loom::cuda::attention
