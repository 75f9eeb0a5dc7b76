// CUDA 2-d max and average pooling over NCHW planes: one thread per output element in the
// forward passes, one thread per input element in the backward passes.
//
// The backward passes gather: an input element sums the gradients of the outputs whose
// windows cover it (kernels/core/pool_window.h, shared with the CPU kernels), in a fixed
// order. No atomics, so the gradients are bitwise reproducible, and every element of dx
// is written, so dx needs no zero-fill first. With the small windows of CNN pooling
// (2x2, 3x3) a thread reads at most a few outputs.
#include <cstdint>
#include <limits>

#include "kernels/core/pool_window.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

namespace loom::cuda {
namespace {

constexpr int kThreads = 256;

// Pool2dArgs by value, trimmed to what the device needs.
struct Geom {
  int64_t h, w, out_h, out_w, kh, kw, stride_h, stride_w, pad_h, pad_w;
};

Geom geom(const Pool2dArgs& a) {
  LOOM_ASSERT(a.layout == ChannelLayout::channels_first, "pooling: the CUDA kernels take NCHW buffers");
  return {a.h, a.w, a.out_h, a.out_w, a.kh, a.kw, a.stride_h, a.stride_w, a.pad_h, a.pad_w};
}

#define LOOM_GRID_STRIDE(e, n) \
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < (n); e += int64_t(gridDim.x) * blockDim.x)

template <class T>
__global__ void max_forward_kernel(T* y, int64_t* indices, const T* x, Geom g, int64_t n) {
  using A = acc_t<T>;
  LOOM_GRID_STRIDE(e, n) {
    const int64_t ow = e % g.out_w, oh = e / g.out_w % g.out_h, plane = e / (g.out_w * g.out_h);
    const T* in = x + plane * g.h * g.w;
    const pool::Span rows = pool::input_span(oh, g.stride_h, g.pad_h, g.kh, g.h);
    const pool::Span cols = pool::input_span(ow, g.stride_w, g.pad_w, g.kw, g.w);
    A best = -std::numeric_limits<A>::infinity();
    int64_t best_at = rows.begin * g.w + cols.begin;
    for (int64_t ih = rows.begin; ih < rows.end; ++ih)
      for (int64_t iw = cols.begin; iw < cols.end; ++iw) {
        const A v = to_acc(in[ih * g.w + iw]);
        if (v > best || v != v) {
          best = v;
          best_at = ih * g.w + iw;
        }
      }
    y[e] = from_acc<T>(best);
    indices[e] = best_at;
  }
}

template <class T>
__global__ void max_backward_kernel(T* dx, const T* dy, const int64_t* indices, Geom g, int64_t n) {
  using A = acc_t<T>;
  LOOM_GRID_STRIDE(e, n) {
    const int64_t iw = e % g.w, ih = e / g.w % g.h, plane = e / (g.w * g.h);
    const int64_t ohw = g.out_h * g.out_w, self = ih * g.w + iw;
    const T* go = dy + plane * ohw;
    const int64_t* idx = indices + plane * ohw;
    const pool::Span rows = pool::output_span(ih, g.stride_h, g.pad_h, g.kh, g.out_h);
    const pool::Span cols = pool::output_span(iw, g.stride_w, g.pad_w, g.kw, g.out_w);
    A sum = A(0);
    for (int64_t oh = rows.begin; oh < rows.end; ++oh)
      for (int64_t ow = cols.begin; ow < cols.end; ++ow)
        if (idx[oh * g.out_w + ow] == self) sum += to_acc(go[oh * g.out_w + ow]);
    dx[e] = from_acc<T>(sum);
  }
}

template <class T>
__global__ void avg_forward_kernel(T* y, const T* x, Geom g, int64_t n) {
  using A = acc_t<T>;
  const A scale = A(1) / A(g.kh * g.kw);
  LOOM_GRID_STRIDE(e, n) {
    const int64_t ow = e % g.out_w, oh = e / g.out_w % g.out_h, plane = e / (g.out_w * g.out_h);
    const T* in = x + plane * g.h * g.w;
    const pool::Span rows = pool::input_span(oh, g.stride_h, g.pad_h, g.kh, g.h);
    const pool::Span cols = pool::input_span(ow, g.stride_w, g.pad_w, g.kw, g.w);
    A sum = A(0);
    for (int64_t ih = rows.begin; ih < rows.end; ++ih)
      for (int64_t iw = cols.begin; iw < cols.end; ++iw) sum += to_acc(in[ih * g.w + iw]);
    y[e] = from_acc<T>(sum * scale);
  }
}

template <class T>
__global__ void avg_backward_kernel(T* dx, const T* dy, Geom g, int64_t n) {
  using A = acc_t<T>;
  const A scale = A(1) / A(g.kh * g.kw);
  LOOM_GRID_STRIDE(e, n) {
    const int64_t iw = e % g.w, ih = e / g.w % g.h, plane = e / (g.w * g.h);
    const T* go = dy + plane * g.out_h * g.out_w;
    const pool::Span rows = pool::output_span(ih, g.stride_h, g.pad_h, g.kh, g.out_h);
    const pool::Span cols = pool::output_span(iw, g.stride_w, g.pad_w, g.kw, g.out_w);
    A sum = A(0);
    for (int64_t oh = rows.begin; oh < rows.end; ++oh)
      for (int64_t ow = cols.begin; ow < cols.end; ++ow) sum += to_acc(go[oh * g.out_w + ow]);
    dx[e] = from_acc<T>(sum * scale);
  }
}

#undef LOOM_GRID_STRIDE

int64_t input_numel(const Pool2dArgs& a) { return a.n * a.c * a.h * a.w; }
int64_t output_numel(const Pool2dArgs& a) { return a.n * a.c * a.out_h * a.out_w; }

}  // namespace

