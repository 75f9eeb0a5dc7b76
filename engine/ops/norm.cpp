// Batch normalisation: the argument rules of F.batch_norm, the kernel calls, and the
// backward closures beside the forwards.
//
// x (N, C, *) is viewed as a contiguous (N, C, S) buffer; a channels-last (N, C, H, W) x as
// the (N, S, C) buffer it is in memory, which the kernels read as it lies on either device,
// its output and its gradient laid out channels-last too. Per-channel vectors live in the
// accumulation type (f32, f64 for f64 x): running statistics must already be of that type,
// since they are updated in place; weight and bias may also be of x's dtype and are then
// converted with the differentiable to(), so a bf16 parameter receives a bf16 gradient.
//
// Training records one node for (x, weight, bias) whose backward is the fused kernel, fed
// the batch mean and 1 / std the forward saved. In evaluation the statistics are constants,
// y = x * scale + shift per channel, and the backward is a few broadcast ops; it keeps its
// own copy of the running statistics, which a later training step may update in place.
// An empty batch gives an empty output and leaves the running statistics alone, as PyTorch.
//
// batch_norm_relu is the same training node with a residual add and a ReLU fused into the
// kernels (BatchNormArgs::relu): its backward keeps the output, whose sign is the ReLU's mask,
// and returns the residual's gradient beside the others.
#include "engine/ops/dispatch.h"

