// Loom against PyTorch, from references computed in float64 (tests/fixtures/make_*.py).
// Tensors are compared by the 2-norm of the difference over the norm of the reference, so no
// single tiny element decides.
//
// SimpleCNN: tests/fixtures/simplecnn_parity.safetensors holds PyTorch's initial weights, a
// batch, the first step's logits and gradients, and the weights after two SGD (momentum,
// weight decay) and two Adam steps. Loom, in f32 on `device` with TF32 off, must match each
// tensor within 1e-4 relative.
//
// GPT: tests/fixtures/gpt_parity.safetensors (make_gpt_parity.py; made on a machine with
// PyTorch and a GPU, so the tests skip until it exists) holds a 2-block, width-64 GPT's
// weights, a batch, the logits, loss and gradients, the weights after one AdamW step, and a
// bf16 autocast run's loss and gradients. check_gpt_parity runs Loom in f32 or f64,
// check_gpt_bf16_parity under bf16 autocast.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "engine/autocast.h"
#include "engine/autograd.h"
#include "engine/ops.h"
#include "engine/serialization.h"
#include "kernels/core/precision.h"
#include "tests/common/gpu.h"
#include "layers/models/gpt.h"
#include "layers/models/simple_cnn.h"
#include "layers/optim/adam.h"
#include "layers/optim/sgd.h"

