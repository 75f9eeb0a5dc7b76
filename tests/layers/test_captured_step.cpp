// CapturedStep and capturable optimizers on the CPU, where steps run eagerly: the step is
// the function's own, SGD reading its learning rate from a tensor (ParamGroup::lr_at)
// updates exactly as with the host's value, and what cannot be captured says so.
#include <gtest/gtest.h>

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

TEST(CapturedStep, SgdWithItsLearningRateInATensorMatchesTheHostValue) {
  for (bool momentum : {false, true}) {
    manual_seed(3);
    Tensor w1 = randn({5, 7}), w2 = w1.clone();
    Tensor g = randn({5, 7});
    w1.set_requires_grad(true);
    w2.set_requires_grad(true);
    const optim::SGDOptions o{.lr = 0.1, .momentum = momentum ? 0.9 : 0.0, .weight_decay = 0.01};
    optim::SGD host({w1}, o), device({w2}, o);
    device.make_capturable(Device::cpu());
    for (int s = 0; s < 4; ++s) {
      host.set_lr(0.1 / (s + 1));
      device.set_lr(0.1 / (s + 1));
      device.write_device_lr();
      w1.set_grad(g.clone());
      w2.set_grad(g.clone());
      host.step();
      device.step();
    }
    EXPECT_EQ(w1.to_vector<float>(), w2.to_vector<float>()) << "momentum " << momentum;
  }
}

TEST(CapturedStep, WhatCannotBeCapturedSaysSo) {
  Tensor w = randn({3});
  w.set_requires_grad(true);
  optim::AdamW adamw({w}, {});
  try {
    adamw.make_capturable(Device::cpu());
    FAIL() << "AdamW became capturable";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot be captured"), std::string::npos) << e.what();
  }
  EXPECT_THROW(optim::CapturedStep(Device::cpu(), {}, [] { return Tensor(); }, 0), Error);
}

}  // namespace
}  // namespace loom
