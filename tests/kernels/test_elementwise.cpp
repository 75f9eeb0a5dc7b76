// The CPU elementwise kernels against plain expectations: each op's formula evaluated in
// double on the same (rounded) inputs, finite differences for unary_backward, and
// hand-picked values for rounding, saturation and integer edge cases. The CPU kernels are
// the reference for the CUDA ones, so these tests are what the CUDA tests lean on.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <tuple>
#include <vector>

#include "kernels/core/error.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/tanh_f32.h"

namespace loom {
namespace {

const std::vector<int64_t> kSizes = {1, 7, 1025};
const std::vector<DType> kFloatTypes = {DType::f64, DType::f32, DType::bf16, DType::f16};
const std::vector<DType> kAllTypes = {DType::f32, DType::f64, DType::bf16, DType::f16,
                                      DType::i32, DType::i64, DType::u8};

// A host buffer of any dtype, written and read as doubles.
struct Buffer {
  DType dtype;
  std::vector<unsigned char> bytes;

  Buffer(DType t, int64_t n) : dtype(t), bytes(size_t(n) * dtype_size(t)) {}
  Buffer(DType t, const std::vector<double>& values) : Buffer(t, int64_t(values.size())) {
    for (size_t i = 0; i < values.size(); ++i) set(int64_t(i), values[i]);
  }
  Buffer(DType t, std::initializer_list<double> values) : Buffer(t, std::vector<double>(values)) {}
  int64_t size() const { return int64_t(bytes.size() / dtype_size(dtype)); }
  template <class T> T& at(int64_t i) { return reinterpret_cast<T*>(bytes.data())[i]; }

  void set(int64_t i, double v) {
    switch (dtype) {
      case DType::f32: at<float>(i) = float(v); break;
      case DType::f64: at<double>(i) = v; break;
      case DType::bf16: at<bf16>(i) = bf16(float(v)); break;
      case DType::f16: at<f16>(i) = f16(float(v)); break;
      case DType::i32: at<int32_t>(i) = int32_t(v); break;
      case DType::i64: at<int64_t>(i) = int64_t(v); break;
      case DType::u8: at<uint8_t>(i) = uint8_t(v); break;
    }
  }
  double get(int64_t i) {
    switch (dtype) {
      case DType::f32: return at<float>(i);
      case DType::f64: return at<double>(i);
      case DType::bf16: return float(at<bf16>(i));
      case DType::f16: return float(at<f16>(i));
      case DType::i32: return at<int32_t>(i);
      case DType::i64: return double(at<int64_t>(i));
      case DType::u8: return at<uint8_t>(i);
    }
    return 0;
  }
  // Row-major contiguous strides unless given.
  Strided view(std::vector<int64_t> shape, std::vector<int64_t> strides = {}) {
    Strided s;
    s.data = bytes.data();
    s.dtype = dtype;
    s.ndim = int(shape.size());
    int64_t expected = 1;
    for (int d = s.ndim - 1; d >= 0; --d) {
      s.shape[d] = shape[d];
      s.strides[d] = strides.empty() ? expected : strides[d];
      expected *= shape[d];
    }
    return s;
  }
  Strided flat() { return view({size()}); }
};

// Deterministic points spread over [lo, hi], none within 0.05 of zero (the kinks of abs,
// relu and sign).
std::vector<double> sample(int64_t n, double lo, double hi) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    double x = lo + (hi - lo) * std::fmod(double(i + 1) * 0.6180339887498949, 1.0);
    if (std::fabs(x) < 0.05) x = x < 0 ? -0.05 : 0.05;
    v[size_t(i)] = x;
  }
  return v;
}

struct Tol {
  double rtol, atol;
};
Tol tol_for(DType t) {
  switch (t) {
    case DType::f64: return {1e-12, 1e-14};
    case DType::f32: return {2e-6, 1e-6};
    case DType::bf16: return {1e-2, 1e-3};
    case DType::f16: return {2e-3, 1e-4};
    default: return {0, 0};
  }
}

