// CPU convolution: im2col + the CPU gemm, the textbook lowering, and the reference the
// cuDNN path is tested against.
//
// For one sample and one group, im2col lays the input windows out as a column matrix
// col (C_in/g * KH * KW, OH * OW), so that
//   forward:          y_g  (C_out/g, OH*OW)        = w_g (C_out/g, rows) @ col
//   backward data:    dcol (rows, OH*OW)           = w_g^T @ dy_g, then col2im adds dcol back
//   backward filter:  dw_g (C_out/g, rows)        += dy_g @ col^T, summed over samples, the
//                     columns and gradients of a chunk of samples side by side in one product
// A 1x1 convolution with stride 1 and no padding needs no im2col in the other two passes: x
// is already col.
//
// Channels-last activations (x (N, H, W, C_in), y (N, OH, OW, C_out); the weight stays
// (C_out, C_in/g, KH, KW) row-major) take the transposed lowering: im2row lays one sample's
// windows out as a row matrix row (OH * OW, C_in/g * KH * KW), one output pixel's window
// per row in the weight's (c, i, j) order, so that
//   forward:          y_g  (OH*OW, C_out/g)        = row @ w_g^T
//   backward data:    drow (OH*OW, rows)           = dy_g @ w_g, then row2im adds drow back
//   backward filter:  dw_g (C_out/g, rows)        += dy_g^T @ row, summed over samples
// where y_g, dy_g and the group's slice of x are columns of their buffers (row stride C_out
// or C_in), read and written in place, and OH*OW spans a chunk of samples (below). A 1x1
// stride-1 unpadded x is its own row matrix.
//
// Everything runs in the accumulation type (f32 for bf16/f16): 16-bit buffers are
// converted once on the way in and the result once on the way out, so sums over the
// batch never round to 16 bits. Row-major, threads split the batch (the gemm then runs
// inline, as parallel_for nests inline); a batch of one leaves the threads to the gemm
// instead. Channels-last, the gemm's threads split each chunk's product. In both layouts the
// filter gradient sums over samples in a fixed number of partial buffers reduced in order,
// so its bits do not depend on the thread count.
#include <algorithm>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels/cpu/common.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/parallel_for.h"

