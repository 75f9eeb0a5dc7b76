// Flash attention backward on Hopper's warpgroup products (wgmma), for H100 and H200 (sm_90a):
// dK, dV and dQ at head_dim 64, bf16/f16, with dQ summed in f32 into the workspace's
// accumulator by bulk reductions, in any order (the default, as attention_mma_backward.cu's
// atomics; AttentionArgs::deterministic keeps that file's kernels). The row preparation
// before it (lse2, Di) and dQ's conversion after it are attention_mma_backward.cu's.
//
// A block is two warpgroups and takes 128 keys: warpgroup w keys 64 w to 64 w + 63, warp v
// of it 16 v to 16 v + 15 of those. Each keeps its K and V rows as A fragments in registers,
// and both sweep the 64-query tiles that can see the block's keys, Q and dO in three of
// wgmma's swizzled tiles (attention_wgmma.cu describes them): the tile in use, the next one,
// landed, and the one after it, loading (the first warpgroup loads Q and lse2, the second dO
// and Di). Per query tile, five products of each warpgroup:
//   S^T = K Q^T and dP^T = V dO^T, issued together (B: the Q and dO tiles, K-major);
//   P^T = exp2(S^T scale - lse2), dS^T = P^T (dP^T - Di), in registers;
//   dV += P^T dO and dK += dS^T Q (A: P^T and dS^T repacked from the accumulators; B: the
//   dO and Q tiles again, read transposed);
//   dQ's columns 32 w to 32 w + 31 of the tile = dS K over all 128 keys, with both
//   warpgroups' dS^T staged in shared memory as swizzled tiles (two buffers of them) that
//   wgmma reads transposed as its A, and that half of the block's K rows as B, a tile in the
//   64-byte swizzle (32 columns are 64 bytes a row; 16-byte chunk c of row r sits at chunk
//   c ^ (r / 2 % 4)).
// The next tile's S^T and dP^T are issued right behind dQ's product, so they run while the
// warpgroup waits for dQ and stages its half in a (64 queries, 64) f32 tile in shared memory
// (two buffers). After the next tile's barrier one thread adds the whole tile into the
// accumulator's rows, which are contiguous, by one asynchronous bulk reduction
// (cp.reduce.async.bulk .add.f32, done by the memory system), in place of a float2 atomic
// per thread for every 2 x 8 of the tile; before the barrier after that it waits until the
// reduction has read its buffer. Rows past q_len add zeros (Q and dO rows there are loaded
// as zeros and lse2 is +inf, so P and dS are 0) into the workspace's padding (q_pad, a
// multiple of 128, covers every tile), which dQ's conversion never reads: no test per row.
// One barrier a tile, between the dS^T stores and dQ: by then the next tile has landed
// (waited for before it) and both warpgroups have waited for every product of the tile
// before, whose buffers are refilled after it. The blocks run in groups of heads
// (attention.cuh's grouped_block), so the accumulator rows the reductions add into stay in
// L2.
#include "kernels/config.h"
#include "kernels/cuda/attention_wgmma_backward.cuh"

namespace loom::cuda::attention {
namespace {

using namespace mma_tiles;
using namespace wgmma_backward;
#if LOOM_WGMMA_CODE
using namespace wgmma_tiles;
#endif

constexpr int kD = 64;  // the head size this kernel takes

// Swizzled tiles (kBuffers Q and dO, each warpgroup's dS^T twice, and the two 32-column halves
// of K), padded K and V rows, lse2 and Di kBuffers times, dQ's f32 tile twice, and room to
// align the tiles to 1024 bytes.
template <class T> constexpr size_t backward_smem() {
  return size_t((2 * kBuffers + 2 * kGroups) * kBlockN * kD + kKeys * kD + 2 * kKeys * (kD + 8)) * sizeof(T) +
         (2 * kBuffers * kQueries + 2 * kQueries * kD) * sizeof(float) + 1024;
}

#if LOOM_WGMMA_CODE
constexpr int kHalf = kD / 2;  // dQ's columns of a warpgroup

// bytes of f32 at src (shared) added into dst (global) by one asynchronous bulk reduction,
// committed as a bulk group of its own.
__device__ __forceinline__ void bulk_add(float* dst, const float* src, int bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
               "cp.async.bulk.commit_group;\n" ::"l"(dst), "r"(smem_addr(src)), "r"(bytes)
               : "memory");
}
// Waits until at most N bulk groups are pending: their sources read (bulk_wait_read), or
// their writes done too (bulk_wait).
template <int N> __device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
template <int N> __device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}

