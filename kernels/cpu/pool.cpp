// CPU 2-d max and average pooling over NCHW planes, threads over the N * C planes.
//
// The backward passes gather rather than scatter: each input element sums the gradients
// of the outputs whose windows cover it (kernels/core/pool_window.h), in a fixed order,
// exactly as the CUDA kernels do. Values are compared and summed in the accumulation type.
#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/core/pool_window.h"
#include "kernels/cpu/common.h"
#include "kernels/cpu/kernels.h"
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

// The engine hands the CPU NCHW buffers only (a channels-last input is converted around it).
void check_layout(const Pool2dArgs& a) {
  LOOM_ASSERT(a.layout == ChannelLayout::channels_first, "the CPU's pooling kernels take NCHW buffers");
}

}  // namespace

void max_pool2d_forward(const Pool2dArgs& a, void* y, int64_t* indices, const void* x, StreamHandle) {
  check_layout(a);
  const int64_t hw = a.h * a.w, ohw = a.out_h * a.out_w;
  for_each_plane(a, "max_pool2d", ohw * a.kh * a.kw, [&](auto tag, int64_t p) {
    using T = decltype(tag);
    using A = acc_t<T>;
    const T* in = static_cast<const T*>(x) + p * hw;
    T* out = static_cast<T*>(y) + p * ohw;
    int64_t* idx = indices + p * ohw;
    for (int64_t oh = 0; oh < a.out_h; ++oh) {
      const pool::Span rows = pool::input_span(oh, a.stride_h, a.pad_h, a.kh, a.h);
      for (int64_t ow = 0; ow < a.out_w; ++ow) {
        const pool::Span cols = pool::input_span(ow, a.stride_w, a.pad_w, a.kw, a.w);
        A best = -std::numeric_limits<A>::infinity();
        int64_t best_at = rows.begin * a.w + cols.begin;
        for (int64_t ih = rows.begin; ih < rows.end; ++ih)
          for (int64_t iw = cols.begin; iw < cols.end; ++iw) {
            const A v = A(in[ih * a.w + iw]);
            if (v > best || std::isnan(v)) {
              best = v;
              best_at = ih * a.w + iw;
            }
          }
        out[oh * a.out_w + ow] = T(best);
        idx[oh * a.out_w + ow] = best_at;
      }
    }
  });
}

void max_pool2d_backward(const Pool2dArgs& a, void* dx, const void* dy, const int64_t* indices, StreamHandle) {
  check_layout(a);
  const int64_t hw = a.h * a.w, ohw = a.out_h * a.out_w;
  for_each_plane(a, "max_pool2d backward", hw * 4, [&](auto tag, int64_t p) {
    using T = decltype(tag);
    using A = acc_t<T>;
    const T* go = static_cast<const T*>(dy) + p * ohw;
    const int64_t* idx = indices + p * ohw;
    T* gi = static_cast<T*>(dx) + p * hw;
    for (int64_t ih = 0; ih < a.h; ++ih) {
      const pool::Span rows = pool::output_span(ih, a.stride_h, a.pad_h, a.kh, a.out_h);
      for (int64_t iw = 0; iw < a.w; ++iw) {
        const pool::Span cols = pool::output_span(iw, a.stride_w, a.pad_w, a.kw, a.out_w);
        const int64_t self = ih * a.w + iw;
        A sum = 0;
        for (int64_t oh = rows.begin; oh < rows.end; ++oh)
          for (int64_t ow = cols.begin; ow < cols.end; ++ow)
            if (idx[oh * a.out_w + ow] == self) sum += A(go[oh * a.out_w + ow]);
        gi[self] = T(sum);
      }
    }
  });
}

void avg_pool2d_forward(const Pool2dArgs& a, void* y, const void* x, StreamHandle) {
  check_layout(a);
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
  check_layout(a);
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