void expect_close(double got, double want, Tol tol, int64_t i) {
  if (std::isnan(want)) {
    EXPECT_TRUE(std::isnan(got)) << "element " << i;
  } else if (std::isinf(want)) {
    EXPECT_EQ(got, want) << "element " << i;
  } else {
    EXPECT_NEAR(got, want, tol.atol + tol.rtol * std::fabs(want)) << "element " << i;
  }
}

// ---- unary --------------------------------------------------------------------------

constexpr double kGeluK = 0.7978845608028654;

struct UnaryCase {
  UnaryOp op;
  const char* name;
  double param, lo, hi;
  double (*f)(double x, double p);
};

const UnaryCase kUnaryCases[] = {
    {UnaryOp::neg, "neg", 0, -3, 3, [](double x, double) { return -x; }},
    {UnaryOp::abs, "abs", 0, -3, 3, [](double x, double) { return std::fabs(x); }},
    {UnaryOp::exp, "exp", 0, -3, 3, [](double x, double) { return std::exp(x); }},
    {UnaryOp::log, "log", 0, 0.1, 5, [](double x, double) { return std::log(x); }},
    {UnaryOp::sqrt, "sqrt", 0, 0.1, 5, [](double x, double) { return std::sqrt(x); }},
    {UnaryOp::rsqrt, "rsqrt", 0, 0.1, 5, [](double x, double) { return 1 / std::sqrt(x); }},
    {UnaryOp::tanh, "tanh", 0, -3, 3, [](double x, double) { return std::tanh(x); }},
    {UnaryOp::sigmoid, "sigmoid", 0, -5, 5, [](double x, double) { return 1 / (1 + std::exp(-x)); }},
    {UnaryOp::relu, "relu", 0, -3, 3, [](double x, double) { return x > 0 ? x : 0; }},
    {UnaryOp::gelu, "gelu", 0, -3, 3,
     [](double x, double) { return 0.5 * x * (1 + std::tanh(kGeluK * (x + 0.044715 * x * x * x))); }},
    {UnaryOp::sign, "sign", 0, -3, 3, [](double x, double) { return double((x > 0) - (x < 0)); }},
    {UnaryOp::add_scalar, "add_scalar", 1.5, -3, 3, [](double x, double p) { return x + p; }},
    {UnaryOp::mul_scalar, "mul_scalar", -2.5, -3, 3, [](double x, double p) { return x * p; }},
    {UnaryOp::pow_scalar, "pow_scalar", 2.5, 0.1, 4, [](double x, double p) { return std::pow(x, p); }},
    {UnaryOp::pow_scalar, "pow_scalar", -1.5, 0.1, 4, [](double x, double p) { return std::pow(x, p); }},
    {UnaryOp::rsub_scalar, "rsub_scalar", 2, -3, 3, [](double x, double p) { return p - x; }},
    {UnaryOp::rdiv_scalar, "rdiv_scalar", 3, 0.1, 4, [](double x, double p) { return p / x; }},
};

// The scalar's rounding is part of the op (it is converted to the accumulation type).
double scalar_in(DType t, double p) { return t == DType::f64 ? p : double(float(p)); }

TEST(ElementwiseCpu, UnaryMatchesFormula) {
  for (const UnaryCase& c : kUnaryCases) {
    for (DType t : kFloatTypes) {
      for (int64_t n : kSizes) {
        SCOPED_TRACE(::testing::Message() << c.name << " p=" << c.param << " " << dtype_name(t) << " n=" << n);
        Buffer in(t, sample(n, c.lo, c.hi)), out(t, n);
        cpu::unary(c.op, out.flat(), in.flat(), c.param, nullptr);
        for (int64_t i = 0; i < n; ++i) {
          expect_close(out.get(i), c.f(in.get(i), scalar_in(t, c.param)), tol_for(t), i);
        }
      }
    }
  }
}

