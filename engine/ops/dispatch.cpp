#include "engine/ops/dispatch.h"

#include <algorithm>

namespace loom::ops {

Strided broadcast_strided(const Tensor& t, const Shape& shape) {
  Strided s = strided(t);
  int nd = int(shape.size()), off = nd - t.dim();
  LOOM_ASSERT(off >= 0 && nd <= kMaxDims, "cannot broadcast ", shape_str(t.shape()), " to ", shape_str(shape));
  s.ndim = nd;
  for (int i = nd - 1; i >= 0; --i) {
    int j = i - off;
    int64_t size = j >= 0 ? t.shape()[j] : 1;
    LOOM_ASSERT(size == shape[i] || size == 1, "cannot broadcast ", shape_str(t.shape()), " to ", shape_str(shape));
    s.shape[i] = shape[i];
    s.strides[i] = (j >= 0 && size == shape[i]) ? t.strides()[j] : 0;
  }
  return s;
}

void check_same_device(const Tensor& a, const Tensor& b, const char* op) {
  LOOM_CHECK(a.device() == b.device(), op, ": inputs are on different devices (", a.device().str(), " and ",
             b.device().str(), "); move one with .to(device)");
}

void check_floating(const Tensor& t, const char* op) {
  LOOM_CHECK(is_floating(t.dtype()), op, " needs a floating-point tensor, got ", dtype_name(t.dtype()));
}

void check_defined(const Tensor& t, const char* op, const char* arg) {
  LOOM_CHECK(t.defined(), op, ": argument '", arg, "' is an undefined tensor");
}

DType promote(DType a, DType b) {
  if (a == b) return a;
  auto rank = [](DType t) {
    switch (t) {
      case DType::f64: return 7;
      case DType::f32: return 6;
      case DType::f16: return 5;
      case DType::bf16: return 4;
      case DType::i64: return 3;
      case DType::i32: return 2;
      case DType::u8: return 1;
    }
    return 0;
  };
  // bf16 with f16 has no exact common 16-bit type: use f32, as PyTorch does.
  if ((a == DType::bf16 && b == DType::f16) || (a == DType::f16 && b == DType::bf16)) return DType::f32;
  return rank(a) >= rank(b) ? a : b;
}

std::vector<int> reduction_dims(const std::vector<int>& dims, int ndim, const char* op) {
  std::vector<int> out;
  if (dims.empty()) {
    for (int i = 0; i < ndim; ++i) out.push_back(i);
    return out;
  }
  for (int d : dims) out.push_back(wrap_dim(d, ndim, op));
  std::sort(out.begin(), out.end());
  LOOM_CHECK(std::adjacent_find(out.begin(), out.end()) == out.end(), op, ": a dim is listed twice");
  if (ndim == 0) out.clear();
  return out;
}

OuterRInner around_dim(const Shape& shape, int dim) {
  OuterRInner r;
  for (int i = 0; i < int(shape.size()); ++i) {
    if (i < dim) r.outer *= shape[i];
    else if (i == dim) r.R = shape[i];
    else r.inner *= shape[i];
  }
  return r;
}

}  // namespace loom::ops