namespace loom::cpu {
namespace {

// Partial sums of the filter gradient: at most this many copies of dw are held at once.
constexpr int64_t kFilterPartials = 8;
// Bytes of windows (and gradients) laid out at once for a chunk of samples; a chunk holds at
// least one.
constexpr int64_t kChunkBytes = int64_t(8) << 20;

struct Geometry {
  int64_t cg = 0, kg = 0;  // input and output channels per group
  int64_t rows = 0;        // cg * KH * KW: rows of the column matrix
  int64_t hw = 0, ohw = 0; // input and output plane sizes
  bool direct = false;     // 1x1, stride 1, no padding: x is its own column matrix
};

Geometry geometry(const Conv2dArgs& a) {
  Geometry g;
  g.cg = a.c_in / a.groups;
  g.kg = a.c_out / a.groups;
  g.rows = g.cg * a.kh * a.kw;
  g.hw = a.h * a.w;
  g.ohw = a.out_h * a.out_w;
  g.direct = a.kh == 1 && a.kw == 1 && a.stride_h == 1 && a.stride_w == 1 && a.pad_h == 0 && a.pad_w == 0;
  return g;
}

// col (cg * KH * KW, OH * OW; row stride ld) from one group's input planes x (cg, H, W);
// zeros where a window reads padding.
template <class A>
void im2col(const Conv2dArgs& a, const Geometry& g, const A* x, A* col, int64_t ld) {
  for (int64_t c = 0; c < g.cg; ++c)
    for (int64_t i = 0; i < a.kh; ++i)
      for (int64_t j = 0; j < a.kw; ++j) {
        A* row = col + ((c * a.kh + i) * a.kw + j) * ld;
        for (int64_t oh = 0; oh < a.out_h; ++oh) {
          A* out = row + oh * a.out_w;
          const int64_t ih = oh * a.stride_h - a.pad_h + i * a.dilation_h;
          if (ih < 0 || ih >= a.h) {
            std::fill_n(out, a.out_w, A(0));
            continue;
          }
          const A* in = x + c * g.hw + ih * a.w;
          for (int64_t ow = 0; ow < a.out_w; ++ow) {
            const int64_t iw = ow * a.stride_w - a.pad_w + j * a.dilation_w;
            out[ow] = iw >= 0 && iw < a.w ? in[iw] : A(0);
          }
        }
      }
}

// The adjoint of im2col: x (cg, H, W) += every entry of col (row stride ld) at the input it
// was read from.
template <class A>
void col2im(const Conv2dArgs& a, const Geometry& g, const A* col, int64_t ld, A* x) {
  for (int64_t c = 0; c < g.cg; ++c)
    for (int64_t i = 0; i < a.kh; ++i)
      for (int64_t j = 0; j < a.kw; ++j) {
        const A* row = col + ((c * a.kh + i) * a.kw + j) * ld;
        for (int64_t oh = 0; oh < a.out_h; ++oh) {
          const int64_t ih = oh * a.stride_h - a.pad_h + i * a.dilation_h;
          if (ih < 0 || ih >= a.h) continue;
          const A* in = row + oh * a.out_w;
          A* out = x + c * g.hw + ih * a.w;
          for (int64_t ow = 0; ow < a.out_w; ++ow) {
            const int64_t iw = ow * a.stride_w - a.pad_w + j * a.dilation_w;
            if (iw >= 0 && iw < a.w) out[iw] += in[ow];
          }
        }
      }
}

// row (OH * OW, cg * KH * KW) from one group's channels of a channels-last sample x (H, W,
// C_in; x points at the group's first channel); zeros where a window reads padding. Each
// input pixel's channels are read together and written KH * KW apart.
template <class A>
void im2row(const Conv2dArgs& a, const Geometry& g, const A* x, A* row) {
  const int64_t taps = a.kh * a.kw;
  for (int64_t oh = 0; oh < a.out_h; ++oh)
    for (int64_t ow = 0; ow < a.out_w; ++ow) {
      A* window = row + (oh * a.out_w + ow) * g.rows;
      for (int64_t i = 0; i < a.kh; ++i) {
        const int64_t ih = oh * a.stride_h - a.pad_h + i * a.dilation_h;
        for (int64_t j = 0; j < a.kw; ++j) {
          const int64_t iw = ow * a.stride_w - a.pad_w + j * a.dilation_w;
          A* out = window + i * a.kw + j;
          if (ih < 0 || ih >= a.h || iw < 0 || iw >= a.w) {
            for (int64_t c = 0; c < g.cg; ++c) out[c * taps] = A(0);
          } else {
            const A* in = x + (ih * a.w + iw) * a.c_in;
            for (int64_t c = 0; c < g.cg; ++c) out[c * taps] = in[c];
          }
        }
      }
    }
}

// The adjoint of im2row: x (H, W, C_in; the group's channels) += every entry of row at the
// input it was read from.
template <class A>
void row2im(const Conv2dArgs& a, const Geometry& g, const A* row, A* x) {
  for (int64_t oh = 0; oh < a.out_h; ++oh)
    for (int64_t ow = 0; ow < a.out_w; ++ow) {
      const A* window = row + (oh * a.out_w + ow) * g.rows;
      for (int64_t i = 0; i < a.kh; ++i) {
        const int64_t ih = oh * a.stride_h - a.pad_h + i * a.dilation_h;
        for (int64_t j = 0; j < a.kw; ++j) {
          const int64_t iw = ow * a.stride_w - a.pad_w + j * a.dilation_w;
          if (ih < 0 || ih >= a.h || iw < 0 || iw >= a.w) continue;
          const A* in = window + i * a.kw + j;
          A* out = x + (ih * a.w + iw) * a.c_in;
          for (int64_t c = 0; c < g.cg; ++c) out[c] += in[c * a.kh * a.kw];
        }
      }
    }
}

// c (m, n) = op(a) (m, k) @ op(b) (k, n) + beta * c, row-major, on the CPU gemm.
template <class A>
void matmul(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const A* a, int64_t lda, const A* b, int64_t ldb,
            A* c, int64_t ldc, float beta) {
  GemmArgs g;
  g.dtype = std::is_same_v<A, double> ? DType::f64 : DType::f32;
  g.trans_a = ta, g.trans_b = tb;
  g.m = m, g.n = n, g.k = k;
  g.a = a, g.lda = lda, g.b = b, g.ldb = ldb, g.c = c, g.ldc = ldc;
  g.beta = beta;
  gemm(g, nullptr);
}

// The filter gradient summed over a fixed number of parts of the batch, threads taking the
// parts: part(acc, first, last) writes the gradient of samples [first, last) into acc, part 0
// into dw and the others into partial buffers then added to dw in order, so the bits do not
// depend on the thread count.
template <class A, class Part>
void sum_over_parts(const Conv2dArgs& a, int64_t w_size, int64_t parts, A* dw, Part&& part) {
  if (a.n == 0) {
    std::fill_n(dw, w_size, A(0));
    return;
  }
  std::vector<A> partial(size_t((parts - 1) * w_size));
  parallel_for(parts, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      part(t == 0 ? dw : partial.data() + (t - 1) * w_size, a.n * t / parts, a.n * (t + 1) / parts);
  });
  parallel_for(w_size, 1 << 14, [&](int64_t i0, int64_t i1) {
    for (int64_t t = 1; t < parts; ++t) {
      const A* p = partial.data() + (t - 1) * w_size;
      for (int64_t i = i0; i < i1; ++i) dw[i] += p[i];
    }
  });
}

// Chunks of samples side by side (row-major): the planes of channels [c0, c0 + kc) of samples
// [n0, n0 + count) of an NCHW buffer with `channels` a sample, as one (kc, count * plane)
// matrix; scatter_planes puts such a matrix back.
template <class A>
void gather_planes(const A* t, int64_t channels, int64_t c0, int64_t kc, int64_t plane, int64_t n0, int64_t count,
                   A* out) {
  for (int64_t s = 0; s < count; ++s)
    for (int64_t k = 0; k < kc; ++k)
      std::copy_n(t + ((n0 + s) * channels + c0 + k) * plane, plane, out + (k * count + s) * plane);
}

template <class A>
void scatter_planes(const A* in, int64_t channels, int64_t c0, int64_t kc, int64_t plane, int64_t n0, int64_t count,
                    A* t) {
  for (int64_t s = 0; s < count; ++s)
    for (int64_t k = 0; k < kc; ++k)
      std::copy_n(in + (k * count + s) * plane, plane, t + ((n0 + s) * channels + c0 + k) * plane);
}

// The columns of samples [n0, n0 + count) of group grp side by side: col (rows, count * OH * OW).
template <class A>
void im2col_chunk(const Conv2dArgs& a, const Geometry& g, const A* x, int64_t n0, int64_t count, int64_t grp,
                  A* col) {
  for (int64_t s = 0; s < count; ++s)
    im2col(a, g, x + ((n0 + s) * a.c_in + grp * g.cg) * g.hw, col + s * g.ohw, count * g.ohw);
}

// Runs body(n0, count) over the chunks of `chunk` samples of n, threads taking chunks.
template <class Body>
void over_chunks(int64_t n, int64_t chunk, Body&& body) {
  parallel_for((n + chunk - 1) / chunk, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) body(c * chunk, std::min(chunk, n - c * chunk));
  });
}

