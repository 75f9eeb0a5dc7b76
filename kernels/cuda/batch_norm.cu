// CUDA batch normalisation over a contiguous (N, C, S) buffer: Loom's own kernels, not cuDNN.
// The table's entry points are here; they hand channels-last (N, S, C) calls to
// batch_norm_channels_last.cu. What both layouts share (the Welford states and gradient
// sums, the per-channel results, the combine kernels) is in batch_norm.cuh.
//
// Work layout. Every kernel runs on one grid shape: `groups` blocks per channel, block b
// taking channel b / groups and slice b % groups of that channel's values. A channel is N
// rows of S contiguous values, C * S apart. When S is a multiple of the 16-byte vector width
// and the buffers are 16-byte aligned, threads move whole vectors (4 f32, 8 bf16/f16, 2 f64),
// else single values. A thread walks its slice with an offset that advances by a fixed step
// and wraps at row ends, so the loops do no integer division.
//
// groups is chosen so the grid holds about kTargetBlocks blocks (two waves of 512-thread
// blocks on 132 SMs) while every thread still gets a few vectors: in ResNet-18 on CIFAR at
// N = 128 the first stage (C = 64, S = 1024) splits each channel 16 ways, the last
// (C = 512, S = 16) takes one block per channel.
//
// Statistics. Each thread keeps a Welford state (count, mean, M2) in the accumulation type
// and merges each vector's own mean and M2 into it with Chan's formula (one division per
// vector, not per value); states then merge across the block with shuffles in a fixed
// pattern. The backward's sums of dy and dy (x - mean) are plain sums, merged the same way.
//
// Scratch. With groups > 1 the blocks' partial states must be combined across blocks, and
// kernels may not allocate. The partials go into the output buffer itself (y in the
// forward, dx in the backward): it is as large as the input and is written in full only by
// the last launch. So each pass is three launches on the stream (partials, a block per
// channel combining them in a fixed order, the elementwise pass); with groups == 1 the
// first launch finishes each channel itself and the combine launch is skipped. No atomics:
// results are bitwise reproducible run to run. y and dx must therefore not alias an input
// (the engine allocates them fresh).
//
// Rows shorter than a memory sector (S = 1: BatchNorm1d on (N, C)) are read one strided
// value per thread: correct, at a fraction of the bandwidth.
#include <algorithm>
#include <cstdint>

#include "kernels/cuda/batch_norm.cuh"
#include "kernels/cuda/kernels.h"

