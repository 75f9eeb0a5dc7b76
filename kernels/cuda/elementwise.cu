// Elementwise kernels on CUDA: fill, copy, arange, unary and its backward, binary, where.
// Semantics are the CPU reference's (kernels/cpu/elementwise.cpp lists what the table
// leaves open: integer wrap-around, x / 0 == 0 for integers, float-to-integer saturation,
// NaN in maximum/minimum); the tests hold the two to each other.
//
// Every entry but arange goes through `launch`, which picks one of two kernels:
// - contiguous: the output is contiguous and each input is contiguous or one broadcast
//   element. A grid-stride loop moves 16 bytes per operand per step (float4, 8 x bf16, ...)
//   when every pointer is aligned for it, then a scalar tail. The grid is one full wave
//   (the SM count times the blocks an SM holds): enough loads in flight to run at memory
//   bandwidth, and no partial second wave running at low occupancy.
// - strided: any strides, coalesced on the host; each thread turns its linear index into
//   per-operand offsets, in 32-bit arithmetic whenever every index and offset fits.
// Each op is a functor templated on the op (kernels/cuda/elementwise_ops.cuh), so one
// kernel template serves all of them and the op's math inlines into the loop.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <type_traits>
#include <utility>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/elementwise_ops.cuh"
#include "kernels/cuda/kernels.h"

namespace loom::cuda {
namespace {

using namespace elementwise;

constexpr int kThreads = 256;

// How many blocks of `kernel` one SM holds at once.
template <class Kernel>
int blocks_per_sm(Kernel kernel) {
  int blocks = 0;
  LOOM_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kThreads, 0));
  return std::max(blocks, 1);
}

// Blocks for a grid-stride loop over `items`: one per kThreads items, at most one wave
// (a second, partial wave would run at low occupancy while the first has finished).
unsigned grid_for(int64_t items, int per_sm) {
  const int64_t blocks = (items + kThreads - 1) / kThreads;
  return unsigned(std::clamp<int64_t>(blocks, 1, int64_t(sm_count()) * per_sm));
}

// ---- the contiguous kernel ----------------------------------------------------------

// An input of the contiguous kernel: a contiguous array, or one element read everywhere.
template <class T>
struct Operand {
  const T* p;
  bool single;
  template <int N>
  __device__ __forceinline__ Pack<T, N> pack(int64_t k) const {
    if (!single) return reinterpret_cast<const Pack<T, N>*>(p)[k];
    Pack<T, N> r;
    const T v = p[0];
#pragma unroll
    for (int j = 0; j < N; ++j) r.v[j] = v;
    return r;
  }
  __device__ __forceinline__ T at(int64_t i) const { return p[single ? 0 : i]; }
};

template <int N, class O, class F, class... P>
__device__ __forceinline__ void store_pack(O* out, int64_t k, const F& f, const P&... packs) {
  Pack<O, N> r;
#pragma unroll
  for (int j = 0; j < N; ++j) r.v[j] = f(packs.v[j]...);
  reinterpret_cast<Pack<O, N>*>(out)[k] = r;
}

// out[i] = f(in[i]...) for i < n; N elements per 16-byte step when `vectorized`.
template <int N, class O, class F, class... T>
__global__ void __launch_bounds__(kThreads)
    contiguous_kernel(int64_t n, bool vectorized, F f, O* out, Operand<T>... in) {
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  int64_t done = 0;
  if (vectorized) {
    const int64_t packs = n / N;
    for (int64_t k = first; k < packs; k += stride) store_pack<N>(out, k, f, in.template pack<N>(k)...);
    done = packs * N;
  }
  for (int64_t i = done + first; i < n; i += stride) out[i] = f(in.at(i)...);
}

// ---- the strided kernel -------------------------------------------------------------

// Per-operand offsets of a linear index; Ix is uint32_t or uint64_t.
template <class Ix, int K>
struct Offsets {
  using Off = std::make_signed_t<Ix>;
  int ndim;
  Ix shape[kMaxDims];
  Off strides[K][kMaxDims];

  __device__ __forceinline__ void get(Ix i, Off (&off)[K]) const {
#pragma unroll
    for (int k = 0; k < K; ++k) off[k] = 0;
#pragma unroll
    for (int d = kMaxDims - 1; d >= 1; --d) {
      if (d < ndim) {
        const Ix q = i / shape[d];
        const Off r = Off(i - q * shape[d]);
#pragma unroll
        for (int k = 0; k < K; ++k) off[k] += r * strides[k][d];
        i = q;
      }
    }
#pragma unroll
    for (int k = 0; k < K; ++k) off[k] += Off(i) * strides[k][0];
  }
};

