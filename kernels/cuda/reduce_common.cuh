// Warp and block reductions shared by the CUDA kernels that reduce along rows (reduce.cu,
// softmax.cu). They live in one header so that the shuffle pattern and the barrier rule of
// block groups are written once; each kernel brings its own value type and combine rule.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

namespace loom::cuda {

// Any trivially copyable value, moved across a warp word by word.
template <class V> __device__ __forceinline__ V shfl_xor(V v, int mask) {
  static_assert(sizeof(V) % 4 == 0, "shuffled values must be whole 32-bit words");
  uint32_t w[sizeof(V) / 4];
  memcpy(w, &v, sizeof(V));
#pragma unroll
  for (int k = 0; k < int(sizeof(V) / 4); ++k) w[k] = __shfl_xor_sync(0xffffffffu, w[k], mask);
  memcpy(&v, w, sizeof(V));
  return v;
}

// Reduces v over a group of kGroup threads (a warp, or the whole block when kGroup > 32);
// every thread of the group gets the result. Block groups share one array, hence the
// barrier before it is written.
template <int kGroup, class V, class Op> __device__ __forceinline__ V group_reduce(V v, Op op) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v = op(v, shfl_xor(v, m));
  if constexpr (kGroup > 32) {
    __shared__ V partial[kGroup / 32];
    __syncthreads();
    if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
    __syncthreads();
    v = partial[0];
#pragma unroll
    for (int w = 1; w < kGroup / 32; ++w) v = op(v, partial[w]);
  }
  return v;
}

}  // namespace loom::cuda
