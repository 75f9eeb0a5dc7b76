// The CPU indexing kernels against plain loops over (outer, R, inner), for every dtype
// and a table of shapes, and the error a bad index gives. The accumulating kernels add
// in j order on every element, as the loops do, so results must match to the bit.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/core/error.h"
#include "kernels/cpu/kernels.h"

namespace loom {
namespace {

struct Shape {
  int64_t outer, R, inner, J;  // J: n_index for index_select/index_add, the gathered extent otherwise
};

// Large enough shapes cross the thread split (several inner blocks, many rows).
const Shape kShapes[] = {{1, 1, 1, 1}, {1, 5, 1, 9}, {3, 7, 5, 4}, {2, 10, 130, 33}, {1, 50, 700, 300}};

template <class T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::f32; }
template <> constexpr DType dtype_of<double>() { return DType::f64; }
template <> constexpr DType dtype_of<bf16>() { return DType::bf16; }
template <> constexpr DType dtype_of<f16>() { return DType::f16; }
template <> constexpr DType dtype_of<int32_t>() { return DType::i32; }
template <> constexpr DType dtype_of<int64_t>() { return DType::i64; }
template <> constexpr DType dtype_of<uint8_t>() { return DType::u8; }

template <class T>
std::vector<T> random_values(int64_t n, std::mt19937& rng) {
  std::uniform_int_distribution<int> dist(0, 100);
  std::vector<T> v(static_cast<size_t>(n));
  for (auto& x : v) {
    if constexpr (std::is_same_v<T, bf16> || std::is_same_v<T, f16>) x = T(float(dist(rng)) * 0.37f);
    else if constexpr (std::is_floating_point_v<T>) x = T(dist(rng)) * T(0.37);
    else x = T(dist(rng));
  }
  return v;
}

std::vector<int64_t> random_index(int64_t n, int64_t R, std::mt19937& rng) {
  std::uniform_int_distribution<int64_t> dist(0, R - 1);
  std::vector<int64_t> v(static_cast<size_t>(n));
  for (auto& x : v) x = dist(rng);
  return v;
}

template <class T>
void add_into(T& dst, T v) {
  if constexpr (std::is_same_v<T, bf16> || std::is_same_v<T, f16>) dst = T(float(dst) + float(v));
  else dst = T(dst + v);
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

template <class T>
void check_all_ops() {
  SCOPED_TRACE(std::string(dtype_name(dtype_of<T>())));
  std::mt19937 rng(3);
  for (const Shape& s : kShapes) {
    SCOPED_TRACE(testing::Message() << "(outer, R, inner, J) = (" << s.outer << ", " << s.R << ", " << s.inner
                                    << ", " << s.J << ")");
    const DType dt = dtype_of<T>();
    const auto table = random_values<T>(s.outer * s.R * s.inner, rng);
    const auto rows = random_values<T>(s.outer * s.J * s.inner, rng);
    const auto index = random_index(s.J, s.R, rng);
    const auto index3 = random_index(s.outer * s.J * s.inner, s.R, rng);
    auto at = [&](int64_t o, int64_t r, int64_t i, int64_t extent) { return size_t((o * extent + r) * s.inner + i); };

    std::vector<T> got(rows.size()), want(rows.size());
    cpu::index_select(got.data(), table.data(), index.data(), s.J, dt, s.outer, s.R, s.inner, nullptr);
    for (int64_t o = 0; o < s.outer; ++o)
      for (int64_t j = 0; j < s.J; ++j)
        for (int64_t i = 0; i < s.inner; ++i) want[at(o, j, i, s.J)] = table[at(o, index[size_t(j)], i, s.R)];
    EXPECT_TRUE(same_bits(got, want)) << "index_select";

    cpu::gather(got.data(), table.data(), index3.data(), s.J, dt, s.outer, s.R, s.inner, nullptr);
    for (int64_t o = 0; o < s.outer; ++o)
      for (int64_t j = 0; j < s.J; ++j)
        for (int64_t i = 0; i < s.inner; ++i)
          want[at(o, j, i, s.J)] = table[at(o, index3[at(o, j, i, s.J)], i, s.R)];
    EXPECT_TRUE(same_bits(got, want)) << "gather";

    std::vector<T> acc = table, acc_want = table;
    cpu::index_add(acc.data(), rows.data(), index.data(), s.J, dt, s.outer, s.R, s.inner, nullptr);
    for (int64_t o = 0; o < s.outer; ++o)
      for (int64_t j = 0; j < s.J; ++j)
        for (int64_t i = 0; i < s.inner; ++i)
          add_into(acc_want[at(o, index[size_t(j)], i, s.R)], rows[at(o, j, i, s.J)]);
    EXPECT_TRUE(same_bits(acc, acc_want)) << "index_add";

    acc = table, acc_want = table;
    cpu::scatter_add(acc.data(), rows.data(), index3.data(), s.J, dt, s.outer, s.R, s.inner, nullptr);
    for (int64_t o = 0; o < s.outer; ++o)
      for (int64_t j = 0; j < s.J; ++j)
        for (int64_t i = 0; i < s.inner; ++i)
          add_into(acc_want[at(o, index3[at(o, j, i, s.J)], i, s.R)], rows[at(o, j, i, s.J)]);
    EXPECT_TRUE(same_bits(acc, acc_want)) << "scatter_add";
  }
}

TEST(IndexingCpu, MatchesLoopsF32) { check_all_ops<float>(); }
TEST(IndexingCpu, MatchesLoopsF64) { check_all_ops<double>(); }
TEST(IndexingCpu, MatchesLoopsBf16) { check_all_ops<bf16>(); }
TEST(IndexingCpu, MatchesLoopsF16) { check_all_ops<f16>(); }
TEST(IndexingCpu, MatchesLoopsI32) { check_all_ops<int32_t>(); }
TEST(IndexingCpu, MatchesLoopsI64) { check_all_ops<int64_t>(); }
TEST(IndexingCpu, MatchesLoopsU8) { check_all_ops<uint8_t>(); }

// Runs f, expects a loom::Error, and returns its message.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a loom::Error";
  return "";
}

TEST(IndexingCpu, BadIndexNamesValuePositionAndSizeAndWritesNothing) {
  const int64_t R = 5, inner = 3;
  std::vector<float> table(size_t(R * inner), 1.f), rows(size_t(4 * inner), 2.f), before = table;
  const std::vector<int64_t> index = {0, 4, 5, 1};
  std::string msg = error_of([&] {
    cpu::index_add(table.data(), rows.data(), index.data(), 4, DType::f32, 1, R, inner, nullptr);
  });
  EXPECT_NE(msg.find("index_add"), std::string::npos) << msg;
  EXPECT_NE(msg.find("index 5 at position 2"), std::string::npos) << msg;
  EXPECT_NE(msg.find("size 5"), std::string::npos) << msg;
  EXPECT_EQ(table, before);

  const std::vector<int64_t> negative = {0, -1, 2, 3};
  msg = error_of([&] {
    cpu::index_select(rows.data(), table.data(), negative.data(), 4, DType::f32, 1, R, inner, nullptr);
  });
  EXPECT_NE(msg.find("index -1 at position 1"), std::string::npos) << msg;

  // (outer, J, inner) = (1, 4, 3): flat position 7 is (0, 2, 1).
  std::vector<int64_t> index3(12, 0);
  index3[7] = 9;
  msg = error_of([&] {
    cpu::scatter_add(table.data(), rows.data(), index3.data(), 4, DType::f32, 1, R, inner, nullptr);
  });
  EXPECT_NE(msg.find("scatter_add: index 9 at position (0, 2, 1)"), std::string::npos) << msg;
  EXPECT_EQ(table, before);
  msg = error_of([&] { cpu::gather(rows.data(), table.data(), index3.data(), 4, DType::f32, 1, R, inner, nullptr); });
  EXPECT_NE(msg.find("gather: index 9"), std::string::npos) << msg;
}

TEST(IndexingCpu, EmptyIndexIsANoOp) {
  std::vector<float> table = {1.f, 2.f};
  cpu::index_add(table.data(), nullptr, nullptr, 0, DType::f32, 1, 2, 1, nullptr);
  cpu::scatter_add(table.data(), nullptr, nullptr, 0, DType::f32, 1, 2, 1, nullptr);
  EXPECT_EQ(table, (std::vector<float>{1.f, 2.f}));
}

}  // namespace
}  // namespace loom