// A thread's part of a warpgroup's dQ tile (rows r and r + 8, columns col + 8 c) into a
// (kQueries, kD) f32 tile. The tile's rows are 256 bytes, so the 8 rows a store of a warp
// reaches would share their banks: store k writes chunk c = (k + r) % 4 of the thread's
// four, which spreads each store over two rows a bank.
__device__ __forceinline__ void stage_dq(float* tile, const float (&dq)[kHalf / 8][4], int r, int col) {
  static_assert(kHalf / 8 == 4, "four column chunks rotate");
  auto pick = [&](int c, int e) { return c == 0 ? dq[0][e] : c == 1 ? dq[1][e] : c == 2 ? dq[2][e] : dq[3][e]; };
#pragma unroll
  for (int k = 0; k < kHalf / 8; ++k) {
    const int c = (k + r) & 3;
    *reinterpret_cast<float2*>(tile + r * kD + col + 8 * c) = make_float2(pick(c, 0), pick(c, 1));
    *reinterpret_cast<float2*>(tile + (r + 8) * kD + col + 8 * c) = make_float2(pick(c, 2), pick(c, 3));
  }
}

// Rows [row0, row0 + kGroupKeys) of a (len, kD) matrix, rows ld apart, into rows first_row..
// of the two 32-column halves of a 64-byte-swizzled (kKeys, kD) tile, by cp.async; rows at
// or past len are zeros. `thread`: this thread's index among a warpgroup's.
template <class T>
__device__ __forceinline__ void load_halves(T* dst, const T* src, int ld, int row0, int len, int first_row,
                                            int thread) {
  constexpr int kChunks = kD / 8;  // 16-byte chunks of a row
  const T* rows = src + int64_t(row0) * ld;
#pragma unroll
  for (int it = 0; it < kGroupKeys * kChunks / kThreads; ++it) {
    const int c = it * kThreads + thread, chunk = c % kChunks, r = c / kChunks;
    const int row = first_row + r, half = chunk / 4;
    const bool valid = row0 + r < len;
    cp_async_16(dst + half * kKeys * kHalf + row * kHalf + ((chunk % 4) ^ (row / 2 % 4)) * 8,
                valid ? rows + (r * ld + chunk * 8) : src, valid);
  }
}
#endif

