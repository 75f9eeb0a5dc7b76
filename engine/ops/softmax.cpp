// Softmax, log-softmax and the fused cross-entropy. All three run over a canonical
// (outer, R, inner) view of a contiguous input around the softmax dim, so no transpose
// is needed for any dim. Cross-entropy keeps only the per-row log-sum-exp for backward.
#include "engine/ops/dispatch.h"

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

Tensor cross_entropy(const Tensor& logits0, const Tensor& target0, int64_t ignore_index, double label_smoothing) {
  ops::check_defined(logits0, "cross_entropy", "logits");
  ops::check_defined(target0, "cross_entropy", "target");
  ops::check_floating(logits0, "cross_entropy");
  ops::check_same_device(logits0, target0, "cross_entropy");
  LOOM_CHECK(logits0.dim() == 2, "cross_entropy expects logits of shape (N, C), got ", shape_str(logits0.shape()),
             ": flatten the leading dims with logits.reshape({-1, C})");
  LOOM_CHECK(target0.dim() == 1 && target0.size(0) == logits0.size(0), "cross_entropy: target of shape ",
             shape_str(target0.shape()), " does not match logits of shape ", shape_str(logits0.shape()),
             " (expected (", logits0.size(0), ",))");
  LOOM_CHECK(target0.dtype() == DType::i64 || target0.dtype() == DType::i32,
             "cross_entropy: targets must be integer class indices (i64), got ", dtype_name(target0.dtype()));
  LOOM_CHECK(label_smoothing >= 0 && label_smoothing < 1, "cross_entropy: label_smoothing must be in [0, 1), got ",
             label_smoothing);
  Tensor logits = logits0.contiguous();
  Tensor target = target0.to(DType::i64).contiguous();
  int64_t N = logits.size(0), C = logits.size(1);
  Device dev = logits.device();
  // Per-row losses and log-sum-exps in the accumulation type: f64 for f64 logits, else f32.
  DType acc = logits.dtype() == DType::f64 ? DType::f64 : DType::f32;
  Tensor loss_rows = Tensor::empty({N}, acc, dev), lse = Tensor::empty({N}, acc, dev);
  if (N > 0)
    kernels(dev).cross_entropy(loss_rows.data_ptr(), lse.data_ptr(), logits.data_ptr(), logits.dtype(),
                               target.data<int64_t>(), N, C, ignore_index, label_smoothing, ops::stream(logits));
  // Mean over the rows that count; the count is a tensor, so nothing waits for the GPU.
  Tensor counted, loss;
  {
    NoGradGuard no_grad;
    counted = ne(target, full({}, double(ignore_index), DType::i64, dev)).to(acc);
    Tensor denom = maximum(sum(counted), ones({}, acc, dev));
    loss = div(sum(loss_rows), denom);  // f32 for 16-bit logits: a bf16 loss would keep 3 digits
    counted = div(counted, denom);  // per-row weight of the mean: 1/count or 0
  }
  if (any_requires_grad({logits})) {
    Tensor sl = logits.detach();
    record("cross_entropy", {logits}, {loss}, [sl, target, lse, counted, ignore_index, label_smoothing, N, C, acc](const TensorList& g) {
      Tensor grad_row = mul(counted, g[0].to(acc)).contiguous();
      Tensor gi = Tensor::empty(sl.shape(), sl.dtype(), sl.device());
      kernels(sl.device()).cross_entropy_backward(gi.data_ptr(), sl.data_ptr(), lse.data_ptr(),
                                                  target.data<int64_t>(), grad_row.data_ptr(), sl.dtype(), N, C,
                                                  ignore_index, label_smoothing, ops::stream(sl));
      return TensorList{gi};
    });
  }
  return loss;
}

}  // namespace loom
