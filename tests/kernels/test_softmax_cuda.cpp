// The CUDA softmax, log-softmax and cross-entropy kernels (forward and backward) against the
// CPU ones on the same random inputs, over every launch path: a thread per (o, i) for short
// or strided rows, a warp per row, a block per row (up to 2^20 + 3 long), in every float
// dtype. A bad cross-entropy target traps the GPU context, so it is tested on the CPU only.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/table.h"
#include "tests/common/device_buffer.h"
#include "tests/common/float_bytes.h"
#include "tests/common/gpu.h"

namespace loom {
namespace {

using test::DeviceBuffer;
using test::decode;
using test::encode;

constexpr DType kDtypes[] = {DType::f32, DType::f64, DType::bf16, DType::f16};

struct Shape {
  int64_t outer, R, inner;
  int64_t numel() const { return outer * R * inner; }
  std::string str() const {
    std::ostringstream os;
    os << "(" << outer << ", " << R << ", " << inner << ")";
    return os.str();
  }
};

const Shape kShapes[] = {
    {4097, 10, 1},          // short rows: a thread per row
    {2, 17, 1},             // the shortest warp rows
    {1000, 1000, 1},        // a warp per row
    {513, 1025, 1},         // a block per row
    {1, (1 << 20) + 3, 1},  // one very long row
    {3, 513, 1025},         // strided: a thread per (o, i)
    {1, 100003, 3},         // few long strided rows
    {7, 1, 5},
    {1, 1, 1},
};


std::vector<double> random_values(int64_t n, uint32_t seed, double lo, double hi) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> dist(lo, hi);
  std::vector<double> x(n);
  for (auto& v : x) v = dist(gen);
  return x;
}

// Relative error allowed per dtype: one unit in the last place of 16-bit outputs (plus a
// little), f32 and f64 accumulation differences; and an absolute floor for f16 subnormals.
double rtol(DType dt) {
  return dt == DType::bf16 ? 1.0 / 64 : dt == DType::f16 ? 1.0 / 512 : dt == DType::f32 ? 3e-5 : 1e-12;
}
double atol(DType dt) { return dt == DType::f16 ? 1.2e-7 : 1e-30; }

// |got - want| <= rtol * scale + atol, element by element; NaN matches NaN.
void expect_close(const std::vector<double>& got, const std::vector<double>& want, const std::vector<double>& scale,
                  DType dt) {
  ASSERT_EQ(got.size(), want.size());
  int bad = 0;
  for (size_t k = 0; k < got.size() && bad < 5; ++k) {
    if (std::isnan(got[k]) && std::isnan(want[k])) continue;
    double tol = rtol(dt) * scale[k] + atol(dt);
    if (!(std::abs(got[k] - want[k]) <= tol)) {
      ++bad;
      ADD_FAILURE() << "element " << k << ": cuda " << got[k] << ", cpu " << want[k] << " (tol " << tol << ")";
    }
  }
}

std::vector<double> abs_plus(const std::vector<double>& v, double c) {
  std::vector<double> s(v.size());
  for (size_t k = 0; k < v.size(); ++k) s[k] = std::abs(v[k]) + c;
  return s;
}

TEST(SoftmaxCuda, ForwardMatchesCpu) {
  LOOM_REQUIRE_CUDA();
  uint32_t seed = 1;
  for (Shape s : kShapes)
    for (DType dt : kDtypes)
      for (bool log : {false, true}) {
        SCOPED_TRACE(std::string(log ? "log_softmax " : "softmax ") + s.str() + " " + std::string(dtype_name(dt)));
        auto in = encode(random_values(s.numel(), seed++, -4, 4), dt);
        std::vector<uint8_t> cpu_out(in.size());
        cpu_kernel_table().softmax(cpu_out.data(), in.data(), dt, s.outer, s.R, s.inner, log, nullptr);
        DeviceBuffer<uint8_t> d_in(in), d_out(in.size());
        cuda_kernel_table().softmax(d_out.get(), d_in.get(), dt, s.outer, s.R, s.inner, log, nullptr);
        auto want = decode(cpu_out, dt);
        // log_softmax values near 0 come from log(sum) near 0: an absolute term for them.
        expect_close(decode(d_out.to_host(), dt), want, abs_plus(want, log ? 1.0 : 0.0), dt);
      }
}

// Five rows of R: huge logits, masked (-inf) entries, fully masked (NaN on both devices),
// all equal, and one +inf (NaN throughout on both devices).
std::vector<double> extreme_rows(int64_t R) {
  std::vector<double> x(5 * R);
  for (int64_t r = 0; r < R; ++r) {
    x[r] = 1000 + double(r % 7);
    x[R + r] = r % 3 ? -INFINITY : double(r % 5);
    x[2 * R + r] = -INFINITY;
    x[3 * R + r] = 3;
    x[4 * R + r] = r == R / 2 ? INFINITY : 1;
  }
  return x;
}

TEST(SoftmaxCuda, MaskedAndHugeLogitsMatchCpu) {
  LOOM_REQUIRE_CUDA();
  for (int64_t R : {int64_t(4), int64_t(40), int64_t(2000)}) {
    // As (5, R, 1) rows, and the same bytes as (1, R, 5) columns.
    for (Shape s : {Shape{5, R, 1}, Shape{1, R, 5}})
      for (DType dt : kDtypes)
        for (bool log : {false, true}) {
          SCOPED_TRACE(s.str() + " " + std::string(dtype_name(dt)) + (log ? " log" : ""));
          auto in = encode(extreme_rows(R), dt);
          std::vector<uint8_t> cpu_out(in.size());
          cpu_kernel_table().softmax(cpu_out.data(), in.data(), dt, s.outer, s.R, s.inner, log, nullptr);
          DeviceBuffer<uint8_t> d_in(in), d_out(in.size());
          cuda_kernel_table().softmax(d_out.get(), d_in.get(), dt, s.outer, s.R, s.inner, log, nullptr);
          auto want = decode(cpu_out, dt), got = decode(d_out.to_host(), dt);
          int bad = 0;
          for (size_t k = 0; k < want.size() && bad < 5; ++k) {
            bool ok = std::isnan(want[k]) ? std::isnan(got[k])
                      : std::isinf(want[k]) ? got[k] == want[k]
                                            : std::abs(got[k] - want[k]) <= rtol(dt) * (std::abs(want[k]) + 1);
            if (!ok) ++bad, ADD_FAILURE() << "element " << k << ": cuda " << got[k] << ", cpu " << want[k];
          }
        }
  }
}

TEST(SoftmaxCuda, BackwardMatchesCpu) {
  LOOM_REQUIRE_CUDA();
  uint32_t seed = 100;
  for (Shape s : kShapes)
    for (DType dt : kDtypes)
      for (bool log : {false, true}) {
        SCOPED_TRACE(std::string(log ? "log_softmax " : "softmax ") + s.str() + " " + std::string(dtype_name(dt)));
        auto x = encode(random_values(s.numel(), seed++, -4, 4), dt);
        auto go = encode(random_values(s.numel(), seed++, -1, 1), dt);
        std::vector<uint8_t> y(x.size()), cpu_gi(x.size());
        cpu_kernel_table().softmax(y.data(), x.data(), dt, s.outer, s.R, s.inner, log, nullptr);
        cpu_kernel_table().softmax_backward(cpu_gi.data(), go.data(), y.data(), dt, s.outer, s.R, s.inner, log,
                                            nullptr);
        DeviceBuffer<uint8_t> d_go(go), d_y(y), d_gi(x.size());
        cuda_kernel_table().softmax_backward(d_gi.get(), d_go.get(), d_y.get(), dt, s.outer, s.R, s.inner, log,
                                             nullptr);
        // Scale: the sizes of the terms, so cancellation in go - sum(...) is not held
        // against the kernel. softmax: |y| (|go| + sum |go y|); log: |go| + e^y sum |go|.
        auto yd = decode(y, dt), god = decode(go, dt);
        std::vector<double> scale(yd.size());
        for (int64_t o = 0; o < s.outer; ++o)
          for (int64_t i = 0; i < s.inner; ++i) {
            auto at = [&](int64_t r) { return (o * s.R + r) * s.inner + i; };
            double row = 0;
            for (int64_t r = 0; r < s.R; ++r) row += std::abs(god[at(r)] * (log ? 1.0 : yd[at(r)]));
            for (int64_t r = 0; r < s.R; ++r) {
              int64_t k = at(r);
              scale[k] = log ? std::abs(god[k]) + std::exp(yd[k]) * row : std::abs(yd[k]) * (std::abs(god[k]) + row);
            }
          }
        expect_close(decode(d_gi.to_host(), dt), decode(cpu_gi, dt), scale, dt);
      }
}

struct CeCase {
  int64_t N, C;
};
// 1000 and 50304 are multiples of every pack width: rows read in packs, with and without a tail
// beyond the packs loaded four at a time.
const std::vector<CeCase> kCeCases = {{1031, 10},  {5, 1},      {64, 1024},   {9, 1000},
                                      {33, 1025},  {24, 50304}, {257, 50257}, {1, 100003}};

// Targets in [0, C), about one row in eight set to ignore_index (-100).
std::vector<int64_t> random_targets(int64_t N, int64_t C, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<int64_t> t(N);
  for (auto& v : t) v = gen() % 8 == 0 ? -100 : int64_t(gen() % uint64_t(C));
  return t;
}

// Runs f for every case, dtype and label smoothing (0 and 0.1), traced, with logits x
// (random in [-4, 4), encoded in the dtype) and targets t drawn from seeds counted up from
// `seed`; f may draw more from the same count.
template <class F> void for_each_ce_case(const std::vector<CeCase>& cases, uint32_t seed, F&& f) {
  for (CeCase c : cases)
    for (DType dt : kDtypes)
      for (double eps : {0.0, 0.1}) {
        SCOPED_TRACE((Shape{c.N, c.C, 1}.str()) + " " + std::string(dtype_name(dt)) + " label_smoothing " +
                     std::to_string(eps));
        const auto x = encode(random_values(c.N * c.C, seed++, -4, 4), dt);
        const auto t = random_targets(c.N, c.C, seed++);
        f(c, dt, eps, x, t, seed);
      }
}

TEST(CrossEntropyCuda, ForwardMatchesCpu) {
  LOOM_REQUIRE_CUDA();
  for_each_ce_case(kCeCases, 7, [](CeCase c, DType dt, double eps, const std::vector<uint8_t>& x,
                                    const std::vector<int64_t>& t, uint32_t& seed) {
    const DType acc = dt == DType::f64 ? DType::f64 : DType::f32;
    std::vector<uint8_t> loss_b(c.N * dtype_size(acc)), lse_b(c.N * dtype_size(acc));
    cpu_kernel_table().cross_entropy(loss_b.data(), lse_b.data(), x.data(), dt, t.data(), c.N, c.C, -100, eps,
                                     nullptr, 0, nullptr);
    auto loss = decode(loss_b, acc), lse = decode(lse_b, acc);
    DeviceBuffer<uint8_t> d_x(x);
    DeviceBuffer<int64_t> d_t(t);
    DeviceBuffer<uint8_t> d_loss(loss_b.size()), d_lse(lse_b.size());
    cuda_kernel_table().cross_entropy(d_loss.get(), d_lse.get(), d_x.get(), dt, d_t.get(), c.N, c.C, -100, eps,
                                      nullptr, 0, nullptr);
    const double rel = dt == DType::f64 ? 1e-9 : rtol(DType::f32);
    auto got_loss = decode(d_loss.to_host(), acc), got_lse = decode(d_lse.to_host(), acc);
    for (int64_t n = 0; n < c.N; ++n) {
      double tol = rel * (std::abs(lse[n]) + 1);
      EXPECT_NEAR(got_lse[n], lse[n], tol) << "row " << n;
      EXPECT_NEAR(got_loss[n], loss[n], tol) << "row " << n;
      if (t[n] == -100) {
        EXPECT_EQ(got_loss[n], 0.0) << "ignored row " << n;
      }
    }
  });
}

TEST(CrossEntropyCuda, BackwardMatchesCpu) {
  LOOM_REQUIRE_CUDA();
  for_each_ce_case(kCeCases, 70, [](CeCase c, DType dt, double eps, const std::vector<uint8_t>& x,
                                    const std::vector<int64_t>& t, uint32_t& seed) {
    const DType acc = dt == DType::f64 ? DType::f64 : DType::f32;
    const std::vector<double> xd = decode(x, dt);
    auto grad_row_b = encode(random_values(c.N, seed++, 0.5, 1.5), acc);
    std::vector<uint8_t> loss_b(c.N * dtype_size(acc)), lse_b(c.N * dtype_size(acc));
    cpu_kernel_table().cross_entropy(loss_b.data(), lse_b.data(), x.data(), dt, t.data(), c.N, c.C, -100, eps,
                                     nullptr, 0, nullptr);
    auto grad_row = decode(grad_row_b, acc), lse = decode(lse_b, acc);
    std::vector<uint8_t> cpu_g(x.size());
    cpu_kernel_table().cross_entropy_backward(cpu_g.data(), x.data(), lse_b.data(), t.data(), grad_row_b.data(),
                                              dt, c.N, c.C, -100, eps, nullptr);
    DeviceBuffer<uint8_t> d_x(x), d_g(x.size());
    DeviceBuffer<int64_t> d_t(t);
    DeviceBuffer<uint8_t> d_lse(lse_b), d_gr(grad_row_b);
    cuda_kernel_table().cross_entropy_backward(d_g.get(), d_x.get(), d_lse.get(), d_t.get(), d_gr.get(), dt, c.N,
                                               c.C, -100, eps, nullptr);
    // Scale: |g| (p + [c == t] + eps / C), the sizes of the terms before they cancel.
    std::vector<double> scale(xd.size());
    for (int64_t n = 0; n < c.N; ++n)
      for (int64_t k = 0; k < c.C; ++k)
        scale[n * c.C + k] = grad_row[n] * (std::exp(xd[n * c.C + k] - lse[n]) + (k == t[n]) + eps / double(c.C));
    expect_close(decode(d_g.to_host(), dt), decode(cpu_g, dt), scale, dt);
  });
}

// Equal bytes, else the first element (of elem bytes) that differs.
void expect_same_bytes(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want, size_t elem,
                       const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t k = 0; k < got.size(); ++k)
    if (got[k] != want[k]) {
      ADD_FAILURE() << what << ": element " << k / elem << " differs";
      return;
    }
}