// Samples a product takes in the forward and backward-data passes. A sample's own product is
// wide enough from kWidePlane output pixels on (one a thread, no copies); below that, a chunk
// of samples goes side by side, within the chunk bytes shared by the threads and at most an
// even share of the batch. The chunking does not change a result: each output sums over the
// same k in the same order.
constexpr int64_t kWidePlane = 256;

// Bytes a sample takes among a chunk's columns and gradients (of element size `bytes`).
int64_t chunk_bytes_of(const Geometry& g, size_t bytes) {
  return std::max<int64_t>(g.ohw * (g.rows + g.kg) * int64_t(bytes), 1);
}

int64_t chunk_for(const Conv2dArgs& a, const Geometry& g, size_t bytes) {
  if (g.direct || g.ohw >= kWidePlane) return 1;
  const int64_t threads = std::max(num_threads(), 1);
  const int64_t share = std::max<int64_t>((a.n + threads - 1) / threads, 1);
  return std::clamp<int64_t>(kChunkBytes / threads / chunk_bytes_of(g, bytes), 1, share);
}

// fn(n, grp, col) for every sample n and group grp, a sample at a time over the threads, each
// thread's samples sharing one column buffer (rows x OH*OW; none for a direct product).
template <class A, class Fn>
void over_samples(const Conv2dArgs& a, const Geometry& g, Fn fn) {
  parallel_for(a.n, 1, [&](int64_t n0, int64_t n1) {
    std::vector<A> col(size_t(g.direct ? 0 : g.rows * g.ohw));
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t grp = 0; grp < a.groups; ++grp) fn(n, grp, col.data());
  });
}

