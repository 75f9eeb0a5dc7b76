// What the two halves of the CUDA attention share: the parameters every attention kernel
// takes, the shared-memory opt-in, and the tensor-core launchers that attention.cu calls
// (defined in attention_mma.cu and attention_wgmma.cu). Contracts are on the KernelTable
// entries in kernels/table.h.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>
#include <utility>

#include "kernels/core/head_groups.h"
#include "kernels/cuda/common.cuh"
#include "kernels/table.h"

namespace loom::cuda::attention {

// Pointers to the operands, (heads, len, head_dim) with heads = batch * heads, each laid out
// by its (resolved) strides: head bh = b * heads_per_batch + h starts at offset(strides, bh),
// its rows `seq` apart. The backward's lse2 and di are rows of the workspace, (heads, q_pad)
// in the accumulation type, q_pad = q_len rounded up to kRowPad: lse2 = lse * log2(e), with
// +inf for padding rows and rows that see no key (so exp2(s - lse2) is 0 there), and
// di = rowsum(dout * out), 0 on padding rows.
struct Params {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* dout = nullptr;
  const void* lse2 = nullptr;
  const void* di = nullptr;
  void* out = nullptr;
  void* lse = nullptr;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  float* dq_acc = nullptr;  // (heads, q_pad, head_dim) f32, zeroed: dQ / scale by atomics (mma_backward)
  // AttentionArgs::column_sums' partial sums, in the accumulation type, zeroed: for batch b
  // and row tile r (rows kSumRows r to kSumRows r + kSumRows - 1 of every head), row
  // b * sum_tiles + r holds dq's, dk's and dv's column sums over those rows, 3 * C values
  // (C = heads_per_batch * head_dim, head h's columns at h * head_dim). Null: no sums.
  void* sum_partials = nullptr;
  int sum_tiles = 0;  // row tiles a batch: max(q_len, kv_len) over kSumRows, rounded up
  AttentionLayout strides;  // every operand's, resolved (none left at the all-zero default)
  int64_t heads = 0;        // batch * heads, below 2^31
  int heads_per_batch = 1;
  int head_group = 0;       // heads per group of the Hopper kernels' grids (core/head_groups.h)
  int q_len = 0, kv_len = 0, q_pad = 0, head_dim = 0;
  bool causal = false;
  double scale = 1, scale_log2 = 1;  // scale, and scale * log2(e) for exp2

  // Elements from an operand's base to row 0 of head bh, in int64, once per block. The
  // division is 32-bit (bh < 2^31): a 64-bit one costs the kernels registers they need.
  __device__ __forceinline__ int64_t offset(const AttentionStrides& s, int64_t bh) const {
    const unsigned b = unsigned(bh) / unsigned(heads_per_batch), h = unsigned(bh) - b * unsigned(heads_per_batch);
    return int64_t(b) * s.batch + int64_t(h) * s.head;
  }
};

constexpr int kRowPad = 128;  // a multiple of every tensor-core kernel's query tile
constexpr int kSumRows = 64;  // rows of a partial column sum: the Hopper backward's key group

// Where row tile `tile` of head bh puts operand `which`'s (0 dq, 1 dk, 2 dv) column sums
// in p.sum_partials, head_dim values of A from there.
template <class A> __device__ __forceinline__ A* sum_partial(const Params& p, int64_t bh, int tile, int which) {
  const int64_t b = bh / p.heads_per_batch, h = bh - b * p.heads_per_batch, C = int64_t(p.heads_per_batch) * p.head_dim;
  return static_cast<A*>(p.sum_partials) + (b * p.sum_tiles + tile) * 3 * C + which * C + h * p.head_dim;
}

// Block b's head and index within it in the Hopper kernels' grids (kernels/core/head_groups.h).
struct GridPlace {
  int64_t bh;
  int index;
};
__device__ __forceinline__ GridPlace grouped_block(const Params& p, int per_head) {
  const head_groups::Place at = head_groups::place(blockIdx.x, unsigned(p.heads), unsigned(per_head),
                                                   unsigned(p.head_group));
  return {int64_t(at.head), int(at.index)};
}

// Lets `kernel` take `bytes` of dynamic shared memory, past the default 48 KiB where
// needed; a clear error when the GPU allows less. Each (kernel, device) is raised once,
// to the most it has been asked for, so a training step makes no extra runtime calls.
template <class Kernel> void allow_shared_memory(Kernel kernel, size_t bytes, const char* what) {
  if (bytes <= 48 * 1024) return;
  int device = 0;
  LOOM_CUDA(cudaGetDevice(&device));
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, size_t> raised;
  std::lock_guard<std::mutex> lock(mutex);
  size_t& done = raised[{reinterpret_cast<const void*>(kernel), device}];
  if (bytes <= done) return;
  int limit = 0;
  LOOM_CUDA(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  LOOM_CHECK(bytes <= size_t(limit), "attention: the ", what, " kernel needs ", bytes,
             " bytes of shared memory per block for this head_dim and dtype, and this GPU allows ", limit,
             ": use a smaller head_dim, or bf16/f16 with head_dim 32, 64, 80, 96 or 128");
  LOOM_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
  done = bytes;
}

// Heads per group (kernels/core/head_groups.h) for `kernel`'s grid of heads x per_head
// blocks of `threads` threads and `smem` bytes: about two waves of resident blocks a group,
// balanced. The occupancy is asked once per (kernel, device, shared memory).
template <class Kernel> int head_group(Kernel kernel, int threads, size_t smem, int64_t heads, int64_t per_head) {
  int device = 0;
  LOOM_CUDA(cudaGetDevice(&device));
  static std::mutex mutex;
  static std::map<std::tuple<const void*, int, size_t>, int> resident;
  int per_sm = 0;
  {
    std::lock_guard<std::mutex> lock(mutex);
    int& known = resident[{reinterpret_cast<const void*>(kernel), device, smem}];
    if (known == 0) {
      LOOM_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&known, kernel, threads, smem));
      known = std::max(known, 1);
    }
    per_sm = known;
  }
  return int(head_groups::balanced(heads, 2 * int64_t(sm_count()) * per_sm / std::max<int64_t>(per_head, 1)));
}