namespace loom {

using ops::kernels;
using ops::ptr_or_null;

namespace {

DType accumulation_type(DType t) { return t == DType::f64 ? DType::f64 : DType::f32; }

// The layout of the kernels' buffers (x, y, dy, dx) as a MemoryFormat.
MemoryFormat format_of(const BatchNormArgs& a) { return ops::memory_format(a.layout); }

// t (dense in `format`) itself, or a copy of it when its data is not 16-byte aligned; the
// copy is outside the graph, a buffer for the kernels only. For the fused ReLU's extra
// operands (the residual, and dy where ReLU's own backward would have made a fresh one): the
// CUDA kernels pick their vector width, and with it the order of the statistics' sums, from
// every buffer they read, so an operand the separate ops never pass to the normalisation must
// not narrow it.
Tensor aligned_buffer(const Tensor& t, MemoryFormat format) {
  if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0) return t;
  NoGradGuard no_grad;
  Tensor copy = Tensor::empty(t.shape(), t.dtype(), t.device(), format);
  copy_(copy, t);
  return copy;
}

void check_channels(const char* name, const Tensor& t, const Tensor& x) {
  LOOM_CHECK(t.dim() == 1 && t.size(0) == x.size(1), "batch_norm: ", name, " must have shape (", x.size(1),
             ") for input ", shape_str(x.shape()), " (C = ", x.size(1), "), got ", shape_str(t.shape()));
}

// weight or bias as the kernels take them: (C), contiguous, in the accumulation type.
Tensor affine_param(const char* name, const Tensor& p, const Tensor& x, DType acc) {
  if (!p.defined()) return p;
  ops::check_same_device(x, p, "batch_norm");
  check_channels(name, p, x);
  LOOM_CHECK(p.dtype() == acc || p.dtype() == x.dtype(), "batch_norm: ", name, " is ", dtype_name(p.dtype()),
             " but the input is ", dtype_name(x.dtype()), ": pass it as ", dtype_name(acc), " or ",
             dtype_name(x.dtype()));
  return p.to(acc).contiguous();
}

void check_running(const char* name, const Tensor& r, const Tensor& x, DType acc) {
  ops::check_same_device(x, r, "batch_norm");
  check_channels(name, r, x);
  LOOM_CHECK(r.dtype() == acc, "batch_norm: ", name, " must be ", dtype_name(acc), " (the accumulation type of ",
             dtype_name(x.dtype()), " input), got ", dtype_name(r.dtype()), ": keep running statistics in ",
             dtype_name(acc));
}


// The reduced dims of x (all but the channel axis) and the shape a (C) vector broadcasts as.
std::vector<int> non_channel_dims(int ndim) {
  std::vector<int> dims{0};
  for (int d = 2; d < ndim; ++d) dims.push_back(d);
  return dims;
}
Shape channel_shape(int ndim, int64_t c) {
  Shape s(size_t(ndim), 1);
  s[1] = c;
  return s;
}

// a.relu: y = relu(batch_norm + residual), residual undefined for none (batch_norm_relu).
Tensor train_forward(const BatchNormArgs& a, const Tensor& x, const Tensor& running_mean, const Tensor& running_var,
                     const Tensor& weight, const Tensor& bias, const Tensor& residual = Tensor()) {
  const Device dev = x.device();
  const DType acc = accumulation_type(a.dtype);
  Tensor y = Tensor::empty(x.shape(), x.dtype(), dev, format_of(a));
  Tensor save_mean = Tensor::empty({a.c}, acc, dev), save_invstd = Tensor::empty({a.c}, acc, dev);
  // Updated in place; a non-contiguous one goes through a contiguous copy.
  Tensor rm = running_mean.defined() ? running_mean.detach().contiguous() : Tensor();
  Tensor rv = running_var.defined() ? running_var.detach().contiguous() : Tensor();
  const bool copy_back = running_mean.defined() && !(running_mean.is_contiguous() && running_var.is_contiguous());
  const Tensor residual_buffer = residual.defined() ? aligned_buffer(residual, format_of(a)) : Tensor();
  kernels(dev).batch_norm_forward_train(a, y.data_ptr(), save_mean.data_ptr(), save_invstd.data_ptr(),
                                        rm.defined() ? rm.data_ptr() : nullptr,
                                        rv.defined() ? rv.data_ptr() : nullptr, x.data_ptr(), ptr_or_null(weight),
                                        ptr_or_null(bias), ptr_or_null(residual_buffer), ops::stream(x));
  if (copy_back) {
    NoGradGuard no_grad;
    copy_(running_mean, rm);
    copy_(running_var, rv);
  }
  if (any_requires_grad({x, weight, bias, residual})) {
    const bool need_w = weight.defined() && weight.requires_grad(), need_b = bias.defined() && bias.requires_grad();
    const bool need_r = residual.defined() && residual.requires_grad();
    // The fused ReLU's mask is its output, which the next layer keeps anyway.
    Tensor sx = x.detach(), sw = weight.defined() ? weight.detach() : Tensor(), sy = a.relu ? y.detach() : Tensor();
    record(a.relu ? "batch_norm_relu" : "batch_norm", {x, weight, bias, residual}, {y},
           [a, acc, dev, sx, sw, sy, save_mean, save_invstd, need_w, need_b, need_r](const TensorList& g) {
             Tensor gy = g[0].to(a.dtype).contiguous(format_of(a));
             if (a.relu) gy = aligned_buffer(gy, format_of(a));
             Tensor gx = Tensor::empty(sx.shape(), a.dtype, dev, format_of(a));
             Tensor gr = need_r ? Tensor::empty(sx.shape(), a.dtype, dev, format_of(a)) : Tensor();
             Tensor gw = Tensor::empty({a.c}, acc, dev), gb = Tensor::empty({a.c}, acc, dev);
             kernels(dev).batch_norm_backward(a, gx.data_ptr(), gw.data_ptr(), gb.data_ptr(), gy.data_ptr(),
                                              sx.data_ptr(), ptr_or_null(sw), save_mean.data_ptr(),
                                              save_invstd.data_ptr(), ptr_or_null(sy), ptr_or_null(gr),
                                              ops::stream(gy));
             return TensorList{gx, need_w ? gw : Tensor(), need_b ? gb : Tensor(), gr};
           });
  }
  return y;
}

Tensor eval_forward(const BatchNormArgs& a, const Tensor& x, const Tensor& running_mean, const Tensor& running_var,
                    const Tensor& weight, const Tensor& bias) {
  const Device dev = x.device();
  const DType acc = accumulation_type(a.dtype);
  Tensor rm = running_mean.detach().contiguous(), rv = running_var.detach().contiguous();
  Tensor y = Tensor::empty(x.shape(), x.dtype(), dev, format_of(a));
  kernels(dev).batch_norm_forward_eval(a, y.data_ptr(), x.data_ptr(), ptr_or_null(weight), ptr_or_null(bias),
                                       rm.data_ptr(), rv.data_ptr(), ops::stream(x));
  if (any_requires_grad({x, weight, bias})) {
    const bool need_x = x.requires_grad(), need_w = weight.defined() && weight.requires_grad(),
               need_b = bias.defined() && bias.requires_grad();
    Tensor sx = need_w ? x.detach() : Tensor(), sw = weight.defined() ? weight.detach() : Tensor();
    Tensor mean, invstd;
    {
      NoGradGuard no_grad;
      mean = rm.clone();
      invstd = rsqrt(add(rv, a.eps));
    }
    const int ndim = x.dim();
    record("batch_norm", {x, weight, bias}, {y},
           [a, acc, ndim, sx, sw, mean, invstd, need_x, need_w, need_b](const TensorList& g) {
             const Shape bshape = channel_shape(ndim, a.c);
             const std::vector<int> dims = non_channel_dims(ndim);
             Tensor gy = g[0].to(acc);
             Tensor gx, gw, gb;
             if (need_x) gx = mul(gy, (sw.defined() ? mul(sw, invstd) : invstd).reshape(bshape)).to(a.dtype);
             if (need_w) {
               Tensor xhat = mul(sub(sx.to(acc), mean.reshape(bshape)), invstd.reshape(bshape));
               gw = sum(mul(gy, xhat), dims);
             }
             if (need_b) gb = sum(gy, dims);
             return TensorList{gx, gw, gb};
           });
  }
  return y;
}

// The checks of F.batch_norm's arguments, and the kernels' arguments for them.
BatchNormArgs checked_args(const Tensor& input, const Tensor& running_mean, const Tensor& running_var, bool training,
                           double momentum, double eps) {
  ops::check_defined(input, "batch_norm", "input");
  ops::check_floating(input, "batch_norm");
  LOOM_CHECK(input.dim() >= 2, "batch_norm expects input (N, C, *) with at least 2 dims, got ",
             shape_str(input.shape()), input.dim() == 1 ? ": add the batch dim with x.unsqueeze(0)" : "");
  LOOM_CHECK(eps >= 0, "batch_norm: eps must not be negative, got ", eps);
  const DType acc = accumulation_type(input.dtype());
  LOOM_CHECK(running_mean.defined() == running_var.defined(),
             "batch_norm: running_mean and running_var must be both defined or both undefined");
  if (running_mean.defined()) {
    check_running("running_mean", running_mean, input, acc);
    check_running("running_var", running_var, input, acc);
  }
  LOOM_CHECK(training || running_mean.defined(),
             "batch_norm: evaluation (training = false) normalises with running_mean and running_var, which are "
             "undefined: pass them, or use training = true to normalise with the batch's own statistics");

  BatchNormArgs a;
  a.dtype = input.dtype();
  a.n = input.size(0);
  a.c = input.size(1);
  a.s = 1;
  for (int d = 2; d < input.dim(); ++d) a.s *= input.size(d);
  a.eps = eps;
  a.momentum = momentum;
  a.layout = ops::channel_layout(input.memory_format());
  LOOM_CHECK(!training || a.n * a.s != 1, "batch_norm: Expected more than 1 value per channel when training, got input ",
             shape_str(input.shape()), ": use a batch of more than one sample, or eval mode");
  return a;
}

}  // namespace