template <class T> __global__ void __launch_bounds__(kBlockThreads, 1) wgmma_dkdv_dq_kernel(const Params p) {
#if LOOM_WGMMA_CODE
  constexpr int D = kD, S = D + 8, NB = kQueries / 8, kTile = kBlockN * D;
  extern __shared__ __align__(128) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem + (-smem_addr(smem) & 1023u));  // kBuffers swizzled tiles
  T* sO = sQ + kBuffers * kTile;                                     // dO: kBuffers swizzled tiles
  const int group = int(threadIdx.x / kThreads), tid = int(threadIdx.x % kThreads);
  T* sS = sO + kBuffers * kTile;                                     // dS^T of each warpgroup, twice: dQ's A
  T* sKh = sS + 2 * kGroups * kTile;                                 // K's two column halves: dQ's B
  T* sK = sKh + kKeys * D;                                           // K rows, padded; dK on the way out
  T* sV = sK + kKeys * S;                                            // V rows, padded; dV on the way out
  float* sL = reinterpret_cast<float*>(sV + kKeys * S);              // lse2: kBuffers x kQueries
  float* sD = sL + kBuffers * kQueries;                              // Di: kBuffers x kQueries
  float* sDq = sD + kBuffers * kQueries;                             // dQ's (kQueries, D) tile, twice
  auto dq_tile = [&](int n) { return sDq + (n & 1) * kQueries * D; };  // query tile n's (of the sweep)

  const int warp = tid / 32, lane = lane_id(), g = lane >> 2, t = lane & 3;
  const GridPlace place = grouped_block(p, (p.kv_len + kKeys - 1) / kKeys);
  const int64_t bh = place.bh;
  const int k0 = place.index * kKeys;  // a group's key blocks ascending: causal's longest sweeps first
  const int kg = k0 + group * kGroupKeys;            // this warpgroup's first key
  const int w0 = kg + warp * 16;                     // this warp's first key; a thread's: w0 + g and w0 + g + 8
  const AttentionLayout& st = p.strides;
  const HeadOperands<T> in(p, bh, true);
  float* dq_acc = p.dq_acc + bh * p.q_pad * D;
  const float scale_log2 = float(p.scale_log2);
  const int it_begin = p.causal ? k0 / kQueries : 0, it_end = (p.q_len + kQueries - 1) / kQueries;
  // Query tile n's dQ (n of the sweep, from it_begin), staged by both warpgroups, added into
  // the accumulator by one bulk reduction (one thread's).
  auto add_dq_tile = [&](int n) {
    bulk_add(dq_acc + int64_t((it_begin + n) * kQueries) * D, dq_tile(n), kQueries * D * 4);
  };

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

  T* sKg = sK + group * kGroupKeys * S;  // this warpgroup's rows
  T* sVg = sV + group * kGroupKeys * S;
  load_rows<D, kGroupKeys, false>(sKg, in.k, int(st.k.seq), kg, p.kv_len, tid);
  load_rows<D, kGroupKeys, false>(sVg, in.v, int(st.v.seq), kg, p.kv_len, tid);
  load_halves(sKh, in.k, int(st.k.seq), kg, p.kv_len, group * kGroupKeys, tid);
  if (it_begin < it_end) load_query_tile(0, it_begin);
  if (it_begin + 1 < it_end) load_query_tile(1, it_begin + 1);
  cp_async_commit();
  cp_async_wait<0>();
  fence_async_shared();
  __syncthreads();
  uint32_t kf[D / 16][4], vf[D / 16][4];
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    load_a<S>(kf[ks], sKg, warp * 16, ks * 16);
    load_a<S>(vf[ks], sVg, warp * 16, ks * 16);
  }

  // S^T = K Q^T and dP^T = V dO^T of the tile in use, issued a tile ahead (B: the Q and dO
  // tiles, K-major).
  float s[NB][4], dp[NB][4];
  auto issue_scores = [&](int buf) {
    issue_times_transposed<T, D>(s, kf, sQ + buf * kTile);
    issue_times_transposed<T, D>(dp, vf, sO + buf * kTile);
  };
  if (it_begin < it_end) issue_scores(0);

  float dk[D / 8][4] = {}, dv[D / 8][4] = {};
  for (int it = it_begin; it < it_end; ++it) {
    const int n = it - it_begin, buf = n % kBuffers;
    const T* qt = sQ + buf * kTile;
    const T* ot = sO + buf * kTile;
    const float* lt = sL + buf * kQueries;
    const float* dt = sD + buf * kQueries;
    T* sSn = sS + (n & 1) * kGroups * kTile;  // this tile's dS^T, both warpgroups'
    const int i0 = it * kQueries;
    wgmma_wait<0>();
    fence_registers(s);
    fence_registers(dp);

    // P^T and dS^T in place of S^T and dP^T, masked where a query of the tile may not see a
    // key of the warp's, or a key is past the end.
    const bool edge = (p.causal && i0 < w0 + 15) || kg + kGroupKeys > p.kv_len;
    backward_scores(s, dp, lt, dt, scale_log2, edge, i0, w0, g, t, p.kv_len, p.causal);
    uint32_t pa[NB / 2][4], da[NB / 2][4];
#pragma unroll
    for (int kk = 0; kk < NB / 2; ++kk) {
      acc_to_a<T>(pa[kk], s[2 * kk], s[2 * kk + 1]);
      acc_to_a<T>(da[kk], dp[2 * kk], dp[2 * kk + 1]);
    }
    // dS^T into its swizzled tile: row = key (this thread's g and g + 8 of its warp's 16),
    // column = query; chunk nb of a row sits at chunk nb ^ (row % 8), the same for both rows.
    {
      T* sSg = sSn + group * kTile;
      const int r = warp * 16 + g;
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) {
        T* at = sSg + r * 64 + (nb ^ (r % 8)) * 8 + 2 * t;
        *reinterpret_cast<uint32_t*>(at) = da[nb / 2][(nb & 1) * 2];
        *reinterpret_cast<uint32_t*>(at + 8 * 64) = da[nb / 2][(nb & 1) * 2 + 1];
      }
    }
    issue_times<T, D>(dv, pa, ot);  // dV += P^T dO
    issue_times<T, D>(dk, da, qt);  // dK += dS^T Q
    cp_async_wait<0>();             // the next tile has landed, for this thread
    if (threadIdx.x == 0) bulk_wait_read<0>();  // the last dQ tile added has been read from its buffer
    fence_async_shared();           // it, the dS^T stores and the staged dQ tile, for wgmma's and
                                    // the bulk add's reads
    __syncthreads();                // both warpgroups': dQ reads all 128 keys; the tile before this
                                    // one has been read by every product, so its buffer is free
    if (it + 2 < it_end) load_query_tile((n + 2) % kBuffers, it + 2);
    cp_async_commit();
    if (threadIdx.x == 0 && it > it_begin)  // the tile before's dQ, staged by both warpgroups
      add_dq_tile(n - 1);

    // dQ's tile (queries x this warpgroup's 32 columns) = dS K over the block's keys: A =
    // dS^T read transposed, B = K's half read transposed.
    float dq[kHalf / 8][4];
    const uint64_t ds = descriptor(sSn, kBlockN * 128, 1024),
                   kh = descriptor(sKh + group * kKeys * kHalf, kKeys * 64, 512, kSwizzle64);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk)  // keys 16 kk.. : 16 rows on, 128 bytes a row in dS^T, 64 in K
      wgmma_ss<T, 1, 1>(dq, advanced(ds, (kk / 4 * kTile + kk % 4 * 16 * 64) * sizeof(T)),
                        advanced(kh, kk * 16 * kHalf * sizeof(T)), kk > 0);
    wgmma_commit();
    if (it + 1 < it_end) {  // the next tile's scores queue behind dQ's product
      issue_scores((n + 1) % kBuffers);
      wgmma_wait<2>();
    } else {
      wgmma_wait<0>();
    }
    fence_registers(dq);
    fence_registers(dk);
    fence_registers(dv);
    stage_dq(dq_tile(n), dq, warp * 16 + g, group * kHalf + 2 * t);
  }
  wgmma_wait<0>();  // every product is done; waited for here, ptxas injects no wait of its own
  cp_async_wait<0>();
  fence_async_shared();  // the last dQ tile, for the bulk add
  __syncthreads();
  if (threadIdx.x == 0 && it_begin < it_end) {
    add_dq_tile(it_end - 1 - it_begin);
    bulk_wait<0>();
  }
  stage_rows<D>(sKg, dk, warp * 16, float(p.scale), float(p.scale));
  stage_rows<D>(sVg, dv, warp * 16, 1.f, 1.f);
  __syncthreads();
  store_rows<D, kGroupKeys, false>(static_cast<T*>(p.dk) + p.offset(st.dk, bh), int(st.dk.seq), sKg, kg, p.kv_len, tid);
  store_rows<D, kGroupKeys, false>(static_cast<T*>(p.dv) + p.offset(st.dv, bh), int(st.dv.seq), sVg, kg, p.kv_len, tid);
  sum_group_rows<D>(p, bh, kg, sKg, sVg, tid);
#endif
}

}  // namespace

bool wgmma_backward_supported(DType dtype, int64_t head_dim) {
  return (head_dim == kD || head_dim == 128) && wgmma_supported(dtype, head_dim);
}

void wgmma_dkdv_dq(const Params& p, DType dtype, cudaStream_t stream) {
  if (p.head_dim == 128) return wgmma_dkdv_dq128(p, dtype, stream);
  if (dtype == DType::bf16)
    launch_blocks(wgmma_dkdv_dq_kernel<__nv_bfloat16>, backward_smem<__nv_bfloat16>(), "Hopper backward", p, stream);
  else
    launch_blocks(wgmma_dkdv_dq_kernel<__half>, backward_smem<__half>(), "Hopper backward", p, stream);
}

}  // namespace loom::cuda::attention
