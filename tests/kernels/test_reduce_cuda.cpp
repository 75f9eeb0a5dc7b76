// The CUDA reduce kernel against the CPU one on the same random inputs, over every launch
// path: a warp per row, a block per row, rows split across blocks (a full reduction), a
// thread per output, columns split over R, and rows whose start is not 16-byte aligned.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/core/error.h"
#include "kernels/table.h"
#include "tests/common/device_buffer.h"
#include "tests/common/gpu.h"

namespace loom {
namespace {

using test::DeviceBuffer;

constexpr ReduceOp kOps[] = {ReduceOp::sum, ReduceOp::mean, ReduceOp::max,
                             ReduceOp::min, ReduceOp::argmax, ReduceOp::argmin};
constexpr DType kDtypes[] = {DType::f32, DType::f64, DType::bf16, DType::f16, DType::i32, DType::i64};

const char* op_name(ReduceOp op) {
  static const char* const names[] = {"sum", "mean", "max", "min", "argmax", "argmin"};
  return names[int(op)];
}
bool is_arg(ReduceOp op) { return op == ReduceOp::argmax || op == ReduceOp::argmin; }

struct Shape {
  int64_t outer, R, inner;
  std::string str() const {
    std::ostringstream os;
    os << "(" << outer << ", " << R << ", " << inner << ")";
    return os.str();
  }
};

template <class T> void put(uint8_t* p, T v) { std::memcpy(p, &v, sizeof(T)); }
template <class T> T get(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// Values of any dtype as raw bytes, written from doubles and read back as doubles.
std::vector<uint8_t> encode(const std::vector<double>& v, DType dt) {
  const size_t es = dtype_size(dt);
  std::vector<uint8_t> b(v.size() * es);
  for (size_t k = 0; k < v.size(); ++k) {
    uint8_t* p = b.data() + k * es;
    switch (dt) {
      case DType::f32: put(p, float(v[k])); break;
      case DType::f64: put(p, v[k]); break;
      case DType::bf16: put(p, bf16(float(v[k]))); break;
      case DType::f16: put(p, f16(float(v[k]))); break;
      case DType::i32: put(p, int32_t(v[k])); break;
      case DType::i64: put(p, int64_t(v[k])); break;
      case DType::u8: put(p, uint8_t(v[k])); break;
    }
  }
  return b;
}
std::vector<double> decode(const std::vector<uint8_t>& b, DType dt) {
  const size_t es = dtype_size(dt);
  std::vector<double> v(b.size() / es);
  for (size_t k = 0; k < v.size(); ++k) {
    const uint8_t* p = b.data() + k * es;
    switch (dt) {
      case DType::f32: v[k] = get<float>(p); break;
      case DType::f64: v[k] = get<double>(p); break;
      case DType::bf16: v[k] = float(get<bf16>(p)); break;
      case DType::f16: v[k] = float(get<f16>(p)); break;
      case DType::i32: v[k] = get<int32_t>(p); break;
      case DType::i64: v[k] = double(get<int64_t>(p)); break;
      case DType::u8: v[k] = get<uint8_t>(p); break;
    }
  }
  return v;
}

// Floats uniform in [-1, 1); integers uniform in [-1000, 1000).
std::vector<double> random_values(int64_t n, DType dt, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> dist(-1, 1);
  std::vector<double> x(n);
  for (auto& v : x) v = is_floating(dt) ? dist(gen) : std::floor(1000 * dist(gen));
  return x;
}

struct Outputs {
  std::vector<double> cpu, cuda;
};

// Runs both kernels on the same bytes; `misaligned` moves the device input one element
// past the start of its allocation, so no row starts on a 16-byte boundary.
Outputs reduce_both(ReduceOp op, DType dt, const std::vector<uint8_t>& in, Shape s, bool misaligned = false) {
  const DType out_dt = is_arg(op) ? DType::i64 : dt;
  const size_t es = dtype_size(dt), n_out = size_t(s.outer * s.inner);
  std::vector<uint8_t> cpu_out(n_out * dtype_size(out_dt));
  cpu_kernel_table().reduce(op, cpu_out.data(), in.data(), dt, s.outer, s.R, s.inner, nullptr);

  std::vector<uint8_t> staged(misaligned ? es : 0, 0);
  staged.insert(staged.end(), in.begin(), in.end());
  DeviceBuffer<uint8_t> d_in(staged), d_out(cpu_out.size());
  cuda_kernel_table().reduce(op, d_out.get(), d_in.get() + (misaligned ? es : 0), dt, s.outer, s.R, s.inner,
                             nullptr);
  return {decode(cpu_out, out_dt), decode(d_out.to_host(), out_dt)};
}

// Max, min, the indices and integers agree exactly. Float sums agree within one unit in
// the last place of the output dtype plus f32 (or f64) accumulation error over R values.
double tolerance(ReduceOp op, DType dt, double want, int64_t R) {
  if (!is_floating(dt) || (op != ReduceOp::sum && op != ReduceOp::mean)) return 0;
  const double ulp = dt == DType::bf16 ? 1.0 / 128 : dt == DType::f16 ? 1.0 / 1024 : dt == DType::f32 ? 1e-6 : 1e-14;
  double acc = (dt == DType::f64 ? 1e-13 : 1e-5) * std::sqrt(double(R));
  if (op == ReduceOp::mean) acc /= double(std::max<int64_t>(R, 1));
  return ulp * std::abs(want) + acc;
}

void expect_same(ReduceOp op, DType dt, const std::vector<uint8_t>& in, Shape s, bool misaligned = false) {
  SCOPED_TRACE(std::string(op_name(op)) + " over " + s.str() + " " + std::string(dtype_name(dt)) +
               (misaligned ? " misaligned" : ""));
  auto out = reduce_both(op, dt, in, s, misaligned);
  int bad = 0;
  for (size_t j = 0; j < out.cpu.size() && bad < 5; ++j) {
    double want = out.cpu[j], got = out.cuda[j];
    if (std::isnan(want) && std::isnan(got)) continue;
    if (!(std::abs(got - want) <= tolerance(op, dt, want, s.R))) {
      ++bad;
      ADD_FAILURE() << "output " << j << ": cuda " << got << ", cpu " << want;
    }
  }
}

void expect_every_op_and_dtype(const std::vector<Shape>& shapes, bool misaligned = false) {
  uint32_t seed = 1;
  for (Shape s : shapes)
    for (DType dt : kDtypes) {
      auto in = encode(random_values(s.outer * s.R * s.inner, dt, seed++), dt);
      for (ReduceOp op : kOps)
        if (op != ReduceOp::mean || is_floating(dt)) expect_same(op, dt, in, s, misaligned);
    }
}

TEST(ReduceCuda, ContiguousRowsMatchCpu) {
  LOOM_REQUIRE_CUDA();
  expect_every_op_and_dtype({
      {100003, 7, 1},        // short rows: a thread per row
      {5, 32, 1},            // the longest "short" row
      {4099, 33, 1},         // a warp per row
      {1000, 1024, 1},       // the longest warp row
      {2049, 1025, 1},       // a block per row, no split
      {3, 100003, 1},        // a few long rows, split across blocks
      {1, (1 << 20) + 3, 1}, // a full reduction
  });
}

TEST(ReduceCuda, StridedColumnsMatchCpu) {
  LOOM_REQUIRE_CUDA();
  expect_every_op_and_dtype({
      {7, 1, 5},
      {1, 2, 2},
      {64, 513, 3},
      {5, 1025, 1031},
      {2, 3, 200001},   // large inner
      {1, 100003, 7},   // few outputs, long R: split over R
      {1, 1, 1},
  });
}

TEST(ReduceCuda, MisalignedRowsUseScalarHeadsAndTails) {
  LOOM_REQUIRE_CUDA();
  expect_every_op_and_dtype({{3, 4099, 1}, {1000, 1000, 1}, {1, (1 << 20) + 3, 1}}, /*misaligned=*/true);
}

TEST(ReduceCuda, TiesAndNaNGiveTheFirstIndexOnEveryPath) {
  LOOM_REQUIRE_CUDA();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (int64_t R : {int64_t(40), int64_t(1000), int64_t(5000), int64_t(1) << 20}) {
    SCOPED_TRACE("R = " + std::to_string(R));
    // A flat row whose extremes each appear twice, far apart (in different splits).
    std::vector<double> x(R, 0.5);
    x[R / 2] = x[R - 2] = 2;
    x[7] = x[R - 1] = -2;
    for (DType dt : {DType::f32, DType::bf16, DType::f64, DType::i64}) {
      auto in = encode(is_floating(dt) ? x : std::vector<double>(R, 3), dt);
      auto amax = reduce_both(ReduceOp::argmax, dt, in, {1, R, 1});
      auto amin = reduce_both(ReduceOp::argmin, dt, in, {1, R, 1});
      EXPECT_EQ(amax.cuda, amax.cpu) << dtype_name(dt);
      EXPECT_EQ(amin.cuda, amin.cpu) << dtype_name(dt);
      EXPECT_EQ(amax.cuda[0], is_floating(dt) ? double(R / 2) : 0.0) << dtype_name(dt);
      EXPECT_EQ(amin.cuda[0], is_floating(dt) ? 7.0 : 0.0) << dtype_name(dt);
    }
    // NaN is the extreme: max and min are NaN, argmax and argmin its first index.
    std::vector<double> y(R, 1.0);
    y[R - 3] = y[5] = nan;
    for (DType dt : {DType::f32, DType::bf16, DType::f16, DType::f64}) {
      auto in = encode(y, dt);
      EXPECT_TRUE(std::isnan(reduce_both(ReduceOp::max, dt, in, {1, R, 1}).cuda[0])) << dtype_name(dt);
      EXPECT_TRUE(std::isnan(reduce_both(ReduceOp::min, dt, in, {1, R, 1}).cuda[0])) << dtype_name(dt);
      EXPECT_EQ(reduce_both(ReduceOp::argmax, dt, in, {1, R, 1}).cuda[0], 5.0) << dtype_name(dt);
      EXPECT_EQ(reduce_both(ReduceOp::argmin, dt, in, {1, R, 1}).cuda[0], 5.0) << dtype_name(dt);
      // The same values as columns of (1, R / 2, 2): column 1 holds y[5].
      auto cols = reduce_both(ReduceOp::argmax, dt, in, {1, R / 2, 2});
      EXPECT_EQ(cols.cuda, cols.cpu) << dtype_name(dt);
    }
  }
}

TEST(ReduceCuda, EmptyAxisAndBadInputsBehaveAsOnCpu) {
  LOOM_REQUIRE_CUDA();
  std::vector<uint8_t> none;
  for (DType dt : {DType::f32, DType::bf16}) {
    expect_same(ReduceOp::sum, dt, none, {2, 0, 3});
    auto mean = reduce_both(ReduceOp::mean, dt, none, {2, 0, 3});
    for (double m : mean.cuda) EXPECT_TRUE(std::isnan(m));
  }
  DeviceBuffer<float> out(6);
  EXPECT_THROW(cuda_kernel_table().reduce(ReduceOp::argmax, out.get(), nullptr, DType::f32, 2, 0, 3, nullptr), Error);
  EXPECT_THROW(cuda_kernel_table().reduce(ReduceOp::mean, out.get(), out.get(), DType::i32, 1, 6, 1, nullptr), Error);
  EXPECT_THROW(cuda_kernel_table().reduce(ReduceOp::sum, out.get(), out.get(), DType::u8, 1, 6, 1, nullptr), Error);
}

TEST(ReduceCuda, FullReductionOfManyElementsIsAccurate) {
  LOOM_REQUIRE_CUDA();
  // 64M copies of 0.1f: one f32 running sum would drift by percents; the split tree stays
  // within a few parts per million (2e-6 measured on an H200).
  const int64_t R = int64_t(1) << 26;
  DeviceBuffer<float> x(std::vector<float>(R, 0.1f));
  DeviceBuffer<float> sum(1), mean(1);
  cuda_kernel_table().reduce(ReduceOp::sum, sum.get(), x.get(), DType::f32, 1, R, 1, nullptr);
  cuda_kernel_table().reduce(ReduceOp::mean, mean.get(), x.get(), DType::f32, 1, R, 1, nullptr);
  const double exact = double(0.1f) * double(R);
  EXPECT_NEAR(sum.to_host()[0], exact, 1e-5 * exact);
  EXPECT_NEAR(mean.to_host()[0], double(0.1f), 1e-5 * 0.1);
}

}  // namespace
}  // namespace loom
