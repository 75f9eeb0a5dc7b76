// Layer normalisation: the argument rules of F.layer_norm over the last dim, the fused
// kernel calls, and the backward closure beside the forward.
//
// x (..., D) is viewed as a contiguous (rows, D) buffer. weight and bias keep their own
// dtype (the kernels read any floating one), so f32 parameters over bf16 activations need no
// cast and receive f32 gradients. The forward saves each row's mean and 1 / std (f32; f64
// for f64 x); the backward is one fused call fed those, x and the weight, with device
// scratch for its per-block parameter sums allocated here (kernels never allocate).
//
// y may be asked for in a dtype other than x's: the kernel writes f32, bf16 or f16 directly
// from f32, bf16 or f16 x (the 16-bit output an autocast matrix product reads); a pair with
// f64 on either side runs in x's dtype and converts with the differentiable to().
//
// When x's gradient will be read in y's 16-bit dtype (x is an autocast product's f32
// residual output: set_gradient_read_dtype), the backward writes dx a second time, rounded
// to that dtype, in the same pass, and keeps it on dx for the product (cast_or_kept).
//
// When x is a product's output whose backward sums its gradient for a bias gradient
// (set_gradient_sums_read), and reads it as the kernel writes it (dx itself, or the rounding
// above), the backward also sums it over the rows in the same pass and keeps the sums on dx
// for the product (keep_column_sums, engine/autograd.h; Options::fused_bias_sums).
#include "engine/autocast.h"
#include "engine/ops/dispatch.h"
#include "engine/options.h"

