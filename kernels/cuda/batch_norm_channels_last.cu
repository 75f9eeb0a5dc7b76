// CUDA batch normalisation over a channels-last (N, S, C) buffer: M = N * S rows of C
// contiguous values, one per channel (NHWC with S = H * W). batch_norm.cu's entry points
// hand channels-last calls here; the per-channel arithmetic, the partials and the kernels
// that combine them are batch_norm.cuh's, as for (N, C, S). Only the walk differs.
//
// Work layout. A channel's values are C apart, so the threads of a warp take neighbouring
// channels. A block's kThreads threads are `lanes` channel lanes (a power of two, at most
// 32) by kThreads / lanes row lanes, thread t being channel lane t % lanes and row lane
// t / lanes: a warp reads 32 / lanes whole rows of the block's tile of channels. Each thread
// takes V neighbouring channels (16 bytes: 4 f32, 8 bf16/f16, 2 f64, when C is a multiple
// of that and the buffers are 16-byte aligned; else 1) and every (kThreads / lanes)-th row
// of the block's row range. The grid is `tiles` tiles of lanes * V channels by `groups` row
// ranges; block b takes tile b % tiles of range b / tiles, so blocks that run together read
// neighbouring memory. groups is chosen, as in batch_norm.cu, for about kTargetBlocks blocks
// with every thread still given kMinRowsPerThread rows. In ResNet-18 on CIFAR at N = 256 in
// bf16 the first stage (C = 64, M = 262144) is one tile of 8 lanes by 32 row lanes over 512
// ranges of 512 rows; the last (C = 512, M = 4096) is two tiles of 32 lanes by 8 over 32
// ranges of 128 rows. Shorter ranges (4 rows a thread) spent more of each block's time in
// its start and its merge than in reading, and gave the combine more partials; longer ones
// (32 rows a thread) left the GPU short of blocks at N = 256.
//
// Statistics. A thread keeps a Welford state for each of its V channels, with one count
// (they see the same rows), and updates it row by row: one division per row, shared by
// the V channels. kUnroll rows are loaded before any is used, so their loads overlap. The
// row lanes of a channel then merge: within the warp by shuffles in a fixed pattern, then
// across warps through shared memory, one thread per channel of the tile merging the
// warps' states in warp order. The backward's sums of dy and dy (x - mean) go the same way.
// With a fused ReLU and a residual, the sums' pass also stores the masked dy (the residual's
// gradient), and the dx pass reads it back in place of dy and y.
//
// Scratch. With groups > 1 each block writes its per-channel partials into the output
// buffer (y in the forward, dx in the backward), channel-major, from the buffer's first
// address aligned for them, so a misaligned output still holds them; the combine launch
// merges each channel's in a fixed order and the elementwise launch then overwrites the
// buffer. With groups == 1 the first launch finishes each channel itself. No atomics:
// results are bitwise reproducible run to run. y and dx must not alias an input.
#include <algorithm>
#include <cstdint>

#include "kernels/cuda/batch_norm.cuh"

namespace loom::cuda::batch_norm {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kUnroll = 4;                  // rows a thread loads before it uses them
constexpr int64_t kTargetBlocks = 1024;
constexpr int64_t kMinRowsPerThread = 16;   // before a tile's rows are split over blocks
static_assert(32 * 8 <= kThreads, "the warps' states are merged by a thread per channel of the widest tile");

// Where a block finds its channels and rows; the same for every launch of one call.
struct Geom {
  int64_t rows;     // M = N * S
  int64_t c;        // channels, the length of a row
  int64_t chunk;    // rows per block (a tile's last block may get fewer)
  int lanes;        // channel lanes, a power of two <= 32
  int row_lanes;    // kThreads / lanes
  int tiles;        // channel tiles of lanes * V channels
  int groups;       // row ranges
};

// A thread's share: channels col .. col + V - 1 of rows row, row + row_lanes, ... below end.
struct Lane {
  int channel_lane;
  int group;
  int64_t tile_c0;  // the tile's first channel
  int64_t col;
  int64_t row, end;  // end == row for a thread whose channels lie past C
};

template <int V> __device__ __forceinline__ Lane lane_of(const Geom& g) {
  Lane l;
  const unsigned tile = blockIdx.x % unsigned(g.tiles);
  l.group = int(blockIdx.x / unsigned(g.tiles));
  l.channel_lane = int(threadIdx.x) & (g.lanes - 1);
  l.tile_c0 = int64_t(tile) * g.lanes * V;
  l.col = l.tile_c0 + int64_t(l.channel_lane) * V;
  l.row = int64_t(l.group) * g.chunk + int(threadIdx.x) / g.lanes;
  l.end = l.col < g.c ? min(g.rows, int64_t(l.group + 1) * g.chunk) : l.row;
  return l;
}

// For each of the thread's rows, in order: use(load(offset), offset), offset being that of
// the thread's first channel in the row. kUnroll loads are issued before their uses.
template <class Load, class Use>
__device__ __forceinline__ void for_each_row(const Geom& g, const Lane& l, Load&& load, Use&& use) {
  using Item = decltype(load(int64_t(0)));
  const int64_t step = int64_t(g.row_lanes) * g.c;
  int64_t r = l.row, off = l.row * g.c + l.col;
  for (; r + int64_t(kUnroll - 1) * g.row_lanes < l.end; r += int64_t(kUnroll) * g.row_lanes) {
    Item items[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) items[u] = load(off + u * step);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) use(items[u], off + u * step);
    off += kUnroll * step;
  }
  for (; r < l.end; r += g.row_lanes, off += step) use(load(off), off);
}

