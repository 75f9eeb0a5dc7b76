// Flash attention forward on Hopper's warpgroup products (wgmma), for H100 and H200 (sm_90a):
// bf16/f16 inputs, f32 accumulation, head_dim 64 or 128. The other head sizes, other GPUs
// and builds without 90 in cuda-arch run attention_mma.cu's kernel, which is also the
// reference the tests hold this one against (AttentionCuda.*, with Options::hopper_attention
// off and on).
//
// The scheme is attention_mma.cu's, block for block: 64 query rows a block, 64-key K/V tiles
// streamed through double-buffered shared memory by cp.async, the online softmax in exp2 form
// on the score accumulators, P repacked from them into A fragments. What changes is the
// products: a block is one warpgroup (4 warps), and each product is a few wgmma instructions
// of the whole warpgroup, 64 rows at once, that read their operands from shared memory
// themselves (Q and K for S = Q K^T, V for O += P V, P from registers), where the mma.sync
// kernel loads every fragment into registers with ldmatrix, one warp at a time.
// wgmma's accumulators and register A operands have mma.sync.m16n8k16's layouts warp by
// warp (warp w holds rows 16 w to 16 w + 15), so the softmax, the masking and the epilogue
// are attention_mma_tiles.cuh's. The products are asynchronous: step n issues the scores of
// tile n + 1, takes the softmax of tile n's while the tensor cores work, then issues P V(n)
// and waits for both. The grid runs in groups of heads (kernels/core/head_groups.h), where
// attention_mma.cu's runs the heads fastest.
//
// Shared memory for wgmma. K and V tiles are stored in wgmma's 128-byte swizzle (plain 8 x 8
// core matrices, which wgmma also reads, made this kernel slower than the sm_80 one, whose
// padded rows ldmatrix reads without bank conflicts): a tile of D columns is D / 64 blocks of
// 64 columns (128 bytes a row), each block kBlockN rows of 128 bytes, and the 16-byte chunk c
// of row r sits at chunk c ^ (r % 8) of its row (blocks start 1024-byte aligned, as the
// swizzle needs). The same bytes serve both products: K as the B of Q K^T (K-major: the
// product's k runs along a row; the next 16 columns are 32 bytes on inside a block, 8 rows
// are 1024 bytes) and V as the B of P V (MN-major, read transposed: 8 keys are 1024 bytes,
// the next 64 columns the next block). cp.async writes each row from 8 neighbouring threads.
// Q is a swizzled tile too, read K-major as the A of S = Q K^T: held in shared memory rather
// than as A fragments in registers, it leaves a thread 12 more registers at head_dim 64 and
// 19 at 128. Its space is sized for attention_mma_tiles.cuh's padded rows, in which O is
// staged on the way out.
#include "kernels/config.h"
#include "kernels/cuda/attention_wgmma.cuh"

