// CPU 2-d max and average pooling over NCHW planes, threads over the N * C planes; over a
// channels-last (N, H, W, C) buffer, threads over the N * OH output rows (N * H input rows
// for average pooling's backward, the N images for max pooling's), each pixel's C channels
// handled together in the innermost loop. Either way a channel sees its window's elements
// in the same order, so both layouts give the same bits, and the same max-pool indices
// (ih * W + iw within the plane). Max pooling's forward adds a channel's bias (Pool2dArgs)
// to each element as add would, before comparing.
//
// Average pooling's backward gathers: each input element sums the gradients of the outputs
// whose windows cover it (kernels/core/pool_window.h), outputs in order, as the CUDA
// kernels do. Max pooling's scatters each output's gradient onto its argmax, outputs in
// order within one thread, so each input element adds its gradients in that same order,
// and the same bits, for no search of the windows. Values are compared and summed in the
// accumulation type.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels/core/pool_window.h"
#include "kernels/cpu/common.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/masked_select.h"
#include "kernels/cpu/parallel_for.h"

namespace loom::cpu {
namespace {

// Runs body(plane) for each of the N * C planes, in parallel, with T the element type.
template <class Body>
void for_each_plane(const Pool2dArgs& a, const char* what, int64_t work_per_plane, Body&& body) {
  dispatch_floating(a.dtype, what, [&](auto tag) {
    const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 14) / std::max<int64_t>(work_per_plane, 1));
    parallel_for(a.n * a.c, grain, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) body(tag, p);
    });
  });
}

bool channels_last(const Pool2dArgs& a) { return a.layout == ChannelLayout::channels_last; }

// Runs body(tag, n, r, acc, at) for each of the N * rows image rows of a channels-last
// buffer, in parallel, with T the element type and acc and at scratch vectors of C
// accumulation-type values and C indices.
template <class Body>
void for_each_row(const Pool2dArgs& a, const char* what, int64_t rows, int64_t work_per_row, Body&& body) {
  dispatch_floating(a.dtype, what, [&](auto tag) {
    using A = acc_t<decltype(tag)>;
    const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 14) / std::max<int64_t>(work_per_row, 1));
    parallel_for(a.n * rows, grain, [&](int64_t r0, int64_t r1) {
      std::vector<A> acc(size_t(a.c));
      std::vector<int64_t> at(size_t(a.c));
      for (int64_t r = r0; r < r1; ++r) body(tag, r / rows, r % rows, acc.data(), at.data());
    });
  });
}

void max_forward_cl(const Pool2dArgs& a, void* y, int64_t* indices, const void* x) {
  const int64_t work = a.out_w * a.kh * a.kw * a.c;
  for_each_row(a, "max_pool2d", a.out_h, work, [&](auto tag, int64_t n, int64_t oh, auto* best, int64_t* best_at) {
    using T = decltype(tag);
    using A = acc_t<T>;
    const T* bias = static_cast<const T*>(a.bias);
    const pool::Span rows = pool::input_span(oh, a.stride_h, a.pad_h, a.kh, a.h);
    for (int64_t ow = 0; ow < a.out_w; ++ow) {
      const pool::Span cols = pool::input_span(ow, a.stride_w, a.pad_w, a.kw, a.w);
      std::fill_n(best, a.c, -std::numeric_limits<A>::infinity());
      std::fill_n(best_at, a.c, rows.begin * a.w + cols.begin);
      for (int64_t ih = rows.begin; ih < rows.end; ++ih)
        for (int64_t iw = cols.begin; iw < cols.end; ++iw) {
          const T* in = static_cast<const T*>(x) + ((n * a.h + ih) * a.w + iw) * a.c;
          const int64_t here = ih * a.w + iw;
          for (int64_t c = 0; c < a.c; ++c) {  // without a branch (masked_select.h)
            const A v = bias ? A(T(A(in[c]) + A(bias[c]))) : A(in[c]);
            const bool take = (v > best[c]) | (v != v);  // larger, or NaN
            best[c] = masked_select(take, v, best[c]);
            best_at[c] = masked_select(take, here, best_at[c]);
          }
        }
      const int64_t at = ((n * a.out_h + oh) * a.out_w + ow) * a.c;
      for (int64_t c = 0; c < a.c; ++c) {
        static_cast<T*>(y)[at + c] = T(best[c]);
        indices[at + c] = best_at[c];
      }
    }
  });
}

