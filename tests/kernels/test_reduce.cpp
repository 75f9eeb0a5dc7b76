// The CPU reduce kernel against plain loops and hand values: every ReduceOp over every
// axis position, every dtype, first-index ties, NaN, empty axes, integers beyond 2^53, and
// the accuracy of long f32 sums.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/core/error.h"
#include "kernels/table.h"

namespace loom {
namespace {

constexpr ReduceOp kOps[] = {ReduceOp::sum, ReduceOp::mean, ReduceOp::max,
                             ReduceOp::min, ReduceOp::argmax, ReduceOp::argmin};

const char* op_name(ReduceOp op) {
  static const char* const names[] = {"sum", "mean", "max", "min", "argmax", "argmin"};
  return names[int(op)];
}
bool is_arg(ReduceOp op) { return op == ReduceOp::argmax || op == ReduceOp::argmin; }

template <class T> constexpr DType dtype_of() {
  if constexpr (std::is_same_v<T, float>) return DType::f32;
  else if constexpr (std::is_same_v<T, double>) return DType::f64;
  else if constexpr (std::is_same_v<T, bf16>) return DType::bf16;
  else if constexpr (std::is_same_v<T, f16>) return DType::f16;
  else if constexpr (std::is_same_v<T, int32_t>) return DType::i32;
  else return DType::i64;
}
template <class T> double to_double(T v) {
  if constexpr (std::is_same_v<T, bf16> || std::is_same_v<T, f16>) return float(v);
  else return double(v);
}
template <class T> T from_double(double v) {
  if constexpr (std::is_same_v<T, bf16> || std::is_same_v<T, f16>) return T(float(v));
  else return T(v);
}

// The CPU kernel's output as doubles (indices for argmax/argmin).
template <class T>
std::vector<double> run(ReduceOp op, const std::vector<T>& x, int64_t outer, int64_t R, int64_t inner) {
  std::vector<double> got(outer * inner);
  if (is_arg(op)) {
    std::vector<int64_t> out(got.size());
    cpu_kernel_table().reduce(op, out.data(), x.data(), dtype_of<T>(), outer, R, inner, nullptr);
    for (size_t j = 0; j < out.size(); ++j) got[j] = double(out[j]);
  } else {
    std::vector<T> out(got.size());
    cpu_kernel_table().reduce(op, out.data(), x.data(), dtype_of<T>(), outer, R, inner, nullptr);
    for (size_t j = 0; j < out.size(); ++j) got[j] = to_double(out[j]);
  }
  return got;
}

// Plain loops in f64 over the values as stored; `abs_sum` gets sum |x| per output.
template <class T>
std::vector<double> naive(ReduceOp op, const std::vector<T>& x, int64_t outer, int64_t R, int64_t inner,
                          std::vector<double>* abs_sum = nullptr) {
  std::vector<double> want(outer * inner);
  if (abs_sum) abs_sum->assign(want.size(), 0.0);
  for (int64_t o = 0; o < outer; ++o) {
    for (int64_t i = 0; i < inner; ++i) {
      double acc = 0, best = 0;
      int64_t at = 0;
      for (int64_t r = 0; r < R; ++r) {
        double v = to_double(x[(o * R + r) * inner + i]);
        if (abs_sum) (*abs_sum)[o * inner + i] += std::abs(v);
        acc += v;
        bool more = op == ReduceOp::max || op == ReduceOp::argmax ? v > best : v < best;
        if (r == 0 || more) best = v, at = r;
      }
      double& w = want[o * inner + i];
      w = op == ReduceOp::sum ? acc : op == ReduceOp::mean ? acc / double(R) : is_arg(op) ? double(at) : best;
    }
  }
  return want;
}

template <class T> std::vector<T> random_values(int64_t n, uint32_t seed, double lo, double hi) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> dist(lo, hi);
  std::vector<T> x(n);
  for (auto& v : x) v = from_double<T>(std::is_integral_v<T> ? std::floor(dist(gen)) : dist(gen));
  return x;
}

// Exact for max, min and the indices; sums within rel_out of the value (rounding of the
// output) plus rel_acc of sum |x| (accumulation).
template <class T>
void expect_matches_loops(const std::vector<T>& x, int64_t outer, int64_t R, int64_t inner, double rel_out,
                          double rel_acc) {
  for (ReduceOp op : kOps) {
    if (op == ReduceOp::mean && std::is_integral_v<T>) continue;
    SCOPED_TRACE(std::string(op_name(op)) + " over (" + std::to_string(outer) + ", " + std::to_string(R) + ", " +
                 std::to_string(inner) + ") " + std::string(dtype_name(dtype_of<T>())));
    std::vector<double> abs_sum;
    auto want = naive(op, x, outer, R, inner, &abs_sum);
    auto got = run(op, x, outer, R, inner);
    int bad = 0;
    for (size_t j = 0; j < want.size() && bad < 5; ++j) {
      double tol = 0;
      if (op == ReduceOp::sum) tol = rel_out * std::abs(want[j]) + rel_acc * abs_sum[j];
      if (op == ReduceOp::mean) tol = rel_out * std::abs(want[j]) + rel_acc * abs_sum[j] / double(R);
      if (!(std::abs(got[j] - want[j]) <= tol)) {
        ++bad;
        ADD_FAILURE() << "output " << j << ": got " << got[j] << ", want " << want[j] << " (tol " << tol << ")";
      }
    }
  }
}

TEST(ReduceCpu, EveryOpOverEveryAxisPositionMatchesPlainLoops) {
  const int64_t sizes[] = {1, 7, 1025};
  uint32_t seed = 1;
  for (int64_t outer : sizes)
    for (int64_t R : sizes)
      for (int64_t inner : sizes) {
        if (outer * R * inner > 1025 * 1025 * 7) continue;
        auto x = random_values<float>(outer * R * inner, seed++, -1, 1);
        expect_matches_loops(x, outer, R, inner, 1e-7, 1e-6);
      }
}

TEST(ReduceCpu, EveryDtypeMatchesPlainLoops) {
  const int64_t shapes[][3] = {{3, 1025, 7}, {5, 33, 1}, {2, 200000, 1}};
  for (auto& s : shapes) {
    int64_t n = s[0] * s[1] * s[2];
    expect_matches_loops(random_values<double>(n, 11, -1, 1), s[0], s[1], s[2], 1e-15, 1e-14);
    expect_matches_loops(random_values<float>(n, 12, -1, 1), s[0], s[1], s[2], 1e-7, 1e-6);
    // 16-bit outputs may round either way: one unit in the last place.
    expect_matches_loops(random_values<bf16>(n, 13, -1, 1), s[0], s[1], s[2], 1.0 / 128, 1e-6);
    expect_matches_loops(random_values<f16>(n, 14, -1, 1), s[0], s[1], s[2], 1.0 / 1024, 1e-6);
    // Integers from a small range: many ties, so argmax/argmin prove the first index.
    expect_matches_loops(random_values<int32_t>(n, 15, -50, 50), s[0], s[1], s[2], 0, 0);
    expect_matches_loops(random_values<int64_t>(n, 16, -50, 50), s[0], s[1], s[2], 0, 0);
  }
}

TEST(ReduceCpu, ArgmaxAndArgminReturnTheFirstIndexOfTies) {
  EXPECT_EQ(run(ReduceOp::argmax, std::vector<float>{1, 3, 3, 2, 3}, 1, 5, 1), std::vector<double>{1});
  EXPECT_EQ(run(ReduceOp::argmin, std::vector<float>{2, 1, 5, 1}, 1, 4, 1), std::vector<double>{1});
  // (1, 3, 2): columns {5, 5, 4} and {1, 0, 0}.
  std::vector<float> cols{5, 1, 5, 0, 4, 0};
  EXPECT_EQ(run(ReduceOp::argmax, cols, 1, 3, 2), (std::vector<double>{0, 0}));
  EXPECT_EQ(run(ReduceOp::argmin, cols, 1, 3, 2), (std::vector<double>{2, 1}));
  // A row long enough to be cut into chunks: the extreme appears in two of them.
  std::vector<float> row(300000, 0.f);
  row[150000] = row[290000] = 7.f;
  row[200000] = row[100] = -7.f;
  EXPECT_EQ(run(ReduceOp::argmax, row, 1, 300000, 1), std::vector<double>{150000});
  EXPECT_EQ(run(ReduceOp::argmin, row, 1, 300000, 1), std::vector<double>{100});
  EXPECT_EQ(run(ReduceOp::max, row, 1, 300000, 1), std::vector<double>{7});
  std::vector<float> flat(300000, 2.f);
  EXPECT_EQ(run(ReduceOp::argmax, flat, 1, 300000, 1), std::vector<double>{0});
  EXPECT_EQ(run(ReduceOp::argmin, flat, 1, 300000, 1), std::vector<double>{0});
}

TEST(ReduceCpu, NaNPropagatesThroughMaxAndMinAndIsTheExtremeForArgOps) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int64_t R : {int64_t(4), int64_t(300000)}) {
    std::vector<float> x(R, 1.f);
    x[R - 3] = nan;
    x[R - 1] = nan;
    x[0] = 9.f;
    EXPECT_TRUE(std::isnan(run(ReduceOp::max, x, 1, R, 1)[0])) << "R = " << R;
    EXPECT_TRUE(std::isnan(run(ReduceOp::min, x, 1, R, 1)[0])) << "R = " << R;
    EXPECT_EQ(run(ReduceOp::argmax, x, 1, R, 1)[0], double(R - 3)) << "R = " << R;
    EXPECT_EQ(run(ReduceOp::argmin, x, 1, R, 1)[0], double(R - 3)) << "R = " << R;
    EXPECT_TRUE(std::isnan(run(ReduceOp::sum, x, 1, R, 1)[0])) << "R = " << R;
  }
  // (1, 3, 2) with a NaN in the second column only.
  std::vector<float> cols{1, 2, 3, nan, 0, 5};
  auto mx = run(ReduceOp::max, cols, 1, 3, 2);
  EXPECT_EQ(mx[0], 3);
  EXPECT_TRUE(std::isnan(mx[1]));
  EXPECT_EQ(run(ReduceOp::argmin, cols, 1, 3, 2), (std::vector<double>{2, 1}));
}

