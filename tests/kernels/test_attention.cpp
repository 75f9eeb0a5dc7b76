// The CPU attention kernels against the naive composite in f64: scores, mask, softmax over
// the full (T_q, T_kv) matrix, then P V; and for the backward the textbook chain through
// that matrix (dP = dO V^T, dS = P (dP - rowsum(P dP)), dQ = scale dS K, ...), so the
// kernels' shortcuts (Di = rowsum(dO O), P recomputed from lse) are checked, not assumed.
// Strided operands (column slices, other axis orders) must give the contiguous results.
// The backward's column sums (AttentionArgs::column_sums) are those of the gradients it wrote.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels/cpu/exp_f32.h"
#include "kernels/cpu/vector_isa.h"
#include "kernels/table.h"
#include "tests/kernels/attention_layout.h"

namespace loom {
namespace {

using test::place;
using test::take;

struct Case {
  int64_t B, H, Tq, Tk, D;
  bool causal;
  double scale;  // 0: 1 / sqrt(D)
  std::string str() const {
    return "(B " + std::to_string(B) + ", H " + std::to_string(H) + ", Tq " + std::to_string(Tq) + ", Tk " +
           std::to_string(Tk) + ", D " + std::to_string(D) + (causal ? ", causal)" : ")");
  }
  AttentionArgs args(DType dt) const {
    return {dt, B, H, Tq, Tk, D, causal, scale != 0 ? scale : 1.0 / std::sqrt(double(D))};
  }
};

const Case kCases[] = {
    {1, 1, 5, 5, 4, false, 0.5},   {2, 3, 7, 7, 8, true, 0},  {1, 2, 4, 9, 3, true, 0},  // fewer queries than keys
    {1, 1, 9, 4, 5, true, 0},                                                          // more queries than keys
    {1, 2, 6, 6, 1, false, 0},     {1, 1, 17, 17, 16, true, 0}, {1, 1, 1, 1, 8, true, 0},
    {1, 1, 12, 12, 8, false, 3.0},  // peaked softmax
    {1, 2, 37, 37, 24, true, 0},    {2, 1, 21, 30, 40, false, 0},  // several blocks of four query rows
};

struct Result {
  std::vector<double> out, lse, dq, dk, dv;
};

struct Inputs {
  std::vector<double> q, k, v, dout;
};

Inputs random_inputs(const Case& c, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> dist(-2, 2);
  auto draw = [&](int64_t n) {
    std::vector<double> x(static_cast<size_t>(n));
    for (auto& e : x) e = dist(gen);
    return x;
  };
  const int64_t bh = c.B * c.H;
  return {draw(bh * c.Tq * c.D), draw(bh * c.Tk * c.D), draw(bh * c.Tk * c.D), draw(bh * c.Tq * c.D)};
}

Result naive(const Case& c, const Inputs& x) {
  const AttentionArgs a = c.args(DType::f64);
  const int64_t D = c.D, Tq = c.Tq, Tk = c.Tk;
  Result r{std::vector<double>(x.q.size()), std::vector<double>(size_t(c.B * c.H * Tq)),
           std::vector<double>(x.q.size()), std::vector<double>(x.k.size()), std::vector<double>(x.v.size())};
  std::vector<double> P(size_t(Tq * Tk)), dP(size_t(Tq * Tk));
  for (int64_t bh = 0; bh < c.B * c.H; ++bh) {
    const double* q = x.q.data() + bh * Tq * D;
    const double* k = x.k.data() + bh * Tk * D;
    const double* v = x.v.data() + bh * Tk * D;
    const double* go = x.dout.data() + bh * Tq * D;
    auto dot = [D](const double* u, const double* w) {
      double s = 0;
      for (int64_t d = 0; d < D; ++d) s += u[d] * w[d];
      return s;
    };
    for (int64_t i = 0; i < Tq; ++i) {
      double m = -INFINITY, sum = 0;
      for (int64_t j = 0; j < Tk; ++j) {
        const bool visible = !c.causal || j <= i;
        P[i * Tk + j] = visible ? a.scale * dot(q + i * D, k + j * D) : -INFINITY;
        m = std::max(m, P[i * Tk + j]);
      }
      for (int64_t j = 0; j < Tk; ++j) sum += P[i * Tk + j] == -INFINITY ? 0 : std::exp(P[i * Tk + j] - m);
      for (int64_t j = 0; j < Tk; ++j) P[i * Tk + j] = P[i * Tk + j] == -INFINITY ? 0 : std::exp(P[i * Tk + j] - m) / sum;
      r.lse[bh * Tq + i] = sum > 0 ? m + std::log(sum) : -INFINITY;
      for (int64_t d = 0; d < D; ++d) {
        double o = 0;
        for (int64_t j = 0; j < Tk; ++j) o += P[i * Tk + j] * v[j * D + d];
        r.out[(bh * Tq + i) * D + d] = o;
      }
    }
    for (int64_t i = 0; i < Tq; ++i) {
      double rowsum = 0;
      for (int64_t j = 0; j < Tk; ++j) {
        dP[i * Tk + j] = dot(go + i * D, v + j * D);
        rowsum += P[i * Tk + j] * dP[i * Tk + j];
      }
      for (int64_t j = 0; j < Tk; ++j) dP[i * Tk + j] = P[i * Tk + j] * (dP[i * Tk + j] - rowsum);  // dS
    }
    for (int64_t d = 0; d < D; ++d) {
      for (int64_t i = 0; i < Tq; ++i) {
        double s = 0;
        for (int64_t j = 0; j < Tk; ++j) s += dP[i * Tk + j] * k[j * D + d];
        r.dq[(bh * Tq + i) * D + d] = a.scale * s;
      }
      for (int64_t j = 0; j < Tk; ++j) {
        double sk = 0, sv = 0;
        for (int64_t i = 0; i < Tq; ++i) {
          sk += dP[i * Tk + j] * q[i * D + d];
          sv += P[i * Tk + j] * go[i * D + d];
        }
        r.dk[(bh * Tk + j) * D + d] = a.scale * sk;
        r.dv[(bh * Tk + j) * D + d] = sv;
      }
    }
  }
  return r;
}

template <class T> std::vector<T> cast(const std::vector<double>& x) {
  std::vector<T> out;
  for (double e : x) out.push_back(T(float(e)));
  return out;
}
template <> std::vector<double> cast(const std::vector<double>& x) { return x; }
template <class T> std::vector<double> widen(const std::vector<T>& x) {
  std::vector<double> out;
  for (const T& e : x) out.push_back(double(e));
  return out;
}

// The CPU kernels in T (inputs rounded to T first); also returns the rounded inputs.
// column_sums: where the backward writes AttentionArgs::column_sums, if anywhere.
template <class T> Result run_cpu(const Case& c, DType dt, Inputs& x, void* column_sums = nullptr) {
  using A = std::conditional_t<std::is_same_v<T, double>, double, float>;
  auto q = cast<T>(x.q), k = cast<T>(x.k), v = cast<T>(x.v), go = cast<T>(x.dout);
  x = {widen(q), widen(k), widen(v), widen(go)};
  AttentionArgs a = c.args(dt);
  a.column_sums = column_sums;
  std::vector<T> out(q.size()), dq(q.size()), dk(k.size()), dv(v.size());
  std::vector<A> lse(size_t(c.B * c.H * c.Tq));
  const KernelTable& cpu = cpu_kernel_table();
  EXPECT_EQ(cpu.attention_workspace_size(a), 0u);
  cpu.attention_forward(a, out.data(), lse.data(), q.data(), k.data(), v.data(), nullptr);
  cpu.attention_backward(a, dq.data(), dk.data(), dv.data(), go.data(), q.data(), k.data(), v.data(), out.data(),
                         lse.data(), nullptr, nullptr);
  return {widen(out), widen(lse), widen(dq), widen(dk), widen(dv)};
}

// |got - want| <= tol * (max |want| + |want|): errors measured against the tensor's scale.
void expect_close(const std::vector<double>& got, const std::vector<double>& want, double tol,
                  const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double scale = 1e-6;
  for (double w : want)
    if (std::isfinite(w)) scale = std::max(scale, std::abs(w));
  int bad = 0;
  for (size_t e = 0; e < got.size() && bad < 5; ++e) {
    const bool ok = std::isinf(want[e]) ? got[e] == want[e] : std::abs(got[e] - want[e]) <= tol * (scale + std::abs(want[e]));
    if (!ok) ++bad, ADD_FAILURE() << what << " element " << e << ": got " << got[e] << ", want " << want[e];
  }
}

template <class T> void check_all(DType dt, double tol) {
  uint32_t seed = 1;
  for (const Case& c : kCases) {
    SCOPED_TRACE(c.str() + " " + std::string(dtype_name(dt)));
    Inputs x = random_inputs(c, seed++);
    const Result got = run_cpu<T>(c, dt, x);
    const Result want = naive(c, x);  // on the inputs as rounded to T
    expect_close(got.out, want.out, tol, "out");
    expect_close(got.lse, want.lse, tol, "lse");
    expect_close(got.dq, want.dq, tol, "dq");
    expect_close(got.dk, want.dk, tol, "dk");
    expect_close(got.dv, want.dv, tol, "dv");
  }
}

TEST(AttentionCpu, MatchesNaiveCompositeInF64) { check_all<double>(DType::f64, 1e-12); }
TEST(AttentionCpu, MatchesNaiveCompositeInF32) { check_all<float>(DType::f32, 1e-5); }
TEST(AttentionCpu, MatchesNaiveCompositeInBf16) { check_all<bf16>(DType::bf16, 1.0 / 64); }

// The backward's column sums are those of dq, dk and dv as it wrote them, and asking for
// them changes no gradient.
template <class T> void check_column_sums(DType dt, double rel) {
  using A = std::conditional_t<std::is_same_v<T, double>, double, float>;
  uint32_t seed = 300;
  for (const Case& c : kCases) {
    SCOPED_TRACE(c.str() + " " + std::string(dtype_name(dt)));
    Inputs x = random_inputs(c, seed++), y = x;
    const Result plain = run_cpu<T>(c, dt, x);
    std::vector<A> sums(size_t(3 * c.H * c.D), std::numeric_limits<A>::quiet_NaN());
    const Result summed = run_cpu<T>(c, dt, y, sums.data());
    EXPECT_EQ(summed.dq, plain.dq);
    EXPECT_EQ(summed.dk, plain.dk);
    EXPECT_EQ(summed.dv, plain.dv);
    test::expect_column_sums(widen(sums), test::column_sums_of(summed.dq, summed.dk, summed.dv, c.B, c.H, c.Tq, c.Tk, c.D),
                             rel, "column sums");
  }
}

TEST(AttentionCpu, ColumnSumsAreThoseOfTheWrittenGradients) {
  check_column_sums<double>(DType::f64, 1e-15);
  check_column_sums<float>(DType::f32, 1e-7);
  check_column_sums<bf16>(DType::bf16, 1e-7);
}

TEST(AttentionCpu, ColumnSumsOfNoBatchAreZeros) {
  AttentionArgs a = Case{0, 3, 5, 5, 4, true, 0}.args(DType::f32);
  std::vector<float> sums(3 * 3 * 4, std::numeric_limits<float>::quiet_NaN());
  a.column_sums = sums.data();
  cpu_kernel_table().attention_backward(a, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                        nullptr, nullptr, nullptr);
  for (float e : sums) EXPECT_EQ(e, 0.0f);
}

TEST(AttentionCpu, CausalIsTopLeftAligned) {
  // Two queries, three keys: query 0 sees key 0 only (its output is v[0] exactly), query 1
  // sees keys 0 and 1, and key 2 no query: its gradients are zero.
  const Case c{1, 1, 2, 3, 2, true, 1.0};
  Inputs x = random_inputs(c, 42);
  const Result r = run_cpu<double>(c, DType::f64, x);
  EXPECT_EQ(r.out[0], x.v[0]);
  EXPECT_EQ(r.out[1], x.v[1]);
  EXPECT_NEAR(r.lse[0], x.q[0] * x.k[0] + x.q[1] * x.k[1], 1e-14);
  for (int d = 0; d < 2; ++d) {
    EXPECT_EQ(r.dk[2 * 2 + d], 0.0);
    EXPECT_EQ(r.dv[2 * 2 + d], 0.0);
  }
}

TEST(AttentionCpu, NoKeysGiveZerosAndMinusInfinity) {
  const AttentionArgs a{DType::f32, 1, 2, 3, 0, 4, false, 0.5};
  std::vector<float> q(24, 1.f), out(24, NAN), lse(6, NAN), dq(24, NAN), go(24, 1.f);
  const KernelTable& cpu = cpu_kernel_table();
  cpu.attention_forward(a, out.data(), lse.data(), q.data(), nullptr, nullptr, nullptr);
  cpu.attention_backward(a, dq.data(), nullptr, nullptr, go.data(), q.data(), nullptr, nullptr, out.data(), lse.data(),
                         nullptr, nullptr);
  for (float e : out) EXPECT_EQ(e, 0.f);
  for (float e : lse) EXPECT_EQ(e, -std::numeric_limits<float>::infinity());
  for (float e : dq) EXPECT_EQ(e, 0.f);
}

TEST(AttentionCpu, NoQueriesGiveZeroKeyGradients) {
  const AttentionArgs a{DType::f32, 2, 1, 0, 3, 4, true, 0.5};
  std::vector<float> k(24, 1.f), v(24, 1.f), dk(24, NAN), dv(24, NAN);
  cpu_kernel_table().attention_backward(a, nullptr, dk.data(), dv.data(), nullptr, nullptr, k.data(), v.data(),
                                        nullptr, nullptr, nullptr, nullptr);
  for (float e : dk) EXPECT_EQ(e, 0.f);
  for (float e : dv) EXPECT_EQ(e, 0.f);
}

TEST(AttentionCpu, StridedOperandsGiveTheContiguousResultsExactly) {
  // Every operand in a layout of its own: q in (B, T_q, C + 1) rows (an odd pitch), k and v
  // as the two halves of one (B, T_kv, 2C) buffer, out in (B, T_q, H, D) order, dout in
  // (H, B, T_q, D) order (head stride above batch stride), dq in (B, T_q, C) rows and dk, dv
  // into one (B, T_kv, 2C) gradient. Unwritten and unread elements are NaN, so a stray read
  // or a missed write shows.
  uint32_t seed = 100;
  for (const Case& c : kCases) {
    SCOPED_TRACE(c.str());
    Inputs x = random_inputs(c, seed++);
    const Result want = run_cpu<double>(c, DType::f64, x);
    const int64_t B = c.B, H = c.H, Tq = c.Tq, Tk = c.Tk, D = c.D, C = H * D;
    AttentionArgs a = c.args(DType::f64);
    a.strides.q = {Tq * (C + 1), D, C + 1};
    a.strides.k = a.strides.v = a.strides.dk = a.strides.dv = {Tk * 2 * C, D, 2 * C};
    a.strides.out = a.strides.dq = {Tq * C, D, C};
    a.strides.dout = {Tq * D, B * Tq * D, D};
    std::vector<double> q(size_t(B * Tq * (C + 1)), NAN), kv(size_t(B * Tk * 2 * C), NAN), dout(x.dout.size(), NAN);
    place(q, 0, a.strides.q, x.q, B, H, Tq, D);
    place(kv, 0, a.strides.k, x.k, B, H, Tk, D);
    place(kv, C, a.strides.v, x.v, B, H, Tk, D);
    place(dout, 0, a.strides.dout, x.dout, B, H, Tq, D);
    std::vector<double> out(size_t(B * Tq * C), NAN), lse(size_t(B * H * Tq), NAN), dq(out.size(), NAN),
        dkv(kv.size(), NAN), sums(size_t(3 * C), NAN);
    a.column_sums = sums.data();
    const KernelTable& cpu = cpu_kernel_table();
    cpu.attention_forward(a, out.data(), lse.data(), q.data(), kv.data(), kv.data() + C, nullptr);
    cpu.attention_backward(a, dq.data(), dkv.data(), dkv.data() + C, dout.data(), q.data(), kv.data(),
                           kv.data() + C, out.data(), lse.data(), nullptr, nullptr);
    EXPECT_EQ(take(out, 0, a.strides.out, B, H, Tq, D), want.out);
    EXPECT_EQ(lse, want.lse);
    EXPECT_EQ(take(dq, 0, a.strides.dq, B, H, Tq, D), want.dq);
    EXPECT_EQ(take(dkv, 0, a.strides.dk, B, H, Tk, D), want.dk);
    EXPECT_EQ(take(dkv, C, a.strides.dv, B, H, Tk, D), want.dv);
    EXPECT_EQ(sums, test::column_sums_of(want.dq, want.dk, want.dv, B, H, Tq, Tk, D).sums);
    for (const auto* filled : {&out, &dq, &dkv})
      for (double e : *filled) ASSERT_FALSE(std::isnan(e)) << "out, dq and dk | dv fill their buffers";
  }
}

// The kernels' loops run as a baseline copy or an AVX2 copy (kernels/cpu/vector_isa.h), which
// must give the same bits.
template <class T> void expect_copies_agree(DType dt) {
  uint32_t seed = 200;
  for (const Case& c : kCases) {
    SCOPED_TRACE(c.str() + " " + std::string(dtype_name(dt)));
    Inputs x = random_inputs(c, seed++);
    Inputs y = x;
    cpu::vector_isa::use_avx2(false);
    const Result baseline = run_cpu<T>(c, dt, x);
    cpu::vector_isa::use_avx2(true);
    const Result avx2 = run_cpu<T>(c, dt, y);
    // Bit for bit (-0 and NaN included): the results widened to f64 exactly.
    auto same_bits = [](const std::vector<double>& x, const std::vector<double>& y) {
      return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(double)) == 0;
    };
    EXPECT_TRUE(same_bits(avx2.out, baseline.out)) << "out";
    EXPECT_TRUE(same_bits(avx2.lse, baseline.lse)) << "lse";
    EXPECT_TRUE(same_bits(avx2.dq, baseline.dq)) << "dq";
    EXPECT_TRUE(same_bits(avx2.dk, baseline.dk)) << "dk";
    EXPECT_TRUE(same_bits(avx2.dv, baseline.dv)) << "dv";
  }
}

TEST(AttentionCpu, Avx2AndBaselineCopiesGiveTheSameBits) {
  if (!cpu::vector_isa::cpu_has_avx2()) GTEST_SKIP() << "this CPU has no AVX2";
  expect_copies_agree<float>(DType::f32);
  expect_copies_agree<bf16>(DType::bf16);
  expect_copies_agree<f16>(DType::f16);
  expect_copies_agree<double>(DType::f64);
  EXPECT_TRUE(cpu::vector_isa::avx2_copies_on());
}

// The f32 exp of the CPU attention (kernels/cpu/exp_f32.h): within 2 ulp of the f64 exp
// rounded (the ulp below it) over every 16th float from -87 to 88.72283, the largest whose
// exp is finite (normal results), within one subnormal step of it from -104 to -87, and its
// edges.
TEST(AttentionCpu, ExpF32IsWithinTwoUlp) {
  double worst = 0;
  float worst_at = 0;
  auto check = [&](float x) {
    const double want = std::exp(double(x));
    const float rounded = float(want);
    const double ulp = std::fabs(double(rounded) - double(std::nextafter(rounded, 0.f)));
    const double err = std::fabs(double(cpu::exp_f32(x)) - want) / ulp;
    if (err > worst) worst = err, worst_at = x;
  };
  for (const auto& [from, to] : {std::pair{0.f, 88.72283f}, std::pair{-0.f, -87.f}}) {
    uint32_t lo = 0, hi = 0;
    std::memcpy(&lo, &from, 4);
    std::memcpy(&hi, &to, 4);
    for (uint32_t bits = lo; bits <= hi; bits += 16) {
      float x = 0;
      std::memcpy(&x, &bits, 4);
      check(x);
    }
  }
  check(88.72283f);
  EXPECT_LE(worst, 2.0) << "at x = " << worst_at;
  const double subnormal = std::numeric_limits<float>::denorm_min();
  for (float x = -104.f; x < -87.f; x += 1.f / 64)
    EXPECT_LE(std::fabs(double(cpu::exp_f32(x)) - std::exp(double(x))), subnormal) << "at x = " << x;
  EXPECT_EQ(cpu::exp_f32(0.f), 1.f);
  EXPECT_EQ(cpu::exp_f32(-0.f), 1.f);
  EXPECT_EQ(cpu::exp_f32(-std::numeric_limits<float>::infinity()), 0.f);
  EXPECT_EQ(cpu::exp_f32(-1e30f), 0.f);
  EXPECT_EQ(cpu::exp_f32(std::numeric_limits<float>::infinity()), std::numeric_limits<float>::infinity());
  EXPECT_EQ(cpu::exp_f32(88.7228394f), std::numeric_limits<float>::infinity());  // exp just past FLT_MAX
  EXPECT_EQ(cpu::exp_f32(89.f), std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(cpu::exp_f32(std::numeric_limits<float>::quiet_NaN())));
}

}  // namespace
}  // namespace loom