void max_backward_cl(const Pool2dArgs& a, void* dx, const void* dy, const int64_t* indices) {
  dispatch_floating(a.dtype, "max_pool2d backward", [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    const int64_t hw = a.h * a.w, ohw = a.out_h * a.out_w;
    const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 14) / std::max<int64_t>((hw + ohw) * a.c, 1));
    parallel_for(a.n, grain, [&](int64_t n0, int64_t n1) {
      std::vector<A> acc(size_t(hw * a.c));
      for (int64_t n = n0; n < n1; ++n) {
        std::fill(acc.begin(), acc.end(), A(0));
        const T* go = static_cast<const T*>(dy) + n * ohw * a.c;
        const int64_t* idx = indices + n * ohw * a.c;
        for (int64_t o = 0; o < ohw * a.c; o += a.c)
          for (int64_t c = 0; c < a.c; ++c) acc[size_t(idx[o + c] * a.c + c)] += A(go[o + c]);
        T* gi = static_cast<T*>(dx) + n * hw * a.c;
        for (int64_t i = 0; i < hw * a.c; ++i) gi[i] = T(acc[size_t(i)]);
      }
    });
  });
}

void avg_forward_cl(const Pool2dArgs& a, void* y, const void* x) {
  for_each_row(a, "avg_pool2d", a.out_h, a.out_w * a.kh * a.kw * a.c, [&](auto tag, int64_t n, int64_t oh, auto* sum, int64_t*) {
    using T = decltype(tag);
    using A = acc_t<T>;
    const A scale = A(1) / A(a.kh * a.kw);
    const pool::Span rows = pool::input_span(oh, a.stride_h, a.pad_h, a.kh, a.h);
    for (int64_t ow = 0; ow < a.out_w; ++ow) {
      const pool::Span cols = pool::input_span(ow, a.stride_w, a.pad_w, a.kw, a.w);
      std::fill_n(sum, a.c, A(0));
      for (int64_t ih = rows.begin; ih < rows.end; ++ih)
        for (int64_t iw = cols.begin; iw < cols.end; ++iw) {
          const T* in = static_cast<const T*>(x) + ((n * a.h + ih) * a.w + iw) * a.c;
          for (int64_t c = 0; c < a.c; ++c) sum[c] += A(in[c]);
        }
      T* out = static_cast<T*>(y) + ((n * a.out_h + oh) * a.out_w + ow) * a.c;
      for (int64_t c = 0; c < a.c; ++c) out[c] = T(sum[c] * scale);
    }
  });
}

void avg_backward_cl(const Pool2dArgs& a, void* dx, const void* dy) {
  for_each_row(a, "avg_pool2d backward", a.h, a.w * a.c * 4, [&](auto tag, int64_t n, int64_t ih, auto* sum, int64_t*) {
    using T = decltype(tag);
    using A = acc_t<T>;
    const A scale = A(1) / A(a.kh * a.kw);
    const pool::Span rows = pool::output_span(ih, a.stride_h, a.pad_h, a.kh, a.out_h);
    for (int64_t iw = 0; iw < a.w; ++iw) {
      const pool::Span cols = pool::output_span(iw, a.stride_w, a.pad_w, a.kw, a.out_w);
      std::fill_n(sum, a.c, A(0));
      for (int64_t oh = rows.begin; oh < rows.end; ++oh)
        for (int64_t ow = cols.begin; ow < cols.end; ++ow) {
          const T* go = static_cast<const T*>(dy) + ((n * a.out_h + oh) * a.out_w + ow) * a.c;
          for (int64_t c = 0; c < a.c; ++c) sum[c] += A(go[c]);
        }
      T* gi = static_cast<T*>(dx) + ((n * a.h + ih) * a.w + iw) * a.c;
      for (int64_t c = 0; c < a.c; ++c) gi[c] = T(sum[c] * scale);
    }
  });
}

}  // namespace

void max_pool2d_forward(const Pool2dArgs& a, void* y, int64_t* indices, const void* x, StreamHandle) {
  if (channels_last(a)) return max_forward_cl(a, y, indices, x);
  const int64_t hw = a.h * a.w, ohw = a.out_h * a.out_w;
  for_each_plane(a, "max_pool2d", ohw * a.kh * a.kw, [&](auto tag, int64_t p) {
    using T = decltype(tag);
    using A = acc_t<T>;
    const T* in = static_cast<const T*>(x) + p * hw;
    T* out = static_cast<T*>(y) + p * ohw;
    int64_t* idx = indices + p * ohw;
    const bool biased = a.bias != nullptr;
    const A shift = biased ? A(static_cast<const T*>(a.bias)[p % a.c]) : A(0);
    for (int64_t oh = 0; oh < a.out_h; ++oh) {
      const pool::Span rows = pool::input_span(oh, a.stride_h, a.pad_h, a.kh, a.h);
      for (int64_t ow = 0; ow < a.out_w; ++ow) {
        const pool::Span cols = pool::input_span(ow, a.stride_w, a.pad_w, a.kw, a.w);
        A best = -std::numeric_limits<A>::infinity();
        int64_t best_at = rows.begin * a.w + cols.begin;
        for (int64_t ih = rows.begin; ih < rows.end; ++ih)
          for (int64_t iw = cols.begin; iw < cols.end; ++iw) {
            // A larger value or a NaN takes over, chosen by bit masks rather than a branch,
            // which random data would mispredict every other time.
            const A v = biased ? A(T(A(in[ih * a.w + iw]) + shift)) : A(in[ih * a.w + iw]);
            const bool take = (v > best) | (v != v);
            best = masked_select(take, v, best);
            best_at = masked_select(take, ih * a.w + iw, best_at);
          }
        out[oh * a.out_w + ow] = T(best);
        idx[oh * a.out_w + ow] = best_at;
      }
    }
  });
}

