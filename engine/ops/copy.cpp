// Copies: within a device through the copy kernel (any strides, any dtype pair), and
// between devices through cudaMemcpyAsync on the destination's (or, to the host, the
// source's) compute stream. A host-bound copy waits for its stream, so the host sees the
// data; a device-bound copy from pageable host memory is staged by the driver before
// cudaMemcpyAsync returns, so the host buffer may be freed right after.
#include "engine/ops/dispatch.h"
#include "kernels/config.h"

#if LOOM_WITH_CUDA
#include <cuda_runtime.h>

#include "kernels/cuda/check.h"
#endif

namespace loom {

namespace {

// Copies `nbytes` between two contiguous buffers on different devices.
void raw_copy(const Tensor& dst, const Tensor& src) {
#if LOOM_WITH_CUDA
  size_t n = dst.nbytes();
  if (n == 0) return;
  for (const Device d : {src.device(), dst.device()})
    LOOM_CHECK(!capturing(d), "a copy from ", src.device().str(), " to ", dst.device().str(),
               " inside a captured step on ", d.str(), " (engine/cuda_graph.h): a graph cannot move host "
               "memory or wait for the host; copy the batch into the step's static tensors before the replay");
  if (src.device().is_cpu()) {  // host to device
    auto s = static_cast<cudaStream_t>(ops::stream(dst));
    LOOM_CUDA(cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), n, cudaMemcpyHostToDevice, s));
  } else if (dst.device().is_cpu()) {  // device to host
    auto s = static_cast<cudaStream_t>(ops::stream(src));
    LOOM_CUDA(cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), n, cudaMemcpyDeviceToHost, s));
    LOOM_CUDA(cudaStreamSynchronize(s));
  } else {  // device to device: dst's stream waits for src's work first
    Event ready;
    ready.record(ops::stream(src));
    StreamHandle s = ops::stream(dst);
    ready.wait_on(s);
    LOOM_CUDA(cudaMemcpyPeerAsync(dst.data_ptr(), dst.device().index, src.data_ptr(), src.device().index, n,
                                  static_cast<cudaStream_t>(s)));
    // src's memory must outlive the copy on dst's stream.
    Event done;
    done.record(s);
    done.wait_on(ops::stream(src));
  }
#else
  LOOM_FAIL("copy between ", src.device().str(), " and ", dst.device().str(), " needs a build of Loom with CUDA");
#endif
}

// A copy of t laid out in `format`, its gradient passed through.
Tensor clone_as(const Tensor& t, MemoryFormat format) {
  Tensor out = Tensor::empty(t.shape(), t.dtype(), t.device(), format);
  copy_(out, t);
  if (any_requires_grad({t}))
    record("Clone", {t}, {out}, [](const TensorList& g) { return TensorList{g[0]}; });
  return out;
}

}  // namespace

void copy_(const Tensor& dst, const Tensor& src) {
  ops::check_defined(dst, "copy_", "dst");
  ops::check_defined(src, "copy_", "src");
  LOOM_CHECK(!(grad_enabled() && dst.requires_grad()),
             "copy_ into a tensor that requires a gradient: in-place updates of parameters go under NoGradGuard");
  Shape bshape = broadcast_shapes(dst.shape(), src.shape());
  LOOM_CHECK(bshape == dst.shape(), "copy_: source of shape ", shape_str(src.shape()),
             " does not broadcast to the destination's shape ", shape_str(dst.shape()));
  dst.bump_version();
  if (dst.numel() == 0) return;
  if (dst.device() == src.device()) {
    ops::kernels(dst.device()).copy(ops::strided(dst), ops::broadcast_strided(src, dst.shape()), ops::stream(dst));
    return;
  }
  // Across devices: make src a contiguous block of dst's dtype and shape on its own
  // device, move the bytes, then place them into dst if dst is not contiguous.
  Tensor packed = src;
  if (src.dtype() != dst.dtype() || src.shape() != dst.shape() || !src.is_contiguous()) {
    packed = Tensor::empty(dst.shape(), dst.dtype(), src.device());
    copy_(packed, src);
  }
  if (dst.is_contiguous()) {
    raw_copy(dst, packed);
  } else {
    Tensor landing = Tensor::empty(dst.shape(), dst.dtype(), dst.device());
    raw_copy(landing, packed);
    copy_(dst, landing);
  }
}

Tensor Tensor::to(Device device) const {
  if (device == this->device()) return *this;
  Tensor out = Tensor::empty(shape(), dtype(), device, memory_format());
  copy_(out, *this);
  if (any_requires_grad({*this})) {
    Device from = this->device();
    record("ToDevice", {*this}, {out}, [from](const TensorList& g) { return TensorList{g[0].to(from)}; });
  }
  return out;
}

Tensor Tensor::to(DType dtype) const {
  if (dtype == this->dtype()) return *this;
  Tensor out = Tensor::empty(shape(), dtype, device(), memory_format());
  copy_(out, *this);
  if (any_requires_grad({*this}) && is_floating(dtype)) {
    DType from = this->dtype();
    record("ToDType", {*this}, {out}, [from](const TensorList& g) { return TensorList{g[0].to(from)}; });
  }
  return out;
}

Tensor Tensor::clone() const { return clone(MemoryFormat::contiguous); }

Tensor Tensor::clone(MemoryFormat format) const { return clone_as(*this, format); }

Tensor Tensor::contiguous() const { return contiguous(MemoryFormat::contiguous); }

Tensor Tensor::contiguous(MemoryFormat format) const {
  if (!is_contiguous(format)) return clone_as(*this, format);
  if (dim() != 4 || memory_format() == format) return *this;
  const Shape want = format_strides(shape(), format);
  if (strides() == want) return *this;  // (N, 1, 1, 1): both formats have these strides
  // Memory that both layouts describe (a dim of size 1), read through the format's own
  // strides: a view, so that memory_format() answers `format`.
  Tensor out = from_storage(storage(), shape(), want, offset(), dtype());
  if (any_requires_grad({*this})) record("Restride", {*this}, {out}, [](const TensorList& g) { return g; });
  return out;
}

}  // namespace loom