// The f32 tanh (kernels/cpu/tanh_f32.h), which the f32, bf16 and f16 tanh and GELU run on the
// CPU: within 3 ulp of the f64 tanh rounded, over every 32nd float from 1e-30 to 10 and
// their negatives; and its edges.
TEST(ElementwiseCpu, TanhF32IsWithinThreeUlp) {
  uint32_t lo = 0, hi = 0;
  const float from = 1e-30f, to = 10.f;
  std::memcpy(&lo, &from, 4);
  std::memcpy(&hi, &to, 4);
  double worst = 0;
  float worst_at = 0;
  for (uint32_t bits = lo; bits <= hi; bits += 32) {
    float x = 0;
    std::memcpy(&x, &bits, 4);
    for (float v : {x, -x}) {
      const double want = std::tanh(double(v));
      const float rounded = float(want);
      const double ulp = std::fabs(double(std::nextafter(rounded, 0.f)) - double(rounded));
      const double err = std::fabs(double(cpu::tanh_f32(v)) - want) / ulp;
      if (err > worst) worst = err, worst_at = v;
    }
  }
  EXPECT_LE(worst, 3.0) << "at x = " << worst_at;
  EXPECT_EQ(cpu::tanh_f32(0.f), 0.f);
  EXPECT_TRUE(std::signbit(cpu::tanh_f32(-0.f)));
  EXPECT_EQ(cpu::tanh_f32(1e-40f), 1e-40f);
  EXPECT_EQ(cpu::tanh_f32(9.1f), 1.f);  // tanh(9.1) = 1 - 2.5e-8 rounds to 1
  EXPECT_EQ(cpu::tanh_f32(std::numeric_limits<float>::infinity()), 1.f);
  EXPECT_EQ(cpu::tanh_f32(-std::numeric_limits<float>::infinity()), -1.f);
  EXPECT_EQ(cpu::tanh_f32(-1e30f), -1.f);
  EXPECT_TRUE(std::isnan(cpu::tanh_f32(std::numeric_limits<float>::quiet_NaN())));
}

TEST(ElementwiseCpu, UnaryBackwardMatchesCentralDifference) {
  for (const UnaryCase& c : kUnaryCases) {
    SCOPED_TRACE(::testing::Message() << c.name << " p=" << c.param);
    const int64_t n = 7;
    Buffer x(DType::f64, sample(n, c.lo, c.hi)), y(DType::f64, n), go(DType::f64, sample(n, -2, 2));
    Buffer gi(DType::f64, n);
    cpu::unary(c.op, y.flat(), x.flat(), c.param, nullptr);
    cpu::unary_backward(c.op, gi.flat(), go.flat(), x.flat(), y.flat(), c.param, nullptr);
    for (int64_t i = 0; i < n; ++i) {
      const double h = 1e-5 * std::max(1.0, std::fabs(x.get(i)));
      Buffer xs(DType::f64, {x.get(i) + h, x.get(i) - h}), ys(DType::f64, 2);
      cpu::unary(c.op, ys.flat(), xs.flat(), c.param, nullptr);
      const double numeric = go.get(i) * (ys.get(0) - ys.get(1)) / (2 * h);
      EXPECT_NEAR(gi.get(i), numeric, 1e-7 * (1 + std::fabs(numeric))) << "element " << i;
    }
  }
}

TEST(ElementwiseCpu, UnaryBackwardTakesZeroSubgradientAtKinks) {
  for (UnaryOp op : {UnaryOp::relu, UnaryOp::abs, UnaryOp::sign}) {
    Buffer x(DType::f32, {0.0}), y(DType::f32, 1), go(DType::f32, {3.0}), gi(DType::f32, 1);
    cpu::unary(op, y.flat(), x.flat(), 0, nullptr);
    cpu::unary_backward(op, gi.flat(), go.flat(), x.flat(), y.flat(), 0, nullptr);
    EXPECT_EQ(gi.get(0), 0.0) << "op " << int(op);
  }
}