void max_pool2d_backward(const Pool2dArgs& a, void* dx, const void* dy, const int64_t* indices, StreamHandle) {
  if (channels_last(a)) return max_backward_cl(a, dx, dy, indices);
  const int64_t hw = a.h * a.w, ohw = a.out_h * a.out_w;
  for_each_plane(a, "max_pool2d backward", hw + ohw, [&](auto tag, int64_t p) {
    using T = decltype(tag);
    using A = acc_t<T>;
    const T* go = static_cast<const T*>(dy) + p * ohw;
    const int64_t* idx = indices + p * ohw;
    T* gi = static_cast<T*>(dx) + p * hw;
    if constexpr (std::is_same_v<T, A>) {
      std::fill_n(gi, hw, T(0));
      for (int64_t o = 0; o < ohw; ++o) gi[idx[o]] += go[o];
    } else {
      thread_local std::vector<A> acc;
      acc.assign(size_t(hw), A(0));
      for (int64_t o = 0; o < ohw; ++o) acc[size_t(idx[o])] += A(go[o]);
      for (int64_t i = 0; i < hw; ++i) gi[i] = T(acc[size_t(i)]);
    }
  });
}

void avg_pool2d_forward(const Pool2dArgs& a, void* y, const void* x, StreamHandle) {
  if (channels_last(a)) return avg_forward_cl(a, y, x);
  const int64_t hw = a.h * a.w, ohw = a.out_h * a.out_w;
  for_each_plane(a, "avg_pool2d", ohw * a.kh * a.kw, [&](auto tag, int64_t p) {
    using T = decltype(tag);
    using A = acc_t<T>;
    const T* in = static_cast<const T*>(x) + p * hw;
    T* out = static_cast<T*>(y) + p * ohw;
    const A scale = A(1) / A(a.kh * a.kw);
    for (int64_t oh = 0; oh < a.out_h; ++oh) {
      const pool::Span rows = pool::input_span(oh, a.stride_h, a.pad_h, a.kh, a.h);
      for (int64_t ow = 0; ow < a.out_w; ++ow) {
        const pool::Span cols = pool::input_span(ow, a.stride_w, a.pad_w, a.kw, a.w);
        A sum = 0;
        for (int64_t ih = rows.begin; ih < rows.end; ++ih)
          for (int64_t iw = cols.begin; iw < cols.end; ++iw) sum += A(in[ih * a.w + iw]);
        out[oh * a.out_w + ow] = T(sum * scale);
      }
    }
  });
}

void avg_pool2d_backward(const Pool2dArgs& a, void* dx, const void* dy, StreamHandle) {
  if (channels_last(a)) return avg_backward_cl(a, dx, dy);
  const int64_t hw = a.h * a.w, ohw = a.out_h * a.out_w;
  for_each_plane(a, "avg_pool2d backward", hw * 4, [&](auto tag, int64_t p) {
    using T = decltype(tag);
    using A = acc_t<T>;
    const T* go = static_cast<const T*>(dy) + p * ohw;
    T* gi = static_cast<T*>(dx) + p * hw;
    const A scale = A(1) / A(a.kh * a.kw);
    for (int64_t ih = 0; ih < a.h; ++ih) {
      const pool::Span rows = pool::output_span(ih, a.stride_h, a.pad_h, a.kh, a.out_h);
      for (int64_t iw = 0; iw < a.w; ++iw) {
        const pool::Span cols = pool::output_span(iw, a.stride_w, a.pad_w, a.kw, a.out_w);
        A sum = 0;
        for (int64_t oh = rows.begin; oh < rows.end; ++oh)
          for (int64_t ow = cols.begin; ow < cols.end; ++ow) sum += A(go[oh * a.out_w + ow]);
        gi[ih * a.w + iw] = T(sum * scale);
      }
    }
  });
}

}  // namespace loom::cpu