namespace loom::cuda {
namespace {

using namespace batch_norm;

constexpr int kThreads = 512;
constexpr int64_t kTargetBlocks = 1024;
constexpr int64_t kMinVectorsPerThread = 4;  // before a channel is split over blocks

// Where a block finds its slice; the same for every launch of one call.
struct Geom {
  int64_t s;            // values per row
  int64_t row_stride;   // C * S
  int64_t sv;           // vectors per row: S / V
  int64_t per_channel;  // vectors per channel: N * sv
  int64_t chunk;        // vectors per block (a channel's last block may get fewer)
  int groups;           // blocks per channel
};

__device__ __forceinline__ int64_t block_channel(const Geom& g) { return blockIdx.x / unsigned(g.groups); }
__device__ __forceinline__ int block_group(const Geom& g) { return int(blockIdx.x % unsigned(g.groups)); }

// Calls f(offset) with the offset of the first value of each vector in this block's slice
// of `channel`, thread t taking vectors t, t + kThreads, ...
template <int V, class F>
__device__ __forceinline__ void for_each_vector(const Geom& g, int64_t channel, int group, F&& f) {
  const int64_t begin = group * g.chunk + threadIdx.x;
  const int64_t end = min(g.per_channel, (group + 1) * g.chunk);
  if (begin >= end) return;
  int64_t col = begin % g.sv;
  int64_t off = (begin / g.sv) * g.row_stride + channel * g.s + col * V;
  const int64_t drow = kThreads / g.sv, dcol = kThreads % g.sv;
  const int64_t step = drow * g.row_stride + dcol * V;
  const int64_t wrap = g.row_stride - g.sv * V;  // from column sv of one row to column 0 of the next
#pragma unroll 4
  for (int64_t k = begin; k < end; k += kThreads) {
    f(off);
    off += step;
    col += dcol;
    if (col >= g.sv) {
      col -= g.sv;
      off += wrap;
    }
  }
}

// ---- statistics ------------------------------------------------------------------------

// The Welford state of one vector, two-pass over its V values.
template <class A, class T, int V> __device__ __forceinline__ Welford<A> vector_stats(const Pack<T, V>& p) {
  A sum = A(0);
#pragma unroll
  for (int j = 0; j < V; ++j) sum += to_acc(p.v[j]);
  const A mean = sum * (A(1) / A(V));  // V is a power of two: exact
  A m2 = A(0);
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const A d = to_acc(p.v[j]) - mean;
    m2 += d * d;
  }
  return {A(V), mean, m2};
}

// A block's Welford state over its slice; groups == 1: the channel's statistics.
template <class T, int V>
__global__ void __launch_bounds__(kThreads)
    stats_kernel(const T* __restrict__ x, Geom g, Stats<acc_t<T>> out, Welford<acc_t<T>>* partials, Hyper h) {
  using A = acc_t<T>;
  const int64_t c = block_channel(g);
  Welford<A> st{A(0), A(0), A(0)};
  for_each_vector<V>(g, c, block_group(g),
                     [&](int64_t off) { st = WelfordMerge{}(st, vector_stats<A>(load<T, V>(x + off))); });
  st = group_reduce<kThreads>(st, WelfordMerge{});
  if (threadIdx.x != 0) return;
  if (g.groups == 1) finish_stats(st, c, out, h);
  else partials[blockIdx.x] = st;
}

// y = (x - mean) * invstd * gamma + beta; with kRelu, y = relu(that + residual) (residual
// may be null), rounded as the separate ops round (batch_norm.cuh, add_relu).
template <class T, int V, Source kSource, bool kRelu>
__global__ void __launch_bounds__(kThreads)
    normalize_kernel(T* __restrict__ y, const T* __restrict__ x, const T* __restrict__ residual, Geom g,
                     const acc_t<T>* mean, const acc_t<T>* spread, const acc_t<T>* gamma, const acc_t<T>* beta,
                     Hyper h) {
  using A = acc_t<T>;
  const int64_t c = block_channel(g);
  const A mu = mean[c];
  const A invstd = kSource == Source::batch ? spread[c] : A(1) / sqrt(spread[c] + A(h.eps));
  const A scale = invstd * (gamma ? gamma[c] : A(1)), shift = beta ? beta[c] : A(0);
  for_each_vector<V>(g, c, block_group(g), [&](int64_t off) {
    Pack<T, V> p = load<T, V>(x + off);
#pragma unroll
    for (int j = 0; j < V; ++j) p.v[j] = from_acc<T>((to_acc(p.v[j]) - mu) * scale + shift);
    if constexpr (kRelu) {
      Pack<T, V> r;
      if (residual) r = load<T, V>(residual + off);
      p = add_relu<T, V>(p, residual ? &r : nullptr);
    }
    store<T, V>(y + off, p);
  });
}

// ---- backward --------------------------------------------------------------------------

// A block's sums over its slice; groups == 1: the channel's dbeta and dgamma. With kRelu and
// dres not null, the masked dy is also written to dres, the residual's gradient, which
// grad_input_kernel then reads in place of dy and y.
template <class T, int V, bool kRelu>
__global__ void __launch_bounds__(kThreads)
    grad_sums_kernel(T* __restrict__ dres, const T* __restrict__ dy, const T* __restrict__ x,
                     const T* __restrict__ y, Geom g, GradChannel<acc_t<T>> ch, GradSums<acc_t<T>>* partials) {
  using A = acc_t<T>;
  const int64_t c = block_channel(g);
  const A mu = ch.save_mean[c];
  GradSums<A> acc{A(0), A(0)};
  for_each_vector<V>(g, c, block_group(g), [&](int64_t off) {
    const Pack<T, V> pg = masked_grad<T, V, kRelu>(dy, y, off), px = load<T, V>(x + off);
    if (kRelu && dres) store<T, V>(dres + off, pg);
    A s = A(0), sx = A(0);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const A gy = to_acc(pg.v[j]);
      s += gy;
      sx += gy * (to_acc(px.v[j]) - mu);
    }
    acc.dy += s;
    acc.dy_xmu += sx;
  });
  acc = group_reduce<kThreads>(acc, GradSumsAdd{});
  if (threadIdx.x != 0) return;
  if (g.groups == 1) finish_grads(acc, c, ch);
  else partials[blockIdx.x] = acc;
}

