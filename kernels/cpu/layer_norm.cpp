// CPU layer normalisation over the rows of a contiguous (rows, dim) buffer: threads over
// rows for the forward and dx, over column blocks for dweight, dbias and dx's sums.
//
// This is the reference the CUDA kernels are checked against, so every sum is pairwise in
// double whatever the dtypes: the row statistics and the backward's row means over dim, the
// parameter gradients over rows. The variance is two-pass (mean, then the mean of squared
// deviations), so a large mean never cancels against it. Values are computed in double from
// the inputs (and from mean and rstd as saved, in the accumulation type) and rounded once to
// the output dtype. Parameters of any floating dtype are read and written through double.
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/core/layer_norm_check.h"
#include "kernels/cpu/common.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/pairwise.h"
#include "kernels/cpu/parallel_for.h"

namespace loom::cpu {
namespace {

constexpr int kColumnBlock = 64;  // columns of dweight/dbias summed together, one task each

template <class T> double as_double(T v) { return double(acc_t<T>(v)); }

// Pairwise sum of f(j) over [j0, j1), in double.
template <class F> double pairwise_sum(int64_t j0, int64_t j1, const F& f) {
  if (j1 - j0 <= kPairwiseLeaf) {
    double s = 0;
    for (int64_t j = j0; j < j1; ++j) s += f(j);
    return s;
  }
  const int64_t mid = j0 + (j1 - j0) / 2;
  return pairwise_sum(j0, mid, f) + pairwise_sum(mid, j1, f);
}

// A parameter vector of any floating dtype in double: `absent` everywhere when p is null.
std::vector<double> param_vector(const void* p, DType dtype, int64_t dim, double absent) {
  std::vector<double> v(size_t(dim), absent);
  if (!p) return v;
  dispatch_floating(dtype, "layer_norm parameters", [&](auto tag) {
    using P = decltype(tag);
    for (int64_t j = 0; j < dim; ++j) v[size_t(j)] = as_double(static_cast<const P*>(p)[j]);
  });
  return v;
}

// Runs body(T{}, O{}) with T the element type of x and dx, O that of y and dy.
template <class Body> void dispatch_io(const LayerNormArgs& a, const char* what, Body&& body) {
  dispatch_floating(a.dtype, what, [&](auto t) {
    dispatch_floating(a.out_dtype, what, [&](auto o) { body(t, o); });
  });
}

// Rows per task: enough values that a thread hand-off pays for itself.
int64_t row_grain(int64_t dim) { return std::max<int64_t>(1, (int64_t(1) << 14) / std::max<int64_t>(dim, 1)); }

}  // namespace

void layer_norm_forward(const LayerNormArgs& a, void* y, void* mean, void* rstd, const void* x, const void* weight,
                        const void* bias, StreamHandle) {
  if (a.rows == 0 || a.dim == 0) return;
  const std::vector<double> w = param_vector(weight, a.param_dtype, a.dim, 1.0);
  const std::vector<double> b = param_vector(bias, a.param_dtype, a.dim, 0.0);
  dispatch_io(a, "layer_norm", [&](auto t, auto o) {
    using T = decltype(t);
    using O = decltype(o);
    using A = acc_t<T>;
    parallel_for(a.rows, row_grain(a.dim), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const T* in = static_cast<const T*>(x) + r * a.dim;  // (dim)
        O* out = static_cast<O*>(y) + r * a.dim;             // (dim)
        const double mu = pairwise_sum(0, a.dim, [&](int64_t j) { return as_double(in[j]); }) / double(a.dim);
        const double var = pairwise_sum(0, a.dim, [&](int64_t j) {
                             const double d = as_double(in[j]) - mu;
                             return d * d;
                           }) / double(a.dim);
        const double rs = 1.0 / std::sqrt(var + a.eps);
        static_cast<A*>(mean)[r] = A(mu);
        static_cast<A*>(rstd)[r] = A(rs);
        for (int64_t j = 0; j < a.dim; ++j) out[j] = O((as_double(in[j]) - mu) * rs * w[size_t(j)] + b[size_t(j)]);
      }
    });
  });
}

size_t layer_norm_workspace_size(const LayerNormArgs&) { return 0; }

