// What the two halves of the CUDA attention share: the parameters every attention kernel
// takes, the shared-memory opt-in, and the tensor-core launchers that attention.cu calls
// (defined in attention_mma.cu). Contracts are on the KernelTable entries in kernels/table.h.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <utility>

#include "kernels/cuda/common.cuh"

namespace loom::cuda::attention {

// Pointers to contiguous (heads, len, head_dim) buffers, heads = batch * heads. The
// backward's lse2 and di are rows of the workspace, (heads, q_pad) in the accumulation
// type, q_pad = q_len rounded up to kRowPad: lse2 = lse * log2(e), with +inf for padding
// rows and rows that see no key (so exp2(s - lse2) is 0 there), and di = rowsum(dout * out),
// 0 on padding rows.
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
  int64_t heads = 0;
  int q_len = 0, kv_len = 0, q_pad = 0, head_dim = 0;
  bool causal = false;
  double scale = 1, scale_log2 = 1;  // scale, and scale * log2(e) for exp2
};

constexpr int kRowPad = 64;

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

// True when the tensor-core kernels take these shapes: bf16 or f16, head_dim 32, 64, 80,
// 96 or 128 (the caller also checks 16-byte alignment of every buffer).
bool mma_supported(DType dtype, int64_t head_dim);
// Forward (out, lse) and the backward's dq and dk/dv kernels; the backward expects
// lse2 and di in the workspace already (attention.cu writes them).
void mma_forward(const Params& p, DType dtype, cudaStream_t stream);
void mma_backward(const Params& p, DType dtype, cudaStream_t stream);

}  // namespace loom::cuda::attention