// dx = gamma invstd / M (M dy - dbeta - xhat dgamma), arranged as k_dy dy - k_x (x - mean) - k_0;
// with kRelu, dy masked by y, read from dres when grad_sums_kernel wrote it there.
template <class T, int V, bool kRelu>
__global__ void __launch_bounds__(kThreads)
    grad_input_kernel(T* __restrict__ dx, const T* __restrict__ dres, const T* __restrict__ dy,
                      const T* __restrict__ x, const T* __restrict__ y, Geom g, GradChannel<acc_t<T>> ch, Hyper h) {
  using A = acc_t<T>;
  const int64_t c = block_channel(g);
  const A m = A(h.m), mu = ch.save_mean[c], invstd = ch.save_invstd[c];
  const A k_dy = invstd * (ch.gamma ? ch.gamma[c] : A(1));
  const A k_x = k_dy * invstd * ch.dgamma[c] / m, k_0 = k_dy * ch.dbeta[c] / m;
  for_each_vector<V>(g, c, block_group(g), [&](int64_t off) {
    const Pack<T, V> pg = stored_or_masked_grad<T, V, kRelu>(dres, dy, y, off), px = load<T, V>(x + off);
    Pack<T, V> out;
#pragma unroll
    for (int j = 0; j < V; ++j)
      out.v[j] = from_acc<T>(k_dy * to_acc(pg.v[j]) - k_x * (to_acc(px.v[j]) - mu) - k_0);
    store<T, V>(dx + off, out);
  });
}

// ---- launch planning -------------------------------------------------------------------

// How many partials of partial_bytes each the output buffer `scratch` holds per channel:
// the most blocks a channel may be split over.
int64_t scratch_groups(const BatchNormArgs& a, const void* scratch, size_t partial_bytes, size_t partial_align) {
  if (!aligned(scratch, partial_align)) return 1;
  return a.n * a.s * int64_t(dtype_size(a.dtype)) / int64_t(partial_bytes);
}

// The grid for a call at vector width v, splitting a channel over at most max_groups blocks.
Geom plan(const BatchNormArgs& a, int v, int64_t max_groups) {
  Geom g;
  g.s = a.s;
  g.row_stride = a.c * a.s;
  g.sv = a.s / v;
  g.per_channel = a.n * g.sv;
  int64_t groups = std::min(ceil_div(kTargetBlocks, a.c), ceil_div(g.per_channel, kThreads * kMinVectorsPerThread));
  groups = std::max<int64_t>(1, std::min(groups, max_groups));
  g.chunk = ceil_div(g.per_channel, groups);
  g.groups = int(ceil_div(g.per_channel, g.chunk));  // no block left empty
  LOOM_ASSERT(a.c * g.groups <= int64_t(INT32_MAX), "batch_norm: ", a.c, " channels need too many blocks");
  return g;
}

}  // namespace

void batch_norm_forward_train(const BatchNormArgs& a, void* y, void* save_mean, void* save_invstd,
                              void* running_mean, void* running_var, const void* x, const void* gamma,
                              const void* beta, const void* residual, StreamHandle stream) {
  LOOM_ASSERT(a.relu || !residual, "batch_norm: a residual is added only before a fused ReLU");
  if (a.c == 0 || a.n * a.s == 0) return;
  if (a.layout == ChannelLayout::channels_last)
    return forward_train_channels_last(a, y, save_mean, save_invstd, running_mean, running_var, x, gamma, beta,
                                       residual, stream);
  dispatch_floating(a.dtype, "batch_norm", [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    with_width<T>(can_vectorise<T>(a.s, {x, y, residual}), [&](auto width) {
      constexpr int V = decltype(width)::value;
      const Geom g = plan(a, V, scratch_groups(a, y, sizeof(Welford<A>), alignof(Welford<A>)));
      const Hyper h{a.eps, a.momentum, double(a.n * a.s)};
      const Stats<A> out{static_cast<A*>(save_mean), static_cast<A*>(save_invstd), static_cast<A*>(running_mean),
                         static_cast<A*>(running_var)};
      auto* partials = static_cast<Welford<A>*>(y);
      const unsigned blocks = unsigned(a.c * g.groups);
      cudaStream_t s = as_cuda(stream);
      stats_kernel<T, V><<<blocks, kThreads, 0, s>>>(static_cast<const T*>(x), g, out, partials, h);
      LOOM_CUDA_LAUNCH();
      if (g.groups > 1) {
        with_combine_lanes(a.c, g.groups, [&](auto lanes, unsigned grid) {
          stats_combine_kernel<A, decltype(lanes)::value>
              <<<grid, kCombineThreads, 0, s>>>(partials, a.c, g.groups, out, h);
        });
        LOOM_CUDA_LAUNCH();
      }
      with_relu(a.relu, [&](auto relu) {
        normalize_kernel<T, V, Source::batch, decltype(relu)::value><<<blocks, kThreads, 0, s>>>(
            static_cast<T*>(y), static_cast<const T*>(x), static_cast<const T*>(residual), g, out.save_mean,
            out.save_invstd, static_cast<const A*>(gamma), static_cast<const A*>(beta), h);
        LOOM_CUDA_LAUNCH();
      });
    });
  });
}

