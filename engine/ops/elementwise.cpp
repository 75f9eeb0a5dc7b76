// Elementwise ops: broadcasting binary arithmetic, comparisons, where, the unary
// functions and the scalar forms. Inputs of different dtypes are promoted first through
// the differentiable Tensor::to, so the backward closures here see one dtype. Unary
// gradients go through the fused unary_backward kernel; binary gradients are built from
// the ops themselves and summed back over broadcast dimensions.
#include "engine/ops/dispatch.h"

namespace loom {

using ops::kernels;
using ops::strided;

namespace {

const char* binary_name(BinaryOp op) {
  static const char* names[] = {"add", "sub", "mul", "div", "pow", "maximum", "minimum",
                                "eq",  "ne",  "lt",  "le",  "gt",  "ge"};
  return names[int(op)];
}

const char* unary_name(UnaryOp op) {
  static const char* names[] = {"neg",  "abs",  "exp",     "log",  "sqrt",       "rsqrt",     "tanh",       "sigmoid",
                                "relu", "gelu", "sign",    "add_scalar", "mul_scalar", "pow_scalar", "rsub_scalar",
                                "rdiv_scalar"};
  return names[int(op)];
}

// The layout of a binary op's output: that of an input of the output's whole shape (a
// channels-last activation plus a bias of shape (1, C, 1, 1) stays channels-last).
MemoryFormat output_format(const Tensor& a, const Tensor& b, const Shape& shape) {
  if (a.shape() == shape && a.memory_format() != MemoryFormat::contiguous) return a.memory_format();
  if (b.shape() == shape) return b.memory_format();
  return MemoryFormat::contiguous;
}

// Runs the binary kernel on promoted, broadcast inputs; no autograd.
Tensor binary_kernel(BinaryOp op, const Tensor& a, const Tensor& b) {
  Shape shape = broadcast_shapes(a.shape(), b.shape());
  const MemoryFormat format = output_format(a, b, shape);
  Tensor out = Tensor::empty(shape, is_comparison(op) ? DType::u8 : a.dtype(), a.device(), format);
  // Operands of one shape in one non-default layout run as one row.
  const bool flat = format != MemoryFormat::contiguous && a.shape() == b.shape() && a.is_contiguous(format) &&
                    b.is_contiguous(format);
  if (out.numel() > 0)
    kernels(a.device()).binary(op, flat ? ops::flat(out) : strided(out),
                               flat ? ops::flat(a) : ops::broadcast_strided(a, shape),
                               flat ? ops::flat(b) : ops::broadcast_strided(b, shape), ops::stream(a));
  return out;
}

std::pair<Tensor, Tensor> promoted(const Tensor& a, const Tensor& b, BinaryOp op) {
  ops::check_defined(a, binary_name(op), "a");
  ops::check_defined(b, binary_name(op), "b");
  ops::check_same_device(a, b, binary_name(op));
  DType t = ops::promote(a.dtype(), b.dtype());
  return {a.to(t), b.to(t)};
}

Tensor binary(BinaryOp op, const Tensor& a0, const Tensor& b0) {
  auto [a, b] = promoted(a0, b0, op);
  Tensor out = binary_kernel(op, a, b);
  if (is_comparison(op) || !any_requires_grad({a, b})) return out;
  Tensor sa = a.detach(), sb = b.detach(), so = out.detach();
  Shape as = a.shape(), bs = b.shape();
  BackwardFn fn;
  switch (op) {
    case BinaryOp::add:
      fn = [as, bs](const TensorList& g) { return TensorList{sum_to(g[0], as), sum_to(g[0], bs)}; };
      break;
    case BinaryOp::sub:
      fn = [as, bs](const TensorList& g) { return TensorList{sum_to(g[0], as), sum_to(neg(g[0]), bs)}; };
      break;
    case BinaryOp::mul:
      fn = [sa, sb, as, bs](const TensorList& g) {
        return TensorList{sum_to(mul(g[0], sb), as), sum_to(mul(g[0], sa), bs)};
      };
      break;
    case BinaryOp::div:
      fn = [sb, so, as, bs](const TensorList& g) {
        Tensor ga = div(g[0], sb);
        return TensorList{sum_to(ga, as), sum_to(neg(mul(ga, so)), bs)};
      };
      break;
    case BinaryOp::pow:  // d/da a^b = b a^(b-1); d/db a^b = a^b log a
      fn = [sa, sb, so, as, bs](const TensorList& g) {
        Tensor ga = mul(g[0], mul(sb, pow(sa, sub(sb, ones_like(sb)))));
        Tensor gb = mul(g[0], mul(so, log(sa)));
        return TensorList{sum_to(ga, as), sum_to(gb, bs)};
      };
      break;
    case BinaryOp::maximum:
    case BinaryOp::minimum:  // the winner takes the gradient; a tie splits it
      fn = [sa, sb, as, bs, op](const TensorList& g) {
        Tensor win = op == BinaryOp::maximum ? gt(sa, sb) : lt(sa, sb);
        Tensor share = add(win.to(g[0].dtype()), mul(eq(sa, sb).to(g[0].dtype()), 0.5));
        Tensor ga = mul(g[0], share);
        return TensorList{sum_to(ga, as), sum_to(sub(g[0], ga), bs)};
      };
      break;
    default:
      LOOM_ASSERT(false, "no gradient for ", binary_name(op));
  }
  record(binary_name(op), {a, b}, {out}, std::move(fn));
  return out;
}

bool differentiable(UnaryOp op) { return op != UnaryOp::sign; }

// Which of x and y = op(x) a unary op's gradient reads (unary_grad in the kernels): the
// backward keeps only those alive. ReLU's reads y alone, so a ReLU after a BatchNorm (or a
// residual add) lets the pre-activation go as soon as the next op has read it.
bool grad_reads_input(UnaryOp op) {
  return op == UnaryOp::abs || op == UnaryOp::log || op == UnaryOp::gelu || op == UnaryOp::pow_scalar ||
         op == UnaryOp::rdiv_scalar;
}
bool grad_reads_output(UnaryOp op) {
  return op == UnaryOp::exp || op == UnaryOp::sqrt || op == UnaryOp::rsqrt || op == UnaryOp::tanh ||
         op == UnaryOp::sigmoid || op == UnaryOp::relu;
}

Tensor unary(UnaryOp op, const Tensor& x, double param = 0) {
  ops::check_defined(x, unary_name(op), "x");
  bool integer_ok = op == UnaryOp::neg || op == UnaryOp::abs || op == UnaryOp::sign || op == UnaryOp::relu ||
                    op == UnaryOp::add_scalar || op == UnaryOp::mul_scalar || op == UnaryOp::rsub_scalar;
  if (!integer_ok) ops::check_floating(x, unary_name(op));
  const MemoryFormat format = x.memory_format();
  Tensor out = Tensor::empty(x.shape(), x.dtype(), x.device(), format);
  // A channels-last x is as dense as a contiguous one: both run as one row.
  const bool flat = format != MemoryFormat::contiguous;
  if (out.numel() > 0)
    kernels(x.device()).unary(op, flat ? ops::flat(out) : strided(out), flat ? ops::flat(x) : strided(x), param,
                              ops::stream(x));
  if (!differentiable(op) || !any_requires_grad({x})) return out;
  // What the gradient does not read is not kept; the kernel gets another operand of the same
  // shape in its place and never reads it.
  Tensor sx = grad_reads_input(op) ? x.detach() : Tensor();
  Tensor so = grad_reads_output(op) ? out.detach() : Tensor();
  record(unary_name(op), {x}, {out}, [op, sx, so, param, format](const TensorList& g) {
    // Every operand in x's layout, each then read as one row.
    Tensor go = g[0].contiguous(format);
    Tensor in = sx.defined() ? sx.contiguous(format) : go, y = so.defined() ? so.contiguous(format) : go;
    Tensor gi = Tensor::empty(go.shape(), go.dtype(), go.device(), format);
    if (gi.numel() > 0)
      kernels(go.device()).unary_backward(op, ops::flat(gi), ops::flat(go), ops::flat(in), ops::flat(y), param,
                                          ops::stream(go));
    return TensorList{gi};
  });
  return out;
}

Tensor scalar_like(const Tensor& t, double v) { return scalar_tensor(v, t.dtype(), t.device()); }

// a = a op (alpha * rhs) in place (no autograd): rhs cast to a's dtype and broadcast to a's
// shape.
void update_in_place(BinaryOp op, const char* name, const Tensor& a, const Tensor& rhs0, double alpha = 1) {
  LOOM_CHECK(!(grad_enabled() && a.requires_grad()), name,
             " on a tensor that requires a gradient: in-place updates of parameters go under NoGradGuard");
  ops::check_same_device(a, rhs0, name);
  LOOM_CHECK(broadcast_shapes(a.shape(), rhs0.shape()) == a.shape(), name, ": b of shape ", shape_str(rhs0.shape()),
             " does not broadcast to a's shape ", shape_str(a.shape()));
  a.bump_version();
  NoGradGuard no_grad;
  Tensor rhs = rhs0.dtype() == a.dtype() ? rhs0 : rhs0.to(a.dtype());
  if (alpha != 1) rhs = mul(rhs, alpha);
  if (!a.is_contiguous()) {
    copy_(a, binary(op, a, rhs));
    return;
  }
  if (a.numel() > 0)
    kernels(a.device()).binary(op, strided(a), strided(a), ops::broadcast_strided(rhs, a.shape()), ops::stream(a));
}

}  // namespace

Tensor add(const Tensor& a, const Tensor& b) { return binary(BinaryOp::add, a, b); }
Tensor sub(const Tensor& a, const Tensor& b) { return binary(BinaryOp::sub, a, b); }
Tensor mul(const Tensor& a, const Tensor& b) { return binary(BinaryOp::mul, a, b); }
Tensor div(const Tensor& a, const Tensor& b) { return binary(BinaryOp::div, a, b); }
Tensor pow(const Tensor& a, const Tensor& b) { return binary(BinaryOp::pow, a, b); }
Tensor maximum(const Tensor& a, const Tensor& b) { return binary(BinaryOp::maximum, a, b); }
Tensor minimum(const Tensor& a, const Tensor& b) { return binary(BinaryOp::minimum, a, b); }
Tensor eq(const Tensor& a, const Tensor& b) { return binary(BinaryOp::eq, a, b); }
Tensor ne(const Tensor& a, const Tensor& b) { return binary(BinaryOp::ne, a, b); }
Tensor lt(const Tensor& a, const Tensor& b) { return binary(BinaryOp::lt, a, b); }
Tensor le(const Tensor& a, const Tensor& b) { return binary(BinaryOp::le, a, b); }
Tensor gt(const Tensor& a, const Tensor& b) { return binary(BinaryOp::gt, a, b); }
Tensor ge(const Tensor& a, const Tensor& b) { return binary(BinaryOp::ge, a, b); }
Tensor gt(const Tensor& a, double b) { return gt(a, scalar_like(a, b)); }
Tensor lt(const Tensor& a, double b) { return lt(a, scalar_like(a, b)); }
Tensor eq(const Tensor& a, double b) { return eq(a, scalar_like(a, b)); }

Tensor add(const Tensor& a, double b) { return unary(UnaryOp::add_scalar, a, b); }
Tensor mul(const Tensor& a, double b) { return unary(UnaryOp::mul_scalar, a, b); }
Tensor pow(const Tensor& a, double exponent) { return unary(UnaryOp::pow_scalar, a, exponent); }
Tensor rsub(const Tensor& a, double b) { return unary(UnaryOp::rsub_scalar, a, b); }
Tensor rdiv(const Tensor& a, double b) { return unary(UnaryOp::rdiv_scalar, a, b); }

Tensor neg(const Tensor& x) { return unary(UnaryOp::neg, x); }
Tensor abs(const Tensor& x) { return unary(UnaryOp::abs, x); }
Tensor sign(const Tensor& x) { return unary(UnaryOp::sign, x); }
Tensor exp(const Tensor& x) { return unary(UnaryOp::exp, x); }
Tensor log(const Tensor& x) { return unary(UnaryOp::log, x); }
Tensor sqrt(const Tensor& x) { return unary(UnaryOp::sqrt, x); }
Tensor rsqrt(const Tensor& x) { return unary(UnaryOp::rsqrt, x); }
Tensor tanh(const Tensor& x) { return unary(UnaryOp::tanh, x); }
Tensor sigmoid(const Tensor& x) { return unary(UnaryOp::sigmoid, x); }
Tensor relu(const Tensor& x) { return unary(UnaryOp::relu, x); }
Tensor gelu(const Tensor& x) { return unary(UnaryOp::gelu, x); }

Tensor where(const Tensor& cond, const Tensor& a0, const Tensor& b0) {
  ops::check_defined(cond, "where", "cond");
  auto [a, b] = promoted(a0, b0, BinaryOp::add);
  ops::check_same_device(cond, a, "where");
  Tensor c = cond.dtype() == DType::u8 ? cond : ne(cond, zeros({}, cond.dtype(), cond.device()));
  Shape shape = broadcast_shapes(broadcast_shapes(c.shape(), a.shape()), b.shape());
  Tensor out = Tensor::empty(shape, a.dtype(), a.device());
  if (out.numel() > 0)
    kernels(a.device()).where(strided(out), ops::broadcast_strided(c, shape), ops::broadcast_strided(a, shape),
                              ops::broadcast_strided(b, shape), ops::stream(a));
  if (any_requires_grad({a, b})) {
    Tensor sc = c.detach();
    Shape as = a.shape(), bs = b.shape();
    record("where", {a, b}, {out}, [sc, as, bs](const TensorList& g) {
      Tensor zero = zeros({}, g[0].dtype(), g[0].device());
      return TensorList{sum_to(where(sc, g[0], zero), as), sum_to(where(sc, zero, g[0]), bs)};
    });
  }
  return out;
}

void add_(const Tensor& a, const Tensor& b, double alpha) { update_in_place(BinaryOp::add, "add_", a, b, alpha); }

void mul_(const Tensor& a, const Tensor& b) { update_in_place(BinaryOp::mul, "mul_", a, b); }

void mul_(const Tensor& a, double s) {
  LOOM_CHECK(!(grad_enabled() && a.requires_grad()),
             "mul_ on a tensor that requires a gradient: in-place updates of parameters go under NoGradGuard");
  a.bump_version();
  if (a.numel() == 0) return;
  if (a.is_contiguous()) {
    kernels(a.device()).unary(UnaryOp::mul_scalar, strided(a), strided(a), s, ops::stream(a));
    return;
  }
  NoGradGuard no_grad;
  copy_(a, mul(a, s));
}

}  // namespace loom
