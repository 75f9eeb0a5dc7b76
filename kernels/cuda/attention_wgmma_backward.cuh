// What the Hopper attention backward kernels (attention_wgmma_backward.cu at head_dim 64,
// attention_wgmma_backward128.cu at 128) share: the block's shape and the launch. The
// kernels differ in where K, V, P^T and dS^T live and in how dQ is added up.
#pragma once

#include "kernels/cuda/attention_wgmma.cuh"

namespace loom::cuda::attention::wgmma_backward {

using namespace mma_tiles;

constexpr int kGroups = 2;                     // warpgroups of a block
constexpr int kGroupKeys = 64;                 // keys of a warpgroup: its rows
constexpr int kKeys = kGroups * kGroupKeys;    // keys of a block
constexpr int kBlockThreads = kGroups * kThreads;
constexpr int kQueries = kBlockN;              // queries of a streamed tile
constexpr int kBuffers = 3;                    // query tiles in flight: in use, landed, loading
static_assert(kThreads == 128 && kQueries == 64, "a warpgroup is 128 threads over 64-query tiles");

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