// True when the tensor-core kernels take these shapes: bf16 or f16, head_dim 32, 64, 80,
// 96 or 128 (the caller also checks that every row they touch is 16-byte aligned).
bool mma_supported(DType dtype, int64_t head_dim);
// The forward (out, lse); the backward (dq, dk, dv), which writes lse2 and di into the
// workspace first (p.lse2, p.di) from the forward's out and lse, and with `atomics`
// (dq_by_atomics) expects p.dq_acc too: (heads, q_pad, head_dim) f32, which it zeroes and fills.
// Every operand's rows are 16-byte aligned (the caller checks).
void mma_forward(const Params& p, DType dtype, cudaStream_t stream);
// With `hopper` and atomics, where wgmma_backward_supported, the Hopper kernel computes dK,
// dV and dQ. With p.sum_partials, the kernels that write a gradient add its partial column
// sums where they can: returns which operands' sums those kernels write when asked, a mask of
// 1 << which (0 dq, 1 dk, 2 dv).
int mma_backward(const Params& p, const void* out, const void* lse, DType dtype, bool atomics, bool hopper,
                 cudaStream_t stream);
// True when the Hopper forward (attention_wgmma.cu) takes these shapes on the current GPU:
// bf16 or f16, head_dim 64 or 128, a GPU of compute capability 9.0, and a build with 90 in
// cuda-arch. wgmma_forward has mma_forward's contract.
bool wgmma_supported(DType dtype, int64_t head_dim);
void wgmma_forward(const Params& p, DType dtype, cudaStream_t stream);
// The same for the Hopper backward's dK, dV and dQ by atomics: head_dim 64
// (attention_wgmma_backward.cu) or 128 (attention_wgmma_backward128.cu, which wgmma_dkdv_dq
// hands head_dim 128). wgmma_dkdv_dq takes the place of mma_backward's dK/dV/dQ kernel,
// between its row preparation and dQ's conversion.
bool wgmma_backward_supported(DType dtype, int64_t head_dim);
void wgmma_dkdv_dq(const Params& p, DType dtype, cudaStream_t stream);
void wgmma_dkdv_dq128(const Params& p, DType dtype, cudaStream_t stream);
// The partial column sums of the operands in `missing` (a mask as mma_backward's), by a pass
// over the stored gradient, then every column's total over the partials into `sums`
// (attention_sums.cu).
void column_sums(const Params& p, DType dtype, int missing, void* sums, cudaStream_t stream);
// Whether mma_backward accumulates dQ with atomics (fewer products, not deterministic) rather
// than in a kernel of its own, which args.deterministic asks for.
bool dq_by_atomics(const AttentionArgs& args);

}  // namespace loom::cuda::attention
