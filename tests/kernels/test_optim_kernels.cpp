// The CPU multi-tensor optimizer kernels against torch.optim's rules written out per element
// in double below. Each step starts from the kernel's own state (parameters and buffers as
// the kernel left them, in their dtype) and the reference takes that step in double, so a
// step's result must match to the dtype's rounding, with no drift to allow for.
//
// The tensors have odd sizes (1, 3, an empty one, 1025, 65537 + 5 so the range splits over
// threads) and join the calls at different steps: the even ones from step 1, the odd ones
// from step 2, as parameters whose gradient first appears later do. Adam's step counts
// differ per tensor.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/cpu/kernels.h"

namespace loom {
namespace {

const std::vector<int64_t> kSizes = {1, 3, 0, 1025, 65537 + 5, 7};
constexpr int kSteps = 3;

// A tensor's bytes on the host, read and written as doubles.
class HostTensor {
 public:
  HostTensor(DType t, int64_t n) : dtype_(t), n_(n), bytes_(size_t(n) * dtype_size(t), 0x5a) {}

  int64_t numel() const { return n_; }
  void* data() { return bytes_.data(); }

  double get(int64_t i) const {
    const unsigned char* p = bytes_.data() + size_t(i) * dtype_size(dtype_);
    auto load = [p](auto v) { std::memcpy(&v, p, sizeof(v)); return v; };
    switch (dtype_) {
      case DType::f32: return load(float{});
      case DType::f64: return load(double{});
      case DType::bf16: return float(load(bf16{}));
      case DType::f16: return float(load(f16{}));
      default: return 0;
    }
  }
  void set(int64_t i, double v) {
    unsigned char* p = bytes_.data() + size_t(i) * dtype_size(dtype_);
    auto store = [p](auto x) { std::memcpy(p, &x, sizeof(x)); };
    switch (dtype_) {
      case DType::f32: return store(float(v));
      case DType::f64: return store(v);
      case DType::bf16: return store(bf16(float(v)));
      case DType::f16: return store(f16(float(v)));
      default: return;
    }
  }

 private:
  DType dtype_;
  int64_t n_;
  std::vector<unsigned char> bytes_;
};

std::vector<HostTensor> tensors(DType t, double lo, double hi, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> u(lo, hi);
  std::vector<HostTensor> out;
  for (int64_t n : kSizes) {
    out.emplace_back(t, n);
    for (int64_t i = 0; i < n; ++i) out.back().set(i, u(rng));
  }
  return out;
}

std::vector<HostTensor> filled(DType t, double value) {
  std::vector<HostTensor> out;
  for (int64_t n : kSizes) {
    out.emplace_back(t, n);
    for (int64_t i = 0; i < n; ++i) out.back().set(i, value);
  }
  return out;
}

// One rounding of the dtype (a result the kernel rounds from f32 may land one unit of the
// last place from the exact one) plus the f32 arithmetic on the way.
struct Tol {
  double rtol, atol;
};
Tol tol_for(DType t) {
  switch (t) {
    case DType::f64: return {1e-13, 1e-15};
    case DType::f32: return {4e-6, 1e-7};
    case DType::bf16: return {1.0 / 128, 1e-6};
    case DType::f16: return {1.0 / 1024, 1e-6};
    default: return {0, 0};
  }
}

void expect_near(const HostTensor& got, const std::vector<double>& want, Tol tol, const std::string& what) {
  int64_t bad = 0;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double g = got.get(i), w = want[size_t(i)];
    if (std::abs(g - w) <= tol.atol + tol.rtol * std::abs(w)) continue;
    if (++bad <= 3) ADD_FAILURE() << what << "[" << i << "]: got " << g << ", expected " << w;
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << got.numel() << " elements differ";
}

// The tensors in the call at `step`: the even ones from step 1, the odd ones from step 2.
bool active(size_t i, int step) { return step >= 2 || i % 2 == 0; }
bool joins_at(size_t i, int step) { return step == (i % 2 == 0 ? 1 : 2); }

// Parallel lists over the active tensors, as the engine hands them to the kernel.
struct Call {
  std::vector<size_t> index;
  std::vector<void*> params, state1, state2;
  std::vector<const void*> grads;
  std::vector<int64_t> numel;