template <class T, int V> struct PackPair {
  Pack<T, V> dy, x;
};

template <class T, int V> struct WithResidual {
  Pack<T, V> x, residual;  // residual: unset where there is none
};

// ---- statistics ------------------------------------------------------------------------

// Welford states of V channels that have seen the same rows.
template <class A, int V> struct WelfordVec {
  A n;
  A mean[V], m2[V];

  template <class T> __device__ __forceinline__ void add(const Pack<T, V>& p) {
    n += A(1);
    const A inv = A(1) / n;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const A x = to_acc(p.v[j]), d = x - mean[j];
      mean[j] += d * inv;
      m2[j] += d * (x - mean[j]);
    }
  }
};

// WelfordMerge for each channel, the weight shared.
struct WelfordVecMerge {
  template <class A, int V>
  __device__ __forceinline__ WelfordVec<A, V> operator()(WelfordVec<A, V> a, const WelfordVec<A, V>& b) const {
    if (b.n == A(0)) return a;
    if (a.n == A(0)) return b;
    const A n = a.n + b.n, w = b.n / n;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const A d = b.mean[j] - a.mean[j];
      a.mean[j] += d * w;
      a.m2[j] += b.m2[j] + d * d * a.n * w;
    }
    a.n = n;
    return a;
  }
};

template <class A, int V> struct SumsVec {
  A dy[V], dy_xmu[V];
};

struct SumsVecAdd {
  template <class A, int V>
  __device__ __forceinline__ SumsVec<A, V> operator()(SumsVec<A, V> a, const SumsVec<A, V>& b) const {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      a.dy[j] += b.dy[j];
      a.dy_xmu[j] += b.dy_xmu[j];
    }
    return a;
  }
};

// Merges a thread's per-channel value v over the block's row lanes. Returns, on thread
// t < lanes * V whose channel c = tile_c0 + t is below C, channel c's value for the whole
// block (false elsewhere). to_one(v, j) is v's channel j as a single value; merge_one merges
// those. The shuffle pattern and the warp order are fixed.
template <int V, class One, class Vec, class Merge, class ToOne, class MergeOne>
__device__ __forceinline__ bool merge_rows(const Geom& g, const Lane& l, Vec v, Merge merge, ToOne to_one,
                                           MergeOne merge_one, One (&warps)[kWarps][32 * V], One& result) {
  for (int m = g.lanes; m < 32; m <<= 1) v = merge(v, shfl_xor(v, m));
  if (int(threadIdx.x) % 32 < g.lanes) {
#pragma unroll
    for (int j = 0; j < V; ++j) warps[threadIdx.x / 32][l.channel_lane * V + j] = to_one(v, j);
  }
  __syncthreads();
  const int t = threadIdx.x;
  if (t >= g.lanes * V || l.tile_c0 + t >= g.c) return false;
  result = warps[0][t];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) result = merge_one(result, warps[w][t]);
  return true;
}

