// Every CUDA elementwise entry against the CPU entry on the same bytes: random inputs,
// odd sizes, strided, broadcast and misaligned views, every dtype. Floating outputs match
// within a tolerance by dtype (the two devices' libm differ by a few ulps, and a 16-bit
// result may round the other way); integer outputs and conversions match exactly.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/core/error.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cuda/kernels.h"
#include "tests/common/device_buffer.h"
#include "tests/common/gpu.h"

namespace loom {
namespace {

using Bytes = std::vector<unsigned char>;

const std::vector<int64_t> kSizes = {1, 7, 1025, (1 << 20) + 3};
const std::vector<DType> kFloatTypes = {DType::f32, DType::f64, DType::bf16, DType::f16};
const std::vector<DType> kAllTypes = {DType::f32, DType::f64, DType::bf16, DType::f16,
                                      DType::i32, DType::i64, DType::u8};

double get(DType t, const Bytes& b, int64_t i) {
  const unsigned char* p = b.data() + size_t(i) * dtype_size(t);
  auto load = [p](auto v) { std::memcpy(&v, p, sizeof(v)); return v; };
  switch (t) {
    case DType::f32: return load(float{});
    case DType::f64: return load(double{});
    case DType::bf16: return float(load(bf16{}));
    case DType::f16: return float(load(f16{}));
    case DType::i32: return load(int32_t{});
    case DType::i64: return double(load(int64_t{}));
    case DType::u8: return load(uint8_t{});
  }
  return 0;
}

void set(DType t, Bytes& b, int64_t i, double v) {
  unsigned char* p = b.data() + size_t(i) * dtype_size(t);
  auto store = [p](auto x) { std::memcpy(p, &x, sizeof(x)); };
  switch (t) {
    case DType::f32: return store(float(v));
    case DType::f64: return store(v);
    case DType::bf16: return store(bf16(float(v)));
    case DType::f16: return store(f16(float(v)));
    case DType::i32: return store(int32_t(v));
    case DType::i64: return store(int64_t(v));
    case DType::u8: return store(uint8_t(v));
  }
}

// n values uniform in [lo, hi]; integers are whole numbers clipped to the dtype.
Bytes random_bytes(DType t, int64_t n, double lo, double hi, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Bytes b(size_t(n) * dtype_size(t));
  if (t == DType::u8) lo = std::max(lo, 0.0), hi = std::min(hi, 255.0);
  std::uniform_real_distribution<double> real(lo, hi);
  std::uniform_int_distribution<int64_t> integer(int64_t(std::ceil(lo)), int64_t(std::floor(hi)));
  for (int64_t i = 0; i < n; ++i) set(t, b, i, is_floating(t) ? real(rng) : double(integer(rng)));
  return b;
}

Strided view(void* data, DType t, std::vector<int64_t> shape, std::vector<int64_t> strides) {
  Strided s;
  s.data = data;
  s.dtype = t;
  s.ndim = int(shape.size());
  int64_t expected = 1;
  for (int d = s.ndim - 1; d >= 0; --d) {
    s.shape[d] = shape[d];
    s.strides[d] = strides.empty() ? expected : strides[d];
    expected *= shape[d];
  }
  return s;
}

// One operand on both devices, from the same bytes: `host` feeds the CPU kernel, `device`
// the CUDA one. An output starts as the same filler on both, so untouched holes compare too.
struct Twin {
  DType dtype;
  Bytes host;
  test::DeviceBuffer<unsigned char> device;

  Twin(DType t, Bytes bytes) : dtype(t), host(std::move(bytes)), device(host) {}
  Twin(DType t, int64_t n) : Twin(t, Bytes(size_t(n) * dtype_size(t), 0x5a)) {}

