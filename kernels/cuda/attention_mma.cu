// Flash attention on tensor cores, forward: bf16/f16 inputs, f32 accumulation, head_dim D in
// {32, 64, 80, 96, 128}, for sm_80 and later (on an H100 or H200 at head_dim 64 and 128,
// attention_wgmma.cu's kernel runs in its place, and the tests hold it against this one).
//
// The FlashAttention-2 scheme with warp-level mma.sync.m16n8k16 (what runs on every target),
// in the blocks of attention_mma_tiles.cuh. A block takes 64 query rows (16 a warp), loads
// its Q tile once (fragments then live in registers) and streams 64-key K/V tiles through
// double-buffered shared memory with cp.async. S = Q K^T comes out in mma accumulators; an
// online softmax (running max m and sum l per row, in exp2 form) rescales O; P is repacked
// from the S accumulators straight into A fragments of O += P V, never touching shared
// memory. The loop is software-pipelined: the products of the next tile's scores go beside
// this tile's softmax. Causal blocks stop at the diagonal tile, and the grid runs the longest
// (last) query tiles first. The backward is attention_mma_backward.cu.
#include "kernels/cuda/attention_mma_tiles.cuh"

namespace loom::cuda::attention {
namespace {

using namespace mma_tiles;

// ---- forward ---------------------------------------------------------------------------

// A forward block's query rows: one row tile of 16 a warp, as many rows as a key tile has
// keys. A causal block's last key tile then starts at its first row (a multiple of 64), so
// every warp sees a key of every tile the block streams and none skips one.
constexpr int kForwardRows = block_rows(1);
static_assert(kForwardRows == kBlockN, "causal forward blocks rely on every warp seeing every key tile");

// Blocks an SM should hold: at head_dim <= 64 the registers are capped at 128 a thread so
// that four fit (an H200 at GPT-2's shape: 0.150 ms against 0.184 ms with three, whose 138
// registers the compiler takes uncapped); larger head sizes would spill under that cap.
constexpr int forward_min_blocks(int D) { return D <= 64 ? 4 : 1; }

template <class T, int D> constexpr size_t forward_smem() {
  return size_t(kForwardRows + 4 * kBlockN) * (D + 8) * sizeof(T);
}

// S (16 rows x kBlockN keys, zeroed by the caller) += this warp's Q rows times key tile kt.
template <int D, class T>
__device__ __forceinline__ void scores_from_q(float (&s)[kBlockN / 8][4], const uint32_t (&qf)[D / 16][4],
                                              const T* kt) {
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks)
#pragma unroll
    for (int np = 0; np < kBlockN / 16; ++np) {
      uint32_t b[4];
      load_b_nk<D + 8>(b, kt, np * 16, ks * 16);
      mma<T>(s[2 * np], qf[ks], b[0], b[1]);
      mma<T>(s[2 * np + 1], qf[ks], b[2], b[3]);
    }
}

// Software-pipelined over key tiles: step n computes the scores of tile n + 1 while it
// takes the softmax of tile n's and adds P V(n), so a warp's tensor-core products and its
// exponentials are independent work the scheduler can interleave. K is loaded one tile
// ahead of V to match: step n reads K(n + 1) and V(n) while K(n + 2) and V(n + 1) land.
// The last step, which has no next tile, is a branch of its own (repeating its two calls)
// so that every other step stays one straight run of code for the scheduler to interleave.
template <class T, int D, int MinBlocks>
__global__ void __launch_bounds__(kThreads, MinBlocks) forward_kernel(const Params p) {
  constexpr int S = D + 8, NB = kBlockN / 8, BM = kForwardRows;
  extern __shared__ __align__(16) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);  // (BM, S); O on the way out
  T* sK = sQ + BM * S;                 // 2 x (kBlockN, S)
  T* sV = sK + 2 * kBlockN * S;        // 2 x (kBlockN, S)

  const int warp = int(threadIdx.x / 32), lane = lane_id(), g = lane >> 2;
  const int64_t bh = blockIdx.x % p.heads;
  const int q0 = query_tile_start<BM>(p), n_tiles = key_tiles<BM>(p, q0);
  const AttentionLayout& st = p.strides;
  const HeadOperands<T> in(p, bh, false);
  const float scale_log2 = float(p.scale_log2);
  const int r0 = q0 + warp * 16;  // this warp's first row; a thread's rows: r0 + g and r0 + g + 8
  auto load_k = [&](int n) {
    load_rows<D, kBlockN>(sK + (n & 1) * kBlockN * S, in.k, int(st.k.seq), n * kBlockN, p.kv_len);
  };
  auto load_v = [&](int n) {
    load_rows<D, kBlockN>(sV + (n & 1) * kBlockN * S, in.v, int(st.v.seq), n * kBlockN, p.kv_len);
  };
  // Tile j0's scores need masking where keys run past kv_len or past a causal row.
  auto edge = [&](int j0) { return j0 + kBlockN > p.kv_len || (p.causal && j0 + kBlockN - 1 > r0); };

  forward_prologue(
      n_tiles, [&] { load_rows<D, BM>(sQ, in.q, int(st.q.seq), q0, p.q_len); }, load_k, load_v);

  uint32_t qf[D / 16][4];
  float o[1][D / 8][4] = {}, s[1][NB][4] = {};  // mma_acc_rows's shapes: one row tile
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  cp_async_wait<1>();
  __syncthreads();
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) load_a<S>(qf[ks], sQ, warp * 16, ks * 16);
  if (n_tiles > 0) scores_from_q<D>(s[0], qf, sK);
  __syncthreads();  // every warp has read K(0) before step 0 refills its buffer with K(2)

  for (int n = 0; n < n_tiles; ++n) {
    if (n + 1 < n_tiles) load_v(n + 1);
    if (n + 2 < n_tiles) load_k(n + 2);
    cp_async_commit();
    cp_async_wait<1>();  // V(n) and K(n + 1) have landed, for this thread
    __syncthreads();     // and for the block
    const T* vt = sV + (n & 1) * kBlockN * S;
    const int j0 = n * kBlockN;
    if (n + 1 < n_tiles) {
      float next[NB][4] = {};
      scores_from_q<D>(next, qf, sK + ((n + 1) & 1) * kBlockN * S);
      online_softmax<D>(s[0], o[0], m, l, scale_log2, edge(j0), r0 + g, j0, p);
      mma_acc_rows<D>(o, s, vt);
#pragma unroll
      for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[0][nb][e] = next[nb][e];
    } else {
      online_softmax<D>(s[0], o[0], m, l, scale_log2, edge(j0), r0 + g, j0, p);
      mma_acc_rows<D>(o, s, vt);
    }
    __syncthreads();  // every warp is done with V(n) and K(n + 1) before step n + 1 refills them
  }
  cp_async_wait<0>();
  __syncthreads();
  finish_forward<D, BM, T>(p, o[0], m, l, sQ, bh, q0);
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
    launch(forward_kernel<T, D, forward_min_blocks(D)>, p.heads * tiles(p.q_len, kForwardRows), forward_smem<T, D>(),
           "forward", p, stream);
  });
}

}  // namespace loom::cuda::attention
