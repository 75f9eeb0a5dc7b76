// CUDA indexing kernels over canonical (outer, R, inner) buffers: one thread per element
// of the indexed side (the output of index_select/gather, the source of
// index_add/scatter_add), with grid-stride loops so any size fits one launch.
//
// index_add and scatter_add accumulate with atomicAdd, so on the GPU the order of the
// additions into one element (and so the last bits of a float sum) can change from run to
// run; integer sums are exact. u8 has no byte atomic and goes through a compare-and-swap
// on its aligned 32-bit word.
//
// An index outside [0, R) is a bug in the caller that the engine checks for where it
// can; here the thread that meets one prints it with its position and executes __trap(),
// which aborts the kernel and leaves a sticky CUDA error that the next synchronisation
// reports (the context is then unusable, as after any device fault). The printed line
// may be lost with the context; the error is not. The kernels never clamp or skip.
#include <cstdint>
#include <cstdio>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

namespace loom::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ int64_t checked(const char* op, int64_t v, int64_t position, int64_t R) {
  if (v < 0 || v >= R) {
    printf("loom %s: index %lld at position %lld is out of range for a dimension of size %lld\n", op,
           (long long)v, (long long)position, (long long)R);
    __trap();
  }
  return v;
}

__device__ __forceinline__ void atomic_add(float* p, float v) { atomicAdd(p, v); }
__device__ __forceinline__ void atomic_add(double* p, double v) { atomicAdd(p, v); }
__device__ __forceinline__ void atomic_add(__half* p, __half v) { atomicAdd(p, v); }
__device__ __forceinline__ void atomic_add(__nv_bfloat16* p, __nv_bfloat16 v) { atomicAdd(p, v); }
__device__ __forceinline__ void atomic_add(int32_t* p, int32_t v) { atomicAdd(reinterpret_cast<int*>(p), int(v)); }
// Two's complement: unsigned addition is signed addition.
__device__ __forceinline__ void atomic_add(int64_t* p, int64_t v) {
  atomicAdd(reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(v));
}
// Adds into one byte of the aligned word that holds it (wrapping modulo 256, as the CPU).
__device__ __forceinline__ void atomic_add(uint8_t* p, uint8_t v) {
  const uintptr_t addr = reinterpret_cast<uintptr_t>(p);
  unsigned int* word = reinterpret_cast<unsigned int*>(addr & ~uintptr_t(3));
  const unsigned int shift = unsigned(addr & 3) * 8;
  unsigned int old = *word, assumed;
  do {
    assumed = old;
    const unsigned int sum = ((assumed >> shift) + v) & 0xffu;
    old = atomicCAS(word, assumed, (assumed & ~(0xffu << shift)) | (sum << shift));
  } while (old != assumed);
}

// out (outer, n_index, inner)[o, j, i] = in (outer, R, inner)[o, index[j], i]
template <class T>
__global__ void index_select_kernel(T* out, const T* in, const int64_t* index, int64_t n_index, int64_t R,
                                    int64_t inner, int64_t n) {
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = e % inner, r = e / inner, j = r % n_index, o = r / n_index;
    out[e] = in[(o * R + checked("index_select", index[j], j, R)) * inner + i];
  }
}

// out (outer, R, inner)[o, index[j], i] += src (outer, n_index, inner)[o, j, i]
template <class T>
__global__ void index_add_kernel(T* out, const T* src, const int64_t* index, int64_t n_index, int64_t R,
                                 int64_t inner, int64_t n) {
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = e % inner, r = e / inner, j = r % n_index, o = r / n_index;
    atomic_add(out + (o * R + checked("index_add", index[j], j, R)) * inner + i, src[e]);
  }
}

// out (outer, J, inner)[o, j, i] = in (outer, R, inner)[o, index[o, j, i], i]
template <class T>
__global__ void gather_kernel(T* out, const T* in, const int64_t* index, int64_t J, int64_t R, int64_t inner,
                              int64_t n) {
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = e % inner, o = e / inner / J;
    out[e] = in[(o * R + checked("gather", index[e], e, R)) * inner + i];
  }
}

// out (outer, R, inner)[o, index[o, j, i], i] += src (outer, J, inner)[o, j, i]
template <class T>
__global__ void scatter_add_kernel(T* out, const T* src, const int64_t* index, int64_t J, int64_t R, int64_t inner,
                                   int64_t n) {
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = e % inner, o = e / inner / J;
    atomic_add(out + (o * R + checked("scatter_add", index[e], e, R)) * inner + i, src[e]);
  }
}

}  // namespace

void index_select(void* out, const void* in, const int64_t* index, int64_t n_index, DType dtype, int64_t outer,
                  int64_t R, int64_t inner, StreamHandle stream) {
  const int64_t n = outer * n_index * inner;
  if (n == 0) return;
  dispatch_all(dtype, [&](auto tag) {
    using T = decltype(tag);
    index_select_kernel<T><<<blocks_for(n, kThreads), kThreads, 0, as_cuda(stream)>>>(
        static_cast<T*>(out), static_cast<const T*>(in), index, n_index, R, inner, n);
  });
  LOOM_CUDA_LAUNCH();
}

void index_add(void* out, const void* src, const int64_t* index, int64_t n_index, DType dtype, int64_t outer,
               int64_t R, int64_t inner, StreamHandle stream) {
  const int64_t n = outer * n_index * inner;
  if (n == 0) return;
  dispatch_all(dtype, [&](auto tag) {
    using T = decltype(tag);
    index_add_kernel<T><<<blocks_for(n, kThreads), kThreads, 0, as_cuda(stream)>>>(
        static_cast<T*>(out), static_cast<const T*>(src), index, n_index, R, inner, n);
  });
  LOOM_CUDA_LAUNCH();
}

void gather(void* out, const void* in, const int64_t* index, int64_t J, DType dtype, int64_t outer, int64_t R,
            int64_t inner, StreamHandle stream) {
  const int64_t n = outer * J * inner;
  if (n == 0) return;
  dispatch_all(dtype, [&](auto tag) {
    using T = decltype(tag);
    gather_kernel<T><<<blocks_for(n, kThreads), kThreads, 0, as_cuda(stream)>>>(
        static_cast<T*>(out), static_cast<const T*>(in), index, J, R, inner, n);
  });
  LOOM_CUDA_LAUNCH();
}

void scatter_add(void* out, const void* src, const int64_t* index, int64_t J, DType dtype, int64_t outer,
                 int64_t R, int64_t inner, StreamHandle stream) {
  const int64_t n = outer * J * inner;
  if (n == 0) return;
  dispatch_all(dtype, [&](auto tag) {
    using T = decltype(tag);
    scatter_add_kernel<T><<<blocks_for(n, kThreads), kThreads, 0, as_cuda(stream)>>>(
        static_cast<T*>(out), static_cast<const T*>(src), index, J, R, inner, n);
  });
  LOOM_CUDA_LAUNCH();
}

}  // namespace loom::cuda
