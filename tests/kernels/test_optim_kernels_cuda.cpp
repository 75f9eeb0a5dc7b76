// The CUDA multi-tensor optimizer kernels against the CPU ones on the same bytes. Each list
// (params, grads, buffers) of every tensor lives in one arena, on the host for the CPU
// kernel and copied to the GPU for the CUDA one; tensors sit 256-byte aligned or, for
// some (tensor, list) pairs, one element past that, so the 16-byte vector path and the
// scalar path both run in one launch. Filler bytes between tensors must come back
// untouched. Before every step the GPU takes the CPU's state, so a step's results match
// to the dtype's rounding (the devices contract a * b + c differently).
//
// Beyond the optimizer cases: 2000 tiny tensors (more than one launch's parameters hold),
// sizes around the 16384-element block chunk, empty tensors, and a tensor of 2^24 + 3.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/cpu/kernels.h"
#include "kernels/cuda/kernels.h"
#include "tests/common/device_buffer.h"
#include "tests/common/gpu.h"

namespace loom {
namespace {

using Bytes = std::vector<unsigned char>;
using Misaligned = std::function<bool(size_t tensor, int list)>;

const std::vector<int64_t> kSizes = {1, 3, 0, 1025, 65537 + 5, 7, 16384, 16385};

// Odd tensors are one element off in one list each (params, grads, then the buffers).
bool some_misaligned(size_t i, int list, int lists) { return i % 2 == 1 && list == int(i / 2) % lists; }

double load(DType t, const unsigned char* p) {
  auto get = [p](auto v) { std::memcpy(&v, p, sizeof(v)); return v; };
  switch (t) {
    case DType::f32: return get(float{});
    case DType::f64: return get(double{});
    case DType::bf16: return float(get(bf16{}));
    case DType::f16: return float(get(f16{}));
    default: return 0;
  }
}

void store(DType t, unsigned char* p, double v) {
  auto put = [p](auto x) { std::memcpy(p, &x, sizeof(x)); };
  switch (t) {
    case DType::f32: return put(float(v));
    case DType::f64: return put(v);
    case DType::bf16: return put(bf16(float(v)));
    case DType::f16: return put(f16(float(v)));
    default: return;
  }
}

struct Tol {
  double rtol, atol;
};
Tol tol_for(DType t) {
  switch (t) {
    case DType::f64: return {1e-12, 1e-14};
    case DType::f32: return {1e-5, 1e-6};
    case DType::bf16: return {1.0 / 128, 1e-6};
    case DType::f16: return {1.0 / 1024, 1e-6};
    default: return {0, 0};
  }
}

// K parallel lists of tensors of `sizes`, each list one arena on the host and on the GPU.
class Lists {
 public:
  Lists(DType t, int lists, const std::vector<int64_t>& sizes, const Misaligned& misaligned)
      : dtype_(t), sizes_(sizes), offset_(size_t(lists)) {
    const int64_t elem = int64_t(dtype_size(t));
    for (int k = 0; k < lists; ++k) {
      int64_t off = 0;
      for (size_t i = 0; i < sizes.size(); ++i) {
        off = (off + 255) / 256 * 256 + (misaligned(i, k) ? elem : 0);
        offset_[size_t(k)].push_back(off);
        off += sizes[i] * elem + 64;  // a gap of filler after every tensor
      }
      host_.emplace_back(size_t(off + 64), 0x5a);
      device_.push_back(std::make_unique<test::DeviceBuffer<unsigned char>>(host_.back().size()));
    }
  }

  size_t count() const { return sizes_.size(); }
  int64_t numel(size_t i) const { return sizes_[i]; }
  void* host(int k, size_t i) { return host_[size_t(k)].data() + offset_[size_t(k)][i]; }
  void* device(int k, size_t i) { return device_[size_t(k)]->get() + offset_[size_t(k)][i]; }
  void set(int k, size_t i, int64_t e, double v) {
    store(dtype_, host_[size_t(k)].data() + offset_[size_t(k)][i] + e * int64_t(dtype_size(dtype_)), v);
  }
  void fill(int k, std::mt19937_64& rng, double lo, double hi) {
    std::uniform_real_distribution<double> u(lo, hi);
    for (size_t i = 0; i < count(); ++i)
      for (int64_t e = 0; e < sizes_[i]; ++e) set(k, i, e, u(rng));
  }
  void fill(int k, double value) {
    for (size_t i = 0; i < count(); ++i)
      for (int64_t e = 0; e < sizes_[i]; ++e) set(k, i, e, value);
  }

