// CapturedStep and capturable optimizers on the CPU, where steps run eagerly: the step is
// the function's own, an optimizer reading its values from a tensor (ParamGroup::hyper_at)
// updates exactly as with the host's values, and bad arguments are named.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "engine/ops.h"
#include "layers/layers.h"
#include "layers/optim/captured_step.h"

namespace loom {
namespace {

TEST(CapturedStep, OnTheCpuEveryCallRunsTheStep) {
  int calls = 0;
  optim::CapturedStep step(Device::cpu(), {}, [&] {
    ++calls;
    return full({1}, double(calls), DType::f32);
  });
  for (int i = 1; i <= 5; ++i) EXPECT_EQ(step.run().item(), double(i));
  EXPECT_FALSE(step.captured());
  EXPECT_EQ(step.pool_bytes(), size_t(0));
}

// On the CPU a batch step runs the step on each batch as given, whatever its shape.
TEST(CapturedStep, OnTheCpuABatchStepRunsTheStepOnEachBatch) {
  std::vector<int64_t> rows;
  optim::CapturedBatchStep step(Device::cpu(), {}, [&](const Tensor& x, const Tensor& y) {
    rows.push_back(x.size(0));
    return add(sum(x), sum(y));
  });
  EXPECT_EQ(step.run(full({4, 2}, 1.0), full({4}, 2.0)).item(), 16.0);
  EXPECT_EQ(step.run(full({3, 2}, 1.0), full({3}, 2.0)).item(), 12.0);
  EXPECT_EQ(rows, (std::vector<int64_t>{4, 3}));
  EXPECT_FALSE(step.captured());
  try {
    optim::CapturedBatchStep bad(Device::cpu(), {}, [](const Tensor& x, const Tensor&) { return x; }, 0);
    FAIL() << "a warmup of 0 was taken";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("warmup 0"), std::string::npos) << e.what();
  }
}

// A capturable optimizer (values on the device, ParamGroup::hyper_at) updates exactly as the
// host-valued one, through a schedule: SGD with and without momentum, Adam and AdamW.
template <class Make>
void expect_capturable_matches(const std::string& what, Make make) {
  manual_seed(3);
  Tensor w1 = randn({5, 7}), w2 = w1.clone();
  w1.set_requires_grad(true);
  w2.set_requires_grad(true);
  std::unique_ptr<optim::Optimizer> host = make(w1), device = make(w2);
  device->make_capturable(Device::cpu());
  EXPECT_TRUE(device->capturable());
  for (int s = 0; s < 4; ++s) {
    Tensor g = randn({5, 7});
    host->set_lr(0.1 / (s + 1));
    device->set_lr(0.1 / (s + 1));
    w1.set_grad(g.clone());
    w2.set_grad(g.clone());
    host->step();
    device->step();
  }
  EXPECT_EQ(w1.to_vector<float>(), w2.to_vector<float>()) << what;
  EXPECT_EQ(device->state(w2)->step, 4) << what;
}

TEST(CapturedStep, CapturableOptimizersMatchTheHostValuedOnes) {
  for (double momentum : {0.0, 0.9})
    expect_capturable_matches("SGD momentum " + std::to_string(momentum), [&](const Tensor& w) {
      return std::make_unique<optim::SGD>(TensorList{w}, optim::SGDOptions{.lr = 0.1, .momentum = momentum,
                                                                          .weight_decay = 0.01});
    });
  expect_capturable_matches("Adam", [](const Tensor& w) {
    return std::make_unique<optim::Adam>(TensorList{w}, optim::AdamOptions{.lr = 0.1, .weight_decay = 0.01});
  });
  expect_capturable_matches("AdamW", [](const Tensor& w) {
    return std::make_unique<optim::AdamW>(TensorList{w}, optim::AdamWOptions{.lr = 0.1, .weight_decay = 0.01});
  });
}

TEST(CapturedStep, BadArgumentsAreNamed) {
  Tensor w = randn({3});
  w.set_requires_grad(true);
  optim::AdamW adamw({w}, {});
  try {
    adamw.make_capturable(Device::cuda(0));
    FAIL() << "parameters on the CPU became capturable on cuda:0";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("is on cpu"), std::string::npos) << e.what();
  }
  EXPECT_THROW(optim::CapturedStep(Device::cpu(), {}, [] { return Tensor(); }, 0), Error);
}

}  // namespace
}  // namespace loom