template <class O, class F, class Off, size_t... J, class... T>
__device__ __forceinline__ void store_at(const F& f, O* out, const Off* off, std::index_sequence<J...>,
                                         const T*... in) {
  out[off[0]] = f(in[off[J + 1]]...);
}

template <class Ix, class O, class F, class... T>
__global__ void __launch_bounds__(kThreads)
    strided_kernel(Ix n, Offsets<Ix, 1 + sizeof...(T)> ix, F f, O* out, const T*... in) {
  const Ix stride = Ix(gridDim.x) * blockDim.x;
  for (Ix i = Ix(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    typename Offsets<Ix, 1 + sizeof...(T)>::Off off[1 + sizeof...(T)];
    ix.get(i, off);
    store_at(f, out, off, std::index_sequence_for<T...>{}, in...);
  }
}

// ---- launching ----------------------------------------------------------------------

// True when every element of s is the same one (all strides of non-trivial dims are 0).
bool is_single(const Strided& s) {
  for (int d = 0; d < s.ndim; ++d) {
    if (s.shape[d] != 1 && s.strides[d] != 0) return false;
  }
  return true;
}

bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

template <class O, class... T, class F, class... S>
void launch_contiguous(cudaStream_t stream, const F& f, const Strided& out, const S&... in) {
  constexpr int N = int(16 / std::max({sizeof(O), sizeof(T)...}));
  const int64_t n = out.numel();
  const bool vectorized =
      aligned(out.data, sizeof(O) * N) && ((is_single(in) || aligned(in.data, sizeof(T) * N)) && ...);
  const int64_t items = vectorized ? n / N + n % N : n;
  auto* const kernel = &contiguous_kernel<N, O, F, T...>;
  static const int per_sm = blocks_per_sm(kernel);
  kernel<<<grid_for(items, per_sm), kThreads, 0, stream>>>(
      n, vectorized, f, static_cast<O*>(out.data), Operand<T>{static_cast<const T*>(in.data), is_single(in)}...);
  LOOM_CUDA_LAUNCH();
}

template <class Ix, class O, class... T, class F, int K>
void launch_strided(cudaStream_t stream, const F& f, const Walk<K>& w, const Strided& out, const T*... in) {
  Offsets<Ix, K> ix{};
  ix.ndim = w.ndim;
  for (int d = 0; d < w.ndim; ++d) {
    ix.shape[d] = Ix(w.shape[d]);
    for (int k = 0; k < K; ++k) ix.strides[k][d] = typename Offsets<Ix, K>::Off(w.strides[k][d]);
  }
  const int64_t n = out.numel();
  auto* const kernel = &strided_kernel<Ix, O, F, T...>;
  static const int per_sm = blocks_per_sm(kernel);
  kernel<<<grid_for(n, per_sm), kThreads, 0, stream>>>(Ix(n), ix, f, static_cast<O*>(out.data), in...);
  LOOM_CUDA_LAUNCH();
}

// out[i] = f(in[i]...): O is out's element type, T... the inputs'.
template <class O, class... T, class F, class... S>
void launch(cudaStream_t stream, const F& f, const Strided& out, const S&... in) {
  static_assert(sizeof...(T) == sizeof...(S));
  const int64_t n = out.numel();
  if (n == 0) return;
  if (out.is_contiguous() && ((in.is_contiguous() || is_single(in)) && ...)) {
    return launch_contiguous<O, T...>(stream, f, out, in...);
  }
  constexpr int K = 1 + int(sizeof...(T));
  const Walk<K> w = coalesce<K>({&out, &in...});
  // 32-bit indexing when every linear index and every operand's offsets fit in int32.
  bool fits = n <= std::numeric_limits<int32_t>::max();
  for (int k = 0; k < K; ++k) {
    int64_t extent = 0;
    for (int d = 0; d < w.ndim; ++d) extent += (w.shape[d] - 1) * std::abs(w.strides[k][d]);
    fits = fits && extent <= std::numeric_limits<int32_t>::max();
  }
  if (fits) launch_strided<uint32_t, O, T...>(stream, f, w, out, static_cast<const T*>(in.data)...);
  else launch_strided<uint64_t, O, T...>(stream, f, w, out, static_cast<const T*>(in.data)...);
}

template <class T>
__global__ void arange_kernel(int64_t n, double start, double step, T* out) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    out[i] = convert<T>(__dadd_rn(start, __dmul_rn(double(i), step)));  // no FMA: as the CPU rounds
  }
}

}  // namespace

// ---- entries ------------------------------------------------------------------------