TEST(ReduceCpu, EmptyAxisGivesZeroSumNaNMeanAndRejectsMaxWithAClearMessage) {
  std::vector<float> none;
  auto sum = run(ReduceOp::sum, none, 2, 0, 3);
  EXPECT_EQ(sum, std::vector<double>(6, 0.0));
  for (double m : run(ReduceOp::mean, none, 2, 0, 3)) EXPECT_TRUE(std::isnan(m));
  for (ReduceOp op : {ReduceOp::max, ReduceOp::min, ReduceOp::argmax, ReduceOp::argmin}) {
    try {
      run(op, none, 2, 0, 3);
      ADD_FAILURE() << op_name(op) << " over an empty axis did not throw";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("empty axis"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(op_name(op)), std::string::npos) << e.what();
    }
  }
}

TEST(ReduceCpu, IntegersReduceExactlyAndMeanOfIntegersIsRejected) {
  const int64_t big = int64_t(1) << 60;  // beyond 2^53: a trip through double would round
  std::vector<int64_t> x{big + 1, big + 3, big - 1, big + 3};
  EXPECT_EQ(run(ReduceOp::argmax, x, 1, 4, 1), std::vector<double>{1});
  std::vector<int64_t> out(1);
  cpu_kernel_table().reduce(ReduceOp::max, out.data(), x.data(), DType::i64, 1, 4, 1, nullptr);
  EXPECT_EQ(out[0], big + 3);
  cpu_kernel_table().reduce(ReduceOp::sum, out.data(), x.data(), DType::i64, 1, 2, 1, nullptr);
  EXPECT_EQ(out[0], 2 * big + 4);

  std::vector<int32_t> small{2147483647, 1, -5};
  std::vector<int32_t> s(1);
  cpu_kernel_table().reduce(ReduceOp::sum, s.data(), small.data(), DType::i32, 1, 3, 1, nullptr);
  EXPECT_EQ(s[0], 2147483643);

  EXPECT_THROW(cpu_kernel_table().reduce(ReduceOp::mean, s.data(), small.data(), DType::i32, 1, 3, 1, nullptr),
               Error);
  std::vector<uint8_t> bytes{1, 2, 3}, b(1);
  EXPECT_THROW(cpu_kernel_table().reduce(ReduceOp::sum, b.data(), bytes.data(), DType::u8, 1, 3, 1, nullptr), Error);
}

TEST(ReduceCpu, LongF32SumsStayAccurate) {
  // 0.1f added 4M times one by one in f32 drifts by whole percents; pairwise stays near 1e-7.
  const int64_t R = int64_t(1) << 22;
  const double exact = double(0.1f) * double(R);
  EXPECT_NEAR(run(ReduceOp::sum, std::vector<float>(R, 0.1f), 1, R, 1)[0], exact, 1e-6 * exact);
  EXPECT_NEAR(run(ReduceOp::mean, std::vector<float>(R, 0.1f), 1, R, 1)[0], double(0.1f), 1e-6 * 0.1);
  const int64_t Rc = int64_t(1) << 20;
  for (double v : run(ReduceOp::sum, std::vector<float>(Rc * 3, 0.1f), 1, Rc, 3))
    EXPECT_NEAR(v, double(0.1f) * double(Rc), 1e-6 * double(Rc) * 0.1);
}

}  // namespace
}  // namespace loom