template <class A>
void forward_acc(const Conv2dArgs& a, A* y, const A* x, const A* w) {
  const Geometry g = geometry(a);
  const int64_t chunk = chunk_for(a, g, sizeof(A));
  if (chunk == 1) {  // a sample a product, written in place
    over_samples<A>(a, g, [&](int64_t n, int64_t grp, A* col) {
      const A* xg = x + (n * a.c_in + grp * g.cg) * g.hw;
      if (!g.direct) im2col(a, g, xg, col, g.ohw);
      matmul<A>(false, false, g.kg, g.ohw, g.rows, w + grp * g.kg * g.rows, g.rows, g.direct ? xg : col, g.ohw,
                y + (n * a.c_out + grp * g.kg) * g.ohw, g.ohw, 0.f);
    });
    return;
  }
  // A chunk's columns, col (rows, S * OH * OW), give ys (C_out/g, S * OH * OW), put back into y.
  over_chunks(a.n, chunk, [&](int64_t n0, int64_t count) {
    const int64_t width = count * g.ohw;
    std::vector<A> col(size_t(width * g.rows)), ys(size_t(width * g.kg));
    for (int64_t grp = 0; grp < a.groups; ++grp) {
      im2col_chunk(a, g, x, n0, count, grp, col.data());
      matmul<A>(false, false, g.kg, width, g.rows, w + grp * g.kg * g.rows, g.rows, col.data(), width, ys.data(),
                width, 0.f);
      scatter_planes(ys.data(), a.c_out, grp * g.kg, g.kg, g.ohw, n0, count, y);
    }
  });
}

template <class A>
void backward_data_acc(const Conv2dArgs& a, A* dx, const A* dy, const A* w) {
  const Geometry g = geometry(a);
  const int64_t chunk = chunk_for(a, g, sizeof(A));
  if (chunk == 1) {  // a sample a product, read in place
    over_samples<A>(a, g, [&](int64_t n, int64_t grp, A* col) {
      A* dxg = dx + (n * a.c_in + grp * g.cg) * g.hw;
      const A* dyg = dy + (n * a.c_out + grp * g.kg) * g.ohw;
      const A* wg = w + grp * g.kg * g.rows;  // (kg, rows), read transposed
      if (g.direct) {
        matmul<A>(true, false, g.rows, g.ohw, g.kg, wg, g.rows, dyg, g.ohw, dxg, g.ohw, 0.f);
        return;
      }
      matmul<A>(true, false, g.rows, g.ohw, g.kg, wg, g.rows, dyg, g.ohw, col, g.ohw, 0.f);
      std::fill_n(dxg, g.cg * g.hw, A(0));
      col2im(a, g, col, g.ohw, dxg);
    });
    return;
  }
  // A chunk's gradients, dys (C_out/g, S * OH * OW), give dcol (rows, S * OH * OW), which
  // col2im adds back into each sample.
  over_chunks(a.n, chunk, [&](int64_t n0, int64_t count) {
    const int64_t width = count * g.ohw;
    std::vector<A> col(size_t(width * g.rows)), dys(size_t(width * g.kg));
    for (int64_t grp = 0; grp < a.groups; ++grp) {
      gather_planes(dy, a.c_out, grp * g.kg, g.kg, g.ohw, n0, count, dys.data());
      matmul<A>(true, false, g.rows, width, g.kg, w + grp * g.kg * g.rows, g.rows, dys.data(), width, col.data(),
                width, 0.f);
      for (int64_t s = 0; s < count; ++s) {
        A* dxg = dx + ((n0 + s) * a.c_in + grp * g.cg) * g.hw;
        std::fill_n(dxg, g.cg * g.hw, A(0));
        col2im(a, g, col.data() + s * g.ohw, width, dxg);
      }
    }
  });
}