void fill(const Strided& out, double value, StreamHandle stream) {
  dispatch_all(out.dtype, [&](auto t) {
    using T = decltype(t);
    launch<T>(as_cuda(stream), ConstantFn<T>{convert<T>(value)}, out);
  });
}

void copy(const Strided& out, const Strided& in, StreamHandle stream) {
  if (out.dtype == in.dtype && out.is_contiguous() && in.is_contiguous()) {
    LOOM_CUDA(cudaMemcpyAsync(out.data, in.data, size_t(out.numel()) * dtype_size(out.dtype),
                              cudaMemcpyDeviceToDevice, as_cuda(stream)));
    return;
  }
  dispatch_all(in.dtype, [&](auto from) {
    using From = decltype(from);
    dispatch_all(out.dtype, [&](auto to) {
      using To = decltype(to);
      launch<To, From>(as_cuda(stream), ConvertFn<To, From>{}, out, in);
    });
  });
}

void arange(const Strided& out, double start, double step, StreamHandle stream) {
  LOOM_ASSERT(out.is_contiguous(), "arange writes a contiguous output");
  const int64_t n = out.numel();
  if (n == 0) return;
  dispatch_all(out.dtype, [&](auto t) {
    using T = decltype(t);
    auto* const kernel = &arange_kernel<T>;
    static const int per_sm = blocks_per_sm(kernel);
    kernel<<<grid_for(n, per_sm), kThreads, 0, as_cuda(stream)>>>(n, start, step, static_cast<T*>(out.data));
    LOOM_CUDA_LAUNCH();
  });
}

void unary(UnaryOp op, const Strided& out, const Strided& in, double param, StreamHandle stream) {
  LOOM_ASSERT(out.dtype == in.dtype, "unary ", op_name(op), ": out and in must share a dtype");
  dispatch_all(in.dtype, [&](auto t) {
    using T = decltype(t);
    with_op(op, [&](auto c) {
      constexpr UnaryOp o = decltype(c)::value;
      if constexpr (!std::is_integral_v<T>) {
        launch<T, T>(as_cuda(stream), UnaryFn<o, T>{acc_t<T>(param)}, out, in);
      } else if constexpr (integer_ok(o)) {
        launch<T, T>(as_cuda(stream), UnaryFn<o, T>{integer_scalar<T>(o, param, in.dtype)}, out, in);
      } else {
        LOOM_FAIL("unary ", op_name(o), " needs a floating-point dtype, got ", dtype_name(in.dtype));
      }
    });
  });
}

void unary_backward(UnaryOp op, const Strided& grad_in, const Strided& grad_out, const Strided& in,
                    const Strided& out, double param, StreamHandle stream) {
  LOOM_ASSERT(grad_in.is_contiguous() && grad_out.is_contiguous() && in.is_contiguous() && out.is_contiguous(),
              "unary_backward takes contiguous operands");
  if (grad_in.numel() == 0) return;
  dispatch_floating(in.dtype, "unary_backward", [&](auto t) {
    using T = decltype(t);
    with_op(op, [&](auto c) {
      constexpr UnaryOp o = decltype(c)::value;
      launch_contiguous<T, T, T, T>(as_cuda(stream), UnaryGradFn<o, T>{acc_t<T>(param)}, grad_in, grad_out, in,
                                    out);
    });
  });
}

void binary(BinaryOp op, const Strided& out, const Strided& a, const Strided& b, StreamHandle stream) {
  LOOM_ASSERT(a.dtype == b.dtype && out.dtype == (is_comparison(op) ? DType::u8 : a.dtype),
              "binary: a and b must share a dtype, and out must be u8 for comparisons or that dtype");
  dispatch_all(a.dtype, [&](auto t) {
    using T = decltype(t);
    with_op(op, [&](auto c) {
      constexpr BinaryOp o = decltype(c)::value;
      using O = std::conditional_t<is_comparison(o), uint8_t, T>;
      launch<O, T, T>(as_cuda(stream), BinaryFn<o, T>{}, out, a, b);
    });
  });
}

void where(const Strided& out, const Strided& cond, const Strided& a, const Strided& b, StreamHandle stream) {
  LOOM_ASSERT(cond.dtype == DType::u8 && a.dtype == b.dtype && out.dtype == a.dtype,
              "where: cond must be u8, and a, b, out share a dtype");
  dispatch_all(a.dtype, [&](auto t) {
    using T = decltype(t);
    launch<T, uint8_t, T, T>(as_cuda(stream), WhereFn<T>{}, out, cond, a, b);
  });
}

}  // namespace loom::cuda