// A block's Welford states over its tile and rows; groups == 1: the channels' statistics.
template <class T, int V>
__global__ void __launch_bounds__(kThreads)
    stats_kernel(const T* __restrict__ x, Geom g, Stats<acc_t<T>> out, Welford<acc_t<T>>* partials, Hyper h) {
  using A = acc_t<T>;
  __shared__ Welford<A> warps[kWarps][32 * V];
  const Lane l = lane_of<V>(g);
  WelfordVec<A, V> st{};
  for_each_row(
      g, l, [&](int64_t off) { return load<T, V>(x + off); }, [&](const Pack<T, V>& p, int64_t) { st.add(p); });
  Welford<A> channel;
  const auto one = [](const WelfordVec<A, V>& v, int j) { return Welford<A>{v.n, v.mean[j], v.m2[j]}; };
  if (!merge_rows<V>(g, l, st, WelfordVecMerge{}, one, WelfordMerge{}, warps, channel)) return;
  const int64_t c = l.tile_c0 + threadIdx.x;
  if (g.groups == 1) finish_stats(channel, c, out, h);
  else partials[c * g.groups + l.group] = channel;
}

// y = (x - mean) * invstd * gamma + beta; with kRelu, y = relu(that + residual) (residual
// may be null), rounded as the separate ops round (batch_norm.cuh, add_relu).
template <class T, int V, Source kSource, bool kRelu>
__global__ void __launch_bounds__(kThreads)
    normalize_kernel(T* __restrict__ y, const T* __restrict__ x, const T* __restrict__ residual, Geom g,
                     const acc_t<T>* mean, const acc_t<T>* spread, const acc_t<T>* gamma, const acc_t<T>* beta,
                     Hyper h) {
  using A = acc_t<T>;
  const Lane l = lane_of<V>(g);
  if (l.row >= l.end) return;
  A mu[V], scale[V], shift[V];
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int64_t c = l.col + j;
    const A invstd = kSource == Source::batch ? spread[c] : A(1) / sqrt(spread[c] + A(h.eps));
    mu[j] = mean[c];
    scale[j] = invstd * (gamma ? gamma[c] : A(1));
    shift[j] = beta ? beta[c] : A(0);
  }
  for_each_row(
      g, l,
      [&](int64_t off) {
        WithResidual<T, V> in;
        in.x = load<T, V>(x + off);
        if (kRelu && residual) in.residual = load<T, V>(residual + off);
        return in;
      },
      [&](const WithResidual<T, V>& in, int64_t off) {
        Pack<T, V> p;
#pragma unroll
        for (int j = 0; j < V; ++j) p.v[j] = from_acc<T>((to_acc(in.x.v[j]) - mu[j]) * scale[j] + shift[j]);
        if constexpr (kRelu) p = add_relu<T, V>(p, residual ? &in.residual : nullptr);
        store<T, V>(y + off, p);
      });
}

// ---- backward --------------------------------------------------------------------------

// A block's sums over its tile and rows; groups == 1: the channels' dbeta and dgamma. With
// kRelu and dres not null, the masked dy is also written to dres, the residual's gradient,
// which grad_input_kernel then reads in place of dy and y.
template <class T, int V, bool kRelu>
__global__ void __launch_bounds__(kThreads)
    grad_sums_kernel(T* __restrict__ dres, const T* __restrict__ dy, const T* __restrict__ x,
                     const T* __restrict__ y, Geom g, GradChannel<acc_t<T>> ch, GradSums<acc_t<T>>* partials) {
  using A = acc_t<T>;
  __shared__ GradSums<A> warps[kWarps][32 * V];
  const Lane l = lane_of<V>(g);
  A mu[V];
#pragma unroll
  for (int j = 0; j < V; ++j) mu[j] = l.row < l.end ? ch.save_mean[l.col + j] : A(0);
  SumsVec<A, V> acc{};
  for_each_row(
      g, l, [&](int64_t off) { return PackPair<T, V>{masked_grad<T, V, kRelu>(dy, y, off), load<T, V>(x + off)}; },
      [&](const PackPair<T, V>& p, int64_t off) {
        if (kRelu && dres) store<T, V>(dres + off, p.dy);
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const A gy = to_acc(p.dy.v[j]);
          acc.dy[j] += gy;
          acc.dy_xmu[j] += gy * (to_acc(p.x.v[j]) - mu[j]);
        }
      });
  GradSums<A> channel;
  const auto one = [](const SumsVec<A, V>& v, int j) { return GradSums<A>{v.dy[j], v.dy_xmu[j]}; };
  if (!merge_rows<V>(g, l, acc, SumsVecAdd{}, one, GradSumsAdd{}, warps, channel)) return;
  const int64_t c = l.tile_c0 + threadIdx.x;
  if (g.groups == 1) finish_grads(channel, c, ch);
  else partials[c * g.groups + l.group] = channel;
}