// Each part of the batch goes a chunk of samples a product: their columns side by side, col
// (rows, S * OH * OW), and their gradients likewise, dys (C_out/g, S * OH * OW), so k spans
// the chunk.
template <class A>
void backward_filter_acc(const Conv2dArgs& a, A* dw, const A* x, const A* dy) {
  const Geometry g = geometry(a);
  const int64_t parts = std::min(a.n, kFilterPartials);
  sum_over_parts(a, a.c_out * g.rows, parts, dw, [&](A* acc, int64_t first, int64_t last) {
    const int64_t chunk = std::clamp<int64_t>(kChunkBytes / parts / chunk_bytes_of(g, sizeof(A)), 1, last - first);
    std::vector<A> col(size_t(chunk * g.ohw * g.rows)), dys(size_t(chunk * g.ohw * g.kg));
    for (int64_t n0 = first; n0 < last; n0 += chunk) {
      const int64_t count = std::min(chunk, last - n0), width = count * g.ohw;
      for (int64_t grp = 0; grp < a.groups; ++grp) {
        im2col_chunk(a, g, x, n0, count, grp, col.data());
        gather_planes(dy, a.c_out, grp * g.kg, g.kg, g.ohw, n0, count, dys.data());
        matmul<A>(false, true, g.kg, g.rows, width, dys.data(), width, col.data(), width, acc + grp * g.kg * g.rows,
                  g.rows, n0 == first ? 0.f : 1.f);
      }
    }
  });
}

// ---- channels-last -------------------------------------------------------------------
//
// A channels-last batch is one tall matrix (N * OH * OW rows of C channels), so the
// products run over chunks of whole samples at once: each chunk's windows are laid out as
// rows (a thread per sample), then one product covers the chunk, its threads splitting the
// rows. The filter gradient sums over the chunk inside the product, chunks in order.

// Runs body(n0, count) over the chunks of samples [n0, n0 + count), in order, with `row`
// sized for a chunk's windows of at most `bytes` (left empty for a direct convolution, whose
// x is its own row matrix and so needs no bound).
template <class A, class Body>
void for_each_chunk(const Conv2dArgs& a, const Geometry& g, std::vector<A>& row, Body&& body,
                    int64_t bytes = kChunkBytes) {
  const int64_t all = std::max<int64_t>(a.n, 1);
  const int64_t per_sample = std::max<int64_t>(g.ohw * g.rows * int64_t(sizeof(A)), 1);
  const int64_t chunk = g.direct ? all : std::clamp<int64_t>(bytes / per_sample, 1, all);
  row.resize(size_t(g.direct ? 0 : chunk * g.ohw * g.rows));
  for (int64_t n0 = 0; n0 < a.n; n0 += chunk) body(n0, std::min(chunk, a.n - n0));
}

// The row matrix of samples [n0, n0 + count) of group grp and its row stride: the group's
// columns of x for a direct convolution, else their windows laid out in `row` (a thread per
// sample), a row per output pixel.
template <class A>
std::pair<const A*, int64_t> windows(const Conv2dArgs& a, const Geometry& g, const A* x, int64_t n0, int64_t count,
                                     int64_t grp, std::vector<A>& row) {
  const A* xg = x + n0 * g.hw * a.c_in + grp * g.cg;
  if (g.direct) return {xg, a.c_in};
  parallel_for(count, 1, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) im2row(a, g, xg + s * g.hw * a.c_in, row.data() + s * g.ohw * g.rows);
  });
  return {row.data(), g.rows};
}

