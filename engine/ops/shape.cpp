// Views and joins. A view shares its input's storage with new shape, strides and offset;
// its backward maps the gradient back to the input's shape. cat, stack and split are
// built from views and copies.
#include <numeric>

#include "engine/ops/dispatch.h"

namespace loom {

namespace {

Tensor make_view(const Tensor& t, Shape shape, Shape strides, int64_t offset) {
  return Tensor::from_storage(t.storage(), std::move(shape), std::move(strides), offset, t.dtype());
}

// Resolves one -1 in a requested shape against numel.
Shape infer_shape(const Shape& requested, int64_t numel, const Shape& from) {
  Shape shape = requested;
  int infer = -1;
  int64_t known = 1;
  for (int i = 0; i < int(shape.size()); ++i) {
    if (shape[i] == -1) {
      LOOM_CHECK(infer < 0, "reshape to ", shape_str(requested), ": only one dimension can be -1");
      infer = i;
    } else {
      LOOM_CHECK(shape[i] >= 0, "reshape to ", shape_str(requested), ": negative dimension");
      known *= shape[i];
    }
  }
  if (infer >= 0) {
    LOOM_CHECK(known > 0 && numel % known == 0, "cannot reshape ", shape_str(from), " to ", shape_str(requested));
    shape[infer] = numel / known;
  }
  LOOM_CHECK(shape_numel(shape) == numel, "cannot reshape ", shape_str(from), " (", numel, " elements) to ",
             shape_str(requested), " (", shape_numel(shape), " elements)");
  return shape;
}

}  // namespace

Shape broadcast_shapes(const Shape& a, const Shape& b) {
  size_t n = std::max(a.size(), b.size());
  Shape out(n);
  for (size_t i = 0; i < n; ++i) {
    int64_t da = i < n - a.size() ? 1 : a[i - (n - a.size())];
    int64_t db = i < n - b.size() ? 1 : b[i - (n - b.size())];
    LOOM_CHECK(da == db || da == 1 || db == 1, "shapes ", shape_str(a), " and ", shape_str(b),
               " cannot be broadcast together (dimension ", i, ": ", da, " vs ", db, ")");
    out[i] = da == 1 ? db : da;
  }
  return out;
}

Tensor Tensor::view(const Shape& requested) const {
  Shape shape = infer_shape(requested, numel(), this->shape());
  LOOM_CHECK(is_contiguous(), "view(", shape_str(requested), ") of a non-contiguous tensor of shape ",
             shape_str(this->shape()), ": use reshape(), which copies when it must");
  Tensor out = make_view(*this, shape, contiguous_strides(shape), offset());
  if (any_requires_grad({*this})) {
    Shape in_shape = this->shape();
    record("View", {*this}, {out}, [in_shape](const TensorList& g) { return TensorList{g[0].reshape(in_shape)}; });
  }
  return out;
}

Tensor Tensor::reshape(const Shape& shape) const { return is_contiguous() ? view(shape) : contiguous().view(shape); }

Tensor Tensor::permute(const std::vector<int>& dims) const {
  LOOM_CHECK(int(dims.size()) == dim(), "permute: got ", dims.size(), " dims for a tensor with ", dim());
  Shape shape(dim()), strides(dim());
  std::vector<int> inverse(dim(), -1);
  for (int i = 0; i < dim(); ++i) {
    int d = wrap_dim(dims[i], dim(), "permute");
    LOOM_CHECK(inverse[d] < 0, "permute: dim ", dims[i], " appears twice");
    inverse[d] = i;
    shape[i] = this->shape()[d];
    strides[i] = this->strides()[d];
  }
  Tensor out = make_view(*this, shape, strides, offset());
  if (any_requires_grad({*this}))
    record("Permute", {*this}, {out}, [inverse](const TensorList& g) { return TensorList{g[0].permute(inverse)}; });
  return out;
}

Tensor Tensor::transpose(int d0, int d1) const {
  if (dim() == 0) {
    wrap_dim(d0, 0, "transpose"), wrap_dim(d1, 0, "transpose");
    return *this;
  }
  std::vector<int> dims(dim());
  std::iota(dims.begin(), dims.end(), 0);
  std::swap(dims[wrap_dim(d0, dim(), "transpose")], dims[wrap_dim(d1, dim(), "transpose")]);
  return permute(dims);
}

Tensor Tensor::slice(int d, int64_t start, int64_t end, int64_t step) const {
  LOOM_CHECK(dim() > 0, "slice of a 0-d tensor: it has no dimension to slice");
  d = wrap_dim(d, dim(), "slice");
  int64_t n = shape()[d];
  LOOM_CHECK(step > 0, "slice: step must be positive, got ", step);
  if (start < 0) start += n;
  if (end < 0) end += n;
  start = std::clamp<int64_t>(start, 0, n);
  end = std::clamp<int64_t>(end, start, n);
  Shape shape = this->shape(), strides = this->strides();
  shape[d] = (end - start + step - 1) / step;
  strides[d] *= step;
  Tensor out = make_view(*this, shape, strides, offset() + start * this->strides()[d]);
  if (any_requires_grad({*this})) {
    Shape in_shape = this->shape();
    record("Slice", {*this}, {out}, [in_shape, d, start, end, step](const TensorList& g) {
      Tensor full = zeros(in_shape, g[0].dtype(), g[0].device());
      copy_(full.slice(d, start, end, step), g[0]);
      return TensorList{full};
    });
  }
  return out;
}

Tensor Tensor::select(int d, int64_t index) const {
  LOOM_CHECK(dim() > 0, "select of a 0-d tensor: it has no dimension to index");
  d = wrap_dim(d, dim(), "select");
  int64_t n = shape()[d];
  LOOM_CHECK(index >= -n && index < n, "select: index ", index, " is out of range for dim ", d, " of size ", n);
  if (index < 0) index += n;
  return slice(d, index, index + 1).squeeze(d);
}

TensorList unbind(const Tensor& x, int d) {
  LOOM_CHECK(x.dim() > 0, "unbind of a 0-d tensor: it has no dimension to split");
  d = wrap_dim(d, x.dim(), "unbind");
  Shape shape = x.shape(), strides = x.strides();
  const int64_t n = shape[d], step = strides[d];
  shape.erase(shape.begin() + d);
  strides.erase(strides.begin() + d);
  TensorList parts;
  for (int64_t i = 0; i < n; ++i) parts.push_back(make_view(x, shape, strides, x.offset() + i * step));
  if (any_requires_grad({x})) {
    // One node for all the parts: backward writes every part's gradient into one buffer,
    // where a select per part would each zero a whole copy of x and sum them.
    Shape in_shape = x.shape();
    record("Unbind", {x}, parts, [in_shape, d](const TensorList& g) {
      Tensor full = Tensor::empty(in_shape, g[0].dtype(), g[0].device());
      for (int64_t i = 0; i < int64_t(g.size()); ++i) copy_(full.select(d, i), g[size_t(i)]);
      return TensorList{full};
    });
  }
  return parts;
}

Tensor Tensor::expand(const Shape& shape) const {
  LOOM_CHECK(int(shape.size()) >= dim(), "expand: cannot expand ", shape_str(this->shape()), " to fewer dims ",
             shape_str(shape));
  int off = int(shape.size()) - dim();
  Shape strides(shape.size(), 0), target = shape;
  for (int i = 0; i < int(shape.size()); ++i) {
    int j = i - off;
    if (j < 0) {
      LOOM_CHECK(target[i] >= 0, "expand: -1 is only allowed for existing dims");
      continue;
    }
    int64_t have = this->shape()[j];
    if (target[i] == -1) target[i] = have;
    LOOM_CHECK(have == target[i] || have == 1, "expand: dimension ", j, " of size ", have, " cannot become ",
               target[i], " (only size-1 dims expand)");
    strides[i] = have == target[i] ? this->strides()[j] : 0;
  }
  Tensor out = make_view(*this, target, strides, offset());
  if (any_requires_grad({*this})) {
    Shape in_shape = this->shape();
    record("Expand", {*this}, {out}, [in_shape](const TensorList& g) { return TensorList{sum_to(g[0], in_shape)}; });
  }
  return out;
}

Tensor Tensor::squeeze(int d) const {
  d = wrap_dim(d, dim(), "squeeze");
  if (dim() == 0) return *this;
  if (shape()[d] != 1) return *this;
  Shape shape = this->shape(), strides = this->strides();
  shape.erase(shape.begin() + d);
  strides.erase(strides.begin() + d);
  Tensor out = make_view(*this, shape, strides, offset());
  if (any_requires_grad({*this})) {
    Shape in_shape = this->shape();
    record("Squeeze", {*this}, {out}, [in_shape](const TensorList& g) { return TensorList{g[0].reshape(in_shape)}; });
  }
  return out;
}

Tensor Tensor::unsqueeze(int d) const {
  d = wrap_dim(d, dim() + 1, "unsqueeze");
  Shape shape = this->shape(), strides = this->strides();
  int64_t stride = d < dim() ? this->strides()[d] * this->shape()[d] : 1;
  shape.insert(shape.begin() + d, 1);
  strides.insert(strides.begin() + d, stride);
  Tensor out = make_view(*this, shape, strides, offset());
  if (any_requires_grad({*this})) {
    Shape in_shape = this->shape();
    record("Unsqueeze", {*this}, {out}, [in_shape](const TensorList& g) { return TensorList{g[0].reshape(in_shape)}; });
  }
  return out;
}

Tensor Tensor::flatten(int start_dim, int end_dim) const {
  if (dim() == 0) return reshape({1});
  int s = wrap_dim(start_dim, dim(), "flatten"), e = wrap_dim(end_dim, dim(), "flatten");
  LOOM_CHECK(s <= e, "flatten: start_dim ", start_dim, " comes after end_dim ", end_dim);
  Shape shape(this->shape().begin(), this->shape().begin() + s);
  int64_t n = 1;
  for (int i = s; i <= e; ++i) n *= this->shape()[i];
  shape.push_back(n);
  shape.insert(shape.end(), this->shape().begin() + e + 1, this->shape().end());
  return reshape(shape);
}

Tensor cat(const TensorList& tensors, int dim) {
  LOOM_CHECK(!tensors.empty(), "cat: needs at least one tensor");
  const Tensor& first = tensors[0];
  LOOM_CHECK(first.dim() > 0, "cat of 0-d tensors: use stack to join scalars");
  int d = wrap_dim(dim, first.dim(), "cat");
  Shape shape = first.shape();
  DType dtype = first.dtype();
  shape[d] = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    ops::check_same_device(first, t, "cat");
    LOOM_CHECK(t.dim() == first.dim(), "cat: tensor ", i, " has shape ", shape_str(t.shape()), ", tensor 0 has ",
               shape_str(first.shape()));
    for (int k = 0; k < t.dim(); ++k)
      LOOM_CHECK(k == d || t.shape()[k] == first.shape()[k], "cat along dim ", d, ": tensor ", i, " has shape ",
                 shape_str(t.shape()), " but tensor 0 has ", shape_str(first.shape()));
    shape[d] += t.shape()[d];
    dtype = ops::promote(dtype, t.dtype());
  }
  Tensor out = Tensor::empty(shape, dtype, first.device());
  std::vector<int64_t> starts;
  int64_t at = 0;
  {
    NoGradGuard no_grad;
    for (const Tensor& t : tensors) {
      starts.push_back(at);
      copy_(out.slice(d, at, at + t.shape()[d]), t);
      at += t.shape()[d];
    }
  }
  if (any_requires_grad(tensors)) {
    std::vector<int64_t> sizes;
    std::vector<DType> dtypes;
    for (const Tensor& t : tensors) {
      sizes.push_back(t.shape()[d]);
      dtypes.push_back(t.dtype());
    }
    record("Cat", tensors, {out}, [d, starts, sizes, dtypes](const TensorList& g) {
      TensorList grads;
      for (size_t i = 0; i < starts.size(); ++i)
        grads.push_back(g[0].slice(d, starts[i], starts[i] + sizes[i]).to(dtypes[i]));
      return grads;
    });
  }
  return out;
}