TEST(ElementwiseCpu, UnaryOnIntegersWrapsAndDividesTowardZero) {
  struct Case {
    UnaryOp op;
    double param;
    std::vector<double> in, want;
  };
  const double kMin = std::numeric_limits<int32_t>::min();
  const Case cases[] = {
      {UnaryOp::neg, 0, {-7, 0, 5, kMin}, {7, 0, -5, kMin}},
      {UnaryOp::abs, 0, {-7, 0, 5, kMin}, {7, 0, 5, kMin}},
      {UnaryOp::sign, 0, {-7, 0, 5}, {-1, 0, 1}},
      {UnaryOp::add_scalar, 3, {-7, 0, 5}, {-4, 3, 8}},
      {UnaryOp::mul_scalar, -2, {-7, 0, 5}, {14, 0, -10}},
      {UnaryOp::rsub_scalar, 1, {-7, 0, 5}, {8, 1, -4}},
      {UnaryOp::rdiv_scalar, 7, {-2, 0, 2, 8}, {-3, 0, 3, 0}},
      {UnaryOp::pow_scalar, 3, {-3, 0, 2, 5}, {-27, 0, 8, 125}},
      {UnaryOp::pow_scalar, 0, {-3, 0, 2}, {1, 1, 1}},
      {UnaryOp::pow_scalar, -1, {-1, 1, 2, 0}, {-1, 1, 0, 0}},  // 1 / x^1, and x / 0 is 0
  };
  for (const Case& c : cases) {
    Buffer in(DType::i32, c.in), out(DType::i32, int64_t(c.in.size()));
    cpu::unary(c.op, out.flat(), in.flat(), c.param, nullptr);
    for (size_t i = 0; i < c.want.size(); ++i) EXPECT_EQ(out.get(int64_t(i)), c.want[i]) << "op " << int(c.op);
  }
  Buffer u(DType::u8, {0, 1, 200}), uo(DType::u8, 3);
  cpu::unary(UnaryOp::neg, uo.flat(), u.flat(), 0, nullptr);
  EXPECT_EQ(uo.get(1), 255);
  EXPECT_EQ(uo.get(2), 56);
  cpu::unary(UnaryOp::add_scalar, uo.flat(), u.flat(), -1, nullptr);  // the scalar wraps too
  EXPECT_EQ(uo.get(0), 255);
  EXPECT_EQ(uo.get(2), 199);
}

TEST(ElementwiseCpu, UnaryRejectsFloatingOnlyOpsAndFractionalScalarsOnIntegers) {
  Buffer in(DType::i64, {1, 2}), out(DType::i64, 2);
  EXPECT_THROW(cpu::unary(UnaryOp::exp, out.flat(), in.flat(), 0, nullptr), Error);
  EXPECT_THROW(cpu::unary(UnaryOp::add_scalar, out.flat(), in.flat(), 0.5, nullptr), Error);
  EXPECT_THROW(cpu::unary_backward(UnaryOp::neg, out.flat(), in.flat(), in.flat(), in.flat(), 0, nullptr), Error);
}

// ---- binary -------------------------------------------------------------------------

struct BinaryCase {
  BinaryOp op;
  const char* name;
  double alo, ahi, blo, bhi;
  double (*f)(double a, double b);
};

const BinaryCase kBinaryCases[] = {
    {BinaryOp::add, "add", -3, 3, -3, 3, [](double a, double b) { return a + b; }},
    {BinaryOp::sub, "sub", -3, 3, -3, 3, [](double a, double b) { return a - b; }},
    {BinaryOp::mul, "mul", -3, 3, -3, 3, [](double a, double b) { return a * b; }},
    {BinaryOp::div, "div", -3, 3, 0.5, 3, [](double a, double b) { return a / b; }},
    {BinaryOp::pow, "pow", 0.1, 3, -2, 2, [](double a, double b) { return std::pow(a, b); }},
    {BinaryOp::maximum, "maximum", -3, 3, -3, 3, [](double a, double b) { return std::max(a, b); }},
    {BinaryOp::minimum, "minimum", -3, 3, -3, 3, [](double a, double b) { return std::min(a, b); }},
    {BinaryOp::eq, "eq", -3, 3, -3, 3, [](double a, double b) { return double(a == b); }},
    {BinaryOp::ne, "ne", -3, 3, -3, 3, [](double a, double b) { return double(a != b); }},
    {BinaryOp::lt, "lt", -3, 3, -3, 3, [](double a, double b) { return double(a < b); }},
    {BinaryOp::le, "le", -3, 3, -3, 3, [](double a, double b) { return double(a <= b); }},
    {BinaryOp::gt, "gt", -3, 3, -3, 3, [](double a, double b) { return double(a > b); }},
    {BinaryOp::ge, "ge", -3, 3, -3, 3, [](double a, double b) { return double(a >= b); }},
};

