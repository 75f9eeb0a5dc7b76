// Layer-wise model parallelism across cuda:0 and the CPU: copies between them are
// differentiable in both directions, each gradient arriving on its tensor's own device, and
// the guide's transformer split over cuda:0,cpu (round-robin and contiguous) trains like the
// unsplit model on the CPU: losses, gradients and weights after SGD steps agree within
// f32 rounding (TF32 off). Skips where no GPU is visible.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "engine/autograd.h"
#include "engine/ops.h"
#include "kernels/core/precision.h"
#include "layers/models/guide_transformer.h"
#include "layers/optim/sgd.h"
#include "layers/placement.h"
#include "tests/common/gpu.h"
#include "tests/common/tensor_checks.h"

namespace loom::nn {
namespace {

using ::loom::test::relative_difference;
using ::loom::test::Tf32Off;

const Device kGpu = Device::cuda(0);

TEST(ModelParallelCuda, CopiesBetweenCpuAndGpuAreDifferentiableBothWays) {
  LOOM_REQUIRE_CUDA();
  Tensor x = from_vector(std::vector<float>{1, -2, 3}, {3}).set_requires_grad();               // on the CPU
  Tensor w = from_vector(std::vector<float>{0.5f, 4, -1}, {3}, kGpu).set_requires_grad();     // on the GPU
  Tensor c = from_vector(std::vector<float>{2, 3, 5}, {3});
  // cpu -> cuda -> (product on the GPU) -> cpu -> loss on the CPU.
  Tensor y = mul(x.to(kGpu), w).to(Device::cpu());
  sum(mul(y, c)).backward();
  ASSERT_TRUE(x.grad().defined() && w.grad().defined());
  EXPECT_EQ(x.grad().device(), Device::cpu());
  EXPECT_EQ(w.grad().device(), kGpu);
  EXPECT_EQ(x.grad().to_vector<float>(), (std::vector<float>{1, 12, -5}));             // w * c
  EXPECT_EQ(w.grad().to(Device::cpu()).to_vector<float>(), (std::vector<float>{2, -6, 15}));  // x * c
}

struct Trained {
  std::vector<double> losses;
  NamedTensors grads, weights;
};

// `steps` SGD steps of a fresh model (seed 0) on fixed batches, placed on `devices` (none:
// unsplit on the CPU). Every gradient must sit on its parameter's device.
Trained train(const std::vector<Device>& devices, PlacementPolicy policy, int steps) {
  manual_seed(0);
  GuideTransformer model({.width = 64, .heads = 4, .layers = 6, .classes = 10});
  if (!devices.empty()) model.place(devices, policy);
  // SGD, not Adam: the keys' share of c_attn's bias gets a gradient that is zero but for
  // rounding (softmax ignores a shift of every key), and Adam's normalised step would turn that
  // noise into steps of +-lr that differ between a GPU and the CPU.
  optim::SGD opt(model.parameters(), {.lr = 0.1});
  GuideSyntheticTask task(64, 10);
  Trained out;
  for (int step = 0; step < steps; ++step) {
    auto batch = task.sample(8, 12);
    opt.zero_grad();
    Tensor loss = model.loss(batch.inputs, batch.targets);
    loss.backward();
    out.losses.push_back(loss.item());
    for (const auto& [name, p] : model.named_parameters()) {
      EXPECT_TRUE(p.grad().defined()) << name;
      if (p.grad().defined()) {
        EXPECT_EQ(p.grad().device(), p.device()) << name;
      }
    }
    if (step + 1 == steps)
      for (const auto& [name, p] : model.named_parameters()) out.grads.emplace_back(name, p.grad().to(Device::cpu()));
    opt.step();
  }
  for (const auto& [name, p] : model.named_parameters()) out.weights.emplace_back(name, p.detach().to(Device::cpu()));
  return out;
}

TEST(ModelParallelCuda, SplitOverCuda0AndCpuTrainsLikeTheUnsplitModel) {
  LOOM_REQUIRE_CUDA();
  Tf32Off tf32_off;
  const Trained whole = train({}, PlacementPolicy::round_robin, 4);
  for (PlacementPolicy policy : {PlacementPolicy::round_robin, PlacementPolicy::contiguous}) {
    SCOPED_TRACE(placement_policy_name(policy));
    const Trained split = train({kGpu, Device::cpu()}, policy, 4);
    ASSERT_EQ(split.losses.size(), whole.losses.size());
    for (size_t i = 0; i < whole.losses.size(); ++i)
      EXPECT_NEAR(split.losses[i], whole.losses[i], 1e-5 * std::abs(whole.losses[i])) << "step " << i;
    ASSERT_EQ(split.grads.size(), whole.grads.size());
    for (size_t i = 0; i < whole.grads.size(); ++i) {
      EXPECT_LT(relative_difference(split.grads[i].second, whole.grads[i].second), 1e-4) << whole.grads[i].first;
      EXPECT_LT(relative_difference(split.weights[i].second, whole.weights[i].second), 1e-5) << whole.weights[i].first;
    }
  }
}

}  // namespace
}  // namespace loom::nn
