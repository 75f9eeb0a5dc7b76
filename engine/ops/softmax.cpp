// Softmax, log-softmax and the fused cross-entropy. All three run over a canonical
// (outer, R, inner) view of a contiguous input around the softmax dim, so no transpose
// is needed for any dim. Cross-entropy keeps only the per-row log-sum-exp for backward.
// linear_cross_entropy is a classifier's loss with its output layer. A batch that fits in one
// chunk (rows_per_chunk) makes its logits in one product; the loss kernel overwrites them
// with their gradient as it reads them, and backward's two products scale that by the
// upstream gradient / count on the device (a split pass, gradient_wanted in
// engine/autograd.h, may ask for x's first and the (classes, in) weight's later). A larger
// batch goes a chunk of rows at a time, so only one chunk's logits ever exist: in training
// two more products turn each chunk's gradient into its rows of x's gradient and its term of
// the weight's there and then, and backward only scales the two.
#include <algorithm>
#include <bit>

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

// The rows that count in a loss's mean (their target is not ignore_index), 1 or 0 each, and
// their number, at least 1, in the accumulation type `acc`: tensors, so nothing waits for
// the GPU.
struct Count {
  Tensor counted;  // (N)
  Tensor denom;    // 0-dim
};

Count count_rows(const Tensor& target, int64_t ignore_index, DType acc) {
  NoGradGuard no_grad;
  const Device dev = target.device();
  Count c;
  c.counted = ne(target, full({}, double(ignore_index), DType::i64, dev)).to(acc);
  c.denom = maximum(sum(c.counted), ones({}, acc, dev));
  return c;
}

// The rows' losses of logits (N, C) contiguous against target (N) i64 contiguous, and their
// mean over the rows that count. With grad, the kernel also writes there the gradient of the
// rows' summed loss (which the mean divides by count.denom).
struct MeanLoss {
  Tensor loss;  // 0-dim, in acc
  Tensor lse;   // (N), in acc
  Count count;
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
                               target.data<int64_t>(), N, C, ignore_index, label_smoothing, grad, 0,
                               ops::stream(logits));
  r.count = count_rows(target, ignore_index, acc);
  NoGradGuard no_grad;
  r.loss = div(sum(loss_rows), r.count.denom);  // f32 for 16-bit logits: a bf16 loss would keep 3 digits
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
      weight = div(m.count.counted, m.count.denom);
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