namespace loom::cuda::attention {
namespace {

using namespace mma_tiles;
#if LOOM_WGMMA_CODE
using namespace wgmma_tiles;
#endif

constexpr int kRows = 64;  // query rows of a block: one warpgroup's product
static_assert(kThreads == 128 && kRows == kBlockN, "a block is one warpgroup; causal blocks end on a whole key tile");

// Two K and two V tiles, Q's (sized for O's padded rows on the way out), and room to align
// the tiles to 1024 bytes.
template <class T, int D> constexpr size_t wgmma_smem() {
  return size_t(4 * kBlockN * D + kRows * (D + 8)) * sizeof(T) + 1024;
}

// ---- forward ---------------------------------------------------------------------------

template <class T, int D> __global__ void __launch_bounds__(kThreads) wgmma_forward_kernel(const Params p) {
#if LOOM_WGMMA_CODE
  constexpr int NB = kBlockN / 8, kTile = kBlockN * D;
  extern __shared__ __align__(128) unsigned char smem[];
  T* sK = reinterpret_cast<T*>(smem + (-smem_addr(smem) & 1023u));  // 2 swizzled tiles, 1024-byte aligned
  T* sV = sK + 2 * kTile;                                            // 2 swizzled tiles
  T* sQ = sV + 2 * kTile;                                            // swizzled; O in padded rows on the way out

  const int warp = int(threadIdx.x / 32), lane = lane_id(), g = lane >> 2;
  const int q_tiles = (p.q_len + kRows - 1) / kRows;
  const GridPlace place = grouped_block(p, q_tiles);  // causal: a group's last (longest) query tiles first
  const int64_t bh = place.bh;
  const int q0 = (p.causal ? q_tiles - 1 - place.index : place.index) * kRows, n_tiles = key_tiles<kRows>(p, q0);
  const AttentionLayout& st = p.strides;
  const HeadOperands<T> in(p, bh, false);
  const float scale_log2 = float(p.scale_log2);
  const int r0 = q0 + warp * 16;  // this warp's first row; a thread's rows: r0 + g and r0 + g + 8
  auto load_k = [&](int n) { load_swizzled<D>(sK + (n & 1) * kTile, in.k, int(st.k.seq), n * kBlockN, p.kv_len); };
  auto load_v = [&](int n) { load_swizzled<D>(sV + (n & 1) * kTile, in.v, int(st.v.seq), n * kBlockN, p.kv_len); };
  auto edge = [&](int j0) { return j0 + kBlockN > p.kv_len || (p.causal && j0 + kBlockN - 1 > r0); };

  forward_prologue(
      n_tiles, [&] { load_swizzled<D>(sQ, in.q, int(st.q.seq), q0, p.q_len); }, load_k, load_v);

  float o[D / 8][4] = {}, s[NB][4];
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  cp_async_wait<1>();
  fence_async_shared();
  __syncthreads();
  if (n_tiles > 0) {
    issue_times_transposed<T, D>(s, sQ, sK);
    wgmma_wait<0>();
    fence_registers(s);
  }
  __syncthreads();  // K(0) has been read before step 0 refills its buffer with K(2)

  // Key tile n, its scores in `cur`: the next tile's scores issued into `nxt` first. Two
  // steps a turn of the loop, the arrays trading roles, so no scores are copied between them.
  float next[NB][4];
  auto step = [&](int n, float (&cur)[NB][4], float (&nxt)[NB][4]) {
    if (n + 1 < n_tiles) load_v(n + 1);
    if (n + 2 < n_tiles) load_k(n + 2);
    cp_async_commit();
    cp_async_wait<1>();  // V(n) and K(n + 1) have landed, for this thread
    fence_async_shared();
    __syncthreads();     // and for the block
    const bool more = n + 1 < n_tiles;
    if (more) issue_times_transposed<T, D>(nxt, sQ, sK + ((n + 1) & 1) * kTile);
    const int j0 = n * kBlockN;
    online_softmax<D, true>(cur, o, m, l, scale_log2, edge(j0), r0 + g, j0, p);
    uint32_t pa[NB / 2][4];
#pragma unroll
    for (int kk = 0; kk < NB / 2; ++kk) acc_to_a<T>(pa[kk], cur[2 * kk], cur[2 * kk + 1]);
    issue_times<T, D>(o, pa, sV + (n & 1) * kTile);
    wgmma_wait<0>();
    fence_registers(o);
    if (more) fence_registers(nxt);
    __syncthreads();  // V(n) and K(n + 1) have been read before step n + 1 refills their buffers
  };
  int n = 0;
  for (; n + 1 < n_tiles; n += 2) {
    step(n, s, next);
    step(n + 1, next, s);
  }
  if (n < n_tiles) step(n, s, next);
  cp_async_wait<0>();
  __syncthreads();
  finish_forward<D, kRows, T>(p, o, m, l, sQ, bh, q0);
#endif
}

}  // namespace

bool wgmma_supported(DType dtype, int64_t head_dim) {
  if (!LOOM_CUDA_SM90A || (dtype != DType::bf16 && dtype != DType::f16) || (head_dim != 64 && head_dim != 128))
    return false;
  return compute_capability() == 90;
}

void wgmma_forward(const Params& p, DType dtype, cudaStream_t stream) {
  dispatch(dtype, p.head_dim, [&](auto tag, auto dim) {
    using T = decltype(tag);
    constexpr int D = decltype(dim)::value;
    if constexpr (D == 64 || D == 128) {
      constexpr size_t smem = wgmma_smem<T, D>();
      allow_shared_memory(wgmma_forward_kernel<T, D>, smem, "Hopper forward");
      Params grouped = p;
      grouped.head_group = head_group(wgmma_forward_kernel<T, D>, kThreads, smem, p.heads, tiles(p.q_len, kRows));
      launch(wgmma_forward_kernel<T, D>, p.heads * tiles(p.q_len, kRows), smem, "Hopper forward", grouped, stream);
    } else
      LOOM_ASSERT(false, "attention: no Hopper kernel for head_dim ", D);
  });
}

}  // namespace loom::cuda::attention