Tensor batch_norm(const Tensor& input, const Tensor& running_mean, const Tensor& running_var, const Tensor& weight,
                  const Tensor& bias, bool training, double momentum, double eps) {
  const BatchNormArgs a = checked_args(input, running_mean, running_var, training, momentum, eps);
  const DType acc = accumulation_type(input.dtype());
  Tensor w = affine_param("weight", weight, input, acc), b = affine_param("bias", bias, input, acc);
  if (input.numel() == 0) return input.clone();
  Tensor x = input.contiguous(format_of(a));
  return training ? train_forward(a, x, running_mean, running_var, w, b)
                  : eval_forward(a, x, running_mean, running_var, w, b);
}

Tensor batch_norm_relu(const Tensor& input, const Tensor& residual, const Tensor& running_mean,
                       const Tensor& running_var, const Tensor& weight, const Tensor& bias, bool training,
                       double momentum, double eps) {
  BatchNormArgs a = checked_args(input, running_mean, running_var, training, momentum, eps);
  if (residual.defined()) {
    ops::check_same_device(input, residual, "batch_norm_relu");
    LOOM_CHECK(residual.shape() == input.shape(), "batch_norm_relu: the residual must have the input's shape ",
               shape_str(input.shape()), ", got ", shape_str(residual.shape()));
  }
  // One kernel each way where it applies: a training step, a residual of x's dtype. Anything
  // else runs the three ops, which give the same values.
  const bool fused = training && input.numel() > 0 && (!residual.defined() || residual.dtype() == input.dtype());
  if (!fused) {
    Tensor y = batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps);
    return relu(residual.defined() ? add(y, residual) : y);
  }
  const DType acc = accumulation_type(input.dtype());
  Tensor w = affine_param("weight", weight, input, acc), b = affine_param("bias", bias, input, acc);
  a.relu = true;
  return train_forward(a, input.contiguous(format_of(a)), running_mean, running_var, w, b,
                       residual.defined() ? residual.contiguous(format_of(a)) : Tensor());
}

}  // namespace loom
