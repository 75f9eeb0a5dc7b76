// The math of the CPU elementwise kernels, one template per op over the accumulation type,
// and the conversions between dtypes. kernels/cuda/elementwise_ops.cuh mirrors it line for
// line, so the two devices' formulas can be compared side by side; the semantics both follow
// are listed at the top of kernels/cpu/elementwise.cpp.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "common.h"
#include "tanh_f32.h"
#include "../table.h"

namespace loom::cpu::elementwise {

// ---- conversions --------------------------------------------------------------------

// d rounded to f32 toward zero with the last bit set when inexact ("round to odd"): a
// second rounding to bf16/f16 then equals one direct rounding of d.
inline float round_to_odd(double d) {
  float f = float(d);
  if (double(f) == d || d != d) return f;
  if (std::fabs(double(f)) > std::fabs(d)) f = std::nextafter(f, 0.f);
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u |= 1u;
  std::memcpy(&f, &u, 4);
  return f;
}

template <class To>
To saturate(double d) {
  using L = std::numeric_limits<To>;
  if (d != d) return To(0);
  if (d <= double(L::min())) return L::min();
  if (d >= double(L::max()) + 1.0) return L::max();
  return To(d);
}

template <class To, class From>
To convert(From v) {
  using A = acc_t<From>;
  if constexpr (std::is_same_v<To, From>) {
    return v;
  } else if constexpr (std::is_integral_v<To>) {
    if constexpr (std::is_integral_v<From>) return To(v);
    else return saturate<To>(double(A(v)));
  } else if constexpr (std::is_same_v<To, double> || std::is_same_v<To, float>) {
    return To(A(v));
  } else if constexpr (std::is_same_v<From, double>) {
    return To(round_to_odd(v));
  } else {
    return To(float(A(v)));
  }
}

// ---- integer arithmetic -------------------------------------------------------------

template <class T>
T wrap_add(T a, T b) {
  using U = std::make_unsigned_t<T>;
  return T(U(a) + U(b));
}
template <class T>
T wrap_sub(T a, T b) {
  using U = std::make_unsigned_t<T>;
  return T(U(a) - U(b));
}
template <class T>
T wrap_mul(T a, T b) {
  using U = std::make_unsigned_t<T>;
  return T(U(a) * U(b));
}
template <class T>
T int_div(T a, T b) {
  if (b == 0) return T(0);
  if constexpr (std::is_signed_v<T>) {
    if (b == T(-1)) return wrap_sub(T(0), a);
  }
  return T(a / b);
}
// x^p by repeated squaring, wrapping. A negative p gives 1 / x^-p under the division
// above: 1 or -1 for x = 1 or -1, else 0 (x = 0 included, as x / 0 is 0).
template <class T>
T int_pow(T x, T p) {
  if constexpr (std::is_signed_v<T>) {
    if (p < 0) return x == 1 ? T(1) : (x == -1 ? T(p % 2 == 0 ? 1 : -1) : T(0));
  }
  T r = T(1);
  for (; p != T(0); p /= T(2)) {
    if (p % T(2) != T(0)) r = wrap_mul(r, x);
    x = wrap_mul(x, x);
  }
  return r;
}
template <class T>
bool is_nan(T v) {
  if constexpr (std::is_integral_v<T>) return false;
  else return v != v;
}

// ---- op names and compile-time dispatch ---------------------------------------------

inline const char* op_name(UnaryOp op) {
  static constexpr const char* names[] = {"neg",  "abs",     "exp",  "log",  "sqrt", "rsqrt",
                                          "tanh", "sigmoid", "relu", "gelu", "sign", "add_scalar",
                                          "mul_scalar", "pow_scalar", "rsub_scalar", "rdiv_scalar"};
  return names[int(op)];
}

// The scalar of an integer *_scalar op: it must be whole, and converts as an integer
// would (saturating to i64, then wrapping to T).
template <class T>
T integer_scalar(UnaryOp op, double param, DType dtype) {
  LOOM_CHECK(param == std::trunc(param), "unary ", op_name(op), " on ", dtype_name(dtype),
             " needs an integral scalar, got ", param);
  return T(convert<int64_t>(param));
}

constexpr bool integer_ok(UnaryOp op) {
  return op == UnaryOp::neg || op == UnaryOp::abs || op == UnaryOp::sign || op == UnaryOp::add_scalar ||
         op == UnaryOp::mul_scalar || op == UnaryOp::pow_scalar || op == UnaryOp::rsub_scalar ||
         op == UnaryOp::rdiv_scalar;
}

template <UnaryOp O> using UnaryC = std::integral_constant<UnaryOp, O>;
template <BinaryOp O> using BinaryC = std::integral_constant<BinaryOp, O>;

// Calls f(std::integral_constant<UnaryOp, op>{}) so the op is a template argument.
template <class F>
void with_op(UnaryOp op, F&& f) {
  switch (op) {
    case UnaryOp::neg: return f(UnaryC<UnaryOp::neg>{});
    case UnaryOp::abs: return f(UnaryC<UnaryOp::abs>{});
    case UnaryOp::exp: return f(UnaryC<UnaryOp::exp>{});
    case UnaryOp::log: return f(UnaryC<UnaryOp::log>{});
    case UnaryOp::sqrt: return f(UnaryC<UnaryOp::sqrt>{});
    case UnaryOp::rsqrt: return f(UnaryC<UnaryOp::rsqrt>{});
    case UnaryOp::tanh: return f(UnaryC<UnaryOp::tanh>{});
    case UnaryOp::sigmoid: return f(UnaryC<UnaryOp::sigmoid>{});
    case UnaryOp::relu: return f(UnaryC<UnaryOp::relu>{});
    case UnaryOp::gelu: return f(UnaryC<UnaryOp::gelu>{});
    case UnaryOp::sign: return f(UnaryC<UnaryOp::sign>{});
    case UnaryOp::add_scalar: return f(UnaryC<UnaryOp::add_scalar>{});
    case UnaryOp::mul_scalar: return f(UnaryC<UnaryOp::mul_scalar>{});
    case UnaryOp::pow_scalar: return f(UnaryC<UnaryOp::pow_scalar>{});
    case UnaryOp::rsub_scalar: return f(UnaryC<UnaryOp::rsub_scalar>{});
    case UnaryOp::rdiv_scalar: return f(UnaryC<UnaryOp::rdiv_scalar>{});
  }
  LOOM_ASSERT(false, "unknown unary op ", int(op));
}

template <class F>
void with_op(BinaryOp op, F&& f) {
  switch (op) {
    case BinaryOp::add: return f(BinaryC<BinaryOp::add>{});
    case BinaryOp::sub: return f(BinaryC<BinaryOp::sub>{});
    case BinaryOp::mul: return f(BinaryC<BinaryOp::mul>{});
    case BinaryOp::div: return f(BinaryC<BinaryOp::div>{});
    case BinaryOp::pow: return f(BinaryC<BinaryOp::pow>{});
    case BinaryOp::maximum: return f(BinaryC<BinaryOp::maximum>{});
    case BinaryOp::minimum: return f(BinaryC<BinaryOp::minimum>{});
    case BinaryOp::eq: return f(BinaryC<BinaryOp::eq>{});
    case BinaryOp::ne: return f(BinaryC<BinaryOp::ne>{});
    case BinaryOp::lt: return f(BinaryC<BinaryOp::lt>{});
    case BinaryOp::le: return f(BinaryC<BinaryOp::le>{});
    case BinaryOp::gt: return f(BinaryC<BinaryOp::gt>{});
    case BinaryOp::ge: return f(BinaryC<BinaryOp::ge>{});
  }
  LOOM_ASSERT(false, "unknown binary op ", int(op));
}

// ---- the math -----------------------------------------------------------------------

constexpr double kGeluK = 0.7978845608028654;  // sqrt(2 / pi)
constexpr double kGeluC = 0.044715;

// tanh in the accumulation type: kernels/cpu/tanh_f32.h in f32 (within 3 ulp, and loops over
// it vectorise), the C library's in f64.
template <class A>
A tanh_a(A x) {
  if constexpr (std::is_same_v<A, float>) return tanh_f32(x);
  else return std::tanh(x);
}

// A is float or double.
template <UnaryOp op, class A>
A unary_float(A x, A p) {
  const A one = A(1), half = A(0.5);
  if constexpr (op == UnaryOp::neg) return -x;
  else if constexpr (op == UnaryOp::abs) return std::abs(x);
  else if constexpr (op == UnaryOp::exp) return std::exp(x);
  else if constexpr (op == UnaryOp::log) return std::log(x);
  else if constexpr (op == UnaryOp::sqrt) return std::sqrt(x);
  else if constexpr (op == UnaryOp::rsqrt) return one / std::sqrt(x);
  else if constexpr (op == UnaryOp::tanh) return tanh_a(x);
  else if constexpr (op == UnaryOp::sigmoid) return one / (one + std::exp(-x));
  else if constexpr (op == UnaryOp::relu) return x < A(0) ? A(0) : x;
  else if constexpr (op == UnaryOp::gelu) return half * x * (one + tanh_a(A(kGeluK) * (x + A(kGeluC) * x * x * x)));
  else if constexpr (op == UnaryOp::sign) return x > A(0) ? one : (x < A(0) ? -one : x);
  else if constexpr (op == UnaryOp::add_scalar) return x + p;
  else if constexpr (op == UnaryOp::mul_scalar) return x * p;
  else if constexpr (op == UnaryOp::pow_scalar) return std::pow(x, p);
  else if constexpr (op == UnaryOp::rsub_scalar) return p - x;
  else return p / x;  // rdiv_scalar
}

// T is an integer type; only the ops with integer_ok(op).
template <UnaryOp op, class T>
T unary_int(T x, T p) {
  if constexpr (op == UnaryOp::neg) return wrap_sub(T(0), x);
  else if constexpr (op == UnaryOp::abs && std::is_unsigned_v<T>) return x;
  else if constexpr (op == UnaryOp::abs) return x < T(0) ? wrap_sub(T(0), x) : x;
  else if constexpr (op == UnaryOp::sign) return x > T(0) ? T(1) : (x == T(0) ? T(0) : T(-1));
  else if constexpr (op == UnaryOp::add_scalar) return wrap_add(x, p);
  else if constexpr (op == UnaryOp::mul_scalar) return wrap_mul(x, p);
  else if constexpr (op == UnaryOp::pow_scalar) return int_pow(x, p);
  else if constexpr (op == UnaryOp::rsub_scalar) return wrap_sub(p, x);
  else return int_div(p, x);  // rdiv_scalar
}

// d(op)/dx times go, from the input x and the output y.
template <UnaryOp op, class A>
A unary_grad(A go, A x, A y, A p) {
  const A zero = A(0), one = A(1), half = A(0.5);
  if constexpr (op == UnaryOp::neg || op == UnaryOp::rsub_scalar) return -go;
  else if constexpr (op == UnaryOp::abs) return x > zero ? go : (x < zero ? -go : zero);
  else if constexpr (op == UnaryOp::exp) return go * y;
  else if constexpr (op == UnaryOp::log) return go / x;
  else if constexpr (op == UnaryOp::sqrt) return go * half / y;
  else if constexpr (op == UnaryOp::rsqrt) return -half * go * y * y * y;
  else if constexpr (op == UnaryOp::tanh) return go * (one - y * y);
  else if constexpr (op == UnaryOp::sigmoid) return go * y * (one - y);
  else if constexpr (op == UnaryOp::relu) return y > zero ? go : zero;  // y > 0 exactly when x > 0
  else if constexpr (op == UnaryOp::gelu) {
    const A k = A(kGeluK), c = A(kGeluC);
    const A t = tanh_a(k * (x + c * x * x * x));
    return go * (half * (one + t) + half * x * (one - t * t) * k * (one + A(3) * c * x * x));
  } else if constexpr (op == UnaryOp::sign) return zero;
  else if constexpr (op == UnaryOp::add_scalar) return go;
  else if constexpr (op == UnaryOp::mul_scalar) return go * p;
  else if constexpr (op == UnaryOp::pow_scalar) return p == zero ? zero : go * p * std::pow(x, p - one);
  else return -go * p / (x * x);  // rdiv_scalar
}

// T is the accumulation type (or an integer type); comparisons return u8.
template <BinaryOp op, class T>
auto binary_math(T a, T b) {
  if constexpr (std::is_integral_v<T> && op == BinaryOp::add) return wrap_add(a, b);
  else if constexpr (std::is_integral_v<T> && op == BinaryOp::sub) return wrap_sub(a, b);
  else if constexpr (std::is_integral_v<T> && op == BinaryOp::mul) return wrap_mul(a, b);
  else if constexpr (std::is_integral_v<T> && op == BinaryOp::div) return int_div(a, b);
  else if constexpr (std::is_integral_v<T> && op == BinaryOp::pow) return int_pow(a, b);
  else if constexpr (op == BinaryOp::add) return T(a + b);
  else if constexpr (op == BinaryOp::sub) return T(a - b);
  else if constexpr (op == BinaryOp::mul) return T(a * b);
  else if constexpr (op == BinaryOp::div) return T(a / b);
  else if constexpr (op == BinaryOp::pow) return std::pow(a, b);
  else if constexpr (op == BinaryOp::maximum) return is_nan(a) || a > b ? a : b;
  else if constexpr (op == BinaryOp::minimum) return is_nan(a) || a < b ? a : b;
  else if constexpr (op == BinaryOp::eq) return uint8_t(a == b);
  else if constexpr (op == BinaryOp::ne) return uint8_t(a != b);
  else if constexpr (op == BinaryOp::lt) return uint8_t(a < b);
  else if constexpr (op == BinaryOp::le) return uint8_t(a <= b);
  else if constexpr (op == BinaryOp::gt) return uint8_t(a > b);
  else return uint8_t(a >= b);
}

}  // namespace loom::cpu::elementwise
