// Tensor: a small handle to a strided view of shared Storage, with the autograd fields.
//
// Copying a Tensor copies the handle: both name the same TensorImpl. Views (reshape,
// permute, slice, expand, ...) make a new TensorImpl over the same Storage. A Module's
// parameters are Tensors, so replacing a parameter's storage through set_data() is seen
// by every holder of the handle (a sharded-parameter scheme can swap full and sharded
// storage this way; tests/engine/test_autograd.cpp shows the swap around forward and backward).
//
// Ops are free functions in engine/ops.h; the members here are the tensor's own state.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "device.h"
#include "storage.h"
#include "../kernels/core/dtype.h"
#include "../kernels/core/error.h"

namespace loom {

using Shape = std::vector<int64_t>;
class Tensor;
struct Node;

// How a dense tensor lays its elements out in memory. A tensor's shape is always logical
// (N, C, H, W for images); the layout is in its strides.
//   contiguous     row-major: the last dimension varies fastest (NCHW for images).
//   channels_last  for 4-d tensors, N, H, W, C in memory: strides (H*W*C, 1, W*C, C). The
//                  layout cuDNN's tensor-core convolutions read and write without a
//                  transpose. An image batch is converted once, at the input
//                  (x.contiguous(MemoryFormat::channels_last)); the CNN ops then keep it:
//                  elementwise ops (which run such operands as one row), casts,
//                  convolutions, BatchNorm and pooling give a channels-last output for a
//                  channels-last input.
// Where both describe the same memory (C = 1, or H = W = 1) the strides decide, as in
// PyTorch: the tensor is channels-last when its strides are exactly format_strides(shape,
// channels_last), so contiguous(channels_last) of a (N, 1, H, W) batch re-strides it (a view)
// and the network after it runs channels-last.
// The convolution, BatchNorm and pooling kernels read and write channels-last buffers as
// they lie, on both devices (on a GPU, cuDNN's convolutions with the weight laid out
// channels-last too; on the CPU the weight stays row-major).
enum class MemoryFormat : uint8_t { contiguous, channels_last };

// Whether a backward pass keeps what each node saved for its gradient once the node has run
// (engine/autograd.h), so that another pass may run through the same graph: PyTorch's
// retain_graph. By default it is freed.
enum class RetainGraph { no, yes };

struct TensorImpl {
  std::shared_ptr<Storage> storage;
  Shape shape, strides;  // strides in elements
  int64_t offset = 0;    // in elements
  DType dtype = DType::f32;

  bool requires_grad = false;
  std::shared_ptr<TensorImpl> grad;
  std::shared_ptr<Node> grad_fn;  // null for leaves
  int output_nr = 0;              // which output of grad_fn this is
  std::weak_ptr<Node> grad_accumulator;
  std::vector<std::function<void(Tensor&)>> post_accumulate_hooks;

  // Autocast's 16-bit copy of a parameter (engine/autocast.h): valid while the storage's
  // version is still cast_version.
  std::shared_ptr<TensorImpl> cast_copy;
  uint64_t cast_version = 0;

  // A gradient's column sums over its last dim, kept by the op that computed the gradient
  // for the op that reads it (engine/autograd.h: keep_column_sums): the sums of its values as
  // read in column_sums_of, valid while the storage's version is still column_sums_version.
  std::shared_ptr<TensorImpl> column_sums;
  DType column_sums_of = DType::f32;
  uint64_t column_sums_version = 0;
};

class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

  // An uninitialised contiguous tensor.
  static Tensor empty(const Shape& shape, DType dtype = DType::f32, Device device = Device::cpu());
  // An uninitialised tensor in `format` (channels_last needs a 4-d shape).
  static Tensor empty(const Shape& shape, DType dtype, Device device, MemoryFormat format);
  // A tensor over existing storage.
  static Tensor from_storage(std::shared_ptr<Storage> storage, Shape shape, Shape strides, int64_t offset,
                             DType dtype);

  bool defined() const { return impl_ != nullptr; }
  TensorImpl* impl() const { return impl_.get(); }
  const std::shared_ptr<TensorImpl>& impl_ptr() const { return impl_; }

