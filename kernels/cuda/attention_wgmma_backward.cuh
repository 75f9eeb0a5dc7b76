// What the Hopper attention backward kernels (attention_wgmma_backward.cu at head_dim 64,
// attention_wgmma_backward128.cu at 128) share: the block's shape, dQ's atomics and the
// launch. The kernels differ in where K, V, P^T and dS^T live.
#pragma once

#include "kernels/cuda/attention_wgmma.cuh"

namespace loom::cuda::attention::wgmma_backward {

using namespace mma_tiles;

constexpr int kGroups = 2;                     // warpgroups of a block
constexpr int kGroupKeys = 64;                 // keys of a warpgroup: its rows
constexpr int kKeys = kGroups * kGroupKeys;    // keys of a block
constexpr int kBlockThreads = kGroups * kThreads;
constexpr int kQueries = kBlockN;              // queries of a streamed tile
static_assert(kThreads == 128 && kQueries == 64, "a warpgroup is 128 threads over 64-query tiles");

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
#endif

// A block per kKeys keys of each head, in groups of heads (attention.cuh's head_group).
template <class Kernel>
void launch_blocks(Kernel kernel, size_t smem, const char* what, const Params& p, cudaStream_t stream) {
  const int64_t blocks = p.heads * tiles(p.kv_len, kKeys);
  if (blocks == 0) return;
  LOOM_CHECK(blocks < (int64_t(1) << 31), "attention: ", blocks, " thread blocks exceed CUDA's grid limit; ",
             "split the batch");
  allow_shared_memory(kernel, smem, what);
  Params grouped = p;
  grouped.head_group = head_group(kernel, kBlockThreads, smem, p.heads, tiles(p.kv_len, kKeys));
  kernel<<<unsigned(blocks), kBlockThreads, smem, stream>>>(grouped);
  LOOM_CUDA_LAUNCH();
}

}  // namespace loom::cuda::attention::wgmma_backward