template <class A>
void forward_cl(const Conv2dArgs& a, A* y, const A* x, const A* w) {
  const Geometry g = geometry(a);
  std::vector<A> row;
  for_each_chunk(a, g, row, [&](int64_t n0, int64_t count) {
    for (int64_t grp = 0; grp < a.groups; ++grp) {
      const auto [rows, ld] = windows(a, g, x, n0, count, grp, row);
      matmul<A>(false, true, count * g.ohw, g.kg, g.rows, rows, ld, w + grp * g.kg * g.rows, g.rows,
                y + n0 * g.ohw * a.c_out + grp * g.kg, a.c_out, 0.f);
    }
  });
}

template <class A>
void backward_data_cl(const Conv2dArgs& a, A* dx, const A* dy, const A* w) {
  const Geometry g = geometry(a);
  std::vector<A> row;
  for_each_chunk(a, g, row, [&](int64_t n0, int64_t count) {
    A* dxn = dx + n0 * g.hw * a.c_in;
    if (!g.direct) std::fill_n(dxn, count * g.hw * a.c_in, A(0));
    for (int64_t grp = 0; grp < a.groups; ++grp) {
      const A* dyg = dy + n0 * g.ohw * a.c_out + grp * g.kg;
      const A* wg = w + grp * g.kg * g.rows;  // (kg, rows)
      if (g.direct) {
        matmul<A>(false, false, count * g.ohw, g.rows, g.kg, dyg, a.c_out, wg, g.rows, dxn + grp * g.cg, a.c_in, 0.f);
        continue;
      }
      matmul<A>(false, false, count * g.ohw, g.rows, g.kg, dyg, a.c_out, wg, g.rows, row.data(), g.rows, 0.f);
      parallel_for(count, 1, [&](int64_t s0, int64_t s1) {
        for (int64_t s = s0; s < s1; ++s)
          row2im(a, g, row.data() + s * g.ohw * g.rows, dxn + s * g.hw * a.c_in + grp * g.cg);
      });
    }
  });
}

// A group's filter gradient smaller than this has too few blocks of product to keep the
// threads busy: the batch is then split into parts, as backward_filter_acc does.
constexpr int64_t kSplitBelow = int64_t(1) << 15;

// The gemm's threads share each chunk's product; a small gradient (kSplitBelow, a rule of
// shapes alone, so the bits never depend on the thread count) is instead summed over a fixed
// number of parts of the batch into partial gradients, threads taking the parts, reduced in
// order, each part going in chunks of its share of the chunk bytes.
template <class A>
void backward_filter_cl(const Conv2dArgs& a, A* dw, const A* x, const A* dy) {
  const Geometry g = geometry(a);
  const int64_t parts = g.kg * g.rows < kSplitBelow ? std::min(a.n, kFilterPartials) : std::min<int64_t>(a.n, 1);
  sum_over_parts(a, a.c_out * g.rows, parts, dw, [&](A* acc, int64_t first, int64_t last) {
    Conv2dArgs part = a;
    part.n = last - first;
    const A* xp = x + first * g.hw * a.c_in;
    const A* dyp = dy + first * g.ohw * a.c_out;
    std::vector<A> row;
    for_each_chunk(part, g, row, [&](int64_t n0, int64_t count) {
      for (int64_t grp = 0; grp < a.groups; ++grp) {
        const auto [rows, ld] = windows(part, g, xp, n0, count, grp, row);
        matmul<A>(true, false, g.kg, g.rows, count * g.ohw, dyp + n0 * g.ohw * a.c_out + grp * g.kg, a.c_out, rows, ld,
                  acc + grp * g.kg * g.rows, g.rows, n0 == 0 ? 0.f : 1.f);
      }
    }, kChunkBytes / parts);
  });
}