  // Views of shape (contiguous unless strides are given), starting `offset` elements in.
  Strided cpu(std::vector<int64_t> shape, std::vector<int64_t> strides = {}, int64_t offset = 0) {
    return view(host.data() + offset * dtype_size(dtype), dtype, std::move(shape), std::move(strides));
  }
  Strided gpu(std::vector<int64_t> shape, std::vector<int64_t> strides = {}, int64_t offset = 0) {
    return view(device.get() + offset * dtype_size(dtype), dtype, std::move(shape), std::move(strides));
  }
};

struct Tol {
  double rtol, atol;
};
Tol tol_for(DType t) {
  switch (t) {
    case DType::f64: return {1e-12, 1e-13};
    case DType::f32: return {4e-6, 1e-6};
    case DType::bf16: return {1e-2, 1e-3};
    case DType::f16: return {2e-3, 1e-4};
    default: return {0, 0};
  }
}
const Tol kExact = {0, 0};

// The CUDA output (read back from the device) against the CPU output, element by element.
void expect_match(Twin& out, Tol tol, const std::string& what) {
  const Bytes got = out.device.to_host();
  const size_t size = dtype_size(out.dtype);
  const int64_t n = int64_t(got.size() / size);
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    bool ok;
    const double g = get(out.dtype, got, i), w = get(out.dtype, out.host, i);
    if (!is_floating(out.dtype)) {
      ok = std::memcmp(got.data() + i * size, out.host.data() + i * size, size) == 0;
    } else if (std::isnan(w) || std::isinf(w)) {
      ok = std::isnan(w) ? std::isnan(g) : g == w;
    } else {
      ok = std::fabs(g - w) <= tol.atol + tol.rtol * std::fabs(w);
    }
    if (!ok && bad++ < 5) ADD_FAILURE() << what << ": element " << i << " is " << g << " on CUDA, " << w << " on CPU";
  }
  EXPECT_EQ(bad, 0) << what;
}

std::string describe(const char* op, DType t, int64_t n) {
  return std::string(op) + " " + std::string(dtype_name(t)) + " n=" + std::to_string(n);
}

// A buffer of `size` elements seen as (rows, cols) through `strides`.
struct Layout {
  const char* name;
  int64_t size;
  std::vector<int64_t> strides;
};
std::vector<Layout> layouts(int64_t rows, int64_t cols) {
  return {{"contiguous", rows * cols, {cols, 1}}, {"transposed", rows * cols, {1, rows}},
          {"row broadcast", cols, {0, 1}},        {"column broadcast", rows, {1, 0}},
          {"scalar", 1, {0, 0}},                  {"every other", 2 * rows * cols, {2 * cols, 2}}};
}
const std::vector<std::pair<int64_t, int64_t>> kShapes = {{5, 3}, {1023, 1025}};

// ---- unary --------------------------------------------------------------------------

struct UnaryCase {
  UnaryOp op;
  const char* name;
  double param, lo, hi;
};
const UnaryCase kUnaryCases[] = {
    {UnaryOp::neg, "neg", 0, -3, 3},          {UnaryOp::abs, "abs", 0, -3, 3},
    {UnaryOp::exp, "exp", 0, -3, 3},          {UnaryOp::log, "log", 0, 0.1, 5},
    {UnaryOp::sqrt, "sqrt", 0, 0.1, 5},       {UnaryOp::rsqrt, "rsqrt", 0, 0.1, 5},
    {UnaryOp::tanh, "tanh", 0, -3, 3},        {UnaryOp::sigmoid, "sigmoid", 0, -5, 5},
    {UnaryOp::relu, "relu", 0, -3, 3},        {UnaryOp::gelu, "gelu", 0, -3, 3},
    {UnaryOp::sign, "sign", 0, -3, 3},        {UnaryOp::add_scalar, "add_scalar", 1.5, -3, 3},
    {UnaryOp::mul_scalar, "mul_scalar", -2.5, -3, 3}, {UnaryOp::pow_scalar, "pow_scalar", 2.5, 0.1, 4},
    {UnaryOp::pow_scalar, "pow_scalar", -1.5, 0.1, 4}, {UnaryOp::rsub_scalar, "rsub_scalar", 2, -3, 3},
    {UnaryOp::rdiv_scalar, "rdiv_scalar", 3, 0.1, 4},
};

bool integer_ok(UnaryOp op) {
  return op == UnaryOp::neg || op == UnaryOp::abs || op == UnaryOp::sign || op == UnaryOp::add_scalar ||
         op == UnaryOp::mul_scalar || op == UnaryOp::rsub_scalar || op == UnaryOp::rdiv_scalar;
}

TEST(ElementwiseCuda, UnaryMatchesCpu) {
  LOOM_REQUIRE_CUDA();
  uint64_t seed = 1;
  for (const UnaryCase& c : kUnaryCases) {
    for (DType t : kAllTypes) {
      if (!is_floating(t) && !integer_ok(c.op)) continue;
      // Integers cover zero divisors and wrap-around; their scalars are whole.
      const double lo = is_floating(t) ? c.lo : -60, hi = is_floating(t) ? c.hi : 60;
      const double param = is_floating(t) ? c.param : std::trunc(c.param);
      for (int64_t n : kSizes) {
        Twin in(t, random_bytes(t, n, lo, hi, seed++)), out(t, n);
        cpu::unary(c.op, out.cpu({n}), in.cpu({n}), param, nullptr);
        cuda::unary(c.op, out.gpu({n}), in.gpu({n}), param, nullptr);
        expect_match(out, tol_for(t), describe(c.name, t, n));
      }
    }
  }
}

TEST(ElementwiseCuda, UnaryReadsStridedAndBroadcastInputs) {
  LOOM_REQUIRE_CUDA();
  for (auto [rows, cols] : kShapes) {
    for (const Layout& l : layouts(rows, cols)) {
      for (auto [op, t] : {std::pair{UnaryOp::gelu, DType::f32}, {UnaryOp::exp, DType::bf16},
                           {UnaryOp::sqrt, DType::f16}, {UnaryOp::tanh, DType::f64}, {UnaryOp::abs, DType::i32}}) {
        Twin in(t, random_bytes(t, l.size, 0.1, 3, 7)), out(t, rows * cols);
        cpu::unary(op, out.cpu({rows, cols}), in.cpu({rows, cols}, l.strides), 0, nullptr);
        cuda::unary(op, out.gpu({rows, cols}), in.gpu({rows, cols}, l.strides), 0, nullptr);
        expect_match(out, tol_for(t), describe(l.name, t, rows * cols));
      }
    }
  }
}

TEST(ElementwiseCuda, UnaryBackwardMatchesCpu) {
  LOOM_REQUIRE_CUDA();
  uint64_t seed = 100;
  for (const UnaryCase& c : kUnaryCases) {
    for (DType t : kFloatTypes) {
      for (int64_t n : kSizes) {
        // The forward output comes from the CPU, so both backwards read the same bytes.
        Twin x(t, random_bytes(t, n, c.lo, c.hi, seed++)), go(t, random_bytes(t, n, -2, 2, seed++));
        Bytes y_bytes(x.host.size());
        cpu::unary(c.op, view(y_bytes.data(), t, {n}, {}), x.cpu({n}), c.param, nullptr);
        Twin y(t, std::move(y_bytes)), gi(t, n);
        cpu::unary_backward(c.op, gi.cpu({n}), go.cpu({n}), x.cpu({n}), y.cpu({n}), c.param, nullptr);
        cuda::unary_backward(c.op, gi.gpu({n}), go.gpu({n}), x.gpu({n}), y.gpu({n}), c.param, nullptr);
        expect_match(gi, tol_for(t), describe(c.name, t, n));
      }
    }
  }
}

// ---- binary and where ---------------------------------------------------------------

struct BinaryCase {
  BinaryOp op;
  const char* name;
  double alo, ahi, blo, bhi;
};
const BinaryCase kBinaryCases[] = {
    {BinaryOp::add, "add", -3, 3, -3, 3},         {BinaryOp::sub, "sub", -3, 3, -3, 3},
    {BinaryOp::mul, "mul", -3, 3, -3, 3},         {BinaryOp::div, "div", -3, 3, 0.5, 3},
    {BinaryOp::pow, "pow", 0.1, 3, -2, 2},        {BinaryOp::maximum, "maximum", -3, 3, -3, 3},
    {BinaryOp::minimum, "minimum", -3, 3, -3, 3}, {BinaryOp::eq, "eq", -3, 3, -3, 3},
    {BinaryOp::ne, "ne", -3, 3, -3, 3},           {BinaryOp::lt, "lt", -3, 3, -3, 3},
    {BinaryOp::le, "le", -3, 3, -3, 3},           {BinaryOp::gt, "gt", -3, 3, -3, 3},
    {BinaryOp::ge, "ge", -3, 3, -3, 3},
};

TEST(ElementwiseCuda, BinaryMatchesCpu) {
  LOOM_REQUIRE_CUDA();
  uint64_t seed = 200;
  for (const BinaryCase& c : kBinaryCases) {
    for (DType t : kAllTypes) {
      // Integers: large enough to wrap in u8, with zero divisors and negative exponents.
      const bool fl = is_floating(t);
      const DType out_type = is_comparison(c.op) ? DType::u8 : t;
      for (int64_t n : kSizes) {
        Bytes a = random_bytes(t, n, fl ? c.alo : -200, fl ? c.ahi : 200, seed++);
        Bytes b = random_bytes(t, n, fl ? c.blo : -20, fl ? c.bhi : 20, seed++);
        const size_t size = dtype_size(t);
        for (int64_t i = 0; i < n; i += 3) std::memcpy(&b[i * size], &a[i * size], size);  // ties
        Twin ta(t, std::move(a)), tb(t, std::move(b)), out(out_type, n);
        cpu::binary(c.op, out.cpu({n}), ta.cpu({n}), tb.cpu({n}), nullptr);
        cuda::binary(c.op, out.gpu({n}), ta.gpu({n}), tb.gpu({n}), nullptr);
        expect_match(out, tol_for(out_type), describe(c.name, t, n));
      }
    }
  }
}

TEST(ElementwiseCuda, BinaryReadsStridedAndBroadcastInputs) {
  LOOM_REQUIRE_CUDA();
  for (auto [rows, cols] : kShapes) {
    for (const Layout& la : layouts(rows, cols)) {
      for (const Layout& lb : layouts(rows, cols)) {
        for (auto [op, t] : {std::pair{BinaryOp::sub, DType::f32}, {BinaryOp::mul, DType::bf16},
                             {BinaryOp::lt, DType::i64}}) {
          Twin a(t, random_bytes(t, la.size, -3, 3, 1)), b(t, random_bytes(t, lb.size, -3, 3, 2));
          Twin out(is_comparison(op) ? DType::u8 : t, rows * cols);
          cpu::binary(op, out.cpu({rows, cols}), a.cpu({rows, cols}, la.strides), b.cpu({rows, cols}, lb.strides),
                      nullptr);
          cuda::binary(op, out.gpu({rows, cols}), a.gpu({rows, cols}, la.strides), b.gpu({rows, cols}, lb.strides),
                       nullptr);
          expect_match(out, tol_for(out.dtype), std::string(la.name) + " op " + lb.name + " " +
                                                    std::string(dtype_name(t)) + " " + std::to_string(rows));
        }
      }
    }
  }
}

TEST(ElementwiseCuda, UnalignedPointersTakeTheScalarPath) {
  LOOM_REQUIRE_CUDA();
  const int64_t n = 1025;
  for (DType t : {DType::f32, DType::bf16, DType::u8, DType::f64}) {
    for (auto [off_a, off_out] : {std::pair<int64_t, int64_t>{1, 0}, {0, 1}, {3, 3}}) {
      Twin a(t, random_bytes(t, n + 3, 0, 9, 3)), b(t, random_bytes(t, n, 0, 9, 4)), out(t, n + 3);
      cpu::binary(BinaryOp::add, out.cpu({n}, {}, off_out), a.cpu({n}, {}, off_a), b.cpu({n}), nullptr);
      cuda::binary(BinaryOp::add, out.gpu({n}, {}, off_out), a.gpu({n}, {}, off_a), b.gpu({n}), nullptr);
      expect_match(out, tol_for(t), describe("add", t, n) + " with offsets " + std::to_string(off_a) + "/" +
                                        std::to_string(off_out));
    }
  }
}

TEST(ElementwiseCuda, WhereMatchesCpu) {
  LOOM_REQUIRE_CUDA();
  uint64_t seed = 300;
  for (DType t : kAllTypes) {
    for (int64_t n : kSizes) {
      Twin cond(DType::u8, random_bytes(DType::u8, n, 0, 1, seed++));
      Twin a(t, random_bytes(t, n, -3, 3, seed++)), b(t, random_bytes(t, n, -3, 3, seed++)), out(t, n);
      cpu::where(out.cpu({n}), cond.cpu({n}), a.cpu({n}), b.cpu({n}), nullptr);
      cuda::where(out.gpu({n}), cond.gpu({n}), a.gpu({n}), b.gpu({n}), nullptr);
      expect_match(out, kExact, describe("where", t, n));
    }
  }
  for (auto [rows, cols] : kShapes) {
    for (const Layout& lc : layouts(rows, cols)) {
      const std::vector<Layout> all = layouts(rows, cols);
      const Layout& la = all[4];  // scalar
      const Layout& lb = all[1];  // transposed
      Twin cond(DType::u8, random_bytes(DType::u8, lc.size, 0, 1, 5));
      Twin a(DType::bf16, random_bytes(DType::bf16, la.size, -3, 3, 6));
      Twin b(DType::bf16, random_bytes(DType::bf16, lb.size, -3, 3, 7)), out(DType::bf16, rows * cols);
      cpu::where(out.cpu({rows, cols}), cond.cpu({rows, cols}, lc.strides), a.cpu({rows, cols}, la.strides),
                 b.cpu({rows, cols}, lb.strides), nullptr);
      cuda::where(out.gpu({rows, cols}), cond.gpu({rows, cols}, lc.strides), a.gpu({rows, cols}, la.strides),
                  b.gpu({rows, cols}, lb.strides), nullptr);
      expect_match(out, kExact, std::string("where, cond ") + lc.name);
    }
  }
}

// ---- fill, arange, copy -------------------------------------------------------------

TEST(ElementwiseCuda, FillMatchesCpu) {
  LOOM_REQUIRE_CUDA();
  for (DType t : kAllTypes) {
    for (double value : {3.0, -2.5, 0.1, 1e10, -1e10, double(NAN)}) {
      for (int64_t n : kSizes) {
        Twin out(t, 2 * n);
        cpu::fill(out.cpu({n}), value, nullptr);
        cuda::fill(out.gpu({n}), value, nullptr);
        cpu::fill(out.cpu({n / 2}, {2}, n), -value, nullptr);
        cuda::fill(out.gpu({n / 2}, {2}, n), -value, nullptr);
        expect_match(out, kExact, describe("fill", t, n) + " value " + std::to_string(value));
      }
    }
  }
}

TEST(ElementwiseCuda, ArangeMatchesCpu) {
  LOOM_REQUIRE_CUDA();
  for (DType t : kAllTypes) {
    for (auto [start, step] : {std::pair{0.0, 1.0}, {-3.0, 0.5}, {1e6, 1e-3}}) {
      for (int64_t n : kSizes) {
        Twin out(t, n);
        cpu::arange(out.cpu({n}), start, step, nullptr);
        cuda::arange(out.gpu({n}), start, step, nullptr);
        expect_match(out, kExact, describe("arange", t, n) + " from " + std::to_string(start));
      }
    }
  }
}

// Values that exercise rounding, saturation, wrap-around, NaN and infinities.
Bytes conversion_inputs(DType t, int64_t n, uint64_t seed) {
  Bytes b = random_bytes(t, n, -300, 300, seed);
  const double specials[] = {NAN, INFINITY, -INFINITY, 1e10, -1e10, 255.5, -0.7, 65520};
  if (is_floating(t)) {
    for (int64_t i = 0; i < std::min<int64_t>(n, 8); ++i) set(t, b, i, specials[i]);
  }
  return b;
}

TEST(ElementwiseCuda, CopyMatchesCpuBetweenEveryDtypePair) {
  LOOM_REQUIRE_CUDA();
  uint64_t seed = 400;
  for (DType from : kAllTypes) {
    for (DType to : kAllTypes) {
      for (int64_t n : kSizes) {
        Twin in(from, conversion_inputs(from, n, seed++)), out(to, n);
        cpu::copy(out.cpu({n}), in.cpu({n}), nullptr);
        cuda::copy(out.gpu({n}), in.gpu({n}), nullptr);
        expect_match(out, kExact, std::string(dtype_name(from)) + "->" + describe("", to, n));
      }
    }
  }
}

TEST(ElementwiseCuda, CopyReadsAndWritesThroughStrides) {
  LOOM_REQUIRE_CUDA();
  for (auto [rows, cols] : kShapes) {
    const std::vector<Layout> all = layouts(rows, cols);
    for (const Layout& lin : all) {
      for (const Layout& lout : {all[0], all[1], all[5]}) {  // outputs are never broadcast
        for (auto [from, to] : {std::pair{DType::f32, DType::f32}, {DType::f32, DType::bf16},
                                {DType::i64, DType::f32}, {DType::u8, DType::f16}}) {
          Twin in(from, conversion_inputs(from, lin.size, 8)), out(to, lout.size);
          cpu::copy(out.cpu({rows, cols}, lout.strides), in.cpu({rows, cols}, lin.strides), nullptr);
          cuda::copy(out.gpu({rows, cols}, lout.strides), in.gpu({rows, cols}, lin.strides), nullptr);
          expect_match(out, kExact, std::string(lin.name) + " into " + lout.name + " " +
                                        std::string(dtype_name(from)) + "->" + std::string(dtype_name(to)));
        }
      }
    }
  }
}

TEST(ElementwiseCuda, CopyWalksPermutedThreeDimensionalViews) {
  LOOM_REQUIRE_CUDA();
  for (auto [A, B, C] : {std::tuple<int64_t, int64_t, int64_t>{2, 3, 4}, {37, 41, 29}, {129, 127, 65}}) {
    Twin in(DType::f32, random_bytes(DType::f32, A * B * C, -3, 3, 9)), out(DType::bf16, A * B * C);
    cpu::copy(out.cpu({A, B, C}), in.cpu({A, B, C}, {1, A, A * B}), nullptr);
    cuda::copy(out.gpu({A, B, C}), in.gpu({A, B, C}, {1, A, A * B}), nullptr);
    expect_match(out, kExact, "permuted " + std::to_string(A * B * C));
  }
}

TEST(ElementwiseCuda, StridedOffsetsBeyond32BitsUse64BitIndexing) {
  LOOM_REQUIRE_CUDA();
  const int64_t far = int64_t(1) << 31;  // the second row starts past INT32_MAX
  std::unique_ptr<test::DeviceBuffer<uint8_t>> big;
  try {
    big = std::make_unique<test::DeviceBuffer<uint8_t>>(size_t(far + 16));
  } catch (const Error&) {
    GTEST_SKIP() << "needs 2 GiB of free GPU memory";
  }
  const uint8_t rows[2][3] = {{1, 2, 3}, {4, 5, 6}};
  ASSERT_EQ(cudaMemcpy(big->get(), rows[0], 3, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(big->get() + far, rows[1], 3, cudaMemcpyHostToDevice), cudaSuccess);
  test::DeviceBuffer<int32_t> out(6);
  cuda::copy(view(out.get(), DType::i32, {2, 3}, {}), view(big->get(), DType::u8, {2, 3}, {far, 1}), nullptr);
  EXPECT_EQ(out.to_host(), (std::vector<int32_t>{1, 2, 3, 4, 5, 6}));
}

}  // namespace
}  // namespace loom
