// CPU batch normalisation over a contiguous (N, C, S) buffer or a channels-last (N, S, C)
// one: threads over tiles of channels, each tile handled by one thread.
//
// This is the reference the CUDA kernels are checked against, so every per-channel sum
// is pairwise in double whatever the dtype: a sample's S values pairwise, the N sample
// totals pairwise. The statistics are two-pass (mean, then the mean of squared deviations),
// so a large mean never cancels against the variance. Values are normalised in double from
// the double statistics and rounded once to the output dtype; the per-channel outputs are
// rounded to the accumulation type (f32, f64 for f64) that the contract gives them.
//
// Both layouts add each channel's values in that same order, so a channels-last tensor
// normalises to the bits of its row-major copy. Only the walk differs. Row-major, a tile is
// one channel: N rows of S contiguous values. Channels-last, a channel's values are C apart,
// so a tile is K neighbouring channels (16 or 4), read as short contiguous runs of each of
// the N * S rows, with one running sum per channel of the tile.
//
// BatchNormArgs::relu fuses a residual add and a ReLU into the forward's last pass and the
// ReLU's mask into the backward's two, rounding as the separate ops do (add_relu, masked).
#include <algorithm>
#include <cmath>

#include "kernels/cpu/common.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/masked_select.h"
#include "kernels/cpu/pairwise.h"
#include "kernels/cpu/parallel_for.h"

namespace loom::cpu {
namespace {

// Two sums carried together (the backward's sum dy and sum dy * (x - mean)).
struct Sums {
  double a = 0, b = 0;
  Sums& operator+=(const Sums& o) {
    a += o.a;
    b += o.b;
    return *this;
  }
};

// Where element (n, c, s) lies in the buffer: n * batch + c * channel + s * value.
struct Walk {
  int64_t batch, channel, value;
};

Walk walk_of(const BatchNormArgs& a) {
  if (a.layout == ChannelLayout::channels_last) return {a.s * a.c, 1, a.c};
  return {a.c * a.s, a.s, 1};
}

// A value for each of K neighbouring channels, the K carried and summed side by side.
template <class V, int K> struct Lanes {
  V v[K]{};
  Lanes& operator+=(const Lanes& o) {
    for (int j = 0; j < K; ++j) v[j] += o.v[j];
    return *this;
  }
};

// Pairwise sum of f(r) over [r0, r1), V being double, Sums or Lanes of them.
template <class V, class F>
V pairwise(int64_t r0, int64_t r1, const F& f) {
  if (r1 - r0 <= kPairwiseLeaf) {
    V s{};
    for (int64_t r = r0; r < r1; ++r) s += f(r);
    return s;
  }
  const int64_t mid = r0 + (r1 - r0) / 2;
  V s = pairwise<V>(r0, mid, f);
  s += pairwise<V>(mid, r1, f);
  return s;
}

// For each channel c0 + j, j < K, the sum over its (n, s) of f(offset, j), offset being the
// element's index in the buffer.
template <int K, class V, class F>
Lanes<V, K> tile_sum(const BatchNormArgs& a, const Walk& w, int64_t c0, const F& f) {
  return pairwise<Lanes<V, K>>(0, a.n, [&](int64_t n) {
    return pairwise<Lanes<V, K>>(0, a.s, [&](int64_t s) {
      const int64_t at = n * w.batch + c0 * w.channel + s * w.value;
      Lanes<V, K> values;
      for (int j = 0; j < K; ++j) values.v[j] = f(at + j * w.channel, j);
      return values;
    });
  });
}

// Calls f(offset, j) for every element of channels c0 .. c0 + K - 1, in memory order.
template <int K, class F>
void for_each_in_tile(const BatchNormArgs& a, const Walk& w, int64_t c0, const F& f) {
  for (int64_t n = 0; n < a.n; ++n)
    for (int64_t s = 0; s < a.s; ++s) {
      const int64_t at = n * w.batch + c0 * w.channel + s * w.value;
      for (int j = 0; j < K; ++j) f(at + j * w.channel, j);
    }
}

// Channels per tile: one row-major; channels-last, 16 or 4 where that still leaves every
// thread a tile, else one. The width changes no sum's order, only the walk.
int tile_width(const BatchNormArgs& a) {
  if (a.layout == ChannelLayout::channels_first) return 1;
  const int64_t per_thread = a.c / num_threads();
  return per_thread >= 16 ? 16 : per_thread >= 4 ? 4 : 1;
}

// Runs body(T{}, std::integral_constant<int, K>{}, c0) over the channels in parallel, T
// being the element type and each call taking channels c0 .. c0 + K - 1: tiles of the
// width tile_width() gives, and the channels left over one at a time.
template <class Body>
void for_each_tile(const BatchNormArgs& a, const char* what, Body&& body) {
  dispatch_floating(a.dtype, what, [&](auto tag) {
    auto run = [&](auto width) {
      constexpr int K = decltype(width)::value;
      const int64_t wide = a.c / K, tiles = wide + a.c % K;
      const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 14) / std::max<int64_t>(a.n * a.s * K, 1));
      parallel_for(tiles, grain, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) {
          if (t < wide) body(tag, width, t * K);
          else body(tag, std::integral_constant<int, 1>{}, wide * K + (t - wide));
        }
      });
    };
    switch (tile_width(a)) {
      case 16: return run(std::integral_constant<int, 16>{});
      case 4: return run(std::integral_constant<int, 4>{});
      default: return run(std::integral_constant<int, 1>{});
    }
  });
}