void batch_norm_forward_eval(const BatchNormArgs& a, void* y, const void* x, const void* gamma, const void* beta,
                             const void* running_mean, const void* running_var, StreamHandle stream) {
  if (a.c == 0 || a.n * a.s == 0) return;
  if (a.layout == ChannelLayout::channels_last)
    return forward_eval_channels_last(a, y, x, gamma, beta, running_mean, running_var, stream);
  dispatch_floating(a.dtype, "batch_norm", [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    with_width<T>(can_vectorise<T>(a.s, {x, y}), [&](auto width) {
      constexpr int V = decltype(width)::value;
      const Geom g = plan(a, V, kTargetBlocks);  // no partials: any split
      normalize_kernel<T, V, Source::running, false><<<unsigned(a.c * g.groups), kThreads, 0, as_cuda(stream)>>>(
          static_cast<T*>(y), static_cast<const T*>(x), nullptr, g, static_cast<const A*>(running_mean),
          static_cast<const A*>(running_var), static_cast<const A*>(gamma), static_cast<const A*>(beta),
          Hyper{a.eps, a.momentum, double(a.n * a.s)});
      LOOM_CUDA_LAUNCH();
    });
  });
}

void batch_norm_backward(const BatchNormArgs& a, void* dx, void* dgamma, void* dbeta, const void* dy,
                         const void* x, const void* gamma, const void* save_mean, const void* save_invstd,
                         const void* y, void* dresidual, StreamHandle stream) {
  LOOM_ASSERT(a.relu == (y != nullptr) && (a.relu || !dresidual),
              "batch_norm backward: the fused ReLU's output is given exactly when args.relu is set");
  if (a.c == 0) return;
  if (a.layout == ChannelLayout::channels_last && a.n * a.s != 0)  // an empty batch: the zeroing below
    return backward_channels_last(a, dx, dgamma, dbeta, dy, x, gamma, save_mean, save_invstd, y, dresidual,
                                  stream);
  dispatch_floating(a.dtype, "batch_norm backward", [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    cudaStream_t s = as_cuda(stream);
    if (a.n * a.s == 0) {  // empty batch: zero sums, nothing else to write
      LOOM_CUDA(cudaMemsetAsync(dgamma, 0, size_t(a.c) * sizeof(A), s));
      LOOM_CUDA(cudaMemsetAsync(dbeta, 0, size_t(a.c) * sizeof(A), s));
      return;
    }
    with_width<T>(can_vectorise<T>(a.s, {dx, dy, x, y, dresidual}), [&](auto width) {
      constexpr int V = decltype(width)::value;
      const Geom g = plan(a, V, scratch_groups(a, dx, sizeof(GradSums<A>), alignof(GradSums<A>)));
      const GradChannel<A> ch{static_cast<const A*>(gamma), static_cast<const A*>(save_mean),
                              static_cast<const A*>(save_invstd), static_cast<A*>(dgamma), static_cast<A*>(dbeta)};
      auto* partials = static_cast<GradSums<A>*>(dx);
      const unsigned blocks = unsigned(a.c * g.groups);
      const T* out = static_cast<const T*>(y);
      with_relu(a.relu, [&](auto relu) {
        constexpr bool kRelu = decltype(relu)::value;
        grad_sums_kernel<T, V, kRelu><<<blocks, kThreads, 0, s>>>(
            static_cast<T*>(dresidual), static_cast<const T*>(dy), static_cast<const T*>(x), out, g, ch, partials);
        LOOM_CUDA_LAUNCH();
        if (g.groups > 1) {
          with_combine_lanes(a.c, g.groups, [&](auto lanes, unsigned grid) {
            grad_combine_kernel<A, decltype(lanes)::value>
                <<<grid, kCombineThreads, 0, s>>>(partials, a.c, g.groups, ch);
          });
          LOOM_CUDA_LAUNCH();
        }
        grad_input_kernel<T, V, kRelu><<<blocks, kThreads, 0, s>>>(
            static_cast<T*>(dx), static_cast<const T*>(dresidual), static_cast<const T*>(dy), static_cast<const T*>(x),
            out, g, ch, Hyper{a.eps, a.momentum, double(a.n * a.s)});
        LOOM_CUDA_LAUNCH();
      });
    });
  });
}

}  // namespace loom::cuda