TEST(ElementwiseCpu, BinaryMatchesFormula) {
  for (const BinaryCase& c : kBinaryCases) {
    for (DType t : kFloatTypes) {
      for (int64_t n : kSizes) {
        SCOPED_TRACE(::testing::Message() << c.name << " " << dtype_name(t) << " n=" << n);
        std::vector<double> bv = sample(n, c.blo, c.bhi), av = sample(n + 3, c.alo, c.ahi);
        av.resize(size_t(n));
        for (int64_t i = 0; i < n; i += 3) bv[size_t(i)] = av[size_t(i)];  // ties, for the comparisons
        Buffer a(t, av), b(t, bv), out(is_comparison(c.op) ? DType::u8 : t, n);
        cpu::binary(c.op, out.flat(), a.flat(), b.flat(), nullptr);
        for (int64_t i = 0; i < n; ++i) expect_close(out.get(i), c.f(a.get(i), b.get(i)), tol_for(t), i);
      }
    }
  }
}

TEST(ElementwiseCpu, BinaryOnIntegersIsExact) {
  for (DType t : {DType::i32, DType::i64, DType::u8}) {
    for (const BinaryCase& c : kBinaryCases) {
      if (c.op == BinaryOp::pow || c.op == BinaryOp::div) continue;  // tested on their own below
      SCOPED_TRACE(::testing::Message() << c.name << " " << dtype_name(t));
      std::vector<double> av = {0, 1, 2, 3, 7, 9, 10}, bv = {0, 2, 2, 1, 9, 3, 10};
      Buffer a(t, av), b(t, bv), out(is_comparison(c.op) ? DType::u8 : t, 7);
      cpu::binary(c.op, out.flat(), a.flat(), b.flat(), nullptr);
      for (int64_t i = 0; i < 7; ++i) {
        double want = c.f(av[size_t(i)], bv[size_t(i)]);
        if (t == DType::u8 && !is_comparison(c.op)) want = std::fmod(want + 256, 256);  // wraps
        EXPECT_EQ(out.get(i), want) << "element " << i;
      }
    }
  }
  Buffer big(DType::u8, {200}), out(DType::u8, 1);
  cpu::binary(BinaryOp::add, out.flat(), big.flat(), big.flat(), nullptr);
  EXPECT_EQ(out.get(0), 144);  // 400 wraps modulo 256
}

TEST(ElementwiseCpu, IntegerDivisionTruncatesTowardZeroAndGivesZeroForZeroDivisor) {
  const double kMin = std::numeric_limits<int32_t>::min();
  for (DType t : {DType::i32, DType::i64}) {
    Buffer a(t, {7, -7, 7, -7, 5, kMin, 0}), b(t, {2, 2, -2, -2, 0, -1, 3}), out(t, 7);
    cpu::binary(BinaryOp::div, out.flat(), a.flat(), b.flat(), nullptr);
    const double want[] = {3, -3, -3, 3, 0, t == DType::i32 ? kMin : -kMin, 0};
    for (int64_t i = 0; i < 7; ++i) EXPECT_EQ(out.get(i), want[i]) << dtype_name(t) << " element " << i;
  }
}

