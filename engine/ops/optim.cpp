// Fused multi-tensor optimizer updates: the checks, the momentum buffers SGD creates, and
// one kernel-table call for the whole list (on CUDA one launch, or a few for lists longer
// than a launch's parameters hold). The arithmetic is torch.optim's; kernels/table.h
// states it.
//
// A call takes tensors of one device and one dtype, each dense in its parameter's layout
// (row-major, or channels-last for a channels-last 4-d parameter): that is what lets the
// kernel treat every tensor as a flat array behind one pointer, element k of each list
// being the same parameter element. Mixed lists are the
// caller's to split (layers/optim does, by device and dtype). Nothing here is recorded by
// autograd: the update writes the parameters' memory in place.
//
// The update changes every parameter's storage version, and a parameter that keeps an
// autocast weight copy (engine/autocast.h) gets a fresh copy written by the update itself.
#include <cstdint>
#include <vector>

#include "engine/autocast.h"
#include "engine/ops/dispatch.h"

namespace loom {
namespace {

void check_length(const char* op, const char* list, size_t n, size_t expected) {
  LOOM_CHECK(n == expected, op, ": ", list, " has ", n, " entries but params has ", expected,
             "; the lists run in parallel, one entry per parameter");
}

// Entry i of `list` against params[i] (its size) and params[0] (the call's device and dtype).
void check_entry(const char* op, const char* list, size_t i, const Tensor& t, const TensorList& params) {
  const Tensor& p = params[i];
  const Tensor& p0 = params[0];
  LOOM_CHECK(t.defined(), op, ": ", list, "[", i, "] is an undefined tensor");
  LOOM_CHECK(t.device() == p0.device(), op, ": ", list, "[", i, "] is on ", t.device().str(), " but params[0] is on ",
             p0.device().str(), "; one call updates tensors of one device: move it with .to(device) or split the call");
  LOOM_CHECK(t.dtype() == p0.dtype(), op, ": ", list, "[", i, "] is ", dtype_name(t.dtype()), " but params[0] is ",
             dtype_name(p0.dtype()),
             "; one call updates tensors of one dtype: convert it with .to(dtype) or split the call");
  const MemoryFormat format = p.memory_format();
  const bool dense = t.is_contiguous(format) && (format == MemoryFormat::contiguous || t.shape() == p.shape());
  LOOM_CHECK(dense, op, ": ", list, "[", i, "] of shape ", shape_str(t.shape()), " (strides ",
             shape_str(t.strides()), ") is not dense in params[", i,
             "]'s layout (shape ", shape_str(p.shape()), ", strides ", shape_str(p.strides()),
             "): update a copy laid out as the parameter and copy it back");
  LOOM_CHECK(t.numel() == p.numel(), op, ": ", list, "[", i, "] has shape ", shape_str(t.shape()), " but params[", i,
             "] has shape ", shape_str(p.shape()), "; each entry needs its parameter's number of elements");
}

void check_params(const char* op, const TensorList& params) {
  LOOM_CHECK(params[0].defined(), op, ": params[0] is an undefined tensor");
  LOOM_CHECK(is_floating(params[0].dtype()), op, ": params[0] is ", dtype_name(params[0].dtype()),
             "; only floating-point tensors can be optimised");
  for (size_t i = 0; i < params.size(); ++i) check_entry(op, "params", i, params[i], params);
}

// The kernel's view of parallel lists: host arrays of raw pointers and sizes.
struct Lists {
  std::vector<void*> params, state1, state2;
  std::vector<const void*> grads;
  std::vector<int64_t> numel;

  MultiTensorArgs args(DType dtype) const {
    MultiTensorArgs a;
    a.dtype = dtype;
    a.count = int64_t(params.size());
    a.params = params.data();
    a.grads = grads.data();
    a.state1 = state1.empty() ? nullptr : state1.data();
    a.state2 = state2.empty() ? nullptr : state2.data();
    a.numel = numel.data();
    return a;
  }
};

// New 16-bit copies for the f32 parameters that keep one (all of one dtype: a parameter
// whose copy has another is left to be cast again at its next use).
struct Copies {
  TensorList tensors;        // per parameter, undefined where none
  std::vector<void*> ptrs;   // the kernel's list
  DType dtype = DType::bf16;
  bool any = false;