  const Shape& shape() const { return impl()->shape; }
  const Shape& strides() const { return impl()->strides; }
  int dim() const { return int(shape().size()); }
  // size(-1) is the last dimension, as in PyTorch.
  int64_t size(int d) const;
  int64_t stride(int d) const;
  int64_t numel() const;
  int64_t offset() const { return impl()->offset; }
  DType dtype() const { return impl()->dtype; }
  Device device() const { return impl()->storage->device(); }
  size_t element_size() const { return dtype_size(dtype()); }
  size_t nbytes() const { return size_t(numel()) * element_size(); }
  bool is_contiguous() const;
  bool is_contiguous(MemoryFormat format) const;
  // The format this tensor is dense in, for an op to give its output the same:
  // channels_last when it is a channels-last 4-d tensor that is not also row-major, or is
  // both (a dim of size 1) with exactly the channels-last strides; else contiguous (also
  // for views that are neither).
  MemoryFormat memory_format() const;
  const std::shared_ptr<Storage>& storage() const { return impl()->storage; }
  // Records a write into the storage made around Loom's in-place ops (through data_ptr()
  // by a kernel of one's own, say), so that copies derived from the old values, such as
  // autocast's weight casts, are not reused. Loom's own in-place ops do this themselves.
  void bump_version() const { storage()->bump_version(); }

  // Pointer to the first element (storage base + offset).
  void* data_ptr() const;
  template <class T>
  T* data() const {
    return static_cast<T*>(data_ptr());
  }

  // The value of a one-element tensor, converted to double (copies from the GPU).
  double item() const;
  // All elements in row-major order, converted to T (copies from the GPU).
  template <class T>
  std::vector<T> to_vector() const;

  // ---- autograd -----------------------------------------------------------------
  bool requires_grad() const { return impl()->requires_grad; }
  // Marks a leaf as needing a gradient; an error on a non-leaf (its flag follows its inputs).
  Tensor& set_requires_grad(bool value = true);
  bool is_leaf() const { return impl()->grad_fn == nullptr; }
  const std::shared_ptr<Node>& grad_fn() const { return impl()->grad_fn; }
  // The accumulated gradient of a leaf (undefined until backward reached it).
  Tensor grad() const { return Tensor(impl()->grad); }
  void set_grad(const Tensor& g) { impl()->grad = g.impl_; }
  void zero_grad() { impl()->grad.reset(); }
  // Back-propagates from this tensor: a one-element tensor needs no gradient argument;
  // otherwise `grad` is the upstream gradient, of this tensor's shape (pipeline stages).
  // A second backward through the same graph needs RetainGraph::yes in the first.
  void backward(const Tensor& grad = Tensor(), RetainGraph retain = RetainGraph::no) const;
  // A tensor sharing this one's data, cut from the graph.
  Tensor detach() const;
  // Runs `hook(param)` as soon as this leaf's gradient is final in a backward pass, after
  // it has been accumulated into grad(). DDP launches its bucket all-reduces from here.
  void register_post_accumulate_grad_hook(std::function<void(Tensor&)> hook);
  // Replaces this tensor's data (storage, shape, strides) in place, keeping its identity,
  // requires_grad and hooks. Used to swap a parameter between sharded and full storage.
  void set_data(const Tensor& other);

  // ---- views and conversions (engine/ops/shape.cpp, engine/ops/copy.cpp) ----------
  Tensor reshape(const Shape& shape) const;
  Tensor view(const Shape& shape) const;  // like reshape, but never copies
  Tensor permute(const std::vector<int>& dims) const;
  Tensor transpose(int d0, int d1) const;
  Tensor t() const { return transpose(0, 1); }
  Tensor slice(int dim, int64_t start, int64_t end, int64_t step = 1) const;
  Tensor select(int dim, int64_t index) const;
  Tensor expand(const Shape& shape) const;
  Tensor squeeze(int dim) const;
  Tensor unsqueeze(int dim) const;
  Tensor flatten(int start_dim = 0, int end_dim = -1) const;
  Tensor contiguous() const;
  // This tensor if it is dense in `format` with that format's strides; a view with them if
  // its memory is dense in both formats (a dim of size 1); else a copy laid out so. All
  // differentiable.
  Tensor contiguous(MemoryFormat format) const;
  Tensor clone() const;
  // A copy laid out in `format` (row-major, or channels-last for a 4-d tensor); differentiable.
  Tensor clone(MemoryFormat format) const;
  Tensor to(Device device) const;
  Tensor to(DType dtype) const;

  // Text: shape, dtype, device and the values (abbreviated past a few per dimension).
  std::string str() const;

  bool same(const Tensor& other) const { return impl_ == other.impl_; }

 private:
  std::shared_ptr<TensorImpl> impl_;
};

using TensorList = std::vector<Tensor>;

std::ostream& operator<<(std::ostream& os, const Tensor& t);
std::string shape_str(const Shape& shape);
int64_t shape_numel(const Shape& shape);
Shape contiguous_strides(const Shape& shape);
// The strides of a dense tensor of `shape` in `format` (channels_last: a 4-d shape).
Shape format_strides(const Shape& shape, MemoryFormat format);
// Normalises a possibly negative dimension index against ndim, with a clear error.
int wrap_dim(int dim, int ndim, const char* op);

}  // namespace loom