// dx = gamma invstd / M (M dy - dbeta - xhat dgamma), arranged as k_dy dy - k_x (x - mean) - k_0;
// with kRelu, dy masked by y, read from dres when grad_sums_kernel wrote it there (one load
// instead of two, and this pass stores dx alone).
template <class T, int V, bool kRelu>
__global__ void __launch_bounds__(kThreads)
    grad_input_kernel(T* __restrict__ dx, const T* __restrict__ dres, const T* __restrict__ dy,
                      const T* __restrict__ x, const T* __restrict__ y, Geom g, GradChannel<acc_t<T>> ch, Hyper h) {
  using A = acc_t<T>;
  const Lane l = lane_of<V>(g);
  if (l.row >= l.end) return;
  const A m = A(h.m);
  A mu[V], k_dy[V], k_x[V], k_0[V];
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int64_t c = l.col + j;
    const A invstd = ch.save_invstd[c];
    mu[j] = ch.save_mean[c];
    k_dy[j] = invstd * (ch.gamma ? ch.gamma[c] : A(1));
    k_x[j] = k_dy[j] * invstd * ch.dgamma[c] / m;
    k_0[j] = k_dy[j] * ch.dbeta[c] / m;
  }
  for_each_row(
      g, l,
      [&](int64_t off) {
        return PackPair<T, V>{stored_or_masked_grad<T, V, kRelu>(dres, dy, y, off), load<T, V>(x + off)};
      },
      [&](const PackPair<T, V>& p, int64_t off) {
        Pack<T, V> out;
#pragma unroll
        for (int j = 0; j < V; ++j)
          out.v[j] = from_acc<T>(k_dy[j] * to_acc(p.dy.v[j]) - k_x[j] * (to_acc(p.x.v[j]) - mu[j]) - k_0[j]);
        store<T, V>(dx + off, out);
      });
}

// ---- launch planning -------------------------------------------------------------------

// The partials' place in an output buffer: from its first address aligned for Partial, and
// how many row ranges' partials of every channel fit there (at least 1: one range needs none).
template <class Partial> struct Scratch {
  Partial* partials;
  int64_t max_groups;
};

template <class Partial> Scratch<Partial> scratch_in(void* out, const BatchNormArgs& a) {
  const uintptr_t base = reinterpret_cast<uintptr_t>(out);
  const uintptr_t at = (base + alignof(Partial) - 1) / alignof(Partial) * alignof(Partial);
  const int64_t bytes = a.n * a.s * a.c * int64_t(dtype_size(a.dtype)) - int64_t(at - base);
  return {reinterpret_cast<Partial*>(at), std::max<int64_t>(1, bytes / (int64_t(sizeof(Partial)) * a.c))};
}

// The grid for a call at vector width v, splitting a tile's rows over at most max_groups blocks.
Geom plan(const BatchNormArgs& a, int v, int64_t max_groups) {
  Geom g;
  g.rows = a.n * a.s;
  g.c = a.c;
  const int64_t vectors = a.c / v;
  g.lanes = 1;
  while (g.lanes < 32 && g.lanes < vectors) g.lanes *= 2;
  g.row_lanes = kThreads / g.lanes;
  const int64_t tiles = ceil_div(vectors, g.lanes);
  int64_t groups = std::min(ceil_div(kTargetBlocks, tiles), ceil_div(g.rows, g.row_lanes * kMinRowsPerThread));
  groups = std::max<int64_t>(1, std::min(groups, max_groups));
  g.chunk = ceil_div(g.rows, groups);
  groups = ceil_div(g.rows, g.chunk);  // no block left without rows
  LOOM_ASSERT(tiles * groups <= int64_t(INT32_MAX), "batch_norm: ", a.c, " channels of ", g.rows,
              " rows need too many blocks");
  g.tiles = int(tiles);
  g.groups = int(groups);
  return g;
}

unsigned blocks_of(const Geom& g) { return unsigned(int64_t(g.tiles) * g.groups); }

}  // namespace

