// CUDA indexing kernels over canonical (outer, R, inner) buffers: one thread per element
// of the indexed side (the output of index_select/gather, the source of
// index_add/scatter_add), with grid-stride loops so any size fits one launch. The token
// and position embeddings of a GPT take a thread per 16-byte pack of a row instead; their
// backward a thread per pack of a position's row, walking the batch.
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
#include <initializer_list>
#include <type_traits>

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

// ---- token and position embeddings -----------------------------------------------------
// A thread per pack of P values of a row (16 bytes when the rows allow it, else P = 1).

template <class T, int P>
__global__ void embedding_sum_kernel(T* out, const T* wte, const T* wpe, const int64_t* ids, int64_t rows, int64_t T_,
                                     int64_t C, int64_t V) {
  const int64_t packs = C / P, n = rows * packs;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = e / packs, c = e % packs * P;
    const int64_t id = checked("embedding", ids[r], r, V);
    const Pack<T, P> a = load<T, P>(wte + id * C + c), b = load<T, P>(wpe + r % T_ * C + c);
    Pack<T, P> y;
#pragma unroll
    for (int j = 0; j < P; ++j) y.v[j] = from_acc<T>(to_acc(a.v[j]) + to_acc(b.v[j]));
    store<T, P>(out + r * C + c, y);
  }
}

// Adds a pack into 16-byte aligned memory: one vector atomic for f32 on sm_90 and later.
template <class T, int P> __device__ __forceinline__ void atomic_add_pack(T* p, const Pack<T, P>& v) {
#if __CUDA_ARCH__ >= 900
  if constexpr (std::is_same_v<T, float> && P == 4) {
    atomicAdd(reinterpret_cast<float4*>(p), make_float4(v.v[0], v.v[1], v.v[2], v.v[3]));
    return;
  }
#endif
#pragma unroll
  for (int j = 0; j < P; ++j) atomic_add(p + j, v.v[j]);
}

// A thread per pack of a position's row: walks the batch, summing into d_wpe[t] and adding
// each row into d_wte at its id.
template <class T, int P>
__global__ void embedding_sum_backward_kernel(T* d_wte, T* d_wpe, const T* grad, const int64_t* ids, int64_t B,
                                              int64_t T_, int64_t C, int64_t V) {
  using A = acc_t<T>;
  const int64_t packs = C / P, n = T_ * packs;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = e / packs, c = e % packs * P;
    A sum[P] = {};
    for (int64_t b = 0; b < B; ++b) {
      const int64_t r = b * T_ + t;
      const Pack<T, P> g = load<T, P>(grad + r * C + c);
      if (d_wte) atomic_add_pack<T, P>(d_wte + checked("embedding backward", ids[r], r, V) * C + c, g);
#pragma unroll
      for (int j = 0; j < P; ++j) sum[j] += to_acc(g.v[j]);
    }
    if (!d_wpe) continue;
    Pack<T, P> out;
#pragma unroll
    for (int j = 0; j < P; ++j) out.v[j] = from_acc<T>(sum[j]);
    store<T, P>(d_wpe + t * C + c, out);
  }
}

// Calls f(Int<P>{}) with 16-byte packs when C and every buffer allow them, else P = 1.
template <class T, class F> void with_pack(int64_t C, std::initializer_list<const void*> buffers, F&& f) {
  constexpr int kP = 16 / int(sizeof(T));
  bool packed = C % kP == 0;
  for (const void* b : buffers) packed = packed && reinterpret_cast<uintptr_t>(b) % 16 == 0;
  if (packed) f(std::integral_constant<int, kP>{});
  else f(std::integral_constant<int, 1>{});
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

void embedding_sum(void* out, const void* wte, const void* wpe, const int64_t* ids, int64_t B, int64_t T, int64_t C,
                   int64_t V, DType dtype, StreamHandle stream) {
  if (B * T * C == 0) return;
  dispatch_floating(dtype, "embedding", [&](auto tag) {
    using T_ = decltype(tag);
    with_pack<T_>(C, {out, wte, wpe}, [&](auto pack) {
      constexpr int P = decltype(pack)::value;
      embedding_sum_kernel<T_, P><<<blocks_for(B * T * C / P, kThreads), kThreads, 0, as_cuda(stream)>>>(
          static_cast<T_*>(out), static_cast<const T_*>(wte), static_cast<const T_*>(wpe), ids, B * T, T, C, V);
      LOOM_CUDA_LAUNCH();
    });
  });
}

void embedding_sum_backward(void* d_wte, void* d_wpe, const void* grad, const int64_t* ids, int64_t B, int64_t T,
                            int64_t C, int64_t V, DType dtype, StreamHandle stream) {
  if (T * C == 0 || (!d_wte && !d_wpe)) return;
  dispatch_floating(dtype, "embedding backward", [&](auto tag) {
    using T_ = decltype(tag);
    with_pack<T_>(C, {d_wte, d_wpe, grad}, [&](auto pack) {
      constexpr int P = decltype(pack)::value;
      embedding_sum_backward_kernel<T_, P><<<blocks_for(T * C / P, kThreads), kThreads, 0, as_cuda(stream)>>>(
          static_cast<T_*>(d_wte), static_cast<T_*>(d_wpe), static_cast<const T_*>(grad), ids, B, T, C, V);
      LOOM_CUDA_LAUNCH();
    });
  });
}

}  // namespace loom::cuda