  // A fresh tensor for each copy, except for a step that is or may be captured
  // (engine/cuda_graph.h): there the copy the forward read is written in place, so that a
  // graph's next replay reads the values this update wrote, whether the update was the
  // graph's or an eager step's between replays (a last, smaller batch).
  Copies(const TensorList& params, bool in_place) : tensors(params.size()), ptrs(params.size(), nullptr) {
    if (params[0].dtype() != DType::f32) return;
    for (size_t i = 0; i < params.size(); ++i) {
      const std::optional<DType> d = weight_copy_dtype(params[i]);
      if (!d || (*d != DType::bf16 && *d != DType::f16) || (any && *d != dtype)) continue;
      dtype = *d;
      any = true;
      // In the parameter's layout: the kernel writes element k of the copy from element k of
      // the parameter's memory.
      const MemoryFormat format = params[i].memory_format();
      Tensor kept = in_place ? kept_weight_copy(params[i]) : Tensor();
      tensors[i] = kept.defined() && kept.dtype() == dtype && kept.is_contiguous(format)
                       ? kept
                       : Tensor::empty(params[i].shape(), dtype, params[i].device(), format);
      ptrs[i] = tensors[i].data_ptr();
    }
  }
  void add_to(MultiTensorArgs& a) const {
    if (!any) return;
    a.copies = ptrs.data();
    a.copy_dtype = dtype;
  }
  // After the update: every parameter changed; the fresh copies match it. All versions
  // change first, so parameters sharing a storage keep each other's fresh copies valid.
  void record(const TensorList& params) const {
    for (const Tensor& p : params) p.bump_version();
    for (size_t i = 0; i < params.size(); ++i)
      if (tensors[i].defined()) set_weight_copy(params[i], tensors[i]);
  }
};

// A captured step's values on the device (lr_at, scalars_at): `count` f64 on `device`.
void check_device_scalars(const char* op, const char* name, const Tensor& t, int64_t count, Device device) {
  LOOM_CHECK(t.numel() == count && t.dtype() == DType::f64 && t.device() == device && t.is_contiguous(), op, ": ",
             name, " must be ", count, " contiguous f64 on ", device.str(), ", got ", dtype_name(t.dtype()), " ",
             shape_str(t.shape()), " on ", t.device().str());
}

Lists lists_of(const TensorList& params, const TensorList& grads) {
  Lists l;
  for (size_t i = 0; i < params.size(); ++i) {
    l.params.push_back(params[i].data_ptr());
    l.grads.push_back(grads[i].data_ptr());
    l.numel.push_back(params[i].numel());
  }
  return l;
}

}  // namespace

void sgd_update_fused(const TensorList& params, const TensorList& grads, TensorList& momentum_buffers, double lr,
                      double momentum, double dampening, double weight_decay, bool nesterov, const Tensor& lr_at) {
  const char* op = "sgd_update_fused";
  const size_t n = params.size();
  const bool use_momentum = momentum != 0;
  check_length(op, "grads", grads.size(), n);
  LOOM_CHECK(momentum_buffers.size() == n || (!use_momentum && momentum_buffers.empty()), op, ": momentum_buffers has ",
             momentum_buffers.size(), " entries but params has ", n,
             "; the lists run in parallel (with momentum 0 it may also be empty)");
  if (n == 0) return;
  check_params(op, params);
  for (size_t i = 0; i < n; ++i) check_entry(op, "grads", i, grads[i], params);
  if (use_momentum)
    for (size_t i = 0; i < n; ++i)
      if (momentum_buffers[i].defined()) check_entry(op, "momentum_buffers", i, momentum_buffers[i], params);

  NoGradGuard no_grad;
  const Device device = params[0].device();
  const DType dtype = params[0].dtype();
  Lists l = lists_of(params, grads);
  std::vector<uint8_t> first(n, 0);
  if (use_momentum) {
    for (size_t i = 0; i < n; ++i) {
      Tensor& buf = momentum_buffers[i];
      if (!buf.defined()) {  // the kernel fills a new buffer with the gradient
        buf = Tensor::empty(params[i].shape(), dtype, device, params[i].memory_format());
        first[i] = 1;
      }
      l.state1.push_back(buf.data_ptr());
    }
  }
  SgdHyper hyper;
  hyper.lr = lr;
  hyper.momentum = momentum;
  hyper.dampening = dampening;
  hyper.weight_decay = weight_decay;
  hyper.nesterov = nesterov;
  hyper.first = first.data();
  // A capturable optimizer's step (lr on the device) keeps its weight copies in place.
  const Copies copies(params, capturing(device) || lr_at.defined());
  if (lr_at.defined()) {
    check_device_scalars(op, "lr_at", lr_at, 1, device);
    hyper.lr_at = lr_at.data<double>();
  }
  MultiTensorArgs args = l.args(dtype);
  copies.add_to(args);
  ops::kernels(device).sgd_step(args, hyper, ops::stream(params[0]));
  copies.record(params);
}

void adam_update_fused(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                       const TensorList& exp_avg_sqs, const std::vector<int64_t>& steps, double lr, double beta1,
                       double beta2, double eps, double weight_decay, bool decoupled, const Tensor& scalars_at) {
  const char* op = "adam_update_fused";
  const size_t n = params.size();
  check_length(op, "grads", grads.size(), n);
  check_length(op, "exp_avgs", exp_avgs.size(), n);
  check_length(op, "exp_avg_sqs", exp_avg_sqs.size(), n);
  check_length(op, "steps", steps.size(), n);
  if (n == 0) return;
  check_params(op, params);
  for (size_t i = 0; i < n; ++i) {
    check_entry(op, "grads", i, grads[i], params);
    check_entry(op, "exp_avgs", i, exp_avgs[i], params);
    check_entry(op, "exp_avg_sqs", i, exp_avg_sqs[i], params);
    LOOM_CHECK(steps[i] >= 1, op, ": steps[", i, "] is ", steps[i],
               "; a step count includes the update being made, so it starts at 1");
  }

  NoGradGuard no_grad;
  Lists l = lists_of(params, grads);
  for (size_t i = 0; i < n; ++i) {
    l.state1.push_back(exp_avgs[i].data_ptr());
    l.state2.push_back(exp_avg_sqs[i].data_ptr());
  }
  AdamHyper hyper;
  hyper.lr = lr;
  hyper.beta1 = beta1;
  hyper.beta2 = beta2;
  hyper.eps = eps;
  hyper.weight_decay = weight_decay;
  hyper.decoupled = decoupled;
  hyper.step = steps.data();
  const Device device = params[0].device();
  if (scalars_at.defined()) {
    check_device_scalars(op, "scalars_at", scalars_at, 3, device);
    for (size_t i = 1; i < n; ++i)
      LOOM_CHECK(steps[i] == steps[0], op, ": steps[", i, "] is ", steps[i], " but steps[0] is ", steps[0],
                 "; with scalars_at every tensor makes the same step");
    hyper.scalars_at = scalars_at.data<double>();
  }
  LOOM_CHECK(hyper.scalars_at || !capturing(device), op, " inside a captured step (engine/cuda_graph.h) without "
             "scalars_at: the bias corrections of the step count at capture would repeat at every replay; make the "
             "optimizer capturable (Optimizer::make_capturable)");
  const Copies copies(params, capturing(device) || scalars_at.defined());
  MultiTensorArgs args = l.args(params[0].dtype());
  copies.add_to(args);
  ops::kernels(params[0].device()).adam_step(args, hyper, ops::stream(params[0]));
  copies.record(params);
}

void copy_many_(const TensorList& dst, const TensorList& src) {
  const char* op = "copy_many_";
  check_length(op, "src", src.size(), dst.size());
  if (dst.empty()) return;
  check_params(op, dst);
  for (size_t i = 0; i < src.size(); ++i) check_entry(op, "src", i, src[i], dst);
  Lists l = lists_of(dst, src);
  ops::kernels(dst[0].device()).multi_tensor_copy(l.args(dst[0].dtype()), ops::stream(dst[0]));
  for (const Tensor& t : dst) t.bump_version();
}

}  // namespace loom