TEST(ElementwiseCpu, IntegerPowWrapsAndTakesNegativeExponentsAsReciprocals) {
  struct Case {
    DType dtype;
    std::vector<double> a, b, want;
  };
  const Case cases[] = {
      {DType::i32, {2, -3, 7, 0, 0, 1, -1, -1, 2, 10}, {10, 3, 0, 0, -1, -5, -3, -4, -1, 10},
       {1024, -27, 1, 1, 0, 1, -1, 1, 0, 1410065408}},  // 10^10 wraps modulo 2^32
      {DType::i64, {10, -2}, {10, 63}, {1e10, -9223372036854775808.0}},
      {DType::u8, {2, 3, 0}, {8, 5, 0}, {0, 243, 1}},
  };
  for (const Case& c : cases) {
    const int64_t n = int64_t(c.a.size());
    Buffer a(c.dtype, c.a), b(c.dtype, c.b), out(c.dtype, n);
    cpu::binary(BinaryOp::pow, out.flat(), a.flat(), b.flat(), nullptr);
    for (int64_t i = 0; i < n; ++i) EXPECT_EQ(out.get(i), c.want[size_t(i)]) << dtype_name(c.dtype) << " " << i;
  }
}

TEST(ElementwiseCpu, MaximumAndMinimumPropagateNaN) {
  const double nan = std::nan("");
  Buffer a(DType::f32, {nan, 1, 2}), b(DType::f32, {1, nan, 3}), out(DType::f32, 3);
  for (BinaryOp op : {BinaryOp::maximum, BinaryOp::minimum}) {
    cpu::binary(op, out.flat(), a.flat(), b.flat(), nullptr);
    EXPECT_TRUE(std::isnan(out.get(0)));
    EXPECT_TRUE(std::isnan(out.get(1)));
    EXPECT_EQ(out.get(2), op == BinaryOp::maximum ? 3 : 2);
  }
}

// A buffer of `size` elements seen as (rows, cols) through `strides`.
struct Layout {
  const char* name;
  int64_t size;
  std::vector<int64_t> strides;
};

TEST(ElementwiseCpu, BinaryReadsBroadcastAndStridedInputs) {
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{3, 5}, {300, 257}}) {
    const Layout layouts[] = {
        {"contiguous", rows * cols, {cols, 1}},  {"row broadcast", cols, {0, 1}},
        {"column broadcast", rows, {1, 0}},      {"scalar", 1, {0, 0}},
        {"transposed", rows * cols, {1, rows}},  {"every other", 2 * rows * cols, {2 * cols, 2}},
    };
    for (const Layout& la : layouts) {
      for (const Layout& lb : layouts) {
        SCOPED_TRACE(::testing::Message() << la.name << " - " << lb.name << " " << rows << "x" << cols);
        // b's samples are shifted by one so that a - b is not zero in the contiguous case.
        Buffer a(DType::f32, sample(la.size, -3, 3)), b(DType::f32, sample(lb.size + 1, -3, 3));
        Buffer out(DType::f32, rows * cols);
        cpu::binary(BinaryOp::sub, out.view({rows, cols}), a.view({rows, cols}, la.strides),
                    b.view({rows, cols}, lb.strides), nullptr);
        int64_t bad = 0;
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t c = 0; c < cols; ++c) {
            double want = double(float(a.get(r * la.strides[0] + c * la.strides[1]) -
                                       b.get(r * lb.strides[0] + c * lb.strides[1])));
            bad += out.get(r * cols + c) != want;
          }
        }
        EXPECT_EQ(bad, 0);
      }
    }
  }
}

TEST(ElementwiseCpu, WhereSelectsByBroadcastCondition) {
  const int64_t rows = 3, cols = 4;
  Buffer cond(DType::u8, {1, 0, 0, 1}), a(DType::f32, {10}), b(DType::f32, sample(rows * cols, -3, 3));
  Buffer out(DType::f32, rows * cols);
  cpu::where(out.view({rows, cols}), cond.view({rows, cols}, {0, 1}), a.view({rows, cols}, {0, 0}),
             b.view({rows, cols}, {1, rows}), nullptr);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      EXPECT_EQ(out.get(r * cols + c), cond.get(c) ? 10.0 : b.get(c * rows + r)) << r << "," << c;
    }
  }
}

