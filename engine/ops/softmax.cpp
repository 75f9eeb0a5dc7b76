// Softmax, log-softmax and the fused cross-entropy. All three run over a canonical
// (outer, R, inner) view of a contiguous input around the softmax dim, so no transpose
// is needed for any dim. Cross-entropy keeps only the per-row log-sum-exp for backward.
// linear_cross_entropy is a classifier's loss with its output layer: the loss kernel
// writes the logits' gradient over the logits as it reads them, and backward's two products
// scale it by the upstream gradient / count on the device. A split pass (gradient_wanted,
// engine/autograd.h) may ask for the two products apart: x's first, the (classes, in)
// weight's later.
#include "engine/autocast.h"
#include "engine/ops/dispatch.h"
#include "engine/ops/product.h"

namespace loom {

using ops::kernels;

namespace {

Tensor softmax_impl(const Tensor& x0, int dim, bool log) {
  const char* name = log ? "log_softmax" : "softmax";
  ops::check_defined(x0, name, "x");
  ops::check_floating(x0, name);
  int d = wrap_dim(dim, x0.dim(), name);
  Tensor x = x0.contiguous();
  ops::OuterRInner s = ops::around_dim(x.shape(), x.dim() == 0 ? 0 : d);
  Tensor out = Tensor::empty(x.shape(), x.dtype(), x.device());
  if (out.numel() > 0)
    kernels(x.device()).softmax(out.data_ptr(), x.data_ptr(), x.dtype(), s.outer, s.R, s.inner, log, ops::stream(x));
  if (any_requires_grad({x})) {
    Tensor so = out.detach();
    record(name, {x}, {out}, [so, s, log](const TensorList& g) {
      Tensor go = g[0].contiguous();
      Tensor gi = Tensor::empty(so.shape(), so.dtype(), so.device());
      if (gi.numel() > 0)
        kernels(so.device()).softmax_backward(gi.data_ptr(), go.data_ptr(), so.data_ptr(), so.dtype(), s.outer, s.R,
                                              s.inner, log, ops::stream(so));
      return TensorList{gi};
    });
  }
  return out;
}

}  // namespace

Tensor softmax(const Tensor& x, int dim) { return softmax_impl(x, dim, false); }
Tensor log_softmax(const Tensor& x, int dim) { return softmax_impl(x, dim, true); }

namespace {

// The checks of the targets of a loss over N rows; `op` names the caller and `input` (of N
// rows) the argument they must match.
void check_targets(const Tensor& target, const Tensor& input, const char* input_name, const char* op) {
  ops::check_defined(target, op, "target");
  ops::check_same_device(input, target, op);
  const int64_t N = input.size(0);
  LOOM_CHECK(target.dim() == 1 && target.size(0) == N, op, ": target of shape ", shape_str(target.shape()),
             " does not match ", input_name, " of shape ", shape_str(input.shape()), " (expected (", N, ",))");
  LOOM_CHECK(target.dtype() == DType::i64 || target.dtype() == DType::i32, op,
             ": targets must be integer class indices (i64), got ", dtype_name(target.dtype()));
}

void check_smoothing(double label_smoothing, const char* op) {
  LOOM_CHECK(label_smoothing >= 0 && label_smoothing < 1, op, ": label_smoothing must be in [0, 1), got ",
             label_smoothing);
}

// The rows' losses of logits (N, C) contiguous against target (N) i64 contiguous, and their
// mean over the rows that count (the count is a tensor, so nothing waits for the GPU). With
// grad, the kernel also writes there the gradient of the rows' summed loss (which the mean
// divides by denom).
struct MeanLoss {
  Tensor loss;     // 0-dim, in acc
  Tensor lse;      // (N), in acc
  Tensor counted;  // (N), in acc: 1 where the row counts, else 0
  Tensor denom;    // 0-dim, in acc: the number of rows that count, at least 1
};

MeanLoss mean_loss(const Tensor& logits, const Tensor& target, int64_t ignore_index, double label_smoothing,
                   void* grad) {
  const int64_t N = logits.size(0), C = logits.size(1);
  const Device dev = logits.device();
  // Per-row losses and log-sum-exps in the accumulation type: f64 for f64 logits, else f32.
  const DType acc = logits.dtype() == DType::f64 ? DType::f64 : DType::f32;
  MeanLoss r;
  Tensor loss_rows = Tensor::empty({N}, acc, dev);
  r.lse = Tensor::empty({N}, acc, dev);
  if (N > 0)
    kernels(dev).cross_entropy(loss_rows.data_ptr(), r.lse.data_ptr(), logits.data_ptr(), logits.dtype(),
                               target.data<int64_t>(), N, C, ignore_index, label_smoothing, grad, ops::stream(logits));
  NoGradGuard no_grad;
  r.counted = ne(target, full({}, double(ignore_index), DType::i64, dev)).to(acc);
  r.denom = maximum(sum(r.counted), ones({}, acc, dev));
  r.loss = div(sum(loss_rows), r.denom);  // f32 for 16-bit logits: a bf16 loss would keep 3 digits
  return r;
}

}  // namespace

Tensor cross_entropy(const Tensor& logits0, const Tensor& target0, int64_t ignore_index, double label_smoothing) {
  ops::check_defined(logits0, "cross_entropy", "logits");
  ops::check_floating(logits0, "cross_entropy");
  LOOM_CHECK(logits0.dim() == 2, "cross_entropy expects logits of shape (N, C), got ", shape_str(logits0.shape()),
             ": flatten the leading dims with logits.reshape({-1, C})");
  check_targets(target0, logits0, "logits", "cross_entropy");
  check_smoothing(label_smoothing, "cross_entropy");
  Tensor logits = logits0.contiguous();
  Tensor target = target0.to(DType::i64).contiguous();
  const int64_t N = logits.size(0), C = logits.size(1);
  MeanLoss m = mean_loss(logits, target, ignore_index, label_smoothing, nullptr);
  if (any_requires_grad({logits})) {
    Tensor sl = logits.detach(), lse = m.lse;
    Tensor weight;  // per-row weight of the mean: 1/count or 0
    {
      NoGradGuard no_grad;
      weight = div(m.counted, m.denom);
    }
    const DType acc = lse.dtype();
    record("cross_entropy", {logits}, {m.loss}, [sl, target, lse, weight, ignore_index, label_smoothing, N, C, acc](const TensorList& g) {
      Tensor grad_row = mul(weight, g[0].to(acc)).contiguous();
      Tensor gi = Tensor::empty(sl.shape(), sl.dtype(), sl.device());
      kernels(sl.device()).cross_entropy_backward(gi.data_ptr(), sl.data_ptr(), lse.data_ptr(),
                                                  target.data<int64_t>(), grad_row.data_ptr(), sl.dtype(), N, C,
                                                  ignore_index, label_smoothing, ops::stream(sl));
      return TensorList{gi};
    });
  }
  return m.loss;
}

Tensor linear_cross_entropy(const Tensor& x0, const Tensor& weight0, const Tensor& target0, int64_t ignore_index,
                            double label_smoothing) {
  const char* op = "linear_cross_entropy";
  ops::check_defined(x0, op, "x");
  ops::check_defined(weight0, op, "weight");
  ops::check_same_device(x0, weight0, op);
  LOOM_CHECK(x0.dim() == 2, op, " expects x of shape (N, in), got ", shape_str(x0.shape()),
             ": flatten the leading dims with x.reshape({-1, in})");
  LOOM_CHECK(weight0.dim() == 2 && weight0.size(1) == x0.size(1), op, ": weight of shape ",
             shape_str(weight0.shape()), " does not match x of shape ", shape_str(x0.shape()), " (expected (classes, ",
             x0.size(1), "))");
  LOOM_CHECK(weight0.size(0) > 0, op, ": weight of shape ", shape_str(weight0.shape()), " has no classes");
  check_targets(target0, x0, "x", op);
  check_smoothing(label_smoothing, op);
  DType t = ops::promote(x0.dtype(), weight0.dtype());
  LOOM_CHECK(is_floating(t), op, " needs floating-point x and weight, got ", dtype_name(x0.dtype()), " and ",
             dtype_name(weight0.dtype()));
  t = autocast_compute_dtype(t);
  // An f32 weight beside 16-bit products (a tied embedding under autocast) gets its gradient
  // straight from the product's f32 output (ops::f32_params).
  const bool f32 = ops::f32_params(t, {weight0});
  const ops::Param w = ops::param(weight0, t, f32);
  Tensor x = x0.to(t);
  Tensor target = target0.to(DType::i64).contiguous();
  // Gradients only when recording (grad mode on): else the logits stay logits.
  const bool record_grad = any_requires_grad({x, w.input});
  const bool need_x = record_grad && x.requires_grad(), need_w = record_grad && w.input.requires_grad();
  Tensor logits = ops::product_2d(x, w.used.t());  // (N, classes), only ever seen here
  // Training: the loss kernel overwrites the logits with their gradient as it goes.
  MeanLoss m = mean_loss(logits, target, ignore_index, label_smoothing, need_x || need_w ? logits.data_ptr() : nullptr);
  if (need_x || need_w) {
    Tensor sx = x.detach(), sw = w.used.detach(), grad = logits, denom = m.denom;
    record(op, {x, w.input}, {m.loss}, [sx, sw, grad, denom, need_x, need_w, f32](const TensorList& g) {
      // d(mean)/d(logits) = g / count times the gradient the kernel wrote: that scale is
      // the products' alpha, read on the device.
      Tensor scale = div(g[0].to(denom.dtype()), denom).contiguous();
      auto scaled = [&](GemmArgs& a) { a.alpha_ptr = scale.data_ptr(); };
      const bool want_x = need_x && gradient_wanted(0), want_w = need_w && gradient_wanted(1);
      Tensor dx = want_x ? ops::product_2d(grad, sw, scaled) : Tensor();              // (N, in)
      Tensor dw = want_w ? ops::product_2d(grad.t(), sx, scaled, f32) : Tensor();      // (classes, in)
      return TensorList{dx, dw};
    });
  }
  return m.loss;
}

}  // namespace loom