namespace loom::testing {

using ::loom::test::Tf32Off;

inline double relative_error(const Tensor& got, const Tensor& want) {
  Tensor g = got.to(Device::cpu()).to(DType::f64), w = want.to(Device::cpu()).to(DType::f64);
  const double diff = std::sqrt(sum(mul(sub(g, w), sub(g, w))).item());
  const double norm = std::sqrt(sum(mul(w, w)).item());
  return diff / std::max(norm, 1e-30);
}

inline void check_simplecnn_parity(Device device) {
  Tf32Off tf32_off;
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

// ---- GPT ------------------------------------------------------------------------------

inline std::string gpt_parity_fixture() { return std::string(LOOM_FIXTURES_DIR) + "/gpt_parity.safetensors"; }

// Skips the current test, saying how to make the fixture, until it exists: the reference
// needs PyTorch and a GPU to make.
#define LOOM_REQUIRE_GPT_PARITY_FIXTURE()                                                              \
  do {                                                                                                 \
    if (!std::filesystem::exists(::loom::testing::gpt_parity_fixture()))                               \
      GTEST_SKIP() << ::loom::testing::gpt_parity_fixture()                                            \
                   << " does not exist yet: make it on a machine with PyTorch and a CUDA GPU with "    \
                      "`python3 tests/fixtures/make_gpt_parity.py tests/fixtures/gpt_parity.safetensors`" \
                      " (from the repo root)";                                                         \
  } while (0)

// A reference file's tensors; a missing key throws, naming the file and the key.
struct Reference {
  std::string path;
  std::map<std::string, Tensor> tensors;

  explicit Reference(std::string p) : path(std::move(p)), tensors(load_safetensors_map(path)) {}
  const Tensor& at(const std::string& key) const {
    auto it = tensors.find(key);
    if (it == tensors.end()) throw Error(path + " has no " + key);
    return it->second;
  }
};

// The fixture's GPT (make_gpt_parity.py's sizes) with its initial weights, in `dtype` on
// `device`. The fixture stores each parameter once; the tied lm_head.weight is read from
// transformer.wte.weight. Every init.* key must name one of Loom's parameters, so a parameter
// PyTorch has and Loom lacks fails here rather than going unchecked.
inline std::shared_ptr<nn::GPT> gpt_from_reference(const Reference& ref, Device device, DType dtype) {
  auto model = std::make_shared<nn::GPT>(
      nn::GPTConfig{.vocab_size = 96, .context = 32, .layers = 2, .heads = 4, .width = 64});
  const nn::NamedTensors params = model->named_parameters();
  size_t stored = 0;
  for (const auto& [key, _] : ref.tensors) stored += key.rfind("init.", 0) == 0;
  EXPECT_EQ(stored, params.size()) << ref.path << " stores " << stored << " initial weights; Loom's GPT has "
                                   << params.size() << " parameters";
  nn::NamedTensors init;
  for (const auto& [name, _] : model->state_dict())
    init.emplace_back(name, ref.at("init." + (name == "lm_head.weight" ? "transformer.wte.weight" : name)));
  model->load_state_dict(init);
  model->to(dtype);
  model->to(device);
  return model;
}

// Logits, loss, every gradient and every weight after one AdamW step (lr 1e-2, betas (0.9,
// 0.95), eps 1e-8, weight decay 0.1 on every parameter, as make_gpt_parity.py) within `tol`.
//
// One slice is compared differently: the key bias, the middle third of each c_attn.bias. It
// adds q.b to all of a query's scores alike, which softmax ignores, so its gradient is zero
// but for rounding (about 1e-18 in f64, 1e-9 in f32). Adam's first step turns any gradient g
// into lr * g / (|g| + eps), so that noise moves it by anything up to lr, in f32 as in
// PyTorch's own f32. After the step it must be within lr of the reference; the query and value
// biases are compared as everything else.
inline void check_gpt_parity(Device device, DType dtype, double tol) {
  Tf32Off tf32_off;
  const Reference ref(gpt_parity_fixture());
  auto model = gpt_from_reference(ref, device, dtype);
  const Tensor ids = ref.at("ids").to(device), targets = ref.at("targets").to(device);
  {
    NoGradGuard no_grad;
    EXPECT_LT(relative_error(model->forward(ids), ref.at("logits")), tol) << "logits";
  }
  constexpr double kLr = 1e-2;
  optim::AdamW opt(model->parameters(),
                   optim::AdamWOptions{.lr = kLr, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1});
  Tensor loss = model->loss(ids, targets);
  loss.backward();
  NoGradGuard no_grad;
  EXPECT_LT(relative_error(loss, ref.at("loss")), tol) << "loss " << loss.item();
  for (const auto& [name, p] : model->named_parameters()) {
    ASSERT_TRUE(p.grad().defined()) << name << " got no gradient";
    EXPECT_LT(relative_error(p.grad(), ref.at("grad." + name)), tol) << "gradient of " << name;
  }
  opt.step();
  for (const auto& [name, p] : model->named_parameters()) {
    const Tensor want = ref.at("after_adamw." + name).to(device);
    if (!name.ends_with("attn.c_attn.bias")) {
      EXPECT_LT(relative_error(p, want), tol) << name << " after one AdamW step";
      continue;
    }
    const int64_t C = p.size(0) / 3;
    for (const auto& [what, begin] : {std::pair{"query", 0 * C}, std::pair{"value", 2 * C}})
      EXPECT_LT(relative_error(p.slice(0, begin, begin + C), want.slice(0, begin, begin + C)), tol)
          << name << " (" << what << " bias) after one AdamW step";
    const double worst = max(abs(sub(p.slice(0, C, 2 * C), want.slice(0, C, 2 * C).to(p.dtype())))).item();
    EXPECT_LE(worst, kLr * 1.001) << name << " (key bias) moved further than one step of lr from the reference";
  }
}

// The same f32 weights under bf16 autocast (forward and loss inside the guard, backward
// outside, as PyTorch's recipe): the loss and the f32 gradients against PyTorch's bf16 run.
inline void check_gpt_bf16_parity(Device device, double loss_tol, double grad_tol) {
  Tf32Off tf32_off;
  const Reference ref(gpt_parity_fixture());
  auto model = gpt_from_reference(ref, device, DType::f32);
  const Tensor ids = ref.at("ids").to(device), targets = ref.at("targets").to(device);
  Tensor loss;
  {
    AutocastGuard autocast(DType::bf16);
    loss = model->loss(ids, targets);
  }
  loss.backward();
  NoGradGuard no_grad;
  EXPECT_EQ(loss.dtype(), DType::f32);
  EXPECT_LT(relative_error(loss, ref.at("bf16.loss")), loss_tol) << "loss " << loss.item();
  for (const auto& [name, p] : model->named_parameters()) {
    ASSERT_TRUE(p.grad().defined()) << name << " got no gradient";
    EXPECT_EQ(p.grad().dtype(), DType::f32) << "gradient of " << name;
    EXPECT_LT(relative_error(p.grad(), ref.at("bf16.grad." + name)), grad_tol) << "gradient of " << name;
  }
}

}  // namespace loom::testing
