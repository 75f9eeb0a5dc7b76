// Linear layers as single ops, so their products carry the work around them in cuBLASLt
// epilogues instead of passes of their own:
//   linear    y = x W^T + b: the bias added in the forward product's epilogue, and its
//             gradient (the column sums of dy) computed by the weight gradient's product,
//             or taken from the op that computed dy when it summed dy as it wrote it
//             (a LayerNorm's backward: sums_or_product below).
//   gelu_mlp  y = gelu(x W1^T + b1) W2^T + b2, a transformer's MLP: the first product
//             applies the bias and GELU and keeps the pre-activation z; in backward the
//             product dH = dy W2 multiplies by gelu'(z) and sums b1's gradient as it stores.
// Both fold the leading dims of x into the rows of one GEMM. The CPU runs the same
// contract (kernels/cpu/matmul.cpp), so the float64 finite-difference checks cover it.
#include "engine/autocast.h"
#include "engine/ops/product.h"
#include "engine/options.h"

namespace loom {

using ops::f32_params;
using ops::param;
using ops::Param;
using ops::ptr_or_null;

namespace {

// The sums of a product's rows or columns are written in its C's dtype (`dtype`); an
// undefined tensor when the bias is absent.
Tensor bias_grad(bool has_bias, int64_t n, DType dtype, Device device) {
  return has_bias ? Tensor::empty({n}, dtype, device) : Tensor();
}

void check_weight(const Tensor& x, const Tensor& w, const Tensor& b, int64_t in, const char* op, const char* name) {
  ops::check_defined(w, op, name);
  ops::check_same_device(x, w, op);
  LOOM_CHECK(w.dim() == 2 && w.size(1) == in, op, ": ", name, " of shape ", shape_str(w.shape()),
             " does not match its input's last dim ", in, " (expected (out, ", in, "))");
  if (b.defined()) {
    ops::check_same_device(x, b, op);
    LOOM_CHECK(b.dim() == 1 && b.size(0) == w.size(0), op, ": bias of shape ", shape_str(b.shape()), " does not match ",
               name, " of shape ", shape_str(w.shape()), " (expected (", w.size(0), ",))");
  }
}

// The compute dtype of an op over these tensors (undefined ones skipped), under autocast.
DType compute_dtype(std::initializer_list<Tensor> ts, const char* op) {
  DType t = ts.begin()->dtype();  // the input, always defined
  for (const Tensor& x : ts)
    if (x.defined()) t = ops::promote(t, x.dtype());
  LOOM_CHECK(is_floating(t), op, " needs floating-point tensors, got ", dtype_name(t));
  return autocast_compute_dtype(t);
}

// How a product's output joins a residual: fused into the product (C = residual + x W^T + b)
// when the residual has the output's shape and the compute dtype, or is f32 beside a 16-bit
// product (then the output, bias and residual are f32: GemmArgs::c_f32). Otherwise the
// caller adds it.
struct Output {
  bool fused = false;
  DType dtype;      // of the output and the bias: the compute dtype, or the residual's when fused
  Tensor residual;  // (rows, n) contiguous, when fused
};

Output plan_output(const Tensor& residual, DType t, const Shape& out_shape) {
  Output o{false, t, Tensor()};
  if (!residual.defined()) return o;
  const bool sixteen = t == DType::bf16 || t == DType::f16;
  if (residual.shape() != out_shape || !(residual.dtype() == t || (residual.dtype() == DType::f32 && sixteen)))
    return o;
  o.fused = true;
  o.dtype = residual.dtype();
  o.residual = residual.reshape({-1, out_shape.back()}).contiguous();
  return o;
}

// The product's extras for its output: bias, and the residual as the beta term.
void set_output(GemmArgs& g, const Output& o, const Tensor& bias) {
  g.bias = ptr_or_null(bias);
  if (o.fused) g.c_in = o.residual.data_ptr(), g.beta = 1.f;
}

// The bias gradient, in the bias's dtype: row sums of dy^T in the product for dW when the
// bias shares the compute dtype, else summed in it and cast (a 16-bit product with an f32
// output keeps its bias in f32).
Tensor cast_bias_grad(const Tensor& db, DType bias_dtype) { return db.defined() ? db.to(bias_dtype) : db; }

// The output's gradient as the (rows, n) buffer the products read.
Tensor rows_of(const Tensor& g) { return g.reshape({-1, g.size(-1)}); }

// The weight's gradient dW = dy^T x (rows of dy and x), and the bias's (db, in `db_dtype`, when
// has_bias): the sums kept on the output gradient g by the op that computed it, read in
// the compute dtype t, when it kept them (set_gradient_sums_read), else the row sums of dy^T
// in the product.
void sums_or_product(const Tensor& g, const Tensor& dy, const Tensor& x, bool has_bias, DType t, DType db_dtype,
                     bool f32, Tensor& dw, Tensor& db) {
  const Tensor kept = has_bias ? take_column_sums(g, t) : Tensor();
  db = kept.defined() ? kept.to(db_dtype) : bias_grad(has_bias, dy.size(1), db_dtype, dy.device());
  dw = ops::product_2d(dy.t(), x, [&](GemmArgs& a) { if (!kept.defined()) a.row_sums_a = ptr_or_null(db); }, f32);
}

// The output's gradient in the compute dtype t, as rows: the f32 gradient of a fused f32
// output is cast, or its rounding taken where the op that computed it kept one.
Tensor read_gradient(const Tensor& g, DType t) { return rows_of(cast_or_kept(g, t)); }

// A fused f32 output beside a 16-bit product: its gradient is read in the product's dtype,
// so the op computing it may keep that rounding (set_gradient_read_dtype). With a bias, the
// gradient's column sums are read too, which that op may also keep (set_gradient_sums_read).
void declare_gradient_reads(const Tensor& y, const Output& o, DType t, bool has_bias) {
  if (o.fused && o.dtype != t && options().autocast_gradient_copies) set_gradient_read_dtype(y, t);
  if (has_bias && options().fused_bias_sums) set_gradient_sums_read(y, t);
}

}  // namespace

Tensor linear(const Tensor& x0, const Tensor& w0, const Tensor& b0, const Tensor& residual0) {
  ops::check_defined(x0, "linear", "input");
  LOOM_CHECK(x0.dim() >= 1, "linear: the input must have at least one dim, got a scalar");
  const int64_t in = x0.size(-1);
  check_weight(x0, w0, b0, in, "linear", "weight");
  if (residual0.defined()) ops::check_same_device(x0, residual0, "linear");
  const int64_t out_features = w0.size(0);
  if (x0.numel() == 0 || in == 0) {
    Tensor y = matmul(x0, w0.t());
    if (b0.defined()) y = add(y, b0.to(y.dtype()));
    return residual0.defined() ? add(residual0, y) : y;
  }
  const DType t = compute_dtype({x0, w0, b0}, "linear");
  Shape out_shape(x0.shape().begin(), x0.shape().end() - 1);
  out_shape.push_back(out_features);
  const Output o = plan_output(residual0, t, out_shape);
  if (residual0.defined() && !o.fused) return add(residual0, linear(x0, w0, b0));
  const bool f32 = f32_params(t, {w0, b0});
  Tensor x = x0.to(t).reshape({-1, in});
  const Param w = param(w0, t, f32), b = param(b0, o.dtype, f32);
  const Tensor bias = b.used.defined() ? b.used.contiguous() : Tensor();
  Tensor y;
  {
    NoGradGuard no_grad;
    y = ops::product_2d(x, w.used.t(), [&](GemmArgs& g) { set_output(g, o, bias); }, o.dtype != t);
    y = y.reshape(out_shape);
  }
  if (any_requires_grad({x, w.input, b.input, o.residual})) {
    Tensor sx = x.detach(), sw = w.used.detach();
    const bool has_bias = b.input.defined(), need_x = x.requires_grad(), fused = o.fused;
    const DType out_dtype = o.dtype;
    record("linear", {x, w.input, b.input, o.residual}, {y},
           [sx, sw, has_bias, need_x, fused, out_dtype, t, f32](const TensorList& g) {
             const Tensor dy = read_gradient(g[0], t);
             Tensor db, dw;
             // A split pass may ask for x's gradient and the parameters' apart (gradient_wanted).
             // The bias's sums ride in the weight's product: both are computed, or neither.
             if (gradient_wanted(1) || (has_bias && gradient_wanted(2)))
               sums_or_product(g[0], dy, sx, has_bias, t, f32 ? DType::f32 : t, f32, dw, db);
             Tensor dx = need_x && gradient_wanted(0) ? ops::product_2d(dy, sw) : Tensor();
             return TensorList{dx, dw, f32 ? db : cast_bias_grad(db, out_dtype), fused ? rows_of(g[0]) : Tensor()};
           });
    declare_gradient_reads(y, o, t, b.input.defined());
  }
  return y;
}

Tensor gelu_mlp(const Tensor& x0, const Tensor& w1_0, const Tensor& b1_0, const Tensor& w2_0, const Tensor& b2_0,
                const Tensor& residual0) {
  ops::check_defined(x0, "gelu_mlp", "input");
  LOOM_CHECK(x0.dim() >= 1, "gelu_mlp: the input must have at least one dim, got a scalar");
  const int64_t in = x0.size(-1);
  check_weight(x0, w1_0, b1_0, in, "gelu_mlp", "w1");
  const int64_t hidden = w1_0.size(0);
  check_weight(x0, w2_0, b2_0, hidden, "gelu_mlp", "w2");
  if (residual0.defined()) ops::check_same_device(x0, residual0, "gelu_mlp");
  const int64_t out_features = w2_0.size(0);
  if (x0.numel() == 0 || in == 0 || hidden == 0) {  // nothing for the fused path to do
    Tensor h = gelu(linear(x0, w1_0, b1_0));
    return linear(h, w2_0, b2_0, residual0);
  }
  const DType t = compute_dtype({x0, w1_0, b1_0, w2_0, b2_0}, "gelu_mlp");
  Shape out_shape(x0.shape().begin(), x0.shape().end() - 1);
  out_shape.push_back(out_features);
  const Output o = plan_output(residual0, t, out_shape);
  if (residual0.defined() && !o.fused) return add(residual0, gelu_mlp(x0, w1_0, b1_0, w2_0, b2_0));
  const bool f32 = f32_params(t, {w1_0, b1_0, w2_0, b2_0});
  Tensor x = x0.to(t).reshape({-1, in});
  const Param w1 = param(w1_0, t, f32), w2 = param(w2_0, t, f32);
  const Param b1 = param(b1_0, t, f32), b2 = param(b2_0, o.dtype, f32);
  const Tensor bias1 = b1.used.defined() ? b1.used.contiguous() : Tensor();
  const Tensor bias2 = b2.used.defined() ? b2.used.contiguous() : Tensor();
  const int64_t rows = x.size(0);
  Tensor z = Tensor::empty({rows, hidden}, t, x.device()), h, y;
  {
    NoGradGuard no_grad;
    h = ops::product_2d(x, w1.used.t(), [&](GemmArgs& g) {
      g.bias = ptr_or_null(bias1);
      g.epilogue = GemmEpilogue::gelu;
      g.aux = z.data_ptr(), g.ld_aux = hidden;
    });
    y = ops::product_2d(h, w2.used.t(), [&](GemmArgs& g) { set_output(g, o, bias2); }, o.dtype != t);
    y = y.reshape(out_shape);
  }
  if (any_requires_grad({x, w1.input, b1.input, w2.input, b2.input, o.residual})) {
    Tensor sx = x.detach(), sw1 = w1.used.detach(), sw2 = w2.used.detach();
    const bool has_b1 = b1.input.defined(), has_b2 = b2.input.defined(), need_x = x.requires_grad(), fused = o.fused;
    const DType out_dtype = o.dtype;
    // A split pass's input half computes dz (with b1's sums) for x and keeps it here for the
    // weight half, which would otherwise compute that product again: the weight half gets
    // the same dz, and holds it (hidden wide) instead of nothing until it runs.
    struct Kept {
      Tensor dy;  // the output gradient dz was computed from (held, so that it stays itself)
      Tensor dz, db1;
    };
    auto kept = std::make_shared<Kept>();
    record("gelu_mlp", {x, w1.input, b1.input, w2.input, b2.input, o.residual}, {y},
           [sx, sw1, sw2, z, h, has_b1, has_b2, need_x, fused, out_dtype, t, hidden, f32,
            kept](const TensorList& g) {
             const Tensor dy = read_gradient(g[0], t);
             // What a split pass asks for (gradient_wanted): each bias's sums ride in a product
             // the weight beside it needs, so both are computed, or neither. dz, which both x and
             // w1 need, is computed once: when they are asked for apart, x's half keeps it for
             // w1's (`kept`, matched by the output gradient both are called with).
             const bool want_x = need_x && gradient_wanted(0);
             const bool want_first = gradient_wanted(1) || (has_b1 && gradient_wanted(2));
             const bool want_second = gradient_wanted(3) || (has_b2 && gradient_wanted(4));
             Tensor db2, dw2;
             if (want_second) sums_or_product(g[0], dy, h, has_b2, t, f32 ? DType::f32 : t, f32, dw2, db2);
             const Tensor db2_out = f32 ? db2 : cast_bias_grad(db2, out_dtype);
             const Tensor dresidual = fused ? rows_of(g[0]) : Tensor();
             if (!want_x && !want_first) return TensorList{Tensor(), Tensor(), Tensor(), dw2, db2_out, dresidual};
             // b1's sums ride in the dgelu product, in its (16-bit) dtype: f32 params get a cast
             // of those (hidden) values.
             Tensor db1, dz;
             if (kept->dz.defined() && kept->dy.impl() == g[0].impl()) {
               dz = kept->dz, db1 = kept->db1;
             } else {
               db1 = bias_grad(has_b1, hidden, t, dy.device());
               dz = ops::product_2d(dy, sw2, [&](GemmArgs& a) {
                 a.epilogue = GemmEpilogue::dgelu;
                 a.aux = z.data_ptr(), a.ld_aux = hidden;
                 a.column_sums = ptr_or_null(db1);
               });
             }
             *kept = {};
             if (want_x && !want_first) *kept = {g[0], dz, db1};  // the weight half comes later
             Tensor dw1 = want_first ? ops::product_2d(dz.t(), sx, {}, f32) : Tensor();
             Tensor dx = want_x ? ops::product_2d(dz, sw1) : Tensor();
             return TensorList{dx, dw1, f32 ? cast_bias_grad(db1, DType::f32) : db1, dw2, db2_out, dresidual};
           });
    declare_gradient_reads(y, o, t, b2.input.defined());
  }
  return y;
}

}  // namespace loom
