// Softmax, log-softmax and fused cross-entropy on the CPU: the reference for CUDA.
//
// Every row is shifted by its maximum before exp, so no logit is too large; sums of exp are
// pairwise (error grows with log R), accumulating 16-bit floats and f32 in f32, f64 in f64.
// The axis is the middle one of a canonical (outer, R, inner) buffer; work items are tiles
// of up to kTile neighbouring columns, so the loops over r read whole cache lines. The tile
// code takes its column count and stride as template types: contiguous rows (inner == 1)
// run it with compile-time 1s and compile as plain row loops. Cross-entropy rows are
// (N, C) with C contiguous.
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "kernels/cpu/common.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/pairwise.h"
#include "kernels/cpu/parallel_for.h"

namespace loom::cpu {
namespace {

constexpr int kTile = 64;
constexpr int64_t kWorkPerItem = int64_t(1) << 14;  // elements a parallel chunk should at least cover

using One = std::integral_constant<int, 1>;

// Calls body(element offset, stride, cols) for every tile of the (outer, R, inner) buffer,
// in parallel.
template <class F> void for_each_tile(int64_t outer, int64_t R, int64_t inner, const F& body) {
  const int64_t grain = std::max<int64_t>(1, kWorkPerItem / (R * std::min<int64_t>(inner, kTile)));
  if (inner == 1) {
    parallel_for(outer, grain, [&](int64_t b, int64_t e) {
      for (int64_t o = b; o < e; ++o) body(o * R, One{}, One{});
    });
    return;
  }
  const int64_t tiles = (inner + kTile - 1) / kTile;
  parallel_for(outer * tiles, grain, [&](int64_t b, int64_t e) {
    for (int64_t item = b; item < e; ++item) {
      int64_t o = item / tiles, i0 = (item % tiles) * kTile;
      body(o * R * inner + i0, inner, int(std::min<int64_t>(kTile, inner - i0)));
    }
  });
}

template <class T, class Stride, class Cols>
void softmax_tile(T* y, const T* x, int64_t R, Stride stride, Cols cols, bool log) {
  using A = acc_t<T>;
  // Where T is its own accumulator, exp(x - m) waits in y for the last pass at full
  // precision, so each element costs one exp; 16-bit outputs recompute it instead.
  constexpr bool kKeepExp = std::is_same_v<T, A>;
  A m[kTile], s[kTile];
  std::fill(m, m + cols, -std::numeric_limits<A>::infinity());
  for (int64_t r = 0; r < R; ++r)
    for (int c = 0; c < cols; ++c) m[c] = std::max(m[c], A(x[r * stride + c]));
  pairwise_cols<kTile>(0, R, cols, s, [&](int64_t r, int c) {
    A e = std::exp(A(x[r * stride + c]) - m[c]);
    if (kKeepExp && !log) y[r * stride + c] = T(e);
    return e;
  });
  for (int c = 0; c < cols; ++c) s[c] = log ? std::log(s[c]) : A(1) / s[c];
  for (int64_t r = 0; r < R; ++r) {
    for (int c = 0; c < cols; ++c) {
      const int64_t k = r * stride + c;
      if (log) y[k] = T(A(x[k]) - m[c] - s[c]);
      else y[k] = T((kKeepExp ? A(y[k]) : std::exp(A(x[k]) - m[c])) * s[c]);
    }
  }
}

template <class T, class Stride, class Cols>
void softmax_backward_tile(T* gi, const T* go, const T* y, int64_t R, Stride stride, Cols cols, bool log) {
  using A = acc_t<T>;
  A dot[kTile];
  pairwise_cols<kTile>(0, R, cols, dot, [&](int64_t r, int c) {
    int64_t k = r * stride + c;
    return log ? A(go[k]) : A(go[k]) * A(y[k]);
  });
  for (int64_t r = 0; r < R; ++r) {
    for (int c = 0; c < cols; ++c) {
      int64_t k = r * stride + c;
      A g = A(go[k]), v = A(y[k]);
      gi[k] = T(log ? g - std::exp(v) * dot[c] : v * (g - dot[c]));
    }
  }
}

// Throws where a row's target is neither a class index nor ignore_index, naming the row as
// row_base + n; true when ignored.
bool ignored_row(const int64_t* target, int64_t n, int64_t C, int64_t ignore_index, int64_t row_base = 0) {
  int64_t t = target[n];
  if (t == ignore_index) return true;
  LOOM_CHECK(t >= 0 && t < C, "cross_entropy: target ", t, " in row ", row_base + n, " is not a class index in [0, ", C,
             ") and not ignore_index (", ignore_index, "); check the labels against the number of classes");
  return false;
}

// One row's gradient: g = gr (softmax(x) - (1 - eps) [c == t] - eps / C), lse = l. g may
// be x itself: each value is read before it is written.
template <class T, class A> void cross_entropy_row_grad(T* g, const T* x, A l, int64_t t, A gr, int64_t C, double eps) {
  const A hit = A(1 - eps), spread = A(eps / double(C));
  for (int64_t c = 0; c < C; ++c) g[c] = T(gr * (std::exp(A(x[c]) - l) - (c == t ? hit : A(0)) - spread));
}

template <class T>
void cross_entropy_typed(acc_t<T>* loss, acc_t<T>* lse, const T* logits, const int64_t* target, int64_t N, int64_t C,
                         int64_t ignore_index, double eps, T* grad, int64_t row_base) {
  using A = acc_t<T>;
  parallel_for(N, std::max<int64_t>(1, kWorkPerItem / C), [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n) {
      bool ignored = ignored_row(target, n, C, ignore_index, row_base);
      const T* x = logits + n * C;
      A m = -std::numeric_limits<A>::infinity();
      // The maximum, NaN once a NaN is seen: std::max(m, NaN) would drop it, std::max(NaN, v)
      // keeps it.
      for (int64_t c = 0; c < C; ++c) m = std::isnan(A(x[c])) ? A(x[c]) : std::max(m, A(x[c]));
      A s, sum_x = 0;
      pairwise_cols<kTile>(0, C, One{}, &s, [&](int64_t c, int) { return std::exp(A(x[c]) - m); });
      if (eps != 0) pairwise_cols<kTile>(0, C, One{}, &sum_x, [&](int64_t c, int) { return A(x[c]); });
      // A row of -inf only: log(sum exp) = log(0) = -inf, as on CUDA (exp(x - m) would be NaN).
      A l = m == -std::numeric_limits<A>::infinity() ? m : m + std::log(s);
      lse[n] = l;
      loss[n] = ignored ? A(0) : A(1 - eps) * (l - A(x[target[n]])) + A(eps) * (l - sum_x / A(C));
      if (!grad) continue;
      T* g = grad + n * C;
      if (ignored) std::fill(g, g + C, T(0.f));
      else cross_entropy_row_grad(g, x, l, target[n], A(1), C, eps);
    }
  });
}

template <class T>
void cross_entropy_backward_typed(T* grad, const T* logits, const acc_t<T>* lse, const int64_t* target,
                                  const acc_t<T>* grad_row, int64_t N, int64_t C, int64_t ignore_index, double eps) {
  using A = acc_t<T>;
  parallel_for(N, std::max<int64_t>(1, kWorkPerItem / C), [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n) {
      T* g = grad + n * C;
      if (ignored_row(target, n, C, ignore_index)) std::fill(g, g + C, T(0.f));
      else cross_entropy_row_grad(g, logits + n * C, A(lse[n]), target[n], A(grad_row[n]), C, eps);
    }
  });
}

}  // namespace