template <class T> double as_double(T v) { return double(acc_t<T>(v)); }

// BatchNormArgs::relu's epilogue on a normalised value: the residual added as add() adds two
// tensors (in the accumulation type, rounded once), then ReLU as relu() takes it. The choices
// go through masked_select (kernels/cpu/masked_select.h): a plain select of floats stays a
// branch, which the signs of normalised values mispredict half the time. T to A and back is
// exact, so the results are the plain select's.
template <class T> T add_relu(T v, const T* residual) {
  using A = acc_t<T>;
  if (residual) v = T(A(v) + A(*residual));
  const A av = A(v);
  return T(masked_select(av < A(0), A(0), av));
}

// The gradient that reaches the normalisation: dy, masked by the fused ReLU's output.
template <class T> T masked(const BatchNormArgs& a, const T* dy, const T* y, int64_t i) {
  using A = acc_t<T>;
  if (!a.relu) return dy[i];
  return T(masked_select(A(y[i]) > A(0), A(dy[i]), A(0)));
}

}  // namespace

void batch_norm_forward_train(const BatchNormArgs& a, void* y, void* save_mean, void* save_invstd,
                              void* running_mean, void* running_var, const void* x, const void* gamma,
                              const void* beta, const void* residual, StreamHandle) {
  LOOM_ASSERT(a.relu || !residual, "batch_norm: a residual is added only before a fused ReLU");
  const int64_t m = a.n * a.s;
  if (m == 0) return;
  const Walk w = walk_of(a);
  for_each_tile(a, "batch_norm", [&](auto tag, auto width, int64_t c0) {
    using T = decltype(tag);
    using A = acc_t<T>;
    constexpr int K = decltype(width)::value;
    const T* in = static_cast<const T*>(x);
    const T* res = static_cast<const T*>(residual);
    T* out = static_cast<T*>(y);
    Lanes<double, K> mean = tile_sum<K, double>(a, w, c0, [&](int64_t i, int) { return as_double(in[i]); });
    for (double& v : mean.v) v /= double(m);
    Lanes<double, K> var = tile_sum<K, double>(a, w, c0, [&](int64_t i, int j) {
      const double d = as_double(in[i]) - mean.v[j];
      return d * d;
    });
    double scale[K], shift[K];
    for (int j = 0; j < K; ++j) {
      const int64_t c = c0 + j;
      var.v[j] /= double(m);
      const double invstd = 1.0 / std::sqrt(var.v[j] + a.eps);
      static_cast<A*>(save_mean)[c] = A(mean.v[j]);
      static_cast<A*>(save_invstd)[c] = A(invstd);
      if (running_mean) {
        A& r = static_cast<A*>(running_mean)[c];
        r = A((1 - a.momentum) * double(r) + a.momentum * mean.v[j]);
      }
      if (running_var) {
        A& r = static_cast<A*>(running_var)[c];
        r = A((1 - a.momentum) * double(r) + a.momentum * var.v[j] * double(m) / double(m - 1));
      }
      scale[j] = invstd * (gamma ? double(static_cast<const A*>(gamma)[c]) : 1.0);
      shift[j] = beta ? double(static_cast<const A*>(beta)[c]) : 0.0;
    }
    for_each_in_tile<K>(a, w, c0, [&](int64_t i, int j) {
      const T v = T((as_double(in[i]) - mean.v[j]) * scale[j] + shift[j]);
      out[i] = a.relu ? add_relu(v, res ? res + i : nullptr) : v;
    });
  });
}

