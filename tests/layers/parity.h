// SimpleCNN against PyTorch: tests/fixtures/simplecnn_parity.safetensors holds PyTorch's
// initial weights, a batch, the first step's logits and gradients, and the weights after two
// SGD (momentum, weight decay) and two Adam steps, computed in float64
// (tests/fixtures/make_simplecnn_parity.py). Loom, in f32 on `device` with TF32 off, must
// match each tensor within 1e-4 relative (in the 2-norm of the difference over the norm of
// the reference, so no single tiny element decides).
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "engine/ops.h"
#include "engine/serialization.h"
#include "kernels/core/precision.h"
#include "layers/models/simple_cnn.h"
#include "layers/optim/adam.h"
#include "layers/optim/sgd.h"

namespace loom::testing {

inline double relative_error(const Tensor& got, const Tensor& want) {
  Tensor g = got.to(Device::cpu()).to(DType::f64), w = want.to(Device::cpu()).to(DType::f64);
  const double diff = std::sqrt(sum(mul(sub(g, w), sub(g, w))).item());
  const double norm = std::sqrt(sum(mul(w, w)).item());
  return diff / std::max(norm, 1e-30);
}

inline void check_simplecnn_parity(Device device) {
  struct Tf32Off {
    bool was = tf32_allowed();
    Tf32Off() { set_tf32_allowed(false); }
    ~Tf32Off() { set_tf32_allowed(was); }
  } tf32_off;
  const std::string path = std::string(LOOM_FIXTURES_DIR) + "/simplecnn_parity.safetensors";
  auto ref = load_safetensors_map(path);
  auto at = [&](const std::string& key) {
    auto it = ref.find(key);
    if (it == ref.end()) throw Error(path + " has no " + key);
    return it->second;
  };
  constexpr double kTol = 1e-4;
  Tensor x = at("input").to(device), y = at("target").to(device);

  for (const std::string opt_name : {"sgd", "adam"}) {
    SCOPED_TRACE(opt_name);
    nn::SimpleCNN model(1, 28, 10);
    nn::NamedTensors init;
    for (const auto& [name, _] : model.state_dict()) init.emplace_back(name, at("init." + name));
    model.load_state_dict(init);
    model.to(device);
    std::unique_ptr<optim::Optimizer> opt;
    if (opt_name == "sgd")
      opt = std::make_unique<optim::SGD>(model.parameters(),
                                         optim::SGDOptions{.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-4});
    else
      opt = std::make_unique<optim::Adam>(model.parameters(), optim::AdamOptions{.lr = 1e-3});
    std::vector<float> want_loss = at(opt_name + ".loss").to_vector<float>();
    for (int step = 0; step < 2; ++step) {
      opt->zero_grad();
      Tensor logits = model.forward(x);
      Tensor loss = cross_entropy(logits, y);
      loss.backward();
      EXPECT_NEAR(loss.item(), want_loss[size_t(step)], kTol * std::abs(want_loss[size_t(step)])) << "step " << step;
      if (step == 0 && opt_name == "sgd") {
        EXPECT_LT(relative_error(logits, at("logits")), kTol) << "logits";
        for (const auto& [name, p] : model.named_parameters())
          EXPECT_LT(relative_error(p.grad(), at("grad." + name)), kTol) << "gradient of " << name;
      }
      opt->step();
    }
    for (const auto& [name, t] : model.state_dict())
      EXPECT_LT(relative_error(t, at(opt_name + ".final." + name)), kTol) << name << " after two steps";
  }
}

}  // namespace loom::testing
