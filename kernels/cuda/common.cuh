// Shared by the CUDA kernels: element types per DType, float conversion for loads and
// stores, launch sizing, and the dispatch from a DType to a typed kernel.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/core/error.h"
#include "kernels/core/strided.h"
#include "kernels/cuda/check.h"

namespace loom::cuda {

inline cudaStream_t as_cuda(StreamHandle s) { return static_cast<cudaStream_t>(s); }

// Accumulation type: f32 for 16-bit floats and f32, f64 for f64, the type itself for ints.
template <class T> struct Acc { using type = T; };
template <> struct Acc<__nv_bfloat16> { using type = float; };
template <> struct Acc<__half> { using type = float; };
template <> struct Acc<float> { using type = float; };
template <class T> using acc_t = typename Acc<T>::type;

template <class T> __device__ __forceinline__ acc_t<T> to_acc(T v) { return acc_t<T>(v); }
template <> __device__ __forceinline__ float to_acc(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> __device__ __forceinline__ float to_acc(__half v) { return __half2float(v); }

template <class T, class A> __device__ __forceinline__ T from_acc(A v) { return T(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16, float>(float v) { return __float2bfloat16(v); }
template <> __device__ __forceinline__ __half from_acc<__half, float>(float v) { return __float2half(v); }

// V values of T moved by one vector access (16 bytes at most per instruction: a larger pack
// is aligned to 16 and moves as several). The buffers must be aligned to the pack.
template <class T, int V> struct alignas(sizeof(T) * V < 16 ? sizeof(T) * V : 16) Pack {
  T v[V];
};
template <class T, int V> __device__ __forceinline__ Pack<T, V> load(const T* p) {
  return *reinterpret_cast<const Pack<T, V>*>(p);
}
template <class T, int V> __device__ __forceinline__ void store(T* p, const Pack<T, V>& v) {
  *reinterpret_cast<Pack<T, V>*>(p) = v;
}

// Multiprocessors of the current device, asked once per host thread and device.
inline int sm_count() {
  int device = 0;
  LOOM_CUDA(cudaGetDevice(&device));
  thread_local int cached_device = -1, cached_sms = 0;
  if (device != cached_device) {
    LOOM_CUDA(cudaDeviceGetAttribute(&cached_sms, cudaDevAttrMultiProcessorCount, device));
    cached_device = device;
  }
  return cached_sms;
}

// Compute capability of the current device as major * 10 + minor (90 for an H100 or H200),
// asked once per host thread and device.
inline int compute_capability() {
  int device = 0;
  LOOM_CUDA(cudaGetDevice(&device));
  thread_local int cached_device = -1, cached_cc = 0;
  if (device != cached_device) {
    int major = 0, minor = 0;
    LOOM_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    LOOM_CUDA(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    cached_cc = major * 10 + minor;
    cached_device = device;
  }
  return cached_cc;
}

// Blocks for n elements at `threads` per block, each thread handling `per_thread`,
// capped so a grid-stride loop covers the rest.
inline unsigned blocks_for(int64_t n, int threads, int per_thread = 1) {
  int64_t b = (n + int64_t(threads) * per_thread - 1) / (int64_t(threads) * per_thread);
  if (b < 1) b = 1;
  if (b > (1 << 20)) b = 1 << 20;
  return unsigned(b);
}

// Calls f(T{}) with T the CUDA element type of `dtype`.
template <class F>
void dispatch_all(DType dtype, F&& f) {
  switch (dtype) {
    case DType::f32: return f(float{});
    case DType::f64: return f(double{});
    case DType::bf16: return f(__nv_bfloat16{});
    case DType::f16: return f(__half{});
    case DType::i32: return f(int32_t{});
    case DType::i64: return f(int64_t{});
    case DType::u8: return f(uint8_t{});
  }
  LOOM_ASSERT(false, "unknown dtype");
}

template <class F>
void dispatch_floating(DType dtype, const char* what, F&& f) {
  switch (dtype) {
    case DType::f32: return f(float{});
    case DType::f64: return f(double{});
    case DType::bf16: return f(__nv_bfloat16{});
    case DType::f16: return f(__half{});
    default: LOOM_FAIL(what, " needs a floating-point dtype, got ", dtype_name(dtype));
  }
}

// Strided offsets on the device: the descriptor is passed by value into kernels.
struct StridedIndexer {
  int ndim;
  int64_t shape[kMaxDims];
  int64_t strides[kMaxDims];
  explicit StridedIndexer(const Strided& s) : ndim(s.ndim) {
    for (int i = 0; i < kMaxDims; ++i) {
      shape[i] = i < s.ndim ? s.shape[i] : 1;
      strides[i] = i < s.ndim ? s.strides[i] : 0;
    }
  }
  // Element offset of the i-th element in row-major order of `shape`.
  __device__ __forceinline__ int64_t offset(int64_t i) const {
    int64_t off = 0;
#pragma unroll
    for (int d = kMaxDims - 1; d >= 0; --d) {
      if (d < ndim) {
        int64_t q = i / shape[d];
        off += (i - q * shape[d]) * strides[d];
        i = q;
      }
    }
    return off;
  }
};

}  // namespace loom::cuda