Tensor stack(const TensorList& tensors, int dim) {
  LOOM_CHECK(!tensors.empty(), "stack: needs at least one tensor");
  int d = wrap_dim(dim, tensors[0].dim() + 1, "stack");
  TensorList expanded;
  for (size_t i = 0; i < tensors.size(); ++i) {
    LOOM_CHECK(tensors[i].shape() == tensors[0].shape(), "stack: tensor ", i, " has shape ",
               shape_str(tensors[i].shape()), " but tensor 0 has ", shape_str(tensors[0].shape()));
    expanded.push_back(tensors[i].unsqueeze(d));
  }
  return cat(expanded, d);
}

TensorList split(const Tensor& t, int64_t split_size, int dim) {
  LOOM_CHECK(t.dim() > 0, "split of a 0-d tensor: it has no dimension to split");
  int d = wrap_dim(dim, t.dim(), "split");
  LOOM_CHECK(split_size > 0, "split: split_size must be positive, got ", split_size);
  TensorList parts;
  for (int64_t at = 0; at < t.shape()[d]; at += split_size)
    parts.push_back(t.slice(d, at, std::min(at + split_size, t.shape()[d])));
  return parts;
}

Tensor sum_to(const Tensor& t, const Shape& shape) {
  if (t.shape() == shape) return t;
  int lead = t.dim() - int(shape.size());
  LOOM_ASSERT(lead >= 0, "sum_to: ", shape_str(t.shape()), " has fewer dims than ", shape_str(shape));
  std::vector<int> dims;
  for (int i = 0; i < t.dim(); ++i)
    if (i < lead || (shape[i - lead] == 1 && t.shape()[i] != 1)) dims.push_back(i);
  Tensor r = dims.empty() ? t : sum(t, dims, true);
  return r.reshape(shape);
}

}  // namespace loom
