// Reductions. Every reduction runs the one `reduce` kernel over a canonical
// (outer, R, inner) buffer: when the reduced dims form one contiguous run of a
// contiguous tensor the input is used as it is. A channels-last tensor is reduced in its
// memory order (N, H, W, C), where it is contiguous: a mean over H and W, or a sum over N,
// H and W (a convolution bias's gradient), is then one run with no copy. Several runs of a
// contiguous f32 or f64 tensor (N, H and W of an NCHW tensor) are reduced one run at a
// time, the last first; what is left (16-bit dtypes, whose partial results would be
// rounded; argmax and argmin; strided views) has its reduced dims permuted to the end and
// packed first. var is composite (mean of squared deviations).
#include <algorithm>

#include "engine/ops/dispatch.h"

namespace loom {

using ops::kernels;

namespace {

Shape reduced_shape(const Shape& shape, const std::vector<int>& dims, bool keepdim) {
  Shape out;
  for (int i = 0; i < int(shape.size()); ++i) {
    bool reduced = std::find(dims.begin(), dims.end(), i) != dims.end();
    if (!reduced) out.push_back(shape[i]);
    else if (keepdim) out.push_back(1);
  }
  return out;
}

// dims (sorted) split into runs of consecutive dims.
std::vector<std::vector<int>> runs_of(const std::vector<int>& dims) {
  std::vector<std::vector<int>> runs;
  for (int d : dims) {
    if (runs.empty() || runs.back().back() + 1 != d) runs.emplace_back();
    runs.back().push_back(d);
  }
  return runs;
}

// Runs `op` over dims; returns the result in keepdim shape, and sets R (elements per output).
Tensor reduce_kernel(ReduceOp op, const Tensor& x, const std::vector<int>& dims, int64_t* R_out) {
  const bool arg = op == ReduceOp::argmax || op == ReduceOp::argmin;
  if (!dims.empty() && !arg && x.memory_format() == MemoryFormat::channels_last) {
    // In memory order the data is row-major: reduce there and put the dims back.
    const std::vector<int> order{0, 2, 3, 1}, back{0, 3, 1, 2};
    std::vector<int> memory_dims;
    for (int d : dims) memory_dims.push_back(back[d]);
    std::sort(memory_dims.begin(), memory_dims.end());
    return reduce_kernel(op, x.permute(order), memory_dims, R_out).permute(back);
  }
  const std::vector<std::vector<int>> runs = runs_of(dims);
  const bool exact_parts = x.dtype() == DType::f32 || x.dtype() == DType::f64;
  if (runs.size() > 1 && !arg && exact_parts && x.is_contiguous()) {
    // The last run, then the others over its (contiguous) result: a sum of sums, a mean of
    // means over equal counts.
    std::vector<int> rest;
    for (size_t r = 0; r + 1 < runs.size(); ++r) rest.insert(rest.end(), runs[r].begin(), runs[r].end());
    int64_t last_R = 1, rest_R = 1;
    Tensor part = reduce_kernel(op, x, runs.back(), &last_R);
    Tensor out = reduce_kernel(op, part, rest, &rest_R);
    *R_out = last_R * rest_R;
    return out;
  }
  Tensor in = x;
  bool run = runs.size() == 1;
  int64_t outer = 1, R = 1, inner = 1;
  if (run && x.is_contiguous()) {
    for (int i = 0; i < x.dim(); ++i) {
      if (i < dims.front()) outer *= x.shape()[i];
      else if (i <= dims.back()) R *= x.shape()[i];
      else inner *= x.shape()[i];
    }
  } else {
    std::vector<int> perm;
    for (int i = 0; i < x.dim(); ++i)
      if (std::find(dims.begin(), dims.end(), i) == dims.end()) perm.push_back(i);
    for (int d : dims) perm.push_back(d);
    in = x.permute(perm).contiguous();
    for (int i = 0; i < x.dim(); ++i) {
      if (std::find(dims.begin(), dims.end(), i) == dims.end()) outer *= x.shape()[i];
      else R *= x.shape()[i];
    }
  }
  Tensor out = Tensor::empty(reduced_shape(x.shape(), dims, true), arg ? DType::i64 : x.dtype(), x.device());
  LOOM_CHECK(R > 0 || op == ReduceOp::sum || op == ReduceOp::mean,
             "max/min/argmax over an empty dimension of a tensor of shape ", shape_str(x.shape()));
  if (out.numel() > 0)
    kernels(x.device()).reduce(op, out.data_ptr(), in.data_ptr(), x.dtype(), outer, R, inner, ops::stream(x));
  *R_out = R;
  return out;
}

Tensor finish(const Tensor& keep, const Shape& shape, const std::vector<int>& dims, bool keepdim) {
  return keepdim ? keep : keep.reshape(reduced_shape(shape, dims, false));
}

Tensor sum_or_mean(ReduceOp op, const Tensor& x, const std::vector<int>& dims_in, bool keepdim) {
  const char* name = op == ReduceOp::sum ? "sum" : "mean";
  ops::check_defined(x, name, "x");
  if (op == ReduceOp::mean) ops::check_floating(x, "mean");
  std::vector<int> dims = ops::reduction_dims(dims_in, x.dim(), name);
  int64_t R = 1;
  Tensor out;
  {
    NoGradGuard no_grad;  // the permute/contiguous inside are not part of the graph
    out = finish(reduce_kernel(op, x, dims, &R), x.shape(), dims, keepdim);
  }
  if (any_requires_grad({x})) {
    Shape in_shape = x.shape(), keep_shape = reduced_shape(x.shape(), dims, true);
    double scale = op == ReduceOp::mean ? 1.0 / double(R) : 1.0;
    record(name, {x}, {out}, [in_shape, keep_shape, scale](const TensorList& g) {
      Tensor gi = g[0].reshape(keep_shape).expand(in_shape);
      return TensorList{scale == 1.0 ? gi : mul(gi, scale)};
    });
  }
  return out;
}

// Values and indices of the extreme along one dim; the gradient goes to the index.
std::pair<Tensor, Tensor> extreme(bool is_max, const Tensor& x, int dim, bool keepdim) {
  const char* name = is_max ? "max" : "min";
  ops::check_defined(x, name, "x");
  int d = wrap_dim(dim, x.dim(), name);
  std::vector<int> dims = x.dim() == 0 ? std::vector<int>{} : std::vector<int>{d};
  int64_t R = 1;
  Tensor values, indices;
  {
    NoGradGuard no_grad;
    values = reduce_kernel(is_max ? ReduceOp::max : ReduceOp::min, x, dims, &R);
    indices = reduce_kernel(is_max ? ReduceOp::argmax : ReduceOp::argmin, x, dims, &R);
  }
  Tensor v = finish(values, x.shape(), dims, keepdim), i = finish(indices, x.shape(), dims, keepdim);
  if (any_requires_grad({x})) {
    Shape in_shape = x.shape(), keep_shape = values.shape();
    Tensor si = indices.detach();
    record(name, {x}, {v}, [in_shape, keep_shape, si, d](const TensorList& g) {
      Tensor gi = zeros(in_shape, g[0].dtype(), g[0].device());
      Tensor go = g[0].reshape(keep_shape).contiguous();
      ops::OuterRInner s = ops::around_dim(in_shape, in_shape.empty() ? 0 : d);
      kernels(gi.device()).scatter_add(gi.data_ptr(), go.data_ptr(), si.data<int64_t>(), 1, gi.dtype(), s.outer,
                                       s.R, s.inner, ops::stream(gi));
      return TensorList{gi};
    });
  }
  return {v, i};
}

}  // namespace

Tensor sum(const Tensor& x, const std::vector<int>& dims, bool keepdim) {
  return sum_or_mean(ReduceOp::sum, x, dims, keepdim);
}

Tensor mean(const Tensor& x, const std::vector<int>& dims, bool keepdim) {
  return sum_or_mean(ReduceOp::mean, x, dims, keepdim);
}

Tensor var(const Tensor& x, const std::vector<int>& dims_in, bool keepdim, int correction) {
  ops::check_floating(x, "var");
  std::vector<int> dims = ops::reduction_dims(dims_in, x.dim(), "var");
  int64_t R = 1;
  for (int d : dims) R *= x.shape()[d];
  LOOM_CHECK(R - correction > 0, "var over ", R, " element(s) with correction ", correction,
             " divides by zero or less");
  Tensor centred = sub(x, mean(x, dims, true));
  return mul(sum(mul(centred, centred), dims, keepdim), 1.0 / double(R - correction));
}

std::pair<Tensor, Tensor> max(const Tensor& x, int dim, bool keepdim) { return extreme(true, x, dim, keepdim); }
std::pair<Tensor, Tensor> min(const Tensor& x, int dim, bool keepdim) { return extreme(false, x, dim, keepdim); }

Tensor max(const Tensor& x) { return extreme(true, x.reshape({-1}), 0, false).first; }

Tensor argmax(const Tensor& x, int dim, bool keepdim) {
  NoGradGuard no_grad;
  return extreme(true, x, dim, keepdim).second;
}

Tensor argmin(const Tensor& x, int dim, bool keepdim) {
  NoGradGuard no_grad;
  return extreme(false, x, dim, keepdim).second;
}

}  // namespace loom
