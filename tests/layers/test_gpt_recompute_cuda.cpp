// GPTConfig::recompute on cuda:0: one training step's peak memory falls (the blocks keep
// only their inputs for backward), the gradients stay those of the plain model, and a bf16
// autocast step recomputes in bf16. Skips where no GPU is visible.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/allocator.h"
#include "engine/autocast.h"
#include "engine/ops.h"
#include "kernels/cuda/check.h"
#include "layers/models/gpt.h"
#include "tests/common/gpu.h"

namespace loom::nn {
namespace {

const Device kGpu = Device::cuda(0);

// Six blocks of width 256 over (8, 256) tokens: each block's activations (about 17 tensors
// of B T C floats, 2 MiB each) dwarf the parameters, so the drop is plain to see.
GPTConfig config(bool recompute) {
  GPTConfig c{.vocab_size = 256, .context = 256, .layers = 6, .heads = 4, .width = 256};
  c.recompute = recompute;
  return c;
}

struct Step {
  size_t peak = 0;  // bytes allocated above the model's own, at the step's high-water mark
  double loss = 0;
  NamedTensors params;
};

// One forward and backward of a fresh model (seed 0) on fixed tokens.
Step train_step(bool recompute, std::optional<DType> autocast = std::nullopt) {
  manual_seed(0);
  auto model = std::make_shared<GPT>(config(recompute));
  model->to(kGpu);
  const int64_t B = 8, T = 256;
  std::vector<int64_t> tokens(size_t(B * (T + 1)));
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = int64_t(i * 37 + 11) % 256;
  Tensor ids = from_vector(tokens, {B, T + 1}, kGpu);
  Tensor inputs = ids.slice(1, 0, T).contiguous(), targets = ids.slice(1, 1, T + 1).contiguous();
  LOOM_CUDA(cudaDeviceSynchronize());
  const size_t base = memory::stats(kGpu).allocated;
  memory::reset_peak(kGpu);
  Tensor loss;
  {
    AutocastGuard cast(autocast);
    loss = model->loss(inputs, targets);
  }
  loss.backward();
  LOOM_CUDA(cudaDeviceSynchronize());
  Step s;
  s.peak = memory::stats(kGpu).peak_allocated - base;
  s.loss = loss.item();
  s.params = model->named_parameters();
  return s;
}

void expect_same_gradients(const Step& got, const Step& want, double rel_tol) {
  ASSERT_EQ(got.params.size(), want.params.size());
  for (size_t i = 0; i < got.params.size(); ++i) {
    const std::string& name = got.params[i].first;
    ASSERT_TRUE(got.params[i].second.grad().defined()) << name << " got no gradient with recompute";
    const std::vector<float> a = got.params[i].second.grad().to(Device::cpu()).to_vector<float>();
    const std::vector<float> b = want.params[i].second.grad().to(Device::cpu()).to_vector<float>();
    float scale = 0;
    for (float v : b) scale = std::max(scale, std::abs(v));
    for (size_t j = 0; j < a.size(); ++j) ASSERT_NEAR(a[j], b[j], rel_tol * scale) << name << "[" << j << "]";
  }
}

TEST(GptRecomputeCuda, PeakMemoryFallsAndGradientsStayTheSame) {
  LOOM_REQUIRE_CUDA();
  const Step plain = train_step(false);
  const Step recomputed = train_step(true);
  std::printf("peak above the model: plain %.1f MiB, recompute %.1f MiB\n", double(plain.peak) / (1 << 20),
              double(recomputed.peak) / (1 << 20));
  // Plain keeps six blocks' activations; recompute keeps six inputs and one block's.
  EXPECT_LT(double(recomputed.peak), 0.6 * double(plain.peak))
      << "recompute must lower the peak: " << recomputed.peak << " vs " << plain.peak << " bytes";
  EXPECT_NEAR(recomputed.loss, plain.loss, 1e-6);
  expect_same_gradients(recomputed, plain, 1e-4);
}

TEST(GptRecomputeCuda, Bf16AutocastStepRecomputesInBf16) {
  LOOM_REQUIRE_CUDA();
  // backward() runs outside the AutocastGuard: a rerun in f32 would give visibly different
  // gradients from those of the bf16 forward.
  const Step plain = train_step(false, DType::bf16);
  const Step recomputed = train_step(true, DType::bf16);
  EXPECT_EQ(recomputed.loss, plain.loss);
  expect_same_gradients(recomputed, plain, 1e-3);
}

}  // namespace
}  // namespace loom::nn