  void upload() {
    for (size_t k = 0; k < host_.size(); ++k)
      LOOM_CUDA(cudaMemcpy(device_[k]->get(), host_[k].data(), host_[k].size(), cudaMemcpyHostToDevice));
  }

  // The GPU's arenas against the host's: tensors within tol, filler bytes exactly.
  void expect_device_matches_host(const std::string& what) const {
    const Tol tol = tol_for(dtype_);
    const size_t elem = dtype_size(dtype_);
    for (size_t k = 0; k < host_.size(); ++k) {
      const Bytes got = device_[k]->to_host();
      const Bytes& want = host_[k];
      std::vector<bool> in_tensor(want.size(), false);
      int64_t bad = 0;
      for (size_t i = 0; i < count(); ++i) {
        const size_t base = size_t(offset_[k][i]);
        for (int64_t e = 0; e < sizes_[i]; ++e) {
          const size_t at = base + size_t(e) * elem;
          for (size_t b = 0; b < elem; ++b) in_tensor[at + b] = true;
          const double g = load(dtype_, got.data() + at), w = load(dtype_, want.data() + at);
          if (std::abs(g - w) <= tol.atol + tol.rtol * std::abs(w)) continue;
          if (std::isnan(g) && std::isnan(w)) continue;  // a buffer neither device has written yet
          if (++bad <= 3)
            ADD_FAILURE() << what << ", list " << k << ", tensor " << i << " [" << e << "]: CUDA " << g
                          << ", CPU " << w;
        }
      }
      EXPECT_EQ(bad, 0) << what << ", list " << k << ": " << bad << " elements differ";
      int64_t stray = 0;
      for (size_t b = 0; b < want.size(); ++b) stray += !in_tensor[b] && got[b] != want[b];
      EXPECT_EQ(stray, 0) << what << ", list " << k << ": bytes outside the tensors were written";
    }
  }

 private:
  DType dtype_;
  std::vector<int64_t> sizes_;
  std::vector<std::vector<int64_t>> offset_;  // [list][tensor], bytes into the arena
  std::vector<Bytes> host_;
  std::vector<std::unique_ptr<test::DeviceBuffer<unsigned char>>> device_;
};

// One call's arguments over the tensors `active`, for one device's pointers.
struct Call {
  std::vector<void*> lists[4];
  std::vector<int64_t> numel;

