// Whole-step CUDA graphs (engine/cuda_graph.h, layers/optim/captured_step.h) on cuda:0: a
// captured training step gives the eager step's losses and weights bit for bit over 20 steps
// (SimpleCNN and ResNet-18, f32 and bf16 autocast, SGD; SimpleCNN with AdamW; both CNNs with
// channels-last batches and weights in bf16; a small GPT in
// bf16 with clipping and AdamW's two parameter groups; a batch step whose short batches run
// eagerly), with a new
// batch copied in and the learning rate changed before every step; the graph's memory is its own pool, handed back
// when it goes; and what a capture cannot hold (a read on the host, a random op) is refused
// with an error that names it.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/allocator.h"
#include "engine/autocast.h"
#include "engine/autograd.h"
#include "engine/cuda_graph.h"
#include "engine/ops.h"
#include "engine/options.h"
#include "layers/layers.h"
#include "layers/optim/captured_step.h"
#include "tests/common/gpu.h"

namespace loom {
namespace {

const Device kGpu = Device::cuda(0);

struct Trained {
  std::vector<float> losses;
  std::vector<std::vector<float>> weights;
  bool captured = false;
};

// 20 steps over 4 batches in turn, lr falling each step; each batch is copied into the static
// x and y before its step, as a data loader's would be. `step` is the whole training step.
Trained run_steps(nn::Module& model, optim::Optimizer& opt, double lr, const std::function<Tensor()>& step,
                  const std::vector<Tensor>& inputs, const std::vector<Tensor>& targets, Tensor& x, Tensor& y,
                  bool capture) {
  std::optional<optim::CapturedStep> captured;
  if (capture) captured.emplace(kGpu, std::vector<optim::Optimizer*>{&opt}, step);
  Trained out;
  for (int s = 0; s < 20; ++s) {
    {
      NoGradGuard no_grad;
      copy_(x, inputs[size_t(s % 4)]);
      copy_(y, targets[size_t(s % 4)]);
    }
    opt.set_lr(lr * (1.0 - s / 40.0));
    Tensor loss = captured ? captured->run() : step();
    out.losses.push_back(float(loss.to(Device::cpu()).item()));
  }
  out.captured = captured && captured->captured();
  for (const Tensor& p : model.parameters()) out.weights.push_back(p.contiguous().to(Device::cpu()).to_vector<float>());
  return out;
}

// A CNN trained by SGD (momentum, weight decay) or AdamW; with `channels_last`, its batches
// and 4-d weights laid out channels-last (Module::to(MemoryFormat)).
Trained train(const std::string& model_name, std::optional<DType> autocast, bool capture, bool adamw,
              bool channels_last = false) {
  manual_seed(7);
  std::shared_ptr<nn::Module> model;
  if (model_name == "simplecnn") model = std::make_shared<nn::SimpleCNN>(3, 32, 10);
  else model = nn::resnet18(10, 3);
  model->to(kGpu);
  if (channels_last) model->to(MemoryFormat::channels_last);
  model->train();
  const int64_t batch = model_name == "simplecnn" ? 32 : 8;
  std::vector<Tensor> images, labels;
  for (int i = 0; i < 4; ++i) {
    Tensor image = randn({batch, 3, 32, 32}, DType::f32, kGpu);
    images.push_back(channels_last ? image.contiguous(MemoryFormat::channels_last) : image);
    std::vector<float> l;
    for (int64_t k = 0; k < batch; ++k) l.push_back(float((k * 7 + i) % 10));
    labels.push_back(from_vector(l, {batch}, kGpu).to(DType::i64));
  }
  Tensor x = channels_last ? empty_like(images[0]).contiguous(MemoryFormat::channels_last) : empty_like(images[0]);
  Tensor y = empty_like(labels[0]);
  std::unique_ptr<optim::Optimizer> made;
  if (adamw) made = std::make_unique<optim::AdamW>(model->parameters(), optim::AdamWOptions{.lr = 1e-3, .weight_decay = 0.01});
  else made = std::make_unique<optim::SGD>(model->parameters(), optim::SGDOptions{.lr = 0.05, .momentum = 0.9,
                                                                                  .weight_decay = 5e-4});
  optim::Optimizer& opt = *made;
  auto step = [&] {
    opt.zero_grad();
    std::optional<AutocastGuard> cast;
    if (autocast) cast.emplace(*autocast);
    Tensor loss = cross_entropy(model->forward(x), y);
    cast.reset();
    loss.backward();
    opt.step();
    return loss;
  };
  return run_steps(*model, opt, adamw ? 1e-3 : 0.05, step, images, labels, x, y, capture);
}

// A small GPT (2 blocks of width 64, heads of 32: the tensor-core attention in bf16) trained
// as train_gpt trains it: bf16 autocast, gradients clipped to norm 1 (on the device, nothing
// read on the host), AdamW with weight decay on the matrices only. The
// embeddings' gradients are summed with atomics; every batch's token ids are distinct and a
// position recurs only once (two rows), so no address gets more than two adds and the sums
// repeat from run to run.
Trained train_gpt(bool capture) {
  manual_seed(11);
  nn::GPTConfig config;
  config.vocab_size = 128, config.context = 32, config.layers = 2, config.heads = 2, config.width = 64;
  auto model = std::make_shared<nn::GPT>(config);
  model->to(kGpu);
  model->train();
  std::vector<Tensor> ids, targets;
  for (int64_t i = 0; i < 4; ++i) {
    std::vector<int64_t> a, b;
    for (int64_t k = 0; k < 64; ++k) {
      a.push_back((k * 37 + i * 11) % 128);  // 37 is prime to 128: 64 distinct ids
      b.push_back((k * 5 + i) % 128);
    }
    ids.push_back(from_vector(a, {2, 32}, kGpu));
    targets.push_back(from_vector(b, {2, 32}, kGpu));
  }
  Tensor x = empty_like(ids[0]), y = empty_like(targets[0]);
  TensorList decay, no_decay;
  for (const Tensor& p : model->parameters()) (p.dim() >= 2 ? decay : no_decay).push_back(p);
  optim::AdamW opt(decay, {.lr = 6e-4, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1});
  opt.add_param_group(no_decay, {.lr = 6e-4, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.0});
  auto step = [&] {
    opt.zero_grad();
    Tensor loss;
    {
      AutocastGuard cast(DType::bf16);
      loss = model->loss(x, y);
    }
    loss.backward();
    optim::clip_grad_norm_(model->parameters(), 1.0);
    opt.step();
    return loss;
  };
  return run_steps(*model, opt, 6e-4, step, ids, targets, x, y, capture);
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Under Options::deterministic (convolutions on cuDNN engines whose results repeat): two
// eager runs agree bit for bit first, so the comparison with the captured run means something.
void expect_equal_runs(const std::string& model, const std::function<Trained(bool capture)>& train_with) {
  Options o = options();
  o.deterministic = true;
  OptionsGuard guard(o);
  const Trained eager = train_with(false);
  const Trained again = train_with(false);
  for (size_t s = 0; s < eager.losses.size(); ++s)
    ASSERT_TRUE(same_bits({eager.losses[s]}, {again.losses[s]}))
        << model << " step " << s << ": two eager runs differ (" << eager.losses[s] << ", " << again.losses[s] << ")";
  const Trained graph = train_with(true);
  ASSERT_TRUE(graph.captured) << model << ": the step was not captured";
  for (size_t s = 0; s < eager.losses.size(); ++s)
    EXPECT_TRUE(same_bits({eager.losses[s]}, {graph.losses[s]}))
        << model << " step " << s << ": eager loss " << eager.losses[s] << ", captured " << graph.losses[s];
  ASSERT_EQ(eager.weights.size(), graph.weights.size());
  for (size_t i = 0; i < eager.weights.size(); ++i)
    EXPECT_TRUE(same_bits(eager.weights[i], graph.weights[i])) << model << ": parameter " << i << " differs";
}

void expect_equal_runs(const std::string& model, std::optional<DType> autocast, bool adamw = false,
                       bool channels_last = false) {
  expect_equal_runs(model, [&](bool capture) { return train(model, autocast, capture, adamw, channels_last); });
}

TEST(CapturedStepCuda, SimpleCnnF32EqualsEagerBitForBit) {
  LOOM_REQUIRE_CUDA();
  expect_equal_runs("simplecnn", std::nullopt);
}

TEST(CapturedStepCuda, SimpleCnnBf16EqualsEagerBitForBit) {
  LOOM_REQUIRE_CUDA();
  expect_equal_runs("simplecnn", DType::bf16);
}

// AdamW: its bias corrections follow the step count through the replays.
TEST(CapturedStepCuda, SimpleCnnAdamWEqualsEagerBitForBit) {
  LOOM_REQUIRE_CUDA();
  expect_equal_runs("simplecnn", std::nullopt, true);
  expect_equal_runs("simplecnn", DType::bf16, true);
}

TEST(CapturedStepCuda, ResNet18F32EqualsEagerBitForBit) {
  LOOM_REQUIRE_CUDA();
  expect_equal_runs("resnet18", std::nullopt);
}

TEST(CapturedStepCuda, ResNet18Bf16EqualsEagerBitForBit) {
  LOOM_REQUIRE_CUDA();
  expect_equal_runs("resnet18", DType::bf16);
}

// Channels-last batches and weights: the optimizers update the weights as they lie and write
// autocast's kept copies in place, and the convolutions add into the shortcuts' gradients.
TEST(CapturedStepCuda, ChannelsLastWeightsEqualEagerBitForBit) {
  LOOM_REQUIRE_CUDA();
  expect_equal_runs("resnet18", DType::bf16, false, true);
  expect_equal_runs("simplecnn", DType::bf16, true, true);
}

TEST(CapturedStepCuda, GptBf16AdamWEqualsEagerBitForBit) {
  LOOM_REQUIRE_CUDA();
  expect_equal_runs("gpt", train_gpt);
}

// CapturedBatchStep, as train_cnn and train_gpt use it: batches of 32 with a short one of 20
// at each epoch's end. Full batches replay the graph, the short ones run eagerly, and the
// losses and weights are the eager run's bit for bit. A run that starts on a short batch (one
// resumed at an epoch's end) warms up again on the full batches and captures them.
TEST(CapturedStepCuda, ABatchStepReplaysFullBatchesAndStepsShortOnesEagerly) {
  LOOM_REQUIRE_CUDA();
  Options o = options();
  o.deterministic = true;
  OptionsGuard guard(o);
  auto run = [](bool capture, int first) {
    manual_seed(7);
    auto model = std::make_shared<nn::SimpleCNN>(3, 32, 10);
    model->to(kGpu);
    model->train();
    optim::SGD opt(model->parameters(), {.lr = 0.05, .momentum = 0.9});
    auto step = [&](const Tensor& x, const Tensor& y) {
      opt.zero_grad();
      Tensor loss = cross_entropy(model->forward(x), y);
      loss.backward();
      opt.step();
      return loss;
    };
    std::optional<optim::CapturedBatchStep> captured;
    if (capture) captured.emplace(kGpu, std::vector<optim::Optimizer*>{&opt}, step);
    Trained out;
    for (int s = first; s < 16; ++s) {
      const int64_t rows = s % 4 == 3 ? 20 : 32;  // every fourth batch short
      manual_seed(100 + s);
      Tensor x = randn({rows, 3, 32, 32}, DType::f32, kGpu);
      Tensor y = argmax(randn({rows, 10}, DType::f32, kGpu), 1);
      Tensor loss = captured ? captured->run(x, y) : step(x, y);
      out.losses.push_back(float(loss.to(Device::cpu()).item()));
    }
    out.captured = captured && captured->captured();
    for (const Tensor& p : model->parameters()) out.weights.push_back(p.to(Device::cpu()).to_vector<float>());
    return out;
  };
  for (int first : {0, 3}) {
    const Trained eager = run(false, first), graph = run(true, first);
    EXPECT_TRUE(graph.captured) << "starting at batch " << first;
    ASSERT_EQ(eager.losses.size(), graph.losses.size());
    for (size_t s = 0; s < eager.losses.size(); ++s)
      EXPECT_TRUE(same_bits({eager.losses[s]}, {graph.losses[s]}))
          << "starting at batch " << first << ", step " << s << ": eager " << eager.losses[s] << ", captured "
          << graph.losses[s];
    for (size_t i = 0; i < eager.weights.size(); ++i)
      EXPECT_TRUE(same_bits(eager.weights[i], graph.weights[i])) << "parameter " << i << " differs";
  }
}

// A graph's pool: what the capture allocates stays the graph's (a new tensor outside never
// gets it), and the graph's destruction hands it to the ordinary cache.
TEST(CudaGraphCuda, ThePoolIsTheGraphsUntilItGoes) {
  LOOM_REQUIRE_CUDA();
  Tensor a = full({1 << 16}, 1.0, DType::f32, kGpu);
  Tensor out;
  void* inside = nullptr;
  size_t pooled = 0;
  {
    CudaGraph graph(kGpu);
    graph.capture([&] {
      Tensor t = add(a, a);  // freed inside the capture: back to the pool
      inside = t.data_ptr();
      out = mul(t, 3.0);
    });
    pooled = graph.pool_bytes();
    EXPECT_GT(pooled, size_t(0));
    // Outside the capture, a tensor of t's size never gets t's block.
    Tensor outside = empty_like(a);
    EXPECT_NE(outside.data_ptr(), inside);
    graph.replay();
    graph.replay();
    EXPECT_EQ(out.to(Device::cpu()).to_vector<float>()[5], 6.0f);
    fill_(a, 2.0);
    graph.replay();
    EXPECT_EQ(out.to(Device::cpu()).to_vector<float>()[5], 12.0f);
  }
  // The graph is gone: its free blocks serve ordinary allocations again.
  Tensor again = empty_like(a);
  EXPECT_EQ(again.data_ptr(), inside);
}

TEST(CudaGraphCuda, WhatACaptureCannotHoldIsNamed) {
  LOOM_REQUIRE_CUDA();
  Tensor a = full({16}, 1.0, DType::f32, kGpu);
  {
    CudaGraph graph(kGpu);
    try {
      graph.capture([&] { (void)sum(a).to(Device::cpu()).item(); });
      FAIL() << "a read on the host was captured";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("inside a captured step"), std::string::npos) << e.what();
    }
    EXPECT_FALSE(graph.captured());
  }
  {
    CudaGraph graph(kGpu);
    try {
      graph.capture([&] { (void)randn({16}, DType::f32, kGpu); });
      FAIL() << "a random op was captured";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("Philox offset"), std::string::npos) << e.what();
    }
  }
  // The device works on after both.
  EXPECT_EQ(sum(a).to(Device::cpu()).item(), 16.0);
}

}  // namespace
}  // namespace loom