void softmax(void* out, const void* in, DType dtype, int64_t outer, int64_t R, int64_t inner, bool log,
             StreamHandle stream) {
  if (outer * R * inner == 0) return;
  dispatch_floating(dtype, log ? "log_softmax" : "softmax", [&](auto tag) {
    using T = decltype(tag);
    auto* y = static_cast<T*>(out);
    auto* x = static_cast<const T*>(in);
    for_each_tile(outer, R, inner,
                  [&](int64_t off, auto stride, auto cols) { softmax_tile(y + off, x + off, R, stride, cols, log); });
  });
}

void softmax_backward(void* grad_in, const void* grad_out, const void* out, DType dtype, int64_t outer,
                      int64_t R, int64_t inner, bool log, StreamHandle stream) {
  if (outer * R * inner == 0) return;
  dispatch_floating(dtype, log ? "log_softmax backward" : "softmax backward", [&](auto tag) {
    using T = decltype(tag);
    auto* gi = static_cast<T*>(grad_in);
    auto* go = static_cast<const T*>(grad_out);
    auto* y = static_cast<const T*>(out);
    for_each_tile(outer, R, inner, [&](int64_t off, auto stride, auto cols) {
      softmax_backward_tile(gi + off, go + off, y + off, R, stride, cols, log);
    });
  });
}

void cross_entropy(void* loss, void* lse, const void* logits, DType dtype, const int64_t* target, int64_t N,
                   int64_t C, int64_t ignore_index, double label_smoothing, void* grad_logits, int64_t row_base,
                   StreamHandle stream) {
  LOOM_CHECK(C > 0 || N == 0, "cross_entropy needs at least one class, got logits of shape (", N, ", 0)");
  dispatch_floating(dtype, "cross_entropy", [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    cross_entropy_typed(static_cast<A*>(loss), static_cast<A*>(lse), static_cast<const T*>(logits), target, N, C,
                        ignore_index, label_smoothing, static_cast<T*>(grad_logits), row_base);
  });
}

void cross_entropy_backward(void* grad_logits, const void* logits, const void* lse, const int64_t* target,
                            const void* grad_row, DType dtype, int64_t N, int64_t C, int64_t ignore_index,
                            double label_smoothing, StreamHandle stream) {
  dispatch_floating(dtype, "cross_entropy backward", [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    cross_entropy_backward_typed(static_cast<T*>(grad_logits), static_cast<const T*>(logits),
                                 static_cast<const A*>(lse), target, static_cast<const A*>(grad_row), N, C, ignore_index, label_smoothing);
  });
}

}  // namespace loom::cpu