// The forward asked for the gradient: the loss and lse it gives without, and the gradient
// the backward writes with grad_row = 1, bit for bit, into a buffer of its own or over the
// logits. Beyond kCeCases, 600 rows of 2056 are more rows than the grid has blocks.
TEST(CrossEntropyCuda, ForwardWritesTheBackwardsGradientOfUnitRows) {
  LOOM_REQUIRE_CUDA();
  std::vector<CeCase> cases = kCeCases;
  cases.push_back({600, 2056});
  for_each_ce_case(cases, 700, [](CeCase c, DType dt, double eps, const std::vector<uint8_t>& x,
                                    const std::vector<int64_t>& t, uint32_t& seed) {
    const DType acc = dt == DType::f64 ? DType::f64 : DType::f32;
    const size_t row_bytes = size_t(c.N) * dtype_size(acc);
    DeviceBuffer<uint8_t> d_x(x), d_in_place(x), d_ones(encode(std::vector<double>(size_t(c.N), 1.0), acc));
    DeviceBuffer<int64_t> d_t(t);
    DeviceBuffer<uint8_t> d_loss(row_bytes), d_lse(row_bytes), d_loss_g(row_bytes), d_lse_g(row_bytes),
        d_loss_i(row_bytes), d_lse_i(row_bytes), d_want(x.size()), d_grad(x.size());
    const auto& cuda = cuda_kernel_table();
    cuda.cross_entropy(d_loss.get(), d_lse.get(), d_x.get(), dt, d_t.get(), c.N, c.C, -100, eps, nullptr, 0, nullptr);
    cuda.cross_entropy_backward(d_want.get(), d_x.get(), d_lse.get(), d_t.get(), d_ones.get(), dt, c.N, c.C, -100,
                                eps, nullptr);
    cuda.cross_entropy(d_loss_g.get(), d_lse_g.get(), d_x.get(), dt, d_t.get(), c.N, c.C, -100, eps, d_grad.get(), 0,
                       nullptr);
    cuda.cross_entropy(d_loss_i.get(), d_lse_i.get(), d_in_place.get(), dt, d_t.get(), c.N, c.C, -100, eps,
                       d_in_place.get(), 0, nullptr);
    const size_t elem = dtype_size(dt), acc_elem = dtype_size(acc);
    const auto loss = d_loss.to_host(), lse = d_lse.to_host(), want = d_want.to_host();
    expect_same_bytes(d_loss_g.to_host(), loss, acc_elem, "loss");
    expect_same_bytes(d_lse_g.to_host(), lse, acc_elem, "lse");
    expect_same_bytes(d_grad.to_host(), want, elem, "gradient");
    expect_same_bytes(d_loss_i.to_host(), loss, acc_elem, "loss, in place");
    expect_same_bytes(d_lse_i.to_host(), lse, acc_elem, "lse, in place");
    expect_same_bytes(d_in_place.to_host(), want, elem, "gradient, in place");
  });
}

