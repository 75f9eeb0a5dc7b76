// Plain-loop references for the convolution and pooling kernel tests (CPU and CUDA
// suites): a direct 7-loop convolution that produces y, dx and dw together in f64, and
// the pooling windows walked one element at a time. Slow and obviously right.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "kernels/table.h"

namespace loom::test {

struct ConvCase {
  std::string name;
  int64_t n, c_in, h, w, c_out, kh, kw;
  int64_t stride_h = 1, stride_w = 1, pad_h = 0, pad_w = 0, dilation_h = 1, dilation_w = 1, groups = 1;
};

inline Conv2dArgs conv_args(const ConvCase& c, DType dtype) {
  Conv2dArgs a;
  a.dtype = dtype;
  a.n = c.n, a.c_in = c.c_in, a.h = c.h, a.w = c.w, a.c_out = c.c_out, a.kh = c.kh, a.kw = c.kw;
  a.stride_h = c.stride_h, a.stride_w = c.stride_w, a.pad_h = c.pad_h, a.pad_w = c.pad_w;
  a.dilation_h = c.dilation_h, a.dilation_w = c.dilation_w, a.groups = c.groups;
  a.out_h = (c.h + 2 * c.pad_h - c.dilation_h * (c.kh - 1) - 1) / c.stride_h + 1;
  a.out_w = (c.w + 2 * c.pad_w - c.dilation_w * (c.kw - 1) - 1) / c.stride_w + 1;
  return a;
}

inline int64_t x_numel(const Conv2dArgs& a) { return a.n * a.c_in * a.h * a.w; }
inline int64_t w_numel(const Conv2dArgs& a) { return a.c_out * (a.c_in / a.groups) * a.kh * a.kw; }
inline int64_t y_numel(const Conv2dArgs& a) { return a.n * a.c_out * a.out_h * a.out_w; }

// Direct convolution in f64. With `abs` every operand is taken by magnitude, which gives
// the scale sum |a||b| that bounds rounding error in any summation order.
struct ConvReference {
  std::vector<double> y, dx, dw;
};

inline ConvReference conv_reference(const Conv2dArgs& a, const std::vector<double>& x, const std::vector<double>& w,
                                    const std::vector<double>& dy, bool abs = false) {
  auto v = [abs](double d) { return abs ? std::abs(d) : d; };
  ConvReference r{std::vector<double>(size_t(y_numel(a))), std::vector<double>(size_t(x_numel(a))),
                  std::vector<double>(size_t(w_numel(a)))};
  const int64_t cg = a.c_in / a.groups, kg = a.c_out / a.groups;
  for (int64_t n = 0; n < a.n; ++n)
    for (int64_t k = 0; k < a.c_out; ++k)
      for (int64_t oh = 0; oh < a.out_h; ++oh)
        for (int64_t ow = 0; ow < a.out_w; ++ow) {
          const int64_t yi = ((n * a.c_out + k) * a.out_h + oh) * a.out_w + ow;
          for (int64_t c = 0; c < cg; ++c)
            for (int64_t i = 0; i < a.kh; ++i)
              for (int64_t j = 0; j < a.kw; ++j) {
                const int64_t ih = oh * a.stride_h - a.pad_h + i * a.dilation_h;
                const int64_t iw = ow * a.stride_w - a.pad_w + j * a.dilation_w;
                if (ih < 0 || ih >= a.h || iw < 0 || iw >= a.w) continue;
                const int64_t xi = ((n * a.c_in + k / kg * cg + c) * a.h + ih) * a.w + iw;
                const int64_t wi = ((k * cg + c) * a.kh + i) * a.kw + j;
                r.y[size_t(yi)] += v(w[size_t(wi)]) * v(x[size_t(xi)]);
                r.dx[size_t(xi)] += v(dy[size_t(yi)]) * v(w[size_t(wi)]);
                r.dw[size_t(wi)] += v(dy[size_t(yi)]) * v(x[size_t(xi)]);
              }
        }
  return r;
}

// A row-major (N, C, H, W) buffer laid out channels-last, (N, H, W, C) in memory, and back.
template <class V>
V to_channels_last(const V& v, int64_t n, int64_t c, int64_t h, int64_t w) {
  V out(v.size());
  for (int64_t i = 0; i < n; ++i)
    for (int64_t k = 0; k < c; ++k)
      for (int64_t p = 0; p < h * w; ++p) out[size_t((i * h * w + p) * c + k)] = v[size_t((i * c + k) * h * w + p)];
  return out;
}

template <class V>
V from_channels_last(const V& v, int64_t n, int64_t c, int64_t h, int64_t w) {
  V out(v.size());
  for (int64_t i = 0; i < n; ++i)
    for (int64_t k = 0; k < c; ++k)
      for (int64_t p = 0; p < h * w; ++p) out[size_t((i * c + k) * h * w + p)] = v[size_t((i * h * w + p) * c + k)];
  return out;
}

struct PoolCase {
  std::string name;
  int64_t n, c, h, w, kh, kw, stride_h, stride_w, pad_h = 0, pad_w = 0;
};

inline Pool2dArgs pool_args(const PoolCase& p, DType dtype) {
  Pool2dArgs a;
  a.dtype = dtype;
  a.n = p.n, a.c = p.c, a.h = p.h, a.w = p.w, a.kh = p.kh, a.kw = p.kw;
  a.stride_h = p.stride_h, a.stride_w = p.stride_w, a.pad_h = p.pad_h, a.pad_w = p.pad_w;
  a.out_h = (p.h + 2 * p.pad_h - p.kh) / p.stride_h + 1;
  a.out_w = (p.w + 2 * p.pad_w - p.kw) / p.stride_w + 1;
  return a;
}

// Max pooling by loops: values, indices (ih * W + iw within the plane), and dx by
// scattering dy to the indices.
struct MaxPoolReference {
  std::vector<double> y, dx;
  std::vector<int64_t> indices;
};

inline MaxPoolReference max_pool_reference(const Pool2dArgs& a, const std::vector<double>& x,
                                           const std::vector<double>& dy) {
  const int64_t planes = a.n * a.c, ohw = a.out_h * a.out_w, hw = a.h * a.w;
  MaxPoolReference r{std::vector<double>(size_t(planes * ohw)), std::vector<double>(size_t(planes * hw)),
                     std::vector<int64_t>(size_t(planes * ohw))};
  for (int64_t p = 0; p < planes; ++p)
    for (int64_t oh = 0; oh < a.out_h; ++oh)
      for (int64_t ow = 0; ow < a.out_w; ++ow) {
        double best = -std::numeric_limits<double>::infinity();
        int64_t at = -1;
        for (int64_t i = 0; i < a.kh; ++i)
          for (int64_t j = 0; j < a.kw; ++j) {
            const int64_t ih = oh * a.stride_h - a.pad_h + i, iw = ow * a.stride_w - a.pad_w + j;
            if (ih < 0 || ih >= a.h || iw < 0 || iw >= a.w) continue;
            if (at < 0 || x[size_t(p * hw + ih * a.w + iw)] > best) {
              best = x[size_t(p * hw + ih * a.w + iw)];
              at = ih * a.w + iw;
            }
          }
        const int64_t o = p * ohw + oh * a.out_w + ow;
        r.y[size_t(o)] = best;
        r.indices[size_t(o)] = at;
        r.dx[size_t(p * hw + at)] += dy[size_t(o)];
      }
  return r;
}

// Average pooling by loops, padding counted as zeros (divisor KH * KW); dx by scattering.
struct AvgPoolReference {
  std::vector<double> y, dx;
};

inline AvgPoolReference avg_pool_reference(const Pool2dArgs& a, const std::vector<double>& x,
                                           const std::vector<double>& dy) {
  const int64_t planes = a.n * a.c, ohw = a.out_h * a.out_w, hw = a.h * a.w;
  AvgPoolReference r{std::vector<double>(size_t(planes * ohw)), std::vector<double>(size_t(planes * hw))};
  const double k = double(a.kh * a.kw);
  for (int64_t p = 0; p < planes; ++p)
    for (int64_t oh = 0; oh < a.out_h; ++oh)
      for (int64_t ow = 0; ow < a.out_w; ++ow) {
        const int64_t o = p * ohw + oh * a.out_w + ow;
        for (int64_t i = 0; i < a.kh; ++i)
          for (int64_t j = 0; j < a.kw; ++j) {
            const int64_t ih = oh * a.stride_h - a.pad_h + i, iw = ow * a.stride_w - a.pad_w + j;
            if (ih < 0 || ih >= a.h || iw < 0 || iw >= a.w) continue;
            r.y[size_t(o)] += x[size_t(p * hw + ih * a.w + iw)] / k;
            r.dx[size_t(p * hw + ih * a.w + iw)] += dy[size_t(o)] / k;
          }
      }
  return r;
}

}  // namespace loom::test
