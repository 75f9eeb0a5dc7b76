// What the two CUDA batch-norm files share: the per-channel statistics and gradient sums as
// the kernels carry and merge them, the per-channel results made from them, and the kernels
// that merge the partial results of the blocks a channel was split over, a block per channel
// in a fixed order, from partials stored channel-major ((C, groups): channel c's at
// c * groups + group). batch_norm.cu holds the (N, C, S) kernels and the table's entry
// points, which hand channels-last calls to batch_norm_channels_last.cu. Contracts are on
// the KernelTable entries in kernels/table.h.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/reduce_common.cuh"
#include "kernels/table.h"

namespace loom::cuda::batch_norm {

// The combine kernels give each channel kLanes threads of a kCombineThreads block: lane t
// merges partials t, t + kLanes, ... (at most a few), then the lanes merge their states in
// a fixed pattern (group_reduce). A channel split over more than 32 row ranges takes a
// whole block (kLanes = kCombineThreads): a warp walking a thousand partials one load after
// another was latency-bound. One split over at most 32 takes a warp (kLanes = 32, each lane
// one load at most), so a call of many channels and few ranges (channels-last, wide C)
// does not launch a block per channel for a few loads each. with_combine_lanes picks.
constexpr int kCombineThreads = 256;

// Scalars of the call, in double on the host; the kernels round them to the accumulation type.
struct Hyper {
  double eps, momentum, m;  // m = N * S, values per channel
};

// ---- statistics ------------------------------------------------------------------------

template <class A> struct Welford {
  A n, mean, m2;  // count, mean, sum of squared deviations from the mean
};

struct WelfordMerge {
  template <class A> __device__ __forceinline__ Welford<A> operator()(Welford<A> a, Welford<A> b) const {
    const A n = a.n + b.n;
    if (n == A(0)) return a;
    const A w = b.n / n, d = b.mean - a.mean;
    return {n, a.mean + d * w, a.m2 + b.m2 + d * d * a.n * w};
  }
};

// The forward's per-channel outputs; running statistics may be null.
template <class A> struct Stats {
  A* save_mean;
  A* save_invstd;
  A* running_mean;
  A* running_var;
};

template <class A> __device__ __forceinline__ void finish_stats(const Welford<A>& st, int64_t c, const Stats<A>& out,
                                                                const Hyper& h) {
  const A m = A(h.m), var = st.m2 / m, momentum = A(h.momentum);
  out.save_mean[c] = st.mean;
  out.save_invstd[c] = A(1) / sqrt(var + A(h.eps));
  if (out.running_mean) out.running_mean[c] = (A(1) - momentum) * out.running_mean[c] + momentum * st.mean;
  if (out.running_var) out.running_var[c] = (A(1) - momentum) * out.running_var[c] + momentum * (st.m2 / (m - A(1)));
}

// Channel c's `groups` partial states merged, always in the same order, by kLanes threads
// (see kCombineThreads).
template <class A, int kLanes>
__global__ void __launch_bounds__(kCombineThreads) stats_combine_kernel(const Welford<A>* partials, int64_t channels,
                                                                        int groups, Stats<A> out, Hyper h) {
  static_assert(kLanes == 32 || kLanes == kCombineThreads, "a warp or the whole block per channel");
  const int lane = threadIdx.x % kLanes;
  const int64_t c = int64_t(blockIdx.x) * (kCombineThreads / kLanes) + threadIdx.x / kLanes;
  if (kLanes == 32 && c >= channels) return;  // the whole warp leaves; a warp's merge has no barrier
  const Welford<A>* channel = partials + c * groups;
  Welford<A> st{A(0), A(0), A(0)};
  for (int k = lane; k < groups; k += kLanes) st = WelfordMerge{}(st, channel[k]);
  st = group_reduce<kLanes>(st, WelfordMerge{});
  if (lane == 0) finish_stats(st, c, out, h);
}

// Where a channel's mean and spread come from: the batch (save_mean, save_invstd) or the
// running statistics (running_mean, running_var).
enum class Source { batch, running };

// ---- the fused ReLU (BatchNormArgs::relu) ----------------------------------------------

// The residual (null: none) added as add() adds two tensors, in the accumulation type and
// rounded once, then ReLU as relu() takes it: the bits of the three ops run apart.
template <class T, int V>
__device__ __forceinline__ Pack<T, V> add_relu(Pack<T, V> p, const Pack<T, V>* residual) {
  using A = acc_t<T>;
  if (residual) {
#pragma unroll
    for (int j = 0; j < V; ++j) p.v[j] = from_acc<T>(to_acc(p.v[j]) + to_acc(residual->v[j]));
  }
#pragma unroll
  for (int j = 0; j < V; ++j)
    if (to_acc(p.v[j]) < A(0)) p.v[j] = from_acc<T>(A(0));
  return p;
}

// The gradient that reaches the normalisation: dy, and with kRelu dy where y > 0, else 0.
template <class T, int V, bool kRelu>
__device__ __forceinline__ Pack<T, V> masked_grad(const T* __restrict__ dy, const T* __restrict__ y, int64_t off) {
  using A = acc_t<T>;
  Pack<T, V> g = load<T, V>(dy + off);
  if constexpr (kRelu) {
    const Pack<T, V> out = load<T, V>(y + off);
#pragma unroll
    for (int j = 0; j < V; ++j)
      if (!(to_acc(out.v[j]) > A(0))) g.v[j] = from_acc<T>(A(0));
  }
  return g;
}

// The masked dy as the dx pass reads it: from dres, where the sums' pass stored it as the
// residual's gradient (not null only with kRelu), else dy masked by y.
template <class T, int V, bool kRelu>
__device__ __forceinline__ Pack<T, V> stored_or_masked_grad(const T* __restrict__ dres, const T* __restrict__ dy,
                                                            const T* __restrict__ y, int64_t off) {
  if (kRelu && dres) return load<T, V>(dres + off);
  return masked_grad<T, V, kRelu>(dy, y, off);
}

// ---- backward --------------------------------------------------------------------------

template <class A> struct GradSums {
  A dy, dy_xmu;  // sum dy, sum dy * (x - mean)
};

struct GradSumsAdd {
  template <class A> __device__ __forceinline__ GradSums<A> operator()(GradSums<A> a, GradSums<A> b) const {
    return {a.dy + b.dy, a.dy_xmu + b.dy_xmu};
  }
};

// The backward's per-channel inputs and outputs.
template <class A> struct GradChannel {
  const A* gamma;  // null: 1
  const A* save_mean;
  const A* save_invstd;
  A* dgamma;
  A* dbeta;
};

template <class A>
__device__ __forceinline__ void finish_grads(const GradSums<A>& s, int64_t c, const GradChannel<A>& ch) {
  ch.dbeta[c] = s.dy;
  ch.dgamma[c] = s.dy_xmu * ch.save_invstd[c];
}

// As stats_combine_kernel, for the backward's sums.
template <class A, int kLanes>
__global__ void __launch_bounds__(kCombineThreads) grad_combine_kernel(const GradSums<A>* partials, int64_t channels,
                                                                       int groups, GradChannel<A> ch) {
  static_assert(kLanes == 32 || kLanes == kCombineThreads, "a warp or the whole block per channel");
  const int lane = threadIdx.x % kLanes;
  const int64_t c = int64_t(blockIdx.x) * (kCombineThreads / kLanes) + threadIdx.x / kLanes;
  if (kLanes == 32 && c >= channels) return;  // the whole warp leaves; a warp's merge has no barrier
  const GradSums<A>* channel = partials + c * groups;
  GradSums<A> acc{A(0), A(0)};
  for (int k = lane; k < groups; k += kLanes) acc = GradSumsAdd{}(acc, channel[k]);
  acc = group_reduce<kLanes>(acc, GradSumsAdd{});
  if (lane == 0) finish_grads(acc, c, ch);
}

// ---- launch planning -------------------------------------------------------------------

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Calls launch(std::integral_constant<int, kLanes>{}, blocks): the combine kernels' threads
// per channel for `groups` partials a channel (see kCombineThreads) and their grid.
template <class F> void with_combine_lanes(int64_t channels, int groups, F&& launch) {
  auto go = [&](auto lanes) {
    const int64_t blocks = ceil_div(channels, kCombineThreads / decltype(lanes)::value);
    LOOM_ASSERT(blocks <= int64_t(INT32_MAX), "batch_norm: ", channels, " channels need too many blocks");
    launch(lanes, unsigned(blocks));
  };
  if (groups <= 32) go(std::integral_constant<int, 32>{});
  else go(std::integral_constant<int, kCombineThreads>{});
}

inline bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// Calls f(std::integral_constant<int, V>) with V the vector width the call can use.
template <class T, class F> void with_width(bool vectors, F&& f) {
  if (vectors) f(std::integral_constant<int, int(16 / sizeof(T))>{});
  else f(std::integral_constant<int, 1>{});
}

// Calls f(std::bool_constant<relu>): the kernels' fused-ReLU variant or the plain one.
template <class F> void with_relu(bool relu, F&& f) {
  if (relu) f(std::true_type{});
  else f(std::false_type{});
}

// Whether the buffers can move whole 16-byte vectors: rows of `run` contiguous values that
// hold a whole number of them, and every buffer 16-byte aligned.
template <class T> bool can_vectorise(int64_t run, std::initializer_list<const void*> buffers) {
  if (run % int64_t(16 / sizeof(T)) != 0) return false;
  for (const void* p : buffers)  // null: a buffer the call does not use
    if (p && !aligned(p, 16)) return false;
  return true;
}

// ---- the channels-last entry points (batch_norm_channels_last.cu) ----------------------
// The table's contracts for args.layout == channels_last, called by batch_norm.cu's entries
// once they have dealt with empty shapes (C == 0, N * S == 0).
void forward_train_channels_last(const BatchNormArgs& args, void* y, void* save_mean, void* save_invstd,
                                 void* running_mean, void* running_var, const void* x, const void* gamma,
                                 const void* beta, const void* residual, StreamHandle stream);
void forward_eval_channels_last(const BatchNormArgs& args, void* y, const void* x, const void* gamma,
                                const void* beta, const void* running_mean, const void* running_var,
                                StreamHandle stream);
void backward_channels_last(const BatchNormArgs& args, void* dx, void* dgamma, void* dbeta, const void* dy,
                            const void* x, const void* gamma, const void* save_mean, const void* save_invstd,
                            const void* y, void* dresidual, StreamHandle stream);

}  // namespace loom::cuda::batch_norm