// A buffer of T seen as A: the buffer itself when T is A, else a converted copy in `store`.
template <class T, class A>
const A* input_as(const void* p, int64_t n, std::vector<A>& store) {
  if constexpr (std::is_same_v<T, A>) {
    return static_cast<const A*>(p);
  } else {
    const T* src = static_cast<const T*>(p);
    store.resize(size_t(n));
    parallel_for(n, 1 << 16, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) store[size_t(i)] = A(float(src[i]));
    });
    return store.data();
  }
}

// Where an output of T is computed as A: in place when T is A and nothing is added to it,
// else in `store`; finish_output converts it back, with `add_into` adding it to what the
// output held (one rounding).
template <class T, class A>
A* output_as(void* p, int64_t n, std::vector<A>& store, bool add_into) {
  if (std::is_same_v<T, A> && !add_into) return static_cast<A*>(p);
  store.resize(size_t(n));
  return store.data();
}

template <class T, class A>
void finish_output(void* p, int64_t n, const std::vector<A>& store, bool add_into) {
  if (std::is_same_v<T, A> && !add_into) return;
  T* dst = static_cast<T*>(p);
  parallel_for(n, 1 << 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      A v = store[size_t(i)];
      if (add_into) {
        if constexpr (std::is_same_v<T, A>) v = dst[i] + v;
        else v = A(float(dst[i])) + v;
      }
      dst[i] = T(v);
    }
  });
}

// Runs `core(out, in0, in1)` in the accumulation type of args.dtype; with `add_into`, the
// result is added to what `out` held.
template <class Core>
void run_acc(const Conv2dArgs& a, const char* what, void* out, int64_t out_n, const void* in0, int64_t in0_n,
             const void* in1, int64_t in1_n, Core&& core, bool add_into = false) {
  dispatch_floating(a.dtype, what, [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    std::vector<A> s0, s1, so;
    const A* p0 = input_as<T>(in0, in0_n, s0);
    const A* p1 = input_as<T>(in1, in1_n, s1);
    A* po = output_as<T>(out, out_n, so, add_into);
    core(po, p0, p1);
    finish_output<T>(out, out_n, so, add_into);
  });
}

int64_t x_numel(const Conv2dArgs& a) { return a.n * a.c_in * a.h * a.w; }
int64_t y_numel(const Conv2dArgs& a) { return a.n * a.c_out * a.out_h * a.out_w; }
int64_t w_numel(const Conv2dArgs& a) { return a.c_out * (a.c_in / a.groups) * a.kh * a.kw; }
bool channels_last(const Conv2dArgs& a) { return a.layout == ChannelLayout::channels_last; }

}  // namespace

size_t conv2d_workspace_size(const Conv2dArgs&, ConvPass) { return 0; }

void conv2d_forward(const Conv2dArgs& a, void* y, const void* x, const void* w, StreamHandle) {
  if (y_numel(a) == 0) return;
  run_acc(a, "conv2d", y, y_numel(a), x, x_numel(a), w, w_numel(a), [&](auto* out, const auto* xa, const auto* wa) {
    channels_last(a) ? forward_cl(a, out, xa, wa) : forward_acc(a, out, xa, wa);
  });
}

void conv2d_backward_data(const Conv2dArgs& a, void* dx, const void* dy, const void* w, StreamHandle) {
  if (x_numel(a) == 0) return;
  run_acc(
      a, "conv2d backward", dx, x_numel(a), dy, y_numel(a), w, w_numel(a),
      [&](auto* out, const auto* dya, const auto* wa) {
        channels_last(a) ? backward_data_cl(a, out, dya, wa) : backward_data_acc(a, out, dya, wa);
      },
      a.accumulate);
}

void conv2d_backward_filter(const Conv2dArgs& a, void* dw, const void* x, const void* dy, StreamHandle) {
  if (w_numel(a) == 0) return;
  run_acc(a, "conv2d backward", dw, w_numel(a), x, x_numel(a), dy, y_numel(a),
          [&](auto* out, const auto* xa, const auto* dya) {
            channels_last(a) ? backward_filter_cl(a, out, xa, dya) : backward_filter_acc(a, out, xa, dya);
          });
}

}  // namespace loom::cpu