// extreme_rows as logits, packed (R = 40: a warp a row; 2000: a block) and not (R = 2001):
// the loss, log-sum-exp and gradient of each row as on the CPU, NaN where the CPU has NaN;
// the fully masked row (log-sum-exp -inf) is ignored, so its loss and gradient are exactly 0.
TEST(CrossEntropyCuda, MaskedAndHugeLogitsMatchCpu) {
  LOOM_REQUIRE_CUDA();
  const std::vector<int64_t> t = {3, 0, -100, 1, 2};
  // NaN where the CPU has NaN, the same infinity, else within tol.
  auto near = [](double got, double want, double tol) {
    return std::isnan(want) ? std::isnan(got) : std::isinf(want) ? got == want : std::abs(got - want) <= tol;
  };
  for (int64_t R : {int64_t(40), int64_t(2000), int64_t(2001)})
    for (DType dt : kDtypes) {
      SCOPED_TRACE("C " + std::to_string(R) + " " + std::string(dtype_name(dt)));
      auto x = encode(extreme_rows(R), dt);
      const DType acc = dt == DType::f64 ? DType::f64 : DType::f32;
      auto grad_row_b = encode(std::vector<double>(5, 1.0), acc);
      std::vector<uint8_t> loss_b(5 * dtype_size(acc)), lse_b(5 * dtype_size(acc)), cpu_g(x.size());
      cpu_kernel_table().cross_entropy(loss_b.data(), lse_b.data(), x.data(), dt, t.data(), 5, R, -100, 0.0, nullptr, 0,
                                       nullptr);
      cpu_kernel_table().cross_entropy_backward(cpu_g.data(), x.data(), lse_b.data(), t.data(), grad_row_b.data(), dt,
                                                5, R, -100, 0.0, nullptr);
      DeviceBuffer<uint8_t> d_x(x), d_g(x.size()), d_loss(loss_b.size()), d_lse(lse_b.size()), d_gr(grad_row_b);
      DeviceBuffer<int64_t> d_t(t);
      cuda_kernel_table().cross_entropy(d_loss.get(), d_lse.get(), d_x.get(), dt, d_t.get(), 5, R, -100, 0.0, nullptr,
                                        0, nullptr);
      cuda_kernel_table().cross_entropy_backward(d_g.get(), d_x.get(), d_lse.get(), d_t.get(), d_gr.get(), dt, 5, R,
                                                 -100, 0.0, nullptr);
      auto loss = decode(loss_b, acc), lse = decode(lse_b, acc), got_loss = decode(d_loss.to_host(), acc),
           got_lse = decode(d_lse.to_host(), acc);
      for (int n = 0; n < 5; ++n) {
        // The loss is lse minus a logit: its error is the lse's, relative to the lse's size.
        const double tol = (dt == DType::f64 ? 1e-9 : rtol(DType::f32)) * (std::isfinite(lse[n]) ? std::abs(lse[n]) + 1 : 1);
        EXPECT_TRUE(near(got_lse[n], lse[n], tol)) << "row " << n << ": lse cuda " << got_lse[n] << ", cpu " << lse[n];
        EXPECT_TRUE(near(got_loss[n], loss[n], tol)) << "row " << n << ": loss cuda " << got_loss[n] << ", cpu " << loss[n];
      }
      EXPECT_EQ(got_loss[2], 0.0);
      auto want = decode(cpu_g, dt), got = decode(d_g.to_host(), dt);
      int bad = 0;
      for (size_t k = 0; k < want.size() && bad < 5; ++k) {
        if (k / size_t(R) == 2 && got[k] != 0.0) ++bad, ADD_FAILURE() << "ignored row, element " << k % R << ": " << got[k];
        // Each device's softmax comes from its own lse, and at logits near 1000 two f32 lse may
        // differ by a few 1e-4 (a few ulp of 1000): 16 rtol(f32) beside the output's rounding.
        const double tol = rtol(dt) * std::abs(want[k]) + 16 * rtol(dt == DType::f64 ? dt : DType::f32) * (std::abs(want[k]) + 1e-3);
        if (!near(got[k], want[k], tol))
          ++bad, ADD_FAILURE() << "row " << k / R << ", element " << k % R << ": cuda " << got[k] << ", cpu " << want[k];
      }
      // The forward writing the gradient over the logits: the backward's values, bit for bit.
      DeviceBuffer<uint8_t> d_fused(x), d_loss_f(loss_b.size()), d_lse_f(lse_b.size());
      cuda_kernel_table().cross_entropy(d_loss_f.get(), d_lse_f.get(), d_fused.get(), dt, d_t.get(), 5, R, -100, 0.0,
                                        d_fused.get(), 0, nullptr);
      expect_same_bytes(d_fused.to_host(), d_g.to_host(), dtype_size(dt), "gradient written by the forward");
      expect_same_bytes(d_loss_f.to_host(), d_loss.to_host(), dtype_size(acc), "loss beside the gradient");
    }
}

}  // namespace
}  // namespace loom
