#include "engine/tensor.h"

#include <cstring>
#include <iomanip>
#include <sstream>

#include "engine/autograd.h"
#include "engine/ops.h"

namespace loom {

std::string shape_str(const Shape& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + (shape.size() == 1 ? ",)" : ")");
}

int64_t shape_numel(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

Shape contiguous_strides(const Shape& shape) {
  Shape strides(shape.size());
  int64_t s = 1;
  for (int i = int(shape.size()) - 1; i >= 0; --i) {
    strides[i] = s;
    s *= std::max<int64_t>(shape[i], 1);
  }
  return strides;
}

int wrap_dim(int dim, int ndim, const char* op) {
  int lo = -std::max(ndim, 1), hi = std::max(ndim, 1) - 1;
  LOOM_CHECK(dim >= lo && dim <= hi, op, ": dim ", dim, " is out of range for a tensor with ", ndim,
             " dimensions (expected ", lo, " to ", hi, ")");
  return dim < 0 ? dim + std::max(ndim, 1) : dim;
}

Shape format_strides(const Shape& shape, MemoryFormat format) {
  if (format == MemoryFormat::contiguous) return contiguous_strides(shape);
  LOOM_CHECK(shape.size() == 4, "channels_last is a layout of 4-d tensors (N, C, H, W), got shape ",
             shape_str(shape));
  const Shape nhwc = contiguous_strides({shape[0], shape[2], shape[3], shape[1]});
  return {nhwc[0], nhwc[3], nhwc[1], nhwc[2]};
}

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device) {
  return empty(shape, dtype, device, MemoryFormat::contiguous);
}

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device, MemoryFormat format) {
  for (int64_t d : shape) LOOM_CHECK(d >= 0, "negative dimension in shape ", shape_str(shape));
  LOOM_CHECK(shape.size() <= 8, "tensors have at most 8 dimensions, got shape ", shape_str(shape));
  auto storage = std::make_shared<Storage>(device, size_t(shape_numel(shape)) * dtype_size(dtype));
  return from_storage(std::move(storage), shape, format_strides(shape, format), 0, dtype);
}

Tensor Tensor::from_storage(std::shared_ptr<Storage> storage, Shape shape, Shape strides, int64_t offset,
                            DType dtype) {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = std::move(storage);
  impl->shape = std::move(shape);
  impl->strides = std::move(strides);
  impl->offset = offset;
  impl->dtype = dtype;
  return Tensor(std::move(impl));
}

int64_t Tensor::size(int d) const {
  LOOM_CHECK(dim() > 0, "size(", d, ") of a 0-d tensor: it has no dimensions");
  return shape()[wrap_dim(d, dim(), "size")];
}
int64_t Tensor::stride(int d) const {
  LOOM_CHECK(dim() > 0, "stride(", d, ") of a 0-d tensor: it has no dimensions");
  return strides()[wrap_dim(d, dim(), "stride")];
}
int64_t Tensor::numel() const { return shape_numel(shape()); }

bool Tensor::is_contiguous() const {
  if (numel() == 0) return true;  // an empty tensor has no layout to get wrong
  int64_t expected = 1;
  for (int i = dim() - 1; i >= 0; --i) {
    if (shape()[i] != 1 && strides()[i] != expected) return false;
    expected *= shape()[i];
  }
  return true;
}

bool Tensor::is_contiguous(MemoryFormat format) const {
  if (format == MemoryFormat::contiguous) return is_contiguous();
  if (dim() != 4) return false;
  if (numel() == 0) return true;
  const Shape want = format_strides(shape(), format);
  for (int i = 0; i < 4; ++i)
    if (shape()[i] != 1 && strides()[i] != want[i]) return false;
  return true;
}

MemoryFormat Tensor::memory_format() const {
  if (!is_contiguous(MemoryFormat::channels_last)) return MemoryFormat::contiguous;
  if (!is_contiguous()) return MemoryFormat::channels_last;
  // Both layouts describe this memory (a dim of size 1): the strides themselves decide, as
  // in PyTorch, so that a (N, 1, H, W) batch laid out channels-last starts a channels-last
  // network.
  const Shape& s = strides();
  return s == format_strides(shape(), MemoryFormat::channels_last) && s != contiguous_strides(shape())
             ? MemoryFormat::channels_last
             : MemoryFormat::contiguous;
}

void* Tensor::data_ptr() const {
  return static_cast<char*>(storage()->data()) + offset() * int64_t(element_size());
}

double Tensor::item() const {
  LOOM_CHECK(numel() == 1, "item() needs a tensor with one element, got shape ", shape_str(shape()));
  return to_vector<double>()[0];
}

