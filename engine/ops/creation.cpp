// Tensors made from nothing: constants, ranges, host values.
#include <cmath>
#include <cstring>

#include "engine/ops/dispatch.h"

namespace loom {

using ops::kernels;
using ops::strided;

void fill_(const Tensor& t, double value) {
  if (t.numel() == 0) return;
  LOOM_CHECK(!(grad_enabled() && t.requires_grad()), "fill_ on a tensor that requires a gradient: wrap it in NoGradGuard");
  t.bump_version();
  kernels(t.device()).fill(strided(t), value, ops::stream(t));
}

void zero_(const Tensor& t) { fill_(t, 0.0); }

Tensor full(const Shape& shape, double value, DType dtype, Device device) {
  Tensor t = Tensor::empty(shape, dtype, device);
  fill_(t, value);
  return t;
}

Tensor zeros(const Shape& shape, DType dtype, Device device) { return full(shape, 0.0, dtype, device); }
Tensor ones(const Shape& shape, DType dtype, Device device) { return full(shape, 1.0, dtype, device); }
Tensor zeros_like(const Tensor& t) { return zeros(t.shape(), t.dtype(), t.device()); }
Tensor ones_like(const Tensor& t) { return ones(t.shape(), t.dtype(), t.device()); }
Tensor empty_like(const Tensor& t) { return Tensor::empty(t.shape(), t.dtype(), t.device()); }
Tensor scalar_tensor(double value, DType dtype, Device device) { return full({}, value, dtype, device); }

Tensor arange(double start, double end, double step, DType dtype, Device device) {
  LOOM_CHECK(step != 0, "arange: step must not be zero");
  double span = (end - start) / step;
  int64_t n = span > 0 ? int64_t(std::ceil(span)) : 0;
  Tensor t = Tensor::empty({n}, dtype, device);
  if (n > 0) kernels(device).arange(strided(t), start, step, ops::stream(t));
  return t;
}

namespace {
template <class T>
Tensor from_host(const std::vector<T>& values, const Shape& shape, DType dtype, Device device) {
  LOOM_CHECK(int64_t(values.size()) == shape_numel(shape), "from_vector: ", values.size(),
             " values do not fill shape ", shape_str(shape), " (", shape_numel(shape), " elements)");
  Tensor host = Tensor::empty(shape, dtype, Device::cpu());
  if (!values.empty()) std::memcpy(host.data_ptr(), values.data(), values.size() * sizeof(T));
  return device.is_cpu() ? host : host.to(device);
}
}  // namespace

Tensor from_vector(const std::vector<float>& v, const Shape& shape, Device device) {
  return from_host(v, shape, DType::f32, device);
}
Tensor from_vector(const std::vector<double>& v, const Shape& shape, Device device) {
  return from_host(v, shape, DType::f64, device);
}
Tensor from_vector(const std::vector<int64_t>& v, const Shape& shape, Device device) {
  return from_host(v, shape, DType::i64, device);
}

}  // namespace loom
