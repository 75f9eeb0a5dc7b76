// CPU batch normalisation over a contiguous (N, C, S) buffer: threads over channels, each
// channel's N rows of S values (C * S apart) handled by one thread.
//
// This is the reference the CUDA kernels are checked against, so every per-channel sum
// is pairwise in double whatever the dtype: rows pairwise over S, row totals pairwise over
// N. The statistics are two-pass (mean, then the mean of squared deviations), so a large
// mean never cancels against the variance. Values are normalised in double from the
// double statistics and rounded once to the output dtype; the per-channel outputs are
// rounded to the accumulation type (f32, f64 for f64) that the contract gives them.
#include <algorithm>
#include <cmath>

#include "kernels/cpu/common.h"
#include "kernels/cpu/kernels.h"
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

// Pairwise sum of f(r) over [r0, r1), V being double or Sums.
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

// Sum over the channel's (n, s) of f(offset), offset the element's index in the buffer.
template <class V, class F>
V channel_sum(const BatchNormArgs& a, int64_t c, const F& f) {
  return pairwise<V>(0, a.n, [&](int64_t n) {
    const int64_t row = (n * a.c + c) * a.s;
    return pairwise<V>(0, a.s, [&](int64_t s) { return f(row + s); });
  });
}

// Calls f(offset) for every element of channel c.
template <class F>
void for_each_in_channel(const BatchNormArgs& a, int64_t c, const F& f) {
  for (int64_t n = 0; n < a.n; ++n) {
    const int64_t row = (n * a.c + c) * a.s;
    for (int64_t s = 0; s < a.s; ++s) f(row + s);
  }
}

// Runs body(T{}, c) for every channel, in parallel, with T the element type.
template <class Body>
void for_each_channel(const BatchNormArgs& a, const char* what, Body&& body) {
  dispatch_floating(a.dtype, what, [&](auto tag) {
    const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 14) / std::max<int64_t>(a.n * a.s, 1));
    parallel_for(a.c, grain, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) body(tag, c);
    });
  });
}

template <class T> double as_double(T v) { return double(acc_t<T>(v)); }

}  // namespace

void batch_norm_forward_train(const BatchNormArgs& a, void* y, void* save_mean, void* save_invstd,
                              void* running_mean, void* running_var, const void* x, const void* gamma,
                              const void* beta, StreamHandle) {
  const int64_t m = a.n * a.s;
  if (m == 0) return;
  for_each_channel(a, "batch_norm", [&](auto tag, int64_t c) {
    using T = decltype(tag);
    using A = acc_t<T>;
    const T* in = static_cast<const T*>(x);
    T* out = static_cast<T*>(y);
    const double mean = channel_sum<double>(a, c, [&](int64_t i) { return as_double(in[i]); }) / double(m);
    const double var = channel_sum<double>(a, c, [&](int64_t i) {
                         const double d = as_double(in[i]) - mean;
                         return d * d;
                       }) / double(m);
    const double invstd = 1.0 / std::sqrt(var + a.eps);
    static_cast<A*>(save_mean)[c] = A(mean);
    static_cast<A*>(save_invstd)[c] = A(invstd);
    if (running_mean) {
      A& r = static_cast<A*>(running_mean)[c];
      r = A((1 - a.momentum) * double(r) + a.momentum * mean);
    }
    if (running_var) {
      A& r = static_cast<A*>(running_var)[c];
      r = A((1 - a.momentum) * double(r) + a.momentum * var * double(m) / double(m - 1));
    }
    const double scale = invstd * (gamma ? double(static_cast<const A*>(gamma)[c]) : 1.0);
    const double shift = beta ? double(static_cast<const A*>(beta)[c]) : 0.0;
    for_each_in_channel(a, c, [&](int64_t i) { out[i] = T((as_double(in[i]) - mean) * scale + shift); });
  });
}

void batch_norm_forward_eval(const BatchNormArgs& a, void* y, const void* x, const void* gamma, const void* beta,
                             const void* running_mean, const void* running_var, StreamHandle) {
  if (a.n * a.s == 0) return;
  for_each_channel(a, "batch_norm", [&](auto tag, int64_t c) {
    using T = decltype(tag);
    using A = acc_t<T>;
    const T* in = static_cast<const T*>(x);
    T* out = static_cast<T*>(y);
    const double mean = double(static_cast<const A*>(running_mean)[c]);
    const double invstd = 1.0 / std::sqrt(double(static_cast<const A*>(running_var)[c]) + a.eps);
    const double scale = invstd * (gamma ? double(static_cast<const A*>(gamma)[c]) : 1.0);
    const double shift = beta ? double(static_cast<const A*>(beta)[c]) : 0.0;
    for_each_in_channel(a, c, [&](int64_t i) { out[i] = T((as_double(in[i]) - mean) * scale + shift); });
  });
}

void batch_norm_backward(const BatchNormArgs& a, void* dx, void* dgamma, void* dbeta, const void* dy,
                         const void* x, const void* gamma, const void* save_mean, const void* save_invstd,
                         StreamHandle) {
  const int64_t m = a.n * a.s;
  for_each_channel(a, "batch_norm backward", [&](auto tag, int64_t c) {
    using T = decltype(tag);
    using A = acc_t<T>;
    const T* in = static_cast<const T*>(x);
    const T* go = static_cast<const T*>(dy);
    T* gi = static_cast<T*>(dx);
    const double mean = double(static_cast<const A*>(save_mean)[c]);
    const double invstd = double(static_cast<const A*>(save_invstd)[c]);
    const Sums sums = channel_sum<Sums>(a, c, [&](int64_t i) {
      const double g = as_double(go[i]);
      return Sums{g, g * (as_double(in[i]) - mean)};
    });
    const double sum_dy = sums.a, sum_dy_xhat = sums.b * invstd;
    static_cast<A*>(dbeta)[c] = A(sum_dy);
    static_cast<A*>(dgamma)[c] = A(sum_dy_xhat);
    if (m == 0) return;
    // dx = gamma invstd / M (M dy - dbeta - xhat dgamma), in the order that keeps x - mean whole.
    const double k_dy = invstd * (gamma ? double(static_cast<const A*>(gamma)[c]) : 1.0);
    const double k_x = k_dy * invstd * sum_dy_xhat / double(m), k_0 = k_dy * sum_dy / double(m);
    for_each_in_channel(a, c, [&](int64_t i) {
      gi[i] = T(k_dy * as_double(go[i]) - k_x * (as_double(in[i]) - mean) - k_0);
    });
  });
}

}  // namespace loom::cpu