  Call(Lists& l, const std::vector<size_t>& active, int nlists, bool on_device) {
    for (size_t i : active) {
      for (int k = 0; k < nlists; ++k) lists[k].push_back(on_device ? l.device(k, i) : l.host(k, i));
      numel.push_back(l.numel(i));
    }
  }
  MultiTensorArgs args(DType t) const {
    MultiTensorArgs a;
    a.dtype = t;
    a.count = int64_t(numel.size());
    a.params = lists[0].data();
    a.grads = lists[1].data();
    a.state1 = lists[2].empty() ? nullptr : lists[2].data();
    a.state2 = lists[3].empty() ? nullptr : lists[3].data();
    a.numel = numel.data();
    return a;
  }
};

std::string dtype_label(DType t) { return std::string(dtype_name(t)); }

// The tensors in the call at `step`: the even ones from step 1, the odd ones from step 2.
std::vector<size_t> active_at(size_t count, int step) {
  std::vector<size_t> active;
  for (size_t i = 0; i < count; ++i)
    if (step >= 2 || i % 2 == 0) active.push_back(i);
  return active;
}

// ---- SGD ------------------------------------------------------------------------------

struct SgdCase {
  std::string name;
  double lr, momentum, dampening, weight_decay;
  bool nesterov;
};

void sgd_matches_cpu(DType dtype, const SgdCase& c, const std::vector<int64_t>& sizes, const Misaligned& misaligned,
                     int steps) {
  const bool momentum = c.momentum != 0;
  Lists l(dtype, 3, sizes, misaligned);
  std::mt19937_64 rng(5);
  l.fill(0, rng, -1, 1);
  l.fill(2, std::nan(""));  // a new buffer's contents must not be read
  for (int step = 1; step <= steps; ++step) {
    l.fill(1, rng, -1, 1);
    l.upload();
    const std::vector<size_t> active = active_at(l.count(), step);
    std::vector<uint8_t> first;
    for (size_t i : active) first.push_back(step == (i % 2 == 0 ? 1 : 2) ? 1 : 0);
    SgdHyper h;
    h.lr = c.lr, h.momentum = c.momentum, h.dampening = c.dampening, h.weight_decay = c.weight_decay;
    h.nesterov = c.nesterov;
    h.first = momentum ? first.data() : nullptr;
    Call host(l, active, momentum ? 3 : 2, false), device(l, active, momentum ? 3 : 2, true);
    cpu::sgd_step(host.args(dtype), h, nullptr);
    cuda::sgd_step(device.args(dtype), h, nullptr);
    l.expect_device_matches_host("step " + std::to_string(step));
  }
}

const std::vector<SgdCase> kSgdCases = {
    {"plain", 0.1, 0, 0, 0, false},           {"momentum", 0.1, 0.9, 0, 0, false},
    {"dampening", 0.05, 0.9, 0.3, 0, false},  {"nesterov", 0.1, 0.9, 0, 0, true},
    {"weight_decay", 0.1, 0, 0, 0.05, false}, {"all", 0.07, 0.8, 0, 0.05, true},
};

class SgdKernelCuda : public ::testing::TestWithParam<std::tuple<SgdCase, DType>> {};

TEST_P(SgdKernelCuda, MatchesCpuOnAlignedAndMisalignedTensors) {
  LOOM_REQUIRE_CUDA();
  const auto& [c, dtype] = GetParam();
  sgd_matches_cpu(dtype, c, kSizes, [](size_t i, int k) { return some_misaligned(i, k, 3); }, 3);
}

INSTANTIATE_TEST_SUITE_P(
    OptimCuda, SgdKernelCuda,
    ::testing::Combine(::testing::ValuesIn(kSgdCases),
                       ::testing::Values(DType::f32, DType::f64, DType::bf16, DType::f16)),
    [](const auto& info) { return std::get<0>(info.param).name + "_" + dtype_label(std::get<1>(info.param)); });

// ---- Adam and AdamW --------------------------------------------------------------------

struct AdamCase {
  std::string name;
  double lr, beta1, beta2, eps, weight_decay;
  bool decoupled;
};

void adam_matches_cpu(DType dtype, const AdamCase& c, const std::vector<int64_t>& sizes,
                      const Misaligned& misaligned, int steps) {
  Lists l(dtype, 4, sizes, misaligned);
  std::mt19937_64 rng(9);
  l.fill(0, rng, -1, 1);
  l.fill(2, rng, -0.1, 0.1);  // moments as after some steps
  l.fill(3, rng, 0, 0.01);
  std::vector<int64_t> count(l.count());
  for (size_t i = 0; i < count.size(); ++i) count[i] = int64_t(i % 3) * 5;  // resumed at different steps
  for (int step = 1; step <= steps; ++step) {
    l.fill(1, rng, -1, 1);
    l.upload();
    const std::vector<size_t> active = active_at(l.count(), step);
    std::vector<int64_t> counts;
    for (size_t i : active) counts.push_back(++count[i]);
    AdamHyper h;
    h.lr = c.lr, h.beta1 = c.beta1, h.beta2 = c.beta2, h.eps = c.eps, h.weight_decay = c.weight_decay;
    h.decoupled = c.decoupled;
    h.step = counts.data();
    Call host(l, active, 4, false), device(l, active, 4, true);
    cpu::adam_step(host.args(dtype), h, nullptr);
    cuda::adam_step(device.args(dtype), h, nullptr);
    l.expect_device_matches_host("step " + std::to_string(step));
  }
}

const std::vector<AdamCase> kAdamCases = {
    {"adam", 0.01, 0.9, 0.999, 1e-8, 0, false},
    {"adam_l2", 0.01, 0.8, 0.95, 1e-3, 0.1, false},
    {"adamw", 0.01, 0.9, 0.999, 1e-8, 0.1, true},
    {"adamw_big_eps", 0.05, 0.5, 0.6, 0.1, 0.3, true},
};

class AdamKernelCuda : public ::testing::TestWithParam<std::tuple<AdamCase, DType>> {};

TEST_P(AdamKernelCuda, MatchesCpuOnAlignedAndMisalignedTensors) {
  LOOM_REQUIRE_CUDA();
  const auto& [c, dtype] = GetParam();
  adam_matches_cpu(dtype, c, kSizes, [](size_t i, int k) { return some_misaligned(i, k, 4); }, 3);
}

INSTANTIATE_TEST_SUITE_P(
    OptimCuda, AdamKernelCuda,
    ::testing::Combine(::testing::ValuesIn(kAdamCases),
                       ::testing::Values(DType::f32, DType::f64, DType::bf16, DType::f16)),
    [](const auto& info) { return std::get<0>(info.param).name + "_" + dtype_label(std::get<1>(info.param)); });

// ---- layouts the cases above do not reach ----------------------------------------------

bool none_misaligned(size_t, int) { return false; }
bool all_misaligned(size_t, int) { return true; }

class OptimLayoutCuda : public ::testing::TestWithParam<DType> {};

TEST_P(OptimLayoutCuda, EveryListOneElementOffTakesTheScalarPath) {
  LOOM_REQUIRE_CUDA();
  sgd_matches_cpu(GetParam(), kSgdCases[5], kSizes, all_misaligned, 2);
  adam_matches_cpu(GetParam(), kAdamCases[2], kSizes, all_misaligned, 2);
}

TEST_P(OptimLayoutCuda, TwoThousandTinyTensorsSpanSeveralLaunches) {
  LOOM_REQUIRE_CUDA();
  std::vector<int64_t> sizes(2000);
  for (size_t i = 0; i < sizes.size(); ++i) sizes[i] = int64_t(i % 7);  // empty ones included
  const Misaligned some = [](size_t i, int k) { return i % 5 == 1 && k == 0; };
  sgd_matches_cpu(GetParam(), kSgdCases[2], sizes, some, 2);
  adam_matches_cpu(GetParam(), kAdamCases[1], sizes, some, 2);
}

TEST_P(OptimLayoutCuda, OnlyEmptyTensorsLaunchNothing) {
  LOOM_REQUIRE_CUDA();
  sgd_matches_cpu(GetParam(), kSgdCases[1], {0, 0, 0}, none_misaligned, 2);
  adam_matches_cpu(GetParam(), kAdamCases[0], {0, 0}, none_misaligned, 1);
}

INSTANTIATE_TEST_SUITE_P(OptimCuda, OptimLayoutCuda, ::testing::Values(DType::f32, DType::bf16, DType::f16),
                         [](const auto& info) { return dtype_label(info.param); });

TEST(OptimKernelCuda, LargeTensorOfTwoToTheTwentyFourPlusThree) {
  LOOM_REQUIRE_CUDA();
  const std::vector<int64_t> sizes = {(int64_t(1) << 24) + 3, 5};
  adam_matches_cpu(DType::f32, kAdamCases[2], sizes, none_misaligned, 1);
  sgd_matches_cpu(DType::bf16, kSgdCases[3], sizes, none_misaligned, 2);
}

TEST(OptimKernelCuda, EmptyListIsANoOp) {
  LOOM_REQUIRE_CUDA();
  MultiTensorArgs a;
  SgdHyper sgd;
  sgd.lr = 0.1, sgd.momentum = 0.9;
  cuda::sgd_step(a, sgd, nullptr);
  AdamHyper adam;
  adam.lr = 0.1;
  cuda::adam_step(a, adam, nullptr);
  LOOM_CUDA(cudaDeviceSynchronize());
}

}  // namespace
}  // namespace loom