// ---- fill, arange, copy -------------------------------------------------------------

TEST(ElementwiseCpu, FillWritesEveryDtypeThroughStrides) {
  for (DType t : kAllTypes) {
    for (int64_t n : kSizes) {
      Buffer out(t, std::vector<double>(size_t(2 * n), 9));
      cpu::fill(out.view({n}, {2}), 3, nullptr);
      for (int64_t i = 0; i < 2 * n; ++i) EXPECT_EQ(out.get(i), i % 2 ? 9 : 3) << dtype_name(t) << " " << i;
    }
  }
  Buffer f(DType::f16, 1), u(DType::u8, 1);
  cpu::fill(f.flat(), -2.5, nullptr);
  cpu::fill(u.flat(), 1000, nullptr);
  EXPECT_EQ(f.get(0), -2.5);
  EXPECT_EQ(u.get(0), 255);
}

TEST(ElementwiseCpu, ArangeCountsFromStartByStep) {
  for (DType t : kAllTypes) {
    for (int64_t n : kSizes) {
      const double start = t == DType::u8 ? 1 : -3, step = is_floating(t) ? 0.5 : 1;
      Buffer out(t, n), want(t, n);
      cpu::arange(out.flat(), start, step, nullptr);
      for (int64_t i = 0; i < n; ++i) {
        const double v = start + double(i) * step;
        want.set(i, t == DType::u8 ? std::min(v, 255.0) : v);  // u8 saturates like every float to integer
        EXPECT_EQ(out.get(i), want.get(i)) << dtype_name(t) << " " << i;
      }
    }
  }
}

TEST(ElementwiseCpu, CopyConvertsSmallIntegersExactlyBetweenEveryPair) {
  for (DType from : kAllTypes) {
    for (DType to : kAllTypes) {
      for (int64_t n : kSizes) {
        std::vector<double> values(static_cast<size_t>(n));
        for (int64_t i = 0; i < n; ++i) values[size_t(i)] = double((i * 37) % 101);
        Buffer in(from, values), out(to, n);
        cpu::copy(out.flat(), in.flat(), nullptr);
        for (int64_t i = 0; i < n; ++i) {
          ASSERT_EQ(out.get(i), values[size_t(i)]) << dtype_name(from) << "->" << dtype_name(to) << " " << i;
        }
      }
    }
  }
}