void forward_train_channels_last(const BatchNormArgs& a, void* y, void* save_mean, void* save_invstd,
                                 void* running_mean, void* running_var, const void* x, const void* gamma,
                                 const void* beta, const void* residual, StreamHandle stream) {
  dispatch_floating(a.dtype, "batch_norm", [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    with_width<T>(can_vectorise<T>(a.c, {x, y, residual}), [&](auto width) {
      constexpr int V = decltype(width)::value;
      const Scratch<Welford<A>> scratch = scratch_in<Welford<A>>(y, a);
      const Geom g = plan(a, V, scratch.max_groups);
      const Hyper h{a.eps, a.momentum, double(a.n * a.s)};
      const Stats<A> out{static_cast<A*>(save_mean), static_cast<A*>(save_invstd), static_cast<A*>(running_mean),
                         static_cast<A*>(running_var)};
      cudaStream_t s = as_cuda(stream);
      stats_kernel<T, V><<<blocks_of(g), kThreads, 0, s>>>(static_cast<const T*>(x), g, out, scratch.partials, h);
      LOOM_CUDA_LAUNCH();
      if (g.groups > 1) {
        with_combine_lanes(a.c, g.groups, [&](auto lanes, unsigned grid) {
          stats_combine_kernel<A, decltype(lanes)::value>
              <<<grid, kCombineThreads, 0, s>>>(scratch.partials, a.c, g.groups, out, h);
        });
        LOOM_CUDA_LAUNCH();
      }
      with_relu(a.relu, [&](auto relu) {
        normalize_kernel<T, V, Source::batch, decltype(relu)::value><<<blocks_of(g), kThreads, 0, s>>>(
            static_cast<T*>(y), static_cast<const T*>(x), static_cast<const T*>(residual), g, out.save_mean,
            out.save_invstd, static_cast<const A*>(gamma), static_cast<const A*>(beta), h);
        LOOM_CUDA_LAUNCH();
      });
    });
  });
}

void forward_eval_channels_last(const BatchNormArgs& a, void* y, const void* x, const void* gamma,
                                const void* beta, const void* running_mean, const void* running_var,
                                StreamHandle stream) {
  dispatch_floating(a.dtype, "batch_norm", [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    with_width<T>(can_vectorise<T>(a.c, {x, y}), [&](auto width) {
      constexpr int V = decltype(width)::value;
      const Geom g = plan(a, V, kTargetBlocks);  // no partials: any split
      normalize_kernel<T, V, Source::running, false><<<blocks_of(g), kThreads, 0, as_cuda(stream)>>>(
          static_cast<T*>(y), static_cast<const T*>(x), nullptr, g, static_cast<const A*>(running_mean),
          static_cast<const A*>(running_var), static_cast<const A*>(gamma), static_cast<const A*>(beta),
          Hyper{a.eps, a.momentum, double(a.n * a.s)});
      LOOM_CUDA_LAUNCH();
    });
  });
}

void backward_channels_last(const BatchNormArgs& a, void* dx, void* dgamma, void* dbeta, const void* dy,
                            const void* x, const void* gamma, const void* save_mean, const void* save_invstd,
                            const void* y, void* dresidual, StreamHandle stream) {
  dispatch_floating(a.dtype, "batch_norm backward", [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    with_width<T>(can_vectorise<T>(a.c, {dx, dy, x, y, dresidual}), [&](auto width) {
      constexpr int V = decltype(width)::value;
      const Scratch<GradSums<A>> scratch = scratch_in<GradSums<A>>(dx, a);
      const Geom g = plan(a, V, scratch.max_groups);
      const GradChannel<A> ch{static_cast<const A*>(gamma), static_cast<const A*>(save_mean),
                              static_cast<const A*>(save_invstd), static_cast<A*>(dgamma), static_cast<A*>(dbeta)};
      cudaStream_t s = as_cuda(stream);
      const T* out = static_cast<const T*>(y);
      with_relu(a.relu, [&](auto relu) {
        constexpr bool kRelu = decltype(relu)::value;
        grad_sums_kernel<T, V, kRelu><<<blocks_of(g), kThreads, 0, s>>>(
            static_cast<T*>(dresidual), static_cast<const T*>(dy), static_cast<const T*>(x), out, g, ch,
            scratch.partials);
        LOOM_CUDA_LAUNCH();
        if (g.groups > 1) {
          with_combine_lanes(a.c, g.groups, [&](auto lanes, unsigned grid) {
            grad_combine_kernel<A, decltype(lanes)::value>
                <<<grid, kCombineThreads, 0, s>>>(scratch.partials, a.c, g.groups, ch);
          });
          LOOM_CUDA_LAUNCH();
        }
        grad_input_kernel<T, V, kRelu><<<blocks_of(g), kThreads, 0, s>>>(
            static_cast<T*>(dx), static_cast<const T*>(dresidual), static_cast<const T*>(dy), static_cast<const T*>(x), out,
            g, ch, Hyper{a.eps, a.momentum, double(a.n * a.s)});
        LOOM_CUDA_LAUNCH();
      });
    });
  });
}

}  // namespace loom::cuda::batch_norm
