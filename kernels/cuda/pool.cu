// CUDA 2-d max and average pooling over NCHW or channels-last (NHWC) buffers: one thread per
// output element in the forward passes, one thread per input element in the backward passes,
// consecutive threads taking consecutive elements in memory (in NHWC the channels of one
// pixel, so a warp's reads of each window position are coalesced).
//
// The backward passes gather: an input element sums the gradients of the outputs whose
// windows cover it (kernels/core/pool_window.h, shared with the CPU kernels), in a fixed
// order. No atomics, so the gradients are bitwise reproducible, and every element of dx
// is written, so dx needs no zero-fill first. With the small windows of CNN pooling
// (2x2, 3x3) a thread reads at most a few outputs. Max pooling over windows that tile the
// input (2 x 2, stride 2, even extents: SimpleCNN's) writes each window from the thread of
// its output instead.
//
// Index arithmetic. Finding an element's image, channel, row and column takes divisions,
// a handful per element; in 64 bits each is a long instruction sequence, and the backward
// passes (a thread per input element, little memory traffic each) were bound by them. So
// every kernel is compiled for 32- and 64-bit indices, and a call whose buffers hold fewer
// than kIndex32Limit elements (every CNN's pooling in practice) runs the 32-bit copy, which
// divides by multiplying with numbers found on the host (FastDivisor).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "kernels/core/pool_window.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