TEST(ElementwiseCpu, CopyRoundsToNearestEvenAndSaturatesFloatToInteger) {
  struct Case {
    DType from, to;
    double in, want;
  };
  const double nan = std::nan(""), inf = INFINITY;
  const Case cases[] = {
      {DType::f32, DType::bf16, 1 + 0x1p-8, 1},                  // a tie goes to even
      {DType::f32, DType::bf16, 1 + 3 * 0x1p-8, 1 + 0x1p-6},     // a tie goes to even
      {DType::f32, DType::bf16, 1 + 0x1p-8 + 0x1p-20, 1 + 0x1p-7},
      {DType::f64, DType::bf16, 1 + 0x1p-8 + 0x1p-40, 1 + 0x1p-7},  // not via f32 (which gives 1)
      {DType::f64, DType::f16, 1 + 0x1p-11 + 0x1p-40, 1 + 0x1p-10},
      {DType::f32, DType::f16, 0x1p-24, 0x1p-24},  // smallest subnormal survives
      {DType::f32, DType::f16, 3 * 0x1p-24, 3 * 0x1p-24},
      {DType::f32, DType::f16, 1023 * 0x1p-24, 1023 * 0x1p-24},  // largest subnormal
      {DType::f32, DType::f16, 0x1p-25, 0},                       // a tie goes to even: zero
      {DType::f32, DType::f16, 3 * 0x1p-26, 0x1p-24},
      {DType::f32, DType::f16, 65504, 65504},
      {DType::f32, DType::f16, 65520, inf},
      {DType::f32, DType::f16, nan, nan},
      {DType::f32, DType::i32, -2.7, -2},
      {DType::f32, DType::i32, 2.7, 2},
      {DType::f32, DType::i32, nan, 0},
      {DType::f32, DType::i32, 3e9, 2147483647},
      {DType::f32, DType::i32, -3e9, -2147483648.0},
      {DType::f64, DType::u8, 300, 255},
      {DType::f64, DType::u8, -5, 0},
      {DType::bf16, DType::u8, 255.5, 255},  // 255.5 is 256 in bf16, which saturates
      {DType::f16, DType::u8, 254.9, 254},
      {DType::i64, DType::u8, 257, 1},  // integer to integer wraps
      {DType::i64, DType::u8, -1, 255},
      {DType::i64, DType::i32, 4294967301.0, 5},
      {DType::i32, DType::f32, 16777217, 16777216},
      {DType::i32, DType::bf16, 257, 256},
  };
  for (const Case& c : cases) {
    Buffer in(c.from, {c.in}), out(c.to, 1);
    cpu::copy(out.flat(), in.flat(), nullptr);
    expect_close(out.get(0), c.want, {0, 0}, 0);
  }
  Buffer big(DType::f64, {1e19, -1e19}), out(DType::i64, 2);
  cpu::copy(out.flat(), big.flat(), nullptr);
  EXPECT_EQ(out.at<int64_t>(0), std::numeric_limits<int64_t>::max());
  EXPECT_EQ(out.at<int64_t>(1), std::numeric_limits<int64_t>::min());
}

TEST(ElementwiseCpu, CopyReadsAndWritesThroughStrides) {
  const int64_t rows = 3, cols = 4;
  Buffer in(DType::f32, sample(rows * cols, -3, 3));
  struct Case {
    const char* name;
    std::vector<int64_t> in_strides, out_strides;
  };
  const Case cases[] = {
      {"transposed in", {1, rows}, {cols, 1}},
      {"broadcast rows", {0, 1}, {cols, 1}},
      {"scalar in", {0, 0}, {cols, 1}},
      {"strided out", {cols, 1}, {2 * cols, 2}},
      {"transposed out", {cols, 1}, {1, rows}},
  };
  for (const Case& c : cases) {
    Buffer out(DType::f64, std::vector<double>(size_t(2 * rows * cols), -99));
    cpu::copy(out.view({rows, cols}, c.out_strides), in.view({rows, cols}, c.in_strides), nullptr);
    int64_t written = 0;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t k = 0; k < cols; ++k) {
        EXPECT_EQ(out.get(r * c.out_strides[0] + k * c.out_strides[1]),
                  in.get(r * c.in_strides[0] + k * c.in_strides[1]))
            << c.name << " " << r << "," << k;
      }
    }
    for (int64_t i = 0; i < out.size(); ++i) written += out.get(i) != -99;
    EXPECT_EQ(written, rows * cols) << c.name;
  }
}

TEST(ElementwiseCpu, CopyWalksPermutedThreeDimensionalViews) {
  // The view (A, B, C) of a contiguous (C, B, A) buffer: no two dimensions merge, and the
  // larger shape splits over threads in the middle of rows.
  for (auto [A, B, C] : {std::tuple<int64_t, int64_t, int64_t>{2, 3, 4}, {37, 41, 29}}) {
    Buffer in(DType::f32, sample(A * B * C, -3, 3)), out(DType::f32, A * B * C);
    cpu::copy(out.view({A, B, C}), in.view({A, B, C}, {1, A, A * B}), nullptr);
    int64_t bad = 0;
    for (int64_t a = 0; a < A; ++a) {
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t c = 0; c < C; ++c) bad += out.get((a * B + b) * C + c) != in.get(a + b * A + c * A * B);
      }
    }
    EXPECT_EQ(bad, 0) << A << "x" << B << "x" << C;
  }
}

}  // namespace
}  // namespace loom
