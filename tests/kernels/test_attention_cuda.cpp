// The CUDA attention kernels (forward and backward) against the CPU ones on the same
// inputs, in f32, bf16 and f16: odd lengths that leave partial tiles (1, 7, 63, 65, 1023),
// head_dim 32 to 128 on the tensor-core path and others on the rows path, causal and not,
// fewer or more queries than keys, many heads, a peaked softmax, unaligned buffers (which
// must take the rows path), strided operands (column slices of packed buffers, other axis
// orders; rows aligned for the tensor cores or not), and sequences with no queries or no keys.
// The tensor-core backward runs both ways it has (dQ by atomics, and deterministic in a
// kernel of its own), and the deterministic one gives the same bits on a second run. Every
// GPU backward also writes its column sums (AttentionArgs::column_sums), checked against
// the sums of the gradients it wrote.
// The backward kernels of both devices get the same out and lse (the CPU forward's), so
// each comparison measures one kernel.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/table.h"
#include "tests/common/device_buffer.h"
#include "tests/common/float_bytes.h"
#include "tests/common/gpu.h"
#include "tests/kernels/attention_layout.h"

namespace loom {
namespace {

using test::column_sums_of;
using test::DeviceBuffer;
using test::decode;
using test::expect_column_sums;
using test::encode;
using test::place;
using test::take;

struct Case {
  int64_t B, H, Tq, Tk, D;
  bool causal;
  double scale = 0;  // 0: 1 / sqrt(D)
  std::string str() const {
    return "(B " + std::to_string(B) + ", H " + std::to_string(H) + ", Tq " + std::to_string(Tq) + ", Tk " +
           std::to_string(Tk) + ", D " + std::to_string(D) + (causal ? ", causal)" : ")");
  }
  AttentionArgs args(DType dt) const {
    return {dt, B, H, Tq, Tk, D, causal, scale != 0 ? scale : 1.0 / std::sqrt(double(D))};
  }
};

std::vector<Case> cases() {
  std::vector<Case> out;
  for (bool causal : {false, true}) {
    for (int64_t T : {1, 7, 63, 65})
      for (int64_t D : {32, 64, 128}) out.push_back({1, 2, T, T, D, causal});
    out.push_back({1, 1, 1023, 1023, 64, causal});
    out.push_back({2, 1, 130, 130, 80, causal});
    out.push_back({1, 2, 129, 129, 96, causal});
    out.push_back({1, 1, 100, 37, 64, causal});   // more queries than keys
    out.push_back({1, 1, 37, 200, 128, causal});  // more keys than queries
    out.push_back({2, 3, 300, 260, 128, causal});  // three 128-key blocks, the last short; five query tiles
    out.push_back({1, 2, 200, 500, 128, causal});  // four key blocks, causal blocks past every query
    out.push_back({1, 2, 45, 300, 64, causal});    // the same where warps own two row tiles
    out.push_back({2, 1, 257, 257, 32, causal});   // three 128-row tiles, the last with one row
    out.push_back({64, 40, 3, 3, 32, causal});    // 2560 heads
    out.push_back({1, 2, 70, 70, 40, causal});    // head_dim without a tensor-core kernel
    out.push_back({1, 1, 9, 9, 200, causal});
    out.push_back({1, 1, 80, 80, 64, causal, 4.0});  // peaked: scores in the hundreds
    out.push_back({1, 2, 65, 65, 64, causal, -0.5});  // negative scale: the scaled max is not the raw max
  }
  return out;
}


std::vector<uint8_t> random_bytes(int64_t n, uint32_t seed, DType dt) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> dist(-2, 2);
  std::vector<double> x(static_cast<size_t>(n));
  for (auto& e : x) e = dist(gen);
  return encode(x, dt);
}

// Error allowed relative to the tensor's largest magnitude: P and dS are rounded to the
// input type before their products on the tensor-core path, the CPU keeps them in f32.
// The magnitude is taken as at least 1, the size of the inputs (uniform in [-2, 2)) and so of
// the terms that cancel in a gradient that is exactly zero: with a single key the softmax is
// constant, dq and dk vanish in exact arithmetic, and each device leaves its own rounding.
double tolerance(DType dt) { return dt == DType::bf16 ? 2e-2 : dt == DType::f16 ? 4e-3 : 2e-4; }

// The column sums' rounding allowed relative to a column's magnitude: f32 sums of 64 rows,
// then of the tiles' partials.
double sums_tolerance(DType dt) { return dt == DType::f64 ? 1e-13 : 2e-5; }

void expect_close(const std::vector<double>& got, const std::vector<double>& want, double tol,
                  const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double scale = 1.0;
  for (double w : want)
    if (std::isfinite(w)) scale = std::max(scale, std::abs(w));
  int bad = 0;
  for (size_t e = 0; e < got.size() && bad < 5; ++e) {
    const bool ok =
        std::isinf(want[e]) ? got[e] == want[e] : std::abs(got[e] - want[e]) <= tol * (scale + std::abs(want[e]));
    if (!ok) ++bad, ADD_FAILURE() << what << " element " << e << ": cuda " << got[e] << ", cpu " << want[e];
  }
}

// A device copy of `host` at `offset` bytes past an aligned allocation.
struct Placed {
  DeviceBuffer<uint8_t> buffer;
  size_t offset;
  Placed(const std::vector<uint8_t>& host, size_t offset) : buffer(host.size() + offset), offset(offset) {
    LOOM_CUDA(cudaMemcpy(get(), host.data(), host.size(), cudaMemcpyHostToDevice));
  }
  uint8_t* get() const { return buffer.get() + offset; }
  std::vector<uint8_t> to_host() const {
    std::vector<uint8_t> all = buffer.to_host();
    return std::vector<uint8_t>(all.begin() + std::ptrdiff_t(offset), all.end());
  }
};

void check(const Case& c, DType dt, size_t offset, bool deterministic = false, bool hopper = true) {
  SCOPED_TRACE(c.str() + " " + std::string(dtype_name(dt)) + (offset ? " unaligned" : "") +
               (deterministic ? " deterministic" : "") + (hopper ? "" : " sm_80 kernels"));
  AttentionArgs a = c.args(dt);
  a.deterministic = deterministic;
  a.hopper = hopper;
  const int64_t nq = c.B * c.H * c.Tq * c.D, nk = c.B * c.H * c.Tk * c.D, nrows = c.B * c.H * c.Tq;
  const size_t es = dtype_size(dt);
  const uint32_t seed = uint32_t(c.Tq * 131 + c.Tk * 7 + c.D + (c.causal ? 1 : 0));
  auto q = random_bytes(nq, seed, dt), k = random_bytes(nk, seed + 1, dt), v = random_bytes(nk, seed + 2, dt);
  auto dout = random_bytes(nq, seed + 3, dt);

  const KernelTable& cpu = cpu_kernel_table();
  std::vector<uint8_t> out(size_t(nq) * es), dq(size_t(nq) * es), dk(size_t(nk) * es), dv(size_t(nk) * es);
  std::vector<float> lse(static_cast<size_t>(nrows));
  cpu.attention_forward(a, out.data(), lse.data(), q.data(), k.data(), v.data(), nullptr);
  cpu.attention_backward(a, dq.data(), dk.data(), dv.data(), dout.data(), q.data(), k.data(), v.data(), out.data(),
                         lse.data(), nullptr, nullptr);

  const KernelTable& gpu = cuda_kernel_table();
  Placed d_q(q, offset), d_k(k, offset), d_v(v, offset), d_dout(dout, offset), d_cpu_out(out, offset);
  Placed d_out(out, offset), d_dq(dq, offset), d_dk(dk, offset), d_dv(dv, offset);
  DeviceBuffer<float> d_lse(static_cast<size_t>(nrows)), d_cpu_lse(lse);
  DeviceBuffer<float> d_sums(size_t(3 * c.H * c.D));
  LOOM_CUDA(cudaMemset(d_sums.get(), 0xff, d_sums.size() * sizeof(float)));  // NaN until written
  a.column_sums = d_sums.get();
  DeviceBuffer<uint8_t> workspace(gpu.attention_workspace_size(a));
  LOOM_CUDA(cudaMemset(d_out.get(), 0xff, out.size()));  // NaN until written
  gpu.attention_forward(a, d_out.get(), d_lse.get(), d_q.get(), d_k.get(), d_v.get(), nullptr);
  for (Placed* g : {&d_dq, &d_dk, &d_dv}) LOOM_CUDA(cudaMemset(g->get(), 0xff, g->buffer.size() - g->offset));
  gpu.attention_backward(a, d_dq.get(), d_dk.get(), d_dv.get(), d_dout.get(), d_q.get(), d_k.get(), d_v.get(),
                         d_cpu_out.get(), d_cpu_lse.get(), workspace.get(), nullptr);

  const double tol = tolerance(dt);
  expect_close(decode(d_out.to_host(), dt), decode(out, dt), tol, "out");
  std::vector<float> got_lse = d_lse.to_host();
  for (int64_t r = 0; r < nrows; ++r)
    EXPECT_NEAR(got_lse[size_t(r)], lse[size_t(r)], 1e-4 * (std::abs(lse[size_t(r)]) + 1)) << "lse row " << r;
  const std::vector<double> got_dq = decode(d_dq.to_host(), dt), got_dk = decode(d_dk.to_host(), dt),
                            got_dv = decode(d_dv.to_host(), dt);
  expect_close(got_dq, decode(dq, dt), tol, "dq");
  expect_close(got_dk, decode(dk, dt), tol, "dk");
  expect_close(got_dv, decode(dv, dt), tol, "dv");
  const std::vector<float> sums = d_sums.to_host();
  expect_column_sums(std::vector<double>(sums.begin(), sums.end()),
                     column_sums_of(got_dq, got_dk, got_dv, c.B, c.H, c.Tq, c.Tk, c.D), sums_tolerance(dt),
                     "column sums");
}

TEST(AttentionCuda, ForwardAndBackwardMatchCpu) {
  LOOM_REQUIRE_CUDA();
  for (const Case& c : cases())
    for (DType dt : {DType::f32, DType::bf16, DType::f16}) check(c, dt, 0);
}

// On an H100 or H200 the test above ran the Hopper kernels where they apply (bf16/f16, head_dim
// 64 or 128; the backward with dQ by atomics); here every case runs the kernels of every
// target, their reference.
TEST(AttentionCuda, Sm80KernelsMatchCpu) {
  LOOM_REQUIRE_CUDA();
  for (const Case& c : cases())
    for (DType dt : {DType::bf16, DType::f16}) check(c, dt, 0, false, false);
}

TEST(AttentionCuda, DeterministicBackwardMatchesCpu) {
  LOOM_REQUIRE_CUDA();
  for (const Case& c : cases())
    for (DType dt : {DType::bf16, DType::f16}) check(c, dt, 0, true);
}

// dq, dk, dv and their column sums as bytes from one GPU forward and backward on fixed inputs.
std::vector<uint8_t> gpu_gradients(const AttentionArgs& a, uint32_t seed) {
  const int64_t nq = a.batch * a.heads * a.q_len * a.head_dim, nk = a.batch * a.heads * a.kv_len * a.head_dim;
  const size_t es = dtype_size(a.dtype);
  const KernelTable& gpu = cuda_kernel_table();
  DeviceBuffer<uint8_t> q(random_bytes(nq, seed, a.dtype)), k(random_bytes(nk, seed + 1, a.dtype)),
      v(random_bytes(nk, seed + 2, a.dtype)), dout(random_bytes(nq, seed + 3, a.dtype));
  DeviceBuffer<uint8_t> out(size_t(nq) * es), dq(size_t(nq) * es), dk(size_t(nk) * es), dv(size_t(nk) * es);
  DeviceBuffer<float> lse(size_t(a.batch * a.heads * a.q_len));
  DeviceBuffer<uint8_t> sums(size_t(3 * a.heads * a.head_dim) * sizeof(float));
  AttentionArgs summed = a;
  summed.column_sums = sums.get();
  DeviceBuffer<uint8_t> workspace(gpu.attention_workspace_size(summed));
  gpu.attention_forward(a, out.get(), lse.get(), q.get(), k.get(), v.get(), nullptr);
  gpu.attention_backward(summed, dq.get(), dk.get(), dv.get(), dout.get(), q.get(), k.get(), v.get(), out.get(),
                         lse.get(), workspace.get(), nullptr);
  std::vector<uint8_t> bytes = dq.to_host();
  for (const auto* g : {&dk, &dv, &sums}) {
    const std::vector<uint8_t> more = g->to_host();
    bytes.insert(bytes.end(), more.begin(), more.end());
  }
  return bytes;
}

// Deterministic: two runs, the same bits, at a size where many key blocks add into every
// query row (with atomics their order may differ from run to run). The workspace drops the
// f32 dQ accumulator the atomics need.
TEST(AttentionCuda, DeterministicBackwardRepeatsBitForBit) {
  LOOM_REQUIRE_CUDA();
  for (DType dt : {DType::bf16, DType::f16}) {
    SCOPED_TRACE(dtype_name(dt));
    AttentionArgs a = Case{2, 4, 1024, 1024, 64, true}.args(dt);
    const size_t with_atomics = cuda_kernel_table().attention_workspace_size(a);
    a.deterministic = true;
    EXPECT_LT(cuda_kernel_table().attention_workspace_size(a), with_atomics);
    EXPECT_TRUE(gpu_gradients(a, 11) == gpu_gradients(a, 11)) << "two deterministic backwards differ";
  }
}

TEST(AttentionCuda, UnalignedBuffersMatchCpu) {
  LOOM_REQUIRE_CUDA();
  // Offset by one element: the tensor-core kernels need 16-byte rows, so these take the rows path.
  for (const Case& c : {Case{1, 2, 65, 65, 64, true}, Case{2, 1, 33, 47, 32, false}})
    for (DType dt : {DType::f32, DType::bf16, DType::f16}) check(c, dt, dtype_size(dt));
}

// Every operand in a layout of its own, against the CPU kernels on contiguous copies: q in
// (B, T_q, C + q_pad) rows, k and v the two halves of one (B, T_kv, 2C) buffer, out in
// (B, T_q, H, D) order, dout in (H, B, T_q, D) order, dq in (B, T_q, C) rows, and dk, dv
// into one (B, T_kv, 2C) gradient. q_pad 8 keeps every row 16-byte aligned (bf16/f16 take
// the tensor cores, through the strides); q_pad 1 does not (both passes take the rows path).
void check_strided(const Case& c, DType dt, int64_t q_pad) {
  SCOPED_TRACE(c.str() + " " + std::string(dtype_name(dt)) + " q_pad " + std::to_string(q_pad));
  const int64_t B = c.B, H = c.H, Tq = c.Tq, Tk = c.Tk, D = c.D, C = H * D;
  const int64_t nq = B * H * Tq * D, nk = B * H * Tk * D;
  const size_t es = dtype_size(dt);
  const uint32_t seed = uint32_t(Tq * 17 + Tk * 5 + D + q_pad);
  // Dense inputs as rounded to dt, so both devices see the same numbers.
  const std::vector<double> q = decode(random_bytes(nq, seed, dt), dt), k = decode(random_bytes(nk, seed + 1, dt), dt),
                            v = decode(random_bytes(nk, seed + 2, dt), dt),
                            dout = decode(random_bytes(nq, seed + 3, dt), dt);

  const AttentionArgs dense_args = c.args(dt);
  const KernelTable& cpu = cpu_kernel_table();
  std::vector<uint8_t> out(size_t(nq) * es), dq(size_t(nq) * es), dk(size_t(nk) * es), dv(size_t(nk) * es);
  std::vector<float> lse(size_t(B * H * Tq));
  const auto bq = encode(q, dt), bk = encode(k, dt), bv = encode(v, dt), bdout = encode(dout, dt);
  cpu.attention_forward(dense_args, out.data(), lse.data(), bq.data(), bk.data(), bv.data(), nullptr);
  cpu.attention_backward(dense_args, dq.data(), dk.data(), dv.data(), bdout.data(), bq.data(), bk.data(), bv.data(),
                         out.data(), lse.data(), nullptr, nullptr);

  AttentionArgs a = dense_args;
  a.strides.q = {Tq * (C + q_pad), D, C + q_pad};
  a.strides.k = a.strides.v = a.strides.dk = a.strides.dv = {Tk * 2 * C, D, 2 * C};
  a.strides.out = a.strides.dq = {Tq * C, D, C};
  a.strides.dout = {Tq * D, B * Tq * D, D};
  std::vector<double> hq(size_t(B * Tq * (C + q_pad)), NAN), hkv(size_t(B * Tk * 2 * C), NAN), hdout(size_t(nq), NAN),
      hout(size_t(nq), NAN);
  place(hq, 0, a.strides.q, q, B, H, Tq, D);
  place(hkv, 0, a.strides.k, k, B, H, Tk, D);
  place(hkv, C, a.strides.v, v, B, H, Tk, D);
  place(hdout, 0, a.strides.dout, dout, B, H, Tq, D);
  place(hout, 0, a.strides.out, decode(out, dt), B, H, Tq, D);  // the CPU's out, for the backward

  const KernelTable& gpu = cuda_kernel_table();
  DeviceBuffer<uint8_t> d_q(encode(hq, dt)), d_kv(encode(hkv, dt)), d_dout(encode(hdout, dt)),
      d_cpu_out(encode(hout, dt));
  DeviceBuffer<uint8_t> d_out(size_t(nq) * es), d_dq(size_t(nq) * es), d_dkv(hkv.size() * es);
  DeviceBuffer<float> d_lse(lse.size()), d_cpu_lse(lse), d_sums(size_t(3 * C));
  a.column_sums = d_sums.get();
  DeviceBuffer<uint8_t> workspace(gpu.attention_workspace_size(a));
  for (auto* g : {&d_out, &d_dq, &d_dkv}) LOOM_CUDA(cudaMemset(g->get(), 0xff, g->size()));  // NaN until written
  LOOM_CUDA(cudaMemset(d_sums.get(), 0xff, d_sums.size() * sizeof(float)));
  const size_t v_at = size_t(C) * es;
  gpu.attention_forward(a, d_out.get(), d_lse.get(), d_q.get(), d_kv.get(), d_kv.get() + v_at, nullptr);
  gpu.attention_backward(a, d_dq.get(), d_dkv.get(), d_dkv.get() + v_at, d_dout.get(), d_q.get(), d_kv.get(),
                         d_kv.get() + v_at, d_cpu_out.get(), d_cpu_lse.get(), workspace.get(), nullptr);

  const double tol = tolerance(dt);
  const std::vector<double> got_out = decode(d_out.to_host(), dt), got_dq = decode(d_dq.to_host(), dt),
                            got_dkv = decode(d_dkv.to_host(), dt);
  expect_close(take(got_out, 0, a.strides.out, B, H, Tq, D), decode(out, dt), tol, "out");
  std::vector<float> got_lse = d_lse.to_host();
  for (size_t r = 0; r < lse.size(); ++r)
    EXPECT_NEAR(got_lse[r], lse[r], 1e-4 * (std::abs(lse[r]) + 1)) << "lse row " << r;
  expect_close(take(got_dq, 0, a.strides.dq, B, H, Tq, D), decode(dq, dt), tol, "dq");
  expect_close(take(got_dkv, 0, a.strides.dk, B, H, Tk, D), decode(dk, dt), tol, "dk");
  expect_close(take(got_dkv, C, a.strides.dv, B, H, Tk, D), decode(dv, dt), tol, "dv");
  const std::vector<float> sums = d_sums.to_host();
  expect_column_sums(std::vector<double>(sums.begin(), sums.end()),
                     column_sums_of(take(got_dq, 0, a.strides.dq, B, H, Tq, D), take(got_dkv, 0, a.strides.dk, B, H, Tk, D),
                                    take(got_dkv, C, a.strides.dv, B, H, Tk, D), B, H, Tq, Tk, D),
                     sums_tolerance(dt), "column sums");
  for (const auto* filled : {&got_out, &got_dq, &got_dkv})
    for (double e : *filled) ASSERT_FALSE(std::isnan(e)) << "out, dq and dk | dv fill their buffers";
}

TEST(AttentionCuda, StridedOperandsMatchCpu) {
  LOOM_REQUIRE_CUDA();
  for (bool causal : {false, true})
    for (const Case& c : {Case{2, 2, 77, 77, 64, causal}, Case{1, 3, 50, 130, 32, causal},
                          Case{1, 2, 130, 40, 128, causal}, Case{2, 2, 33, 33, 40, causal}})
      for (DType dt : {DType::bf16, DType::f16, DType::f32})
        for (int64_t q_pad : {8, 1}) check_strided(c, dt, q_pad);
}

TEST(AttentionCuda, F64MatchesCpu) {
  LOOM_REQUIRE_CUDA();
  for (const Case& c : {Case{1, 2, 65, 65, 64, true}, Case{1, 1, 30, 50, 24, false}}) {
    SCOPED_TRACE(c.str());
    const AttentionArgs a = c.args(DType::f64);
    const int64_t nq = c.B * c.H * c.Tq * c.D, nk = c.B * c.H * c.Tk * c.D, nrows = c.B * c.H * c.Tq;
    auto q = random_bytes(nq, 5, DType::f64), k = random_bytes(nk, 6, DType::f64), v = random_bytes(nk, 7, DType::f64);
    std::vector<uint8_t> out(q.size());
    std::vector<double> lse(static_cast<size_t>(nrows));
    cpu_kernel_table().attention_forward(a, out.data(), lse.data(), q.data(), k.data(), v.data(), nullptr);
    DeviceBuffer<uint8_t> d_q(q), d_k(k), d_v(v), d_out(out.size());
    DeviceBuffer<double> d_lse(static_cast<size_t>(nrows));
    cuda_kernel_table().attention_forward(a, d_out.get(), d_lse.get(), d_q.get(), d_k.get(), d_v.get(), nullptr);
    expect_close(decode(d_out.to_host(), DType::f64), decode(out, DType::f64), 1e-12, "out");
    expect_close(d_lse.to_host(), lse, 1e-12, "lse");
  }
}

TEST(AttentionCuda, NoKeysOrNoQueriesGiveZeros) {
  LOOM_REQUIRE_CUDA();
  for (DType dt : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dt));
    const KernelTable& gpu = cuda_kernel_table();
    const size_t es = dtype_size(dt);
    // No keys: out 0, lse -inf, dq 0.
    const AttentionArgs none_k{dt, 1, 2, 5, 0, 64, true, 0.125};
    DeviceBuffer<uint8_t> q(encode(std::vector<double>(640, 1.0), dt)), out(640 * es), dq(640 * es);
    DeviceBuffer<float> lse(10);
    DeviceBuffer<uint8_t> ws(gpu.attention_workspace_size(none_k));
    LOOM_CUDA(cudaMemset(out.get(), 0xff, 640 * es));
    LOOM_CUDA(cudaMemset(dq.get(), 0xff, 640 * es));
    gpu.attention_forward(none_k, out.get(), lse.get(), q.get(), nullptr, nullptr, nullptr);
    gpu.attention_backward(none_k, dq.get(), nullptr, nullptr, q.get(), q.get(), nullptr, nullptr, out.get(),
                           lse.get(), ws.get(), nullptr);
    for (double e : decode(out.to_host(), dt)) EXPECT_EQ(e, 0.0);
    for (float e : lse.to_host()) EXPECT_EQ(e, -std::numeric_limits<float>::infinity());
    for (double e : decode(dq.to_host(), dt)) EXPECT_EQ(e, 0.0);
    // No queries: dk and dv 0.
    const AttentionArgs none_q{dt, 1, 2, 0, 70, 64, false, 0.125};
    DeviceBuffer<uint8_t> k(encode(std::vector<double>(8960, 1.0), dt)), dk(8960 * es), dv(8960 * es);
    LOOM_CUDA(cudaMemset(dk.get(), 0xff, 8960 * es));
    LOOM_CUDA(cudaMemset(dv.get(), 0xff, 8960 * es));
    EXPECT_EQ(gpu.attention_workspace_size(none_q), 0u);
    gpu.attention_backward(none_q, nullptr, dk.get(), dv.get(), nullptr, nullptr, k.get(), k.get(), nullptr, nullptr,
                           nullptr, nullptr);
    for (double e : decode(dk.to_host(), dt)) EXPECT_EQ(e, 0.0);
    for (double e : decode(dv.to_host(), dt)) EXPECT_EQ(e, 0.0);
    // Column sums of either, and of a batch with no heads' rows at all, are zeros.
    for (AttentionArgs a : {none_k, none_q, AttentionArgs{dt, 0, 2, 5, 5, 64, true, 0.125}}) {
      DeviceBuffer<float> sums(size_t(3 * 2 * 64));
      LOOM_CUDA(cudaMemset(sums.get(), 0xff, sums.size() * sizeof(float)));
      a.column_sums = sums.get();
      DeviceBuffer<uint8_t> sum_ws(std::max<size_t>(gpu.attention_workspace_size(a), 1));
      LOOM_CUDA(cudaMemset(dk.get(), 0xff, 8960 * es));
      gpu.attention_backward(a, dq.get(), dk.get(), dv.get(), q.get(), q.get(), k.get(), k.get(), out.get(), lse.get(),
                             sum_ws.get(), nullptr);
      for (float e : sums.to_host()) EXPECT_EQ(e, 0.0f) << "B " << a.batch << ", Tq " << a.q_len << ", Tk " << a.kv_len;
    }
  }
}

}  // namespace
}  // namespace loom