namespace loom::cuda {
namespace {

constexpr int kThreads = 256;
// Below this many elements in every buffer of a call, and so below it in every index and
// every step of a grid-stride loop (blocks_for launches fewer threads than 2^30), the
// kernels index in 32 bits. Tests lower it (set_pool_index32_limit) to run the 64-bit copy.
constexpr int64_t kIndex32Limit = int64_t(1) << 30;
std::atomic<int64_t> index32_limit{kIndex32Limit};

// n / d for 0 <= n < 2^31 and 1 <= d < 2^31 by a multiply, an add and a shift:
// q = (umulhi(n, m) + n) >> s, with s the least such that 2^s >= d and
// m = floor(2^32 (2^s - d) / d) + 1, found once on the host (Granlund and Montgomery's
// method, as PyTorch's IntDivider). The quotient is exact in that range, and t + n stays
// below 2^32.
struct FastDivisor {
  int32_t d;
  uint32_t m, s;
  explicit FastDivisor(int64_t divisor) : d(int32_t(divisor)), s(0) {
    LOOM_ASSERT(divisor >= 1 && divisor < (int64_t(1) << 31), "FastDivisor: divisor ", divisor, " out of range");
    while ((int64_t(1) << s) < divisor) ++s;
    m = uint32_t((uint64_t(1) << 32) * ((uint64_t(1) << s) - uint64_t(divisor)) / uint64_t(divisor) + 1);
  }
  __device__ __forceinline__ int32_t value() const { return d; }
  __device__ __forceinline__ int32_t div(int32_t n) const {
    return int32_t((__umulhi(uint32_t(n), m) + uint32_t(n)) >> s);
  }
};

// The 32-bit kernels divide by multiplying (FastDivisor); the 64-bit ones plainly.
template <class I>
using Divisor = std::conditional_t<std::is_same_v<I, int32_t>, FastDivisor, pool::PlainDivisor<I>>;

template <class I> Divisor<I> divisor(int64_t d) {
  if constexpr (std::is_same_v<I, int32_t>) return FastDivisor(d);
  else return pool::PlainDivisor<I>{I(d)};
}

// Pool2dArgs by value, trimmed to what the device needs, in the index type I, with a
// divisor for each extent the kernels divide by.
template <class I> struct Geom {
  I c, h, w, out_h, out_w, kh, kw, stride_h, stride_w, pad_h, pad_w;
  Divisor<I> div_c, div_h, div_w, div_out_h, div_out_w, div_stride_h, div_stride_w;
  bool channels_last;
};

template <class I> Geom<I> geom(const Pool2dArgs& a) {
  return {I(a.c),
          I(a.h),
          I(a.w),
          I(a.out_h),
          I(a.out_w),
          I(a.kh),
          I(a.kw),
          I(a.stride_h),
          I(a.stride_w),
          I(a.pad_h),
          I(a.pad_w),
          divisor<I>(a.c),
          divisor<I>(a.h),
          divisor<I>(a.w),
          divisor<I>(a.out_h),
          divisor<I>(a.out_w),
          divisor<I>(a.stride_h),
          divisor<I>(a.stride_w),
          a.layout == ChannelLayout::channels_last};
}

// Element e (in memory order) of a buffer of (N, C) planes of rows x cols, in the Geom's
// layout: its image n, channel c, row and column.
template <class I> struct Place {
  I n, c, row, col;
};

template <class I>
__device__ __forceinline__ Place<I> place(I e, const Divisor<I>& rows, const Divisor<I>& cols, const Geom<I>& g) {
  if (g.channels_last) {  // e = ((n * rows + row) * cols + col) * C + c
    const I pixel = g.div_c.div(e), t = cols.div(pixel), n = rows.div(t);
    return {n, e - pixel * g.c, t - n * rows.value(), pixel - t * cols.value()};
  }
  // e = ((n * C + c) * rows + row) * cols + col
  const I t = cols.div(e), plane = rows.div(t), n = g.div_c.div(plane);
  return {n, plane - n * g.c, t - plane * rows.value(), e - t * cols.value()};
}

// Where the plane of p starts in a buffer of rows x cols planes; its element (r, q) is then
// (r * cols + q) * stride(g) further on.
template <class I>
__device__ __forceinline__ I plane_start(const Place<I>& p, I rows, I cols, const Geom<I>& g) {
  return g.channels_last ? p.n * rows * cols * g.c + p.c : (p.n * g.c + p.c) * rows * cols;
}

template <class I> __device__ __forceinline__ I stride(const Geom<I>& g) { return g.channels_last ? g.c : I(1); }

#define LOOM_GRID_STRIDE(e, n) \
  for (I e = I(blockIdx.x) * I(blockDim.x) + I(threadIdx.x); e < (n); e += I(gridDim.x) * I(blockDim.x))

// With a bias (Pool2dArgs::bias), each element is x + bias[c] rounded to T, as add rounds it.
template <class T, class I>
__global__ void max_forward_kernel(T* y, int64_t* indices, const T* x, const T* bias, Geom<I> g, I n) {
  using A = acc_t<T>;
  const I step = stride(g);
  LOOM_GRID_STRIDE(e, n) {
    const Place<I> p = place(e, g.div_out_h, g.div_out_w, g);
    const T* in = x + plane_start(p, g.h, g.w, g);
    const A shift = bias ? to_acc(bias[p.c]) : A(0);
    const pool::SpanOf<I> rows = pool::input_span(p.row, g.stride_h, g.pad_h, g.kh, g.h);
    const pool::SpanOf<I> cols = pool::input_span(p.col, g.stride_w, g.pad_w, g.kw, g.w);
    A best = -std::numeric_limits<A>::infinity();
    I best_at = rows.begin * g.w + cols.begin;
    for (I ih = rows.begin; ih < rows.end; ++ih)
      for (I iw = cols.begin; iw < cols.end; ++iw) {
        const T value = in[(ih * g.w + iw) * step];
        const A v = bias ? to_acc(from_acc<T>(to_acc(value) + shift)) : to_acc(value);
        if (v > best || v != v) {
          best = v;
          best_at = ih * g.w + iw;
        }
      }
    y[e] = from_acc<T>(best);
    indices[e] = int64_t(best_at);
  }
}

template <class T, class I>
__global__ void max_backward_kernel(T* dx, const T* dy, const int64_t* indices, Geom<I> g, I n) {
  using A = acc_t<T>;
  const I step = stride(g);
  LOOM_GRID_STRIDE(e, n) {
    const Place<I> p = place(e, g.div_h, g.div_w, g);
    const I self = p.row * g.w + p.col, start = plane_start(p, g.out_h, g.out_w, g);
    const T* go = dy + start;
    const int64_t* idx = indices + start;
    const pool::SpanOf<I> rows = pool::output_span_by(p.row, g.div_stride_h, g.pad_h, g.kh, g.out_h);
    const pool::SpanOf<I> cols = pool::output_span_by(p.col, g.div_stride_w, g.pad_w, g.kw, g.out_w);
    A sum = A(0);
    for (I oh = rows.begin; oh < rows.end; ++oh)
      for (I ow = cols.begin; ow < cols.end; ++ow) {
        const I at = (oh * g.out_w + ow) * step;
        if (idx[at] == int64_t(self)) sum += to_acc(go[at]);
      }
    dx[e] = from_acc<T>(sum);
  }
}

// Max pooling's backward when the windows tile the input (stride = kernel, no padding, the
// output's extents times the kernel's = the input's): every input element lies in exactly one
// window, so a thread per output writes its whole window, the gradient at the maximum and
// zeros elsewhere: the gather's bits (its sum of one term, or of none), from a quarter of the
// threads for 2 x 2 windows, none of them working out which outputs cover an element.
template <class T, class I>
__global__ void max_backward_tiles_kernel(T* dx, const T* dy, const int64_t* indices, Geom<I> g, I n) {
  const I step = stride(g);
  LOOM_GRID_STRIDE(e, n) {
    const Place<I> p = place(e, g.div_out_h, g.div_out_w, g);
    T* in = dx + plane_start(p, g.h, g.w, g);
    const I best = I(indices[e]), row0 = p.row * g.kh, col0 = p.col * g.kw;
    const T grad = from_acc<T>(acc_t<T>(0) + to_acc(dy[e]));  // the gather's sum of one term: -0 becomes +0
    for (I ih = row0; ih < row0 + g.kh; ++ih)
      for (I iw = col0; iw < col0 + g.kw; ++iw) {
        const I at = ih * g.w + iw;
        in[at * step] = at == best ? grad : from_acc<T>(acc_t<T>(0));
      }
  }
}

bool windows_tile(const Pool2dArgs& a) {
  return a.stride_h == a.kh && a.stride_w == a.kw && a.pad_h == 0 && a.pad_w == 0 && a.out_h * a.kh == a.h &&
         a.out_w * a.kw == a.w;
}

template <class T, class I>
__global__ void avg_forward_kernel(T* y, const T* x, Geom<I> g, I n) {
  using A = acc_t<T>;
  const A scale = A(1) / A(g.kh * g.kw);
  const I step = stride(g);
  LOOM_GRID_STRIDE(e, n) {
    const Place<I> p = place(e, g.div_out_h, g.div_out_w, g);
    const T* in = x + plane_start(p, g.h, g.w, g);
    const pool::SpanOf<I> rows = pool::input_span(p.row, g.stride_h, g.pad_h, g.kh, g.h);
    const pool::SpanOf<I> cols = pool::input_span(p.col, g.stride_w, g.pad_w, g.kw, g.w);
    A sum = A(0);
    for (I ih = rows.begin; ih < rows.end; ++ih)
      for (I iw = cols.begin; iw < cols.end; ++iw) sum += to_acc(in[(ih * g.w + iw) * step]);
    y[e] = from_acc<T>(sum * scale);
  }
}

template <class T, class I>
__global__ void avg_backward_kernel(T* dx, const T* dy, Geom<I> g, I n) {
  using A = acc_t<T>;
  const A scale = A(1) / A(g.kh * g.kw);
  const I step = stride(g);
  LOOM_GRID_STRIDE(e, n) {
    const Place<I> p = place(e, g.div_h, g.div_w, g);
    const T* go = dy + plane_start(p, g.out_h, g.out_w, g);
    const pool::SpanOf<I> rows = pool::output_span_by(p.row, g.div_stride_h, g.pad_h, g.kh, g.out_h);
    const pool::SpanOf<I> cols = pool::output_span_by(p.col, g.div_stride_w, g.pad_w, g.kw, g.out_w);
    A sum = A(0);
    for (I oh = rows.begin; oh < rows.end; ++oh)
      for (I ow = cols.begin; ow < cols.end; ++ow) sum += to_acc(go[(oh * g.out_w + ow) * step]);
    dx[e] = from_acc<T>(sum * scale);
  }
}

#undef LOOM_GRID_STRIDE

int64_t input_numel(const Pool2dArgs& a) { return a.n * a.c * a.h * a.w; }
int64_t output_numel(const Pool2dArgs& a) { return a.n * a.c * a.out_h * a.out_w; }

// Calls f(I{}) with I = int32_t when both buffers of the call hold fewer than
// index32_limit elements and the window's extents are below it too (the output spans add
// the stride, the padding and the kernel to a position), else int64_t.
template <class F> void with_index(const Pool2dArgs& a, F&& f) {
  const int64_t limit = index32_limit.load();
  const int64_t window = std::max(a.stride_h + a.pad_h + a.kh, a.stride_w + a.pad_w + a.kw);
  if (input_numel(a) < limit && output_numel(a) < limit && window < limit) f(int32_t{});
  else f(int64_t{});
}

}  // namespace

int64_t set_pool_index32_limit(int64_t elements) {
  return index32_limit.exchange(std::min(elements, kIndex32Limit));
}

void max_pool2d_forward(const Pool2dArgs& a, void* y, int64_t* indices, const void* x, StreamHandle stream) {
  const int64_t n = output_numel(a);
  if (n == 0) return;
  dispatch_floating(a.dtype, "max_pool2d", [&](auto tag) {
    using T = decltype(tag);
    with_index(a, [&](auto index) {
      using I = decltype(index);
      max_forward_kernel<T, I><<<blocks_for(n, kThreads), kThreads, 0, as_cuda(stream)>>>(
          static_cast<T*>(y), indices, static_cast<const T*>(x), static_cast<const T*>(a.bias), geom<I>(a), I(n));
    });
  });
  LOOM_CUDA_LAUNCH();
}

void max_pool2d_backward(const Pool2dArgs& a, void* dx, const void* dy, const int64_t* indices,
                         StreamHandle stream) {
  const int64_t n = input_numel(a);
  if (n == 0) return;
  const bool tiles = windows_tile(a);
  dispatch_floating(a.dtype, "max_pool2d backward", [&](auto tag) {
    using T = decltype(tag);
    with_index(a, [&](auto index) {
      using I = decltype(index);
      if (tiles) {
        const int64_t outputs = output_numel(a);
        max_backward_tiles_kernel<T, I><<<blocks_for(outputs, kThreads), kThreads, 0, as_cuda(stream)>>>(
            static_cast<T*>(dx), static_cast<const T*>(dy), indices, geom<I>(a), I(outputs));
      } else {
        max_backward_kernel<T, I><<<blocks_for(n, kThreads), kThreads, 0, as_cuda(stream)>>>(
            static_cast<T*>(dx), static_cast<const T*>(dy), indices, geom<I>(a), I(n));
      }
    });
  });
  LOOM_CUDA_LAUNCH();
}

void avg_pool2d_forward(const Pool2dArgs& a, void* y, const void* x, StreamHandle stream) {
  const int64_t n = output_numel(a);
  if (n == 0) return;
  dispatch_floating(a.dtype, "avg_pool2d", [&](auto tag) {
    using T = decltype(tag);
    with_index(a, [&](auto index) {
      using I = decltype(index);
      avg_forward_kernel<T, I><<<blocks_for(n, kThreads), kThreads, 0, as_cuda(stream)>>>(
          static_cast<T*>(y), static_cast<const T*>(x), geom<I>(a), I(n));
    });
  });
  LOOM_CUDA_LAUNCH();
}

void avg_pool2d_backward(const Pool2dArgs& a, void* dx, const void* dy, StreamHandle stream) {
  const int64_t n = input_numel(a);
  if (n == 0) return;
  dispatch_floating(a.dtype, "avg_pool2d backward", [&](auto tag) {
    using T = decltype(tag);
    with_index(a, [&](auto index) {
      using I = decltype(index);
      avg_backward_kernel<T, I><<<blocks_for(n, kThreads), kThreads, 0, as_cuda(stream)>>>(
          static_cast<T*>(dx), static_cast<const T*>(dy), geom<I>(a), I(n));
    });
  });
  LOOM_CUDA_LAUNCH();
}

}  // namespace loom::cuda