namespace loom {

using ops::kernels;
using ops::ptr_or_null;

namespace {

DType accumulation_type(DType t) { return t == DType::f64 ? DType::f64 : DType::f32; }

// The dtype the kernel writes y in, for x of dtype t and y wanted in `want`.
DType kernel_out_dtype(DType t, DType want) { return t == DType::f64 || want == DType::f64 ? t : want; }

void check_param(const char* name, const Tensor& p, const Tensor& x) {
  if (!p.defined()) return;
  ops::check_same_device(x, p, "layer_norm");
  ops::check_floating(p, "layer_norm");
  LOOM_CHECK(p.dim() == 1 && p.size(0) == x.size(-1), "layer_norm: ", name, " must have shape (", x.size(-1),
             ") for input ", shape_str(x.shape()), " (normalised over its last dim), got ", shape_str(p.shape()));
}


// LayerNorm of input; with `tee`, also an alias of the (contiguous) input as a second output
// of the same node, so the input's gradient from its other use arrives in this backward
// and is added inside the kernel (LayerNormArgs::dx_add).
TensorList layer_norm_impl(const Tensor& input, const Tensor& weight, const Tensor& bias, double eps,
                           std::optional<DType> out_dtype, bool tee) {
  ops::check_defined(input, "layer_norm", "input");
  ops::check_floating(input, "layer_norm");
  LOOM_CHECK(input.dim() >= 1, "layer_norm expects input (..., D) with at least 1 dim, got a 0-dim tensor: "
                               "reshape it to (1)");
  LOOM_CHECK(eps >= 0, "layer_norm: eps must not be negative, got ", eps);
  check_param("weight", weight, input);
  check_param("bias", bias, input);
  LOOM_CHECK(!weight.defined() || !bias.defined() || weight.dtype() == bias.dtype(), "layer_norm: weight is ",
             dtype_name(weight.defined() ? weight.dtype() : DType::f32), " but bias is ",
             dtype_name(bias.defined() ? bias.dtype() : DType::f32), ": give both the same dtype");
  const DType want = out_dtype.value_or(input.dtype());
  LOOM_CHECK(is_floating(want), "layer_norm: out_dtype must be a floating-point dtype, got ", dtype_name(want));

  LayerNormArgs a;
  a.dtype = input.dtype();
  a.out_dtype = kernel_out_dtype(a.dtype, want);
  a.param_dtype = weight.defined() ? weight.dtype() : bias.defined() ? bias.dtype() : accumulation_type(a.dtype);
  a.dim = input.size(-1);
  a.rows = 1;
  for (int d = 0; d + 1 < input.dim(); ++d) a.rows *= input.size(d);
  a.eps = eps;

  const Device dev = input.device();
  Tensor x = input.contiguous();
  Tensor w = weight.defined() ? weight.contiguous() : Tensor(), b = bias.defined() ? bias.contiguous() : Tensor();
  StreamHandle st = ops::stream(x);
  const DType acc = accumulation_type(a.dtype);
  Tensor y = Tensor::empty(x.shape(), a.out_dtype, dev);                                      // (..., D)
  Tensor mean = Tensor::empty({a.rows}, acc, dev), rstd = Tensor::empty({a.rows}, acc, dev);  // (rows)
  kernels(dev).layer_norm_forward(a, y.data_ptr(), mean.data_ptr(), rstd.data_ptr(), x.data_ptr(), ptr_or_null(w),
                                  ptr_or_null(b), st);

  Tensor alias = tee ? x.detach() : Tensor();
  if (any_requires_grad({x, w, b})) {
    const bool need_x = x.requires_grad(), need_w = w.defined() && w.requires_grad(),
               need_b = b.defined() && b.requires_grad();
    Tensor sx = x.detach(), sw = w.defined() ? w.detach() : Tensor();
    const std::optional<DType> read_as = gradient_read_dtype(x);
    const bool round_dx = need_x && a.dtype == DType::f32 && a.out_dtype != DType::f32 && read_as == a.out_dtype;
    const bool sum_dx = need_x && options().fused_bias_sums &&
                        gradient_sums_read(x) == (round_dx ? a.out_dtype : a.dtype);
    record(tee ? "layer_norm_tee" : "layer_norm", {x, w, b}, tee ? TensorList{alias, y} : TensorList{y},
           [a, dev, sx, sw, mean, rstd, need_x, need_w, need_b, tee, round_dx, sum_dx](const TensorList& g) {
             LayerNormArgs args = a;
             Tensor dL_dalias = tee && need_x ? g[0].to(a.dtype).contiguous() : Tensor();
             args.dx_add = dL_dalias.defined() ? dL_dalias.data_ptr() : nullptr;
             Tensor dL_dy = g[tee ? 1 : 0].to(a.out_dtype).contiguous();
             StreamHandle gst = ops::stream(dL_dy);  // also makes the device current for the scratch size
             Tensor dL_dx = need_x ? Tensor::empty(sx.shape(), a.dtype, dev) : Tensor();
             Tensor dL_dx_rounded = round_dx ? Tensor::empty(sx.shape(), a.out_dtype, dev) : Tensor();
             args.dx_rounded = ptr_or_null(dL_dx_rounded);
             Tensor dL_dw = need_w ? Tensor::empty({a.dim}, a.param_dtype, dev) : Tensor();
             Tensor dL_db = need_b ? Tensor::empty({a.dim}, a.param_dtype, dev) : Tensor();
             Tensor dx_sums = sum_dx ? Tensor::empty({a.dim}, accumulation_type(a.dtype), dev) : Tensor();
             args.dx_sums = ptr_or_null(dx_sums);
             // Scratch lives until the kernels are queued; the allocator reuses it in stream order.
             const size_t bytes = need_w || need_b || sum_dx ? kernels(dev).layer_norm_workspace_size(args) : 0;
             Tensor ws = bytes ? Tensor::empty({int64_t(bytes)}, DType::u8, dev) : Tensor();
             kernels(dev).layer_norm_backward(args, ptr_or_null(dL_dx), ptr_or_null(dL_dw), ptr_or_null(dL_db),
                                              dL_dy.data_ptr(), sx.data_ptr(), mean.data_ptr(), rstd.data_ptr(),
                                              ptr_or_null(sw), ptr_or_null(ws), gst);
             if (round_dx) set_weight_copy(dL_dx, dL_dx_rounded);
             if (sum_dx) keep_column_sums(dL_dx, dx_sums, round_dx ? a.out_dtype : a.dtype);
             return TensorList{dL_dx, dL_dw, dL_db};
           });
  }
  Tensor out = a.out_dtype == want ? y : y.to(want);
  return tee ? TensorList{alias, out} : TensorList{out};
}

}  // namespace

Tensor layer_norm(const Tensor& input, const Tensor& weight, const Tensor& bias, double eps,
                  std::optional<DType> out_dtype) {
  return layer_norm_impl(input, weight, bias, eps, out_dtype, false)[0];
}

TensorList layer_norm_tee(const Tensor& input, const Tensor& weight, const Tensor& bias, double eps,
                          std::optional<DType> out_dtype) {
  return layer_norm_impl(input, weight, bias, eps, out_dtype, true);
}

}  // namespace loom
