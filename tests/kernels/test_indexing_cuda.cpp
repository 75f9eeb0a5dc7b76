// The CUDA indexing kernels against the CPU ones on the same inputs, for every dtype.
// Values are small integers, so the atomic sums of index_add and scatter_add are exact
// in every dtype (bf16 included) whatever order the GPU adds them in, and the results
// must match to the bit. A bad index traps on the GPU, which would end the test process,
// so that path is documented in kernels/cuda/indexing.cu rather than tested here.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/cpu/kernels.h"
#include "kernels/cuda/kernels.h"
#include "tests/common/device_buffer.h"
#include "tests/common/gpu.h"

namespace loom {
namespace {

using test::DeviceBuffer;

struct Shape {
  int64_t outer, R, inner, J;  // J: n_index for index_select/index_add, the gathered extent otherwise
};

// The last shape puts ~6 updates on every target element, up to ~20: sums stay below
// 256, exact in bf16 and without wrapping in u8.
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
std::vector<T> small_integers(int64_t n, int max, std::mt19937& rng) {
  std::uniform_int_distribution<int> dist(0, max);
  std::vector<T> v(static_cast<size_t>(n));
  for (auto& x : v) {
    if constexpr (std::is_same_v<T, bf16> || std::is_same_v<T, f16>) x = T(float(dist(rng)));
    else x = T(dist(rng));
  }
  return v;
}

template <class T>
void expect_same_bits(const std::vector<T>& got, const std::vector<T>& want, const char* op) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_EQ(std::memcmp(&got[i], &want[i], sizeof(T)), 0) << op << ": element " << i;
}

template <class T>
void check_all_ops() {
  SCOPED_TRACE(std::string(dtype_name(dtype_of<T>())));
  std::mt19937 rng(5);
  for (const Shape& s : kShapes) {
    SCOPED_TRACE(testing::Message() << "(outer, R, inner, J) = (" << s.outer << ", " << s.R << ", " << s.inner
                                    << ", " << s.J << ")");
    const DType dt = dtype_of<T>();
    const auto table = small_integers<T>(s.outer * s.R * s.inner, 3, rng);
    const auto rows = small_integers<T>(s.outer * s.J * s.inner, 1, rng);
    const auto index = small_integers<int64_t>(s.J, int(s.R - 1), rng);
    const auto index3 = small_integers<int64_t>(s.outer * s.J * s.inner, int(s.R - 1), rng);
    DeviceBuffer<T> d_table(table), d_rows(rows);
    DeviceBuffer<int64_t> d_index(index), d_index3(index3);

    std::vector<T> want(rows.size());
    DeviceBuffer<T> d_out(rows.size());
    cpu::index_select(want.data(), table.data(), index.data(), s.J, dt, s.outer, s.R, s.inner, nullptr);
    cuda::index_select(d_out.get(), d_table.get(), d_index.get(), s.J, dt, s.outer, s.R, s.inner, nullptr);
    expect_same_bits(d_out.to_host(), want, "index_select");

    cpu::gather(want.data(), table.data(), index3.data(), s.J, dt, s.outer, s.R, s.inner, nullptr);
    cuda::gather(d_out.get(), d_table.get(), d_index3.get(), s.J, dt, s.outer, s.R, s.inner, nullptr);
    expect_same_bits(d_out.to_host(), want, "gather");

    auto acc_want = table;
    DeviceBuffer<T> d_acc(table);
    cpu::index_add(acc_want.data(), rows.data(), index.data(), s.J, dt, s.outer, s.R, s.inner, nullptr);
    cuda::index_add(d_acc.get(), d_rows.get(), d_index.get(), s.J, dt, s.outer, s.R, s.inner, nullptr);
    expect_same_bits(d_acc.to_host(), acc_want, "index_add");

    acc_want = table;
    DeviceBuffer<T> d_acc3(table);
    cpu::scatter_add(acc_want.data(), rows.data(), index3.data(), s.J, dt, s.outer, s.R, s.inner, nullptr);
    cuda::scatter_add(d_acc3.get(), d_rows.get(), d_index3.get(), s.J, dt, s.outer, s.R, s.inner, nullptr);
    expect_same_bits(d_acc3.to_host(), acc_want, "scatter_add");
  }
}

TEST(IndexingCuda, MatchesCpuF32) { LOOM_REQUIRE_CUDA(); check_all_ops<float>(); }
TEST(IndexingCuda, MatchesCpuF64) { LOOM_REQUIRE_CUDA(); check_all_ops<double>(); }
TEST(IndexingCuda, MatchesCpuBf16) { LOOM_REQUIRE_CUDA(); check_all_ops<bf16>(); }
TEST(IndexingCuda, MatchesCpuF16) { LOOM_REQUIRE_CUDA(); check_all_ops<f16>(); }
TEST(IndexingCuda, MatchesCpuI32) { LOOM_REQUIRE_CUDA(); check_all_ops<int32_t>(); }
TEST(IndexingCuda, MatchesCpuI64) { LOOM_REQUIRE_CUDA(); check_all_ops<int64_t>(); }
TEST(IndexingCuda, MatchesCpuU8) { LOOM_REQUIRE_CUDA(); check_all_ops<uint8_t>(); }

// Token and position embeddings, forward and backward: 16-byte packs (C = 8, 64 in every
// dtype, 12 in the 4-byte ones) and single values (C = 6); wpe has two rows past T, which
// the backward leaves alone. Small integers keep the atomic sums exact.
template <class T> void check_embedding_sum() {
  SCOPED_TRACE(std::string(dtype_name(dtype_of<T>())));
  struct Case {
    int64_t B, L, C, V;  // L: the sequence length
  };
  std::mt19937 rng(11);
  for (const Case& c : {Case{2, 3, 8, 5}, Case{3, 5, 12, 4}, Case{2, 4, 6, 9}, Case{16, 64, 64, 30}}) {
    SCOPED_TRACE(testing::Message() << "(B, T, C, V) = (" << c.B << ", " << c.L << ", " << c.C << ", " << c.V << ")");
    const DType dt = dtype_of<T>();
    const int64_t P = c.L + 2;
    const auto wte = small_integers<T>(c.V * c.C, 3, rng), wpe = small_integers<T>(P * c.C, 3, rng);
    const auto grad = small_integers<T>(c.B * c.L * c.C, 1, rng);
    const auto ids = small_integers<int64_t>(c.B * c.L, int(c.V - 1), rng);
    DeviceBuffer<T> d_wte(wte), d_wpe(wpe), d_grad(grad), d_out(size_t(c.B * c.L * c.C));
    DeviceBuffer<int64_t> d_ids(ids);
    std::vector<T> want(size_t(c.B * c.L * c.C));
    cpu::embedding_sum(want.data(), wte.data(), wpe.data(), ids.data(), c.B, c.L, c.C, c.V, dt, nullptr);
    cuda::embedding_sum(d_out.get(), d_wte.get(), d_wpe.get(), d_ids.get(), c.B, c.L, c.C, c.V, dt, nullptr);
    expect_same_bits(d_out.to_host(), want, "embedding_sum");

    auto dwte_want = wte, dwpe_want = wpe;  // added into, and written for t < T
    DeviceBuffer<T> d_dwte(wte), d_dwpe(wpe);
    cpu::embedding_sum_backward(dwte_want.data(), dwpe_want.data(), grad.data(), ids.data(), c.B, c.L, c.C, c.V, dt,
                                nullptr);
    cuda::embedding_sum_backward(d_dwte.get(), d_dwpe.get(), d_grad.get(), d_ids.get(), c.B, c.L, c.C, c.V, dt,
                                 nullptr);
    expect_same_bits(d_dwte.to_host(), dwte_want, "embedding_sum backward, wte");
    expect_same_bits(d_dwpe.to_host(), dwpe_want, "embedding_sum backward, wpe");
    DeviceBuffer<T> d_only(wte);  // one output asked for
    cuda::embedding_sum_backward(d_only.get(), nullptr, d_grad.get(), d_ids.get(), c.B, c.L, c.C, c.V, dt, nullptr);
    expect_same_bits(d_only.to_host(), dwte_want, "embedding_sum backward, wte alone");
  }
}

TEST(IndexingCuda, EmbeddingSumMatchesCpu) {
  LOOM_REQUIRE_CUDA();
  check_embedding_sum<float>();
  check_embedding_sum<double>();
  check_embedding_sum<bf16>();
  check_embedding_sum<f16>();
}

// Neighbouring bytes of one 32-bit word take concurrent u8 updates through the
// compare-and-swap path; none may be lost and none may spill into its neighbours.
TEST(IndexingCuda, U8AtomicsOnSharedWordsLoseNothing) {
  LOOM_REQUIRE_CUDA();
  const int64_t R = 8, J = 4000;
  std::vector<int64_t> index(static_cast<size_t>(J));
  for (int64_t j = 0; j < J; ++j) index[size_t(j)] = j % R;
  std::vector<uint8_t> src(static_cast<size_t>(J), 1);
  DeviceBuffer<uint8_t> d_out(std::vector<uint8_t>(size_t(R), 0)), d_src(src);
  DeviceBuffer<int64_t> d_index(index);
  cuda::index_add(d_out.get(), d_src.get(), d_index.get(), J, DType::u8, 1, R, 1, nullptr);
  for (uint8_t v : d_out.to_host()) EXPECT_EQ(int(v), (J / R) % 256);  // 500 updates each, modulo 256
}

}  // namespace
}  // namespace loom