  MultiTensorArgs args(DType t) const {
    MultiTensorArgs a;
    a.dtype = t;
    a.count = int64_t(index.size());
    a.params = params.data();
    a.grads = grads.data();
    a.state1 = state1.empty() ? nullptr : state1.data();
    a.state2 = state2.empty() ? nullptr : state2.data();
    a.numel = numel.data();
    return a;
  }
};

std::string dtype_label(DType t) { return std::string(dtype_name(t)); }

// ---- SGD ------------------------------------------------------------------------------

struct SgdCase {
  std::string name;
  double lr, momentum, dampening, weight_decay;
  bool nesterov;
};

// torch.optim.SGD for one element; b is the momentum buffer.
double reference_sgd(const SgdCase& c, double p, double g, double& b, bool first) {
  double d = g + c.weight_decay * p;
  if (c.momentum != 0) {
    b = first ? d : c.momentum * b + (1 - c.dampening) * d;
    d = c.nesterov ? d + c.momentum * b : b;
  }
  return p - c.lr * d;
}

class SgdKernel : public ::testing::TestWithParam<std::tuple<SgdCase, DType>> {};

TEST_P(SgdKernel, MatchesTorchRulesStepByStep) {
  const auto& [c, dtype] = GetParam();
  std::mt19937_64 rng(7);
  std::vector<HostTensor> p = tensors(dtype, -1, 1, rng);
  std::vector<HostTensor> b = filled(dtype, std::nan(""));  // a new buffer's contents must not be read
  const bool momentum = c.momentum != 0;
  for (int step = 1; step <= kSteps; ++step) {
    std::vector<HostTensor> g = tensors(dtype, -1, 1, rng);
    Call call;
    std::vector<uint8_t> first;
    std::vector<std::vector<double>> want_p(kSizes.size()), want_b(kSizes.size());
    for (size_t i = 0; i < kSizes.size(); ++i) {
      if (!active(i, step)) continue;
      call.index.push_back(i);
      call.params.push_back(p[i].data());
      call.grads.push_back(g[i].data());
      call.numel.push_back(kSizes[i]);
      if (momentum) call.state1.push_back(b[i].data());
      first.push_back(joins_at(i, step) ? 1 : 0);
      for (int64_t k = 0; k < kSizes[i]; ++k) {
        double buf = b[i].get(k);
        want_p[i].push_back(reference_sgd(c, p[i].get(k), g[i].get(k), buf, first.back() != 0));
        want_b[i].push_back(buf);
      }
    }
    SgdHyper h;
    h.lr = c.lr, h.momentum = c.momentum, h.dampening = c.dampening, h.weight_decay = c.weight_decay;
    h.nesterov = c.nesterov;
    h.first = momentum ? first.data() : nullptr;
    cpu::sgd_step(call.args(dtype), h, nullptr);
    for (size_t i : call.index) {
      const std::string at = "step " + std::to_string(step) + " tensor " + std::to_string(i);
      expect_near(p[i], want_p[i], tol_for(dtype), at + " param");
      if (momentum) expect_near(b[i], want_b[i], tol_for(dtype), at + " momentum_buffer");
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Optim, SgdKernel,
    ::testing::Combine(::testing::Values(SgdCase{"plain", 0.1, 0, 0, 0, false},
                                         SgdCase{"momentum", 0.1, 0.9, 0, 0, false},
                                         SgdCase{"dampening", 0.05, 0.9, 0.3, 0, false},
                                         SgdCase{"nesterov", 0.1, 0.9, 0, 0, true},
                                         SgdCase{"weight_decay", 0.1, 0, 0, 0.05, false},
                                         SgdCase{"all", 0.07, 0.8, 0, 0.05, true}),
                       ::testing::Values(DType::f32, DType::f64, DType::bf16, DType::f16)),
    [](const auto& info) { return std::get<0>(info.param).name + "_" + dtype_label(std::get<1>(info.param)); });

// ---- Adam and AdamW --------------------------------------------------------------------

struct AdamCase {
  std::string name;
  double lr, beta1, beta2, eps, weight_decay;
  bool decoupled;
};

// torch.optim.Adam / AdamW for one element at step t (counting this one).
double reference_adam(const AdamCase& c, double p, double g, double& m, double& v, int64_t t) {
  if (c.decoupled) p *= 1 - c.lr * c.weight_decay;
  else g += c.weight_decay * p;
  m = c.beta1 * m + (1 - c.beta1) * g;
  v = c.beta2 * v + (1 - c.beta2) * g * g;
  const double m_hat = m / (1 - std::pow(c.beta1, double(t)));
  const double v_hat = v / (1 - std::pow(c.beta2, double(t)));
  return p - c.lr * m_hat / (std::sqrt(v_hat) + c.eps);
}

class AdamKernel : public ::testing::TestWithParam<std::tuple<AdamCase, DType>> {};

TEST_P(AdamKernel, MatchesTorchRulesStepByStep) {
  const auto& [c, dtype] = GetParam();
  std::mt19937_64 rng(11);
  std::vector<HostTensor> p = tensors(dtype, -1, 1, rng);
  std::vector<HostTensor> m = filled(dtype, 0), v = filled(dtype, 0);
  std::vector<int64_t> count(kSizes.size(), 0);
  for (size_t i = 0; i < kSizes.size(); ++i) count[i] = int64_t(i % 3) * 5;  // tensors resumed at other steps
  for (int step = 1; step <= kSteps; ++step) {
    std::vector<HostTensor> g = tensors(dtype, -1, 1, rng);
    Call call;
    std::vector<int64_t> steps;
    std::vector<std::vector<double>> want_p(kSizes.size()), want_m(kSizes.size()), want_v(kSizes.size());
    for (size_t i = 0; i < kSizes.size(); ++i) {
      if (!active(i, step)) continue;
      call.index.push_back(i);
      call.params.push_back(p[i].data());
      call.grads.push_back(g[i].data());
      call.state1.push_back(m[i].data());
      call.state2.push_back(v[i].data());
      call.numel.push_back(kSizes[i]);
      steps.push_back(++count[i]);
      for (int64_t k = 0; k < kSizes[i]; ++k) {
        double mk = m[i].get(k), vk = v[i].get(k);
        want_p[i].push_back(reference_adam(c, p[i].get(k), g[i].get(k), mk, vk, steps.back()));
        want_m[i].push_back(mk);
        want_v[i].push_back(vk);
      }
    }
    AdamHyper h;
    h.lr = c.lr, h.beta1 = c.beta1, h.beta2 = c.beta2, h.eps = c.eps, h.weight_decay = c.weight_decay;
    h.decoupled = c.decoupled;
    h.step = steps.data();
    cpu::adam_step(call.args(dtype), h, nullptr);
    for (size_t i : call.index) {
      const std::string at = "step " + std::to_string(step) + " tensor " + std::to_string(i);
      expect_near(p[i], want_p[i], tol_for(dtype), at + " param");
      expect_near(m[i], want_m[i], tol_for(dtype), at + " exp_avg");
      expect_near(v[i], want_v[i], tol_for(dtype), at + " exp_avg_sq");
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Optim, AdamKernel,
    ::testing::Combine(::testing::Values(AdamCase{"adam", 0.01, 0.9, 0.999, 1e-8, 0, false},
                                         AdamCase{"adam_l2", 0.01, 0.8, 0.95, 1e-3, 0.1, false},
                                         AdamCase{"adamw", 0.01, 0.9, 0.999, 1e-8, 0.1, true},
                                         AdamCase{"adamw_big_eps", 0.05, 0.5, 0.6, 0.1, 0.3, true}),
                       ::testing::Values(DType::f32, DType::f64, DType::bf16, DType::f16)),
    [](const auto& info) { return std::get<0>(info.param).name + "_" + dtype_label(std::get<1>(info.param)); });

TEST(OptimKernel, EmptyListIsANoOp) {
  MultiTensorArgs a;  // count 0, every list null
  SgdHyper sgd;
  sgd.lr = 0.1, sgd.momentum = 0.9;
  cpu::sgd_step(a, sgd, nullptr);
  AdamHyper adam;
  adam.lr = 0.1;
  cpu::adam_step(a, adam, nullptr);
}

TEST(OptimKernel, RejectsIntegerTensors) {
  std::vector<int32_t> p(4), g(4);
  void* params[] = {p.data()};
  const void* grads[] = {g.data()};
  const int64_t numel[] = {4};
  MultiTensorArgs a;
  a.dtype = DType::i32, a.count = 1, a.params = params, a.grads = grads, a.numel = numel;
  SgdHyper h;
  h.lr = 0.1;
  EXPECT_THROW(cpu::sgd_step(a, h, nullptr), Error);
}

}  // namespace
}  // namespace loom