void max_pool2d_forward(const Pool2dArgs& a, void* y, int64_t* indices, const void* x, StreamHandle stream) {
  const int64_t n = output_numel(a);
  if (n == 0) return;
  dispatch_floating(a.dtype, "max_pool2d", [&](auto tag) {
    using T = decltype(tag);
    max_forward_kernel<T><<<blocks_for(n, kThreads), kThreads, 0, as_cuda(stream)>>>(
        static_cast<T*>(y), indices, static_cast<const T*>(x), geom(a), n);
  });
  LOOM_CUDA_LAUNCH();
}

void max_pool2d_backward(const Pool2dArgs& a, void* dx, const void* dy, const int64_t* indices,
                         StreamHandle stream) {
  const int64_t n = input_numel(a);
  if (n == 0) return;
  dispatch_floating(a.dtype, "max_pool2d backward", [&](auto tag) {
    using T = decltype(tag);
    max_backward_kernel<T><<<blocks_for(n, kThreads), kThreads, 0, as_cuda(stream)>>>(
        static_cast<T*>(dx), static_cast<const T*>(dy), indices, geom(a), n);
  });
  LOOM_CUDA_LAUNCH();
}

void avg_pool2d_forward(const Pool2dArgs& a, void* y, const void* x, StreamHandle stream) {
  const int64_t n = output_numel(a);
  if (n == 0) return;
  dispatch_floating(a.dtype, "avg_pool2d", [&](auto tag) {
    using T = decltype(tag);
    avg_forward_kernel<T><<<blocks_for(n, kThreads), kThreads, 0, as_cuda(stream)>>>(
        static_cast<T*>(y), static_cast<const T*>(x), geom(a), n);
  });
  LOOM_CUDA_LAUNCH();
}

void avg_pool2d_backward(const Pool2dArgs& a, void* dx, const void* dy, StreamHandle stream) {
  const int64_t n = input_numel(a);
  if (n == 0) return;
  dispatch_floating(a.dtype, "avg_pool2d backward", [&](auto tag) {
    using T = decltype(tag);
    avg_backward_kernel<T><<<blocks_for(n, kThreads), kThreads, 0, as_cuda(stream)>>>(
        static_cast<T*>(dx), static_cast<const T*>(dy), geom(a), n);
  });
  LOOM_CUDA_LAUNCH();
}

}  // namespace loom::cuda