template <class T>
std::vector<T> Tensor::to_vector() const {
  DType want = DType::f64;
  if constexpr (std::is_same_v<T, float>) want = DType::f32;
  if constexpr (std::is_same_v<T, int64_t>) want = DType::i64;
  if constexpr (std::is_same_v<T, int32_t>) want = DType::i32;
  if constexpr (std::is_same_v<T, uint8_t>) want = DType::u8;
  NoGradGuard no_grad;
  Tensor host = Tensor::empty(shape(), want, Device::cpu());
  copy_(host, *this);
  std::vector<T> out(static_cast<size_t>(numel()));
  if (!out.empty()) std::memcpy(out.data(), host.data_ptr(), out.size() * sizeof(T));
  return out;
}
template std::vector<float> Tensor::to_vector<float>() const;
template std::vector<double> Tensor::to_vector<double>() const;
template std::vector<int64_t> Tensor::to_vector<int64_t>() const;
template std::vector<int32_t> Tensor::to_vector<int32_t>() const;
template std::vector<uint8_t> Tensor::to_vector<uint8_t>() const;

Tensor& Tensor::set_requires_grad(bool value) {
  LOOM_CHECK(is_leaf(), "set_requires_grad() on a tensor computed by ", grad_fn()->name,
             ": only leaves (parameters, inputs) can be marked; use detach() for a new leaf");
  LOOM_CHECK(!value || is_floating(dtype()), "only floating-point tensors can require a gradient, got ",
             dtype_name(dtype()));
  impl()->requires_grad = value;
  return *this;
}

void Tensor::backward(const Tensor& grad, RetainGraph retain) const {
  Tensor g = grad;
  if (!g.defined()) {
    LOOM_CHECK(numel() == 1, "backward() without a gradient needs a one-element tensor (a loss), got shape ",
               shape_str(shape()), ": pass the upstream gradient, backward(grad)");
    g = ones(shape(), dtype(), device());
  }
  LOOM_CHECK(g.shape() == shape(), "backward(grad): grad has shape ", shape_str(g.shape()),
             " but the tensor has shape ", shape_str(shape()));
  run_backward({*this}, {g}, Nesting::separate, retain);
}

Tensor Tensor::detach() const {
  return from_storage(storage(), shape(), strides(), offset(), dtype());
}

void Tensor::register_post_accumulate_grad_hook(std::function<void(Tensor&)> hook) {
  LOOM_CHECK(is_leaf() && requires_grad(), "post-accumulate gradient hooks go on leaves that require a gradient");
  impl()->post_accumulate_hooks.push_back(std::move(hook));
}

void Tensor::set_data(const Tensor& other) {
  LOOM_CHECK(other.dtype() == dtype() || !requires_grad() || is_floating(other.dtype()),
             "set_data: cannot give a tensor that requires a gradient ", dtype_name(other.dtype()), " data");
  impl()->storage = other.storage();
  impl()->shape = other.shape();
  impl()->strides = other.strides();
  impl()->offset = other.offset();
  impl()->dtype = other.dtype();
  impl()->cast_copy.reset();
  impl()->column_sums.reset();
}

namespace {
void print_values(std::ostringstream& os, const std::vector<double>& v, const Shape& shape, const Shape& strides,
                  int d, int64_t base, int indent) {
  constexpr int64_t kEdge = 3;
  if (shape.empty()) {
    os << v[0];
    return;
  }
  os << "[";
  int64_t n = shape[d];
  for (int64_t i = 0; i < n; ++i) {
    if (n > 2 * kEdge && i == kEdge) {
      os << (d + 1 == int(shape.size()) ? "..., " : "...,\n" + std::string(indent + 1, ' '));
      i = n - kEdge;
    }
    if (d + 1 == int(shape.size()))
      os << v[base + i * strides[d]];
    else
      print_values(os, v, shape, strides, d + 1, base + i * strides[d], indent + 1);
    if (i + 1 < n) os << (d + 1 == int(shape.size()) ? ", " : ",\n" + std::string(indent + 1, ' '));
  }
  os << "]";
}
}  // namespace

std::string Tensor::str() const {
  if (!defined()) return "Tensor(undefined)";
  std::ostringstream os;
  os << std::setprecision(5);
  os << "Tensor(";
  if (numel() > 0) {
    std::vector<double> v = to_vector<double>();
    print_values(os, v, shape(), contiguous_strides(shape()), 0, 0, 7);
    os << ", ";
  }
  os << "shape=" << shape_str(shape()) << ", dtype=" << dtype_name(dtype()) << ", device=" << device().str();
  if (grad_fn()) os << ", grad_fn=" << grad_fn()->name;
  else if (requires_grad()) os << ", requires_grad";
  os << ")";
  return os.str();
}

std::ostream& operator<<(std::ostream& os, const Tensor& t) { return os << t.str(); }

}  // namespace loom
