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

// With p.sum_partials, the column sums of a warpgroup's dK and dV rows as staged for their
// stores (keys kg.. of head bh, rows D + 8 elements apart in shared memory) into key tile
// kg / kSumRows's partials: a thread a column, summed down the rows in order. `thread`: its
// index in the warpgroup.
static_assert(kGroupKeys == kSumRows, "a warpgroup's keys are one tile of the partial sums");
template <int D, class T>
__device__ __forceinline__ void sum_group_rows(const Params& p, int64_t bh, int kg, const T* sdk, const T* sdv,
                                               int thread) {
  const int rows = min(kGroupKeys, p.kv_len - kg);
  if (!p.sum_partials || rows <= 0) return;
  for (int c = thread; c < 2 * D; c += kThreads) {
    const T* column = (c < D ? sdk : sdv) + c % D;
    float sum = 0;
    for (int r = 0; r < rows; ++r) sum += to_acc(column[r * (D + 8)]);
    sum_partial<float>(p, bh, kg / kSumRows, c < D ? 1 : 2)[c % D] = sum;
  }
}

}  // namespace loom::cuda::attention::wgmma_backward
