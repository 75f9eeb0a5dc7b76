// Layers and optimizers on cuda:0 against the same computation on the CPU: a Linear's
// forward and backward, optimizer steps, clipping, and a module moved to the GPU after its
// optimizer was made. Matrix products use TF32 on the GPU, hence the looser tolerance there.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>

#include "engine/ops.h"
#include "engine/options.h"
#include "layers/linear.h"
#include "layers/optim/adam.h"
#include "layers/optim/clip.h"
#include "layers/optim/sgd.h"
#include "tests/common/gpu.h"
#include "tests/layers/conv_pool_fusion.h"

namespace loom::nn {
namespace {

const Device kGpu = Device::cuda(0);

void expect_close(const Tensor& gpu, const Tensor& cpu, double tol, const char* what) {
  ASSERT_TRUE(gpu.device().is_cuda()) << what;
  std::vector<float> g = gpu.to_vector<float>(), c = cpu.to_vector<float>();
  ASSERT_EQ(g.size(), c.size()) << what;
  for (size_t i = 0; i < g.size(); ++i) EXPECT_NEAR(g[i], c[i], tol * (1 + std::abs(c[i]))) << what << "[" << i << "]";
}

TEST(LinearCuda, ForwardAndBackwardMatchTheCpu) {
  LOOM_REQUIRE_CUDA();
  manual_seed(1);
  Linear cpu(64, 32);
  manual_seed(1);
  Linear gpu(64, 32);
  gpu.to(kGpu);
  Tensor x = randn({8, 64});
  Tensor xg = x.to(kGpu);
  Tensor y = cpu.forward(x), yg = gpu.forward(xg);
  expect_close(yg, y, 1e-2, "output");
  sum(mul(y, y)).backward();
  sum(mul(yg, yg)).backward();
  expect_close(gpu.weight.grad(), cpu.weight.grad(), 1e-2, "weight grad");
  expect_close(gpu.bias.grad(), cpu.bias.grad(), 1e-2, "bias grad");
}

// Same parameters and gradients on both devices, three steps of `make`'s optimizer.
template <class Make>
void expect_same_steps(Make make) {
  manual_seed(2);
  TensorList cpu = {randn({33, 7}).set_requires_grad(), randn({5}).set_requires_grad()};
  TensorList gpu;
  for (const Tensor& p : cpu) gpu.push_back(p.detach().to(kGpu).set_requires_grad());
  auto opt_cpu = make(cpu);
  auto opt_gpu = make(gpu);
  for (int step = 0; step < 3; ++step) {
    for (size_t k = 0; k < cpu.size(); ++k) {
      Tensor g = randn(cpu[k].shape());
      cpu[k].set_grad(g);
      gpu[k].set_grad(g.to(kGpu));
    }
    opt_cpu->step();
    opt_gpu->step();
  }
  for (size_t k = 0; k < cpu.size(); ++k) expect_close(gpu[k], cpu[k], 1e-5, "parameter");
}

TEST(AdamCuda, AdamWStepsMatchTheCpu) {
  LOOM_REQUIRE_CUDA();
  expect_same_steps([](TensorList ps) { return std::make_unique<optim::AdamW>(ps, optim::AdamWOptions{.lr = 0.01}); });
}

TEST(SgdCuda, NesterovStepsMatchTheCpu) {
  LOOM_REQUIRE_CUDA();
  expect_same_steps([](TensorList ps) {
    return std::make_unique<optim::SGD>(
        ps, optim::SGDOptions{.lr = 0.1, .momentum = 0.9, .weight_decay = 0.01, .nesterov = optim::Nesterov::yes});
  });
}

TEST(ModuleCuda, ToDeviceAfterTheOptimizerKeepsItsHandles) {
  LOOM_REQUIRE_CUDA();
  Linear layer(4, 3);
  optim::Adam adam(layer.parameters(), {.lr = 0.1});
  layer.to(kGpu);
  EXPECT_TRUE(adam.param_groups()[0].params[0].device().is_cuda());
  std::vector<float> before = layer.weight.to_vector<float>();
  sum(layer.forward(ones({2, 4}, DType::f32, kGpu))).backward();
  adam.step();
  EXPECT_TRUE(adam.state(layer.weight)->buffers.at("exp_avg").device().is_cuda());
  EXPECT_NE(layer.weight.to_vector<float>(), before);
}

TEST(OptimCuda, ClipGradNormMatchesTheCpu) {
  LOOM_REQUIRE_CUDA();
  Tensor a = zeros({3}, DType::f32, kGpu).set_requires_grad();
  a.set_grad(from_vector(std::vector<float>{2, 3, 6}, {3}, kGpu));
  const Tensor norm = optim::clip_grad_norm_({a}, 3.5);
  EXPECT_TRUE(norm.device().is_cuda());  // not read: the step that clips waits for nothing
  EXPECT_NEAR(norm.item(), 7.0, 1e-5);
  std::vector<float> g = a.grad().to_vector<float>();
  EXPECT_NEAR(g[2], 3.0, 1e-5);
}

TEST(ConvPoolFusionCuda, MaxPoolBiasIsTheAddThenThePooling) {
  LOOM_REQUIRE_CUDA();
  for (DType dtype : {DType::f32, DType::bf16, DType::f16})
    for (MemoryFormat format : {MemoryFormat::contiguous, MemoryFormat::channels_last}) {
      test::expect_max_pool_bias_is_add_then_pool(kGpu, dtype, format, {{2, 2}, {2, 2}, {0, 0}});
      test::expect_max_pool_bias_is_add_then_pool(kGpu, dtype, format, {{3, 3}, {2, 2}, {1, 1}});
    }
}

// Deterministic convolution engines only: the first layer's weight gradient sums over the
// batch, and an engine with cuDNN's nondeterministic note (split sums added by atomics) may
// round it differently in the two runs however the pooling ran.
TEST(ConvPoolFusionCuda, SequentialConvThenPoolChangesNoBit) {
  LOOM_REQUIRE_CUDA();
  Options o = options();
  o.deterministic = true;
  OptionsGuard deterministic(o);
  test::expect_sequential_fusion_changes_no_bit(kGpu, MemoryFormat::contiguous);
  test::expect_sequential_fusion_changes_no_bit(kGpu, MemoryFormat::channels_last);
}

}  // namespace
}  // namespace loom::nn