namespace {

// linear_cross_entropy's chunks: a power of two of rows whose logits hold at most 2^28
// values (512 MiB in bf16; GPT-2's 50,257 classes give 4096 rows), or the whole batch when
// it is smaller. Smaller chunks hold less but cost more: every chunk reads and writes the
// weight's f32 gradient sum once more.
constexpr int64_t kChunkValues = int64_t(1) << 28;

int64_t rows_per_chunk(int64_t classes) {
  return int64_t(std::bit_floor(uint64_t(std::max<int64_t>(1, kChunkValues / classes))));
}

// What linear_cross_entropy computes with: x (N, in) and the weight in the compute dtype t,
// the targets, and the gradients it records.
struct Head {
  Tensor x, target;
  ops::Param w;
  DType t;
  bool f32;  // an f32 weight beside 16-bit products, whose gradient comes out in f32
  bool need_x, need_w;
};

// The batch in one chunk: in training the loss kernel overwrites the logits with their
// gradient, kept for backward, whose two products scale it by the upstream gradient / count.
// A split pass may run them apart, the weight's in its later half.
Tensor head_whole(const Head& h, int64_t ignore_index, double label_smoothing) {
  const char* op = "linear_cross_entropy";
  Tensor logits = ops::product_2d(h.x, h.w.used.t());  // (N, classes), only ever seen here
  const bool grads = h.need_x || h.need_w;
  MeanLoss m = mean_loss(logits, h.target, ignore_index, label_smoothing, grads ? logits.data_ptr() : nullptr);
  if (!grads) return m.loss;
  Tensor sx = h.x.detach(), sw = h.w.used.detach(), grad = logits, denom = m.count.denom;
  const bool need_x = h.need_x, need_w = h.need_w, f32 = h.f32;
  record(op, {h.x, h.w.input}, {m.loss}, [sx, sw, grad, denom, need_x, need_w, f32](const TensorList& g) {
    // d(mean)/d(logits) = g / count times the gradient the kernel wrote: that scale is the
    // products' alpha, read on the device.
    Tensor scale = div(g[0].to(denom.dtype()), denom).contiguous();
    auto scaled = [&](GemmArgs& a) { a.alpha_ptr = scale.data_ptr(); };
    const bool want_x = need_x && gradient_wanted(0), want_w = need_w && gradient_wanted(1);
    Tensor dx = want_x ? ops::product_2d(grad, sw, scaled) : Tensor();          // (N, in)
    Tensor dw = want_w ? ops::product_2d(grad.t(), sx, scaled, f32) : Tensor();  // (classes, in)
    return TensorList{dx, dw};
  });
  return m.loss;
}

// Several chunks of `rows` rows: each chunk's logits live only while the loss kernel turns
// them into their gradient and, in training, two products turn that into the chunk's rows of
// x's gradient (the mean's: 1 / count is their alpha, read on the device) and its term of
// the weight's (the summed loss's, over the chunks, in f32 for 16-bit products). Backward
// only scales them, in f32: x's by its upstream gradient, the weight's by that / count. Both
// come back from any pass, so a split pass's later half has nothing of this op to run.
Tensor head_chunked(const Head& h, int64_t rows, int64_t ignore_index, double label_smoothing) {
  const char* op = "linear_cross_entropy";
  const Device dev = h.x.device();
  const int64_t N = h.x.size(0), classes = h.w.used.size(0), in = h.x.size(1);
  const DType t = h.t, acc = t == DType::f64 ? DType::f64 : DType::f32;
  const Count count = count_rows(h.target, ignore_index, acc);
  const Tensor x = h.x.detach();  // the chunks' slices, with no node each
  Tensor loss_rows = Tensor::empty({N}, acc, dev), lse = Tensor::empty({N}, acc, dev);
  Tensor inv_count, dx, dw;
  if (h.need_x) {
    NoGradGuard no_grad;
    inv_count = div(ones({}, acc, dev), count.denom);
    dx = Tensor::empty({N, in}, t, dev);
  }
  if (h.need_w) dw = Tensor::empty({classes, in}, acc, dev);
  for (int64_t r0 = 0; r0 < N; r0 += rows) {
    const int64_t r1 = std::min(N, r0 + rows);
    const Tensor xc = x.slice(0, r0, r1);
    Tensor logits = ops::product_2d(xc, h.w.used.t());  // (r1 - r0, classes)
    void* grad = dx.defined() || dw.defined() ? logits.data_ptr() : nullptr;
    kernels(dev).cross_entropy(loss_rows.slice(0, r0, r1).data_ptr(), lse.slice(0, r0, r1).data_ptr(),
                               logits.data_ptr(), t, h.target.slice(0, r0, r1).data<int64_t>(), r1 - r0, classes,
                               ignore_index, label_smoothing, grad, r0, ops::stream(logits));
    if (dx.defined())
      ops::product_2d_into(dx.slice(0, r0, r1), logits, h.w.used,
                           [&](GemmArgs& a) { a.alpha_ptr = inv_count.data_ptr(); });
    if (dw.defined()) ops::product_2d_into(dw, logits.t(), xc, [&](GemmArgs& a) { a.beta = r0 > 0 ? 1.f : 0.f; });
  }
  Tensor loss;
  {
    NoGradGuard no_grad;
    loss = div(sum(loss_rows), count.denom);
  }
  if (!dx.defined() && !dw.defined()) return loss;
  const DType w_grad = h.f32 ? DType::f32 : t;
  Tensor denom = count.denom;
  record(op, {h.x, h.w.input}, {loss}, [dx, dw, denom, w_grad, t, acc](const TensorList& g) {
    const Tensor up = g[0].to(acc);
    Tensor gx = dx.defined() ? mul(dx.to(acc), up).to(t) : Tensor();
    Tensor gw = dw.defined() ? mul(dw, div(up, denom)).to(w_grad) : Tensor();
    return TensorList{gx, gw};
  });
  return loss;
}

}  // namespace

Tensor linear_cross_entropy(const Tensor& x0, const Tensor& weight0, const Tensor& target0, int64_t ignore_index,
                            double label_smoothing, int64_t chunk_rows) {
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
  LOOM_CHECK(chunk_rows >= 0, op, ": chunk_rows must be 0 (chosen from the classes) or a number of rows, got ",
             chunk_rows);
  check_targets(target0, x0, "x", op);
  check_smoothing(label_smoothing, op);
  DType t = ops::promote(x0.dtype(), weight0.dtype());
  LOOM_CHECK(is_floating(t), op, " needs floating-point x and weight, got ", dtype_name(x0.dtype()), " and ",
             dtype_name(weight0.dtype()));
  Head h;
  h.t = autocast_compute_dtype(t);
  // An f32 weight beside 16-bit products (a tied embedding under autocast) gets its gradient
  // in f32 (ops::f32_params).
  h.f32 = ops::f32_params(h.t, {weight0});
  h.w = ops::param(weight0, h.t, h.f32);
  h.x = x0.to(h.t);
  h.target = target0.to(DType::i64).contiguous();
  // Gradients only when recording (grad mode on): else the logits stay logits.
  const bool record_grad = any_requires_grad({h.x, h.w.input});
  h.need_x = record_grad && h.x.requires_grad(), h.need_w = record_grad && h.w.input.requires_grad();
  const int64_t rows = chunk_rows > 0 ? chunk_rows : rows_per_chunk(h.w.used.size(0));
  return h.x.size(0) <= rows ? head_whole(h, ignore_index, label_smoothing)
                             : head_chunked(h, rows, ignore_index, label_smoothing);
}

}  // namespace loom