void batch_norm_forward_eval(const BatchNormArgs& a, void* y, const void* x, const void* gamma, const void* beta,
                             const void* running_mean, const void* running_var, StreamHandle) {
  if (a.n * a.s == 0) return;
  const Walk w = walk_of(a);
  for_each_tile(a, "batch_norm", [&](auto tag, auto width, int64_t c0) {
    using T = decltype(tag);
    using A = acc_t<T>;
    constexpr int K = decltype(width)::value;
    const T* in = static_cast<const T*>(x);
    T* out = static_cast<T*>(y);
    double mean[K], scale[K], shift[K];
    for (int j = 0; j < K; ++j) {
      const int64_t c = c0 + j;
      mean[j] = double(static_cast<const A*>(running_mean)[c]);
      const double invstd = 1.0 / std::sqrt(double(static_cast<const A*>(running_var)[c]) + a.eps);
      scale[j] = invstd * (gamma ? double(static_cast<const A*>(gamma)[c]) : 1.0);
      shift[j] = beta ? double(static_cast<const A*>(beta)[c]) : 0.0;
    }
    for_each_in_tile<K>(a, w, c0, [&](int64_t i, int j) {
      out[i] = T((as_double(in[i]) - mean[j]) * scale[j] + shift[j]);
    });
  });
}

void batch_norm_backward(const BatchNormArgs& a, void* dx, void* dgamma, void* dbeta, const void* dy,
                         const void* x, const void* gamma, const void* save_mean, const void* save_invstd,
                         const void* y, void* dresidual, StreamHandle) {
  LOOM_ASSERT(a.relu == (y != nullptr) && (a.relu || !dresidual),
              "batch_norm backward: the fused ReLU's output is given exactly when args.relu is set");
  const int64_t m = a.n * a.s;
  const Walk w = walk_of(a);
  for_each_tile(a, "batch_norm backward", [&](auto tag, auto width, int64_t c0) {
    using T = decltype(tag);
    using A = acc_t<T>;
    constexpr int K = decltype(width)::value;
    const T* in = static_cast<const T*>(x);
    const T* go = static_cast<const T*>(dy);
    const T* out = static_cast<const T*>(y);
    T* gi = static_cast<T*>(dx);
    T* gr = static_cast<T*>(dresidual);
    double mean[K], k_dy[K], k_x[K], k_0[K];
    for (int j = 0; j < K; ++j) mean[j] = double(static_cast<const A*>(save_mean)[c0 + j]);
    const Lanes<Sums, K> sums = tile_sum<K, Sums>(a, w, c0, [&](int64_t i, int j) {
      const double g = as_double(masked(a, go, out, i));
      return Sums{g, g * (as_double(in[i]) - mean[j])};
    });
    double invstd[K];
    for (int j = 0; j < K; ++j) {
      const int64_t c = c0 + j;
      invstd[j] = double(static_cast<const A*>(save_invstd)[c]);
      static_cast<A*>(dbeta)[c] = A(sums.v[j].a);
      static_cast<A*>(dgamma)[c] = A(sums.v[j].b * invstd[j]);
    }
    if (m == 0) return;
    // dx = gamma invstd / M (M dy - dbeta - xhat dgamma), in the order that keeps x - mean whole.
    for (int j = 0; j < K; ++j) {
      const double sum_dy = sums.v[j].a, sum_dy_xhat = sums.v[j].b * invstd[j];
      k_dy[j] = invstd[j] * (gamma ? double(static_cast<const A*>(gamma)[c0 + j]) : 1.0);
      k_x[j] = k_dy[j] * invstd[j] * sum_dy_xhat / double(m);
      k_0[j] = k_dy[j] * sum_dy / double(m);
    }
    for_each_in_tile<K>(a, w, c0, [&](int64_t i, int j) {
      const T g = masked(a, go, out, i);
      gi[i] = T(k_dy[j] * as_double(g) - k_x[j] * (as_double(in[i]) - mean[j]) - k_0[j]);
      if (gr) gr[i] = g;
    });
  });
}

}  // namespace loom::cpu