void layer_norm_backward(const LayerNormArgs& a, void* dx, void* dweight, void* dbias, const void* dy, const void* x,
                         const void* mean, const void* rstd, const void* weight, void*, StreamHandle) {
  if (a.dim == 0) return;
  check_layer_norm_backward(a, dx);
  const std::vector<double> w = param_vector(weight, a.param_dtype, a.dim, 1.0);
  dispatch_io(a, "layer_norm backward", [&](auto t, auto o) {
    using T = decltype(t);
    using O = decltype(o);
    using A = acc_t<T>;
    const T* xs = static_cast<const T*>(x);    // (rows, dim)
    const O* gys = static_cast<const O*>(dy);  // (rows, dim)
    auto xhat = [&](int64_t r, int64_t j) {
      return (as_double(xs[r * a.dim + j]) - double(static_cast<const A*>(mean)[r])) *
             double(static_cast<const A*>(rstd)[r]);
    };
    if (dx) {
      parallel_for(a.rows, row_grain(a.dim), [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          const O* gy = gys + r * a.dim;
          T* gx = static_cast<T*>(dx) + r * a.dim;
          const T* add = a.dx_add ? static_cast<const T*>(a.dx_add) + r * a.dim : nullptr;
          O* rounded = a.dx_rounded ? static_cast<O*>(a.dx_rounded) + r * a.dim : nullptr;
          auto g = [&](int64_t j) { return as_double(gy[j]) * w[size_t(j)]; };
          const double mean_g = pairwise_sum(0, a.dim, g) / double(a.dim);
          const double mean_gx = pairwise_sum(0, a.dim, [&](int64_t j) { return g(j) * xhat(r, j); }) / double(a.dim);
          const double rs = double(static_cast<const A*>(rstd)[r]);
          for (int64_t j = 0; j < a.dim; ++j) {
            gx[j] = T(rs * (g(j) - mean_g - xhat(r, j) * mean_gx) + (add ? as_double(add[j]) : 0.0));
            if (rounded) rounded[j] = O(gx[j]);  // the stored value, rounded as a cast would
          }
        }
      });
    }
    if (!dweight && !dbias && !a.dx_sums) return;
    // dx as stored, for its column sums.
    auto stored_dx = [&](int64_t i) {
      return a.dx_rounded ? as_double(static_cast<const O*>(a.dx_rounded)[i]) : as_double(static_cast<const T*>(dx)[i]);
    };
    // Column blocks, each summed pairwise over all rows.
    const int64_t blocks = (a.dim + kColumnBlock - 1) / kColumnBlock;
    parallel_for(blocks, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t blk = b0; blk < b1; ++blk) {
        const int64_t c0 = blk * kColumnBlock;
        const int cols = int(std::min<int64_t>(kColumnBlock, a.dim - c0));
        if (dweight || dbias) {
          double sw[kColumnBlock], sb[kColumnBlock];
          pairwise_cols<kColumnBlock>(0, a.rows, cols, sw, [&](int64_t r, int c) {
            return as_double(gys[r * a.dim + c0 + c]) * xhat(r, c0 + c);
          });
          pairwise_cols<kColumnBlock>(0, a.rows, cols, sb,
                                      [&](int64_t r, int c) { return as_double(gys[r * a.dim + c0 + c]); });
          dispatch_floating(a.param_dtype, "layer_norm parameters", [&](auto tag) {
            using P = decltype(tag);
            for (int c = 0; c < cols; ++c) {
              if (dweight) static_cast<P*>(dweight)[c0 + c] = P(sw[c]);
              if (dbias) static_cast<P*>(dbias)[c0 + c] = P(sb[c]);
            }
          });
        }
        if (a.dx_sums) {
          double sd[kColumnBlock];
          pairwise_cols<kColumnBlock>(0, a.rows, cols, sd,
                                      [&](int64_t r, int c) { return stored_dx(r * a.dim + c0 + c); });
          for (int c = 0; c < cols; ++c) static_cast<A*>(a.dx_sums)[c0 + c] = A(sd[c]);
        }
      }
    });
  });
}

}  // namespace loom::cpu
