// Models and the layers they are made of: SimpleCNN and ResNet-18 have PyTorch's module
// names, parameter counts and output shapes; Conv2d and the pooling layers wrap their ops;
// training checkpoints resume a run bit for bit; autocast computes products in bf16 while
// gradients reach f32 parameters in f32.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <unistd.h>

#include "engine/autocast.h"
#include "engine/autograd.h"
#include "engine/ops.h"
#include "engine/serialization.h"
#include "layers/checkpoint.h"
#include "layers/conv.h"
#include "layers/models/resnet.h"
#include "layers/models/simple_cnn.h"
#include "layers/optim/adam.h"
#include "layers/optim/sgd.h"
#include "layers/pool.h"
#include "tests/common/tensor_checks.h"

namespace loom::nn {
namespace {

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("loom_models_" + std::to_string(getpid()) + "_" + name)).string();
}

std::vector<std::string> keys(const NamedTensors& named) {
  std::vector<std::string> out;
  for (const auto& [name, _] : named) out.push_back(name);
  return out;
}

TEST(SimpleCnn, HasTheGuidesModuleNamesAndSizes) {
  SimpleCNN cifar(3, 32, 10);
  EXPECT_EQ(keys(cifar.state_dict()),
            (std::vector<std::string>{"features.0.weight", "features.0.bias", "features.3.weight", "features.3.bias",
                                      "classifier.1.weight", "classifier.1.bias", "classifier.3.weight",
                                      "classifier.3.bias"}));
  // 3*32*9+32 + 32*64*9+64 + 64*6*6*128+128 + 128*10+10, as torch counts the guide's model.
  EXPECT_EQ(cifar.num_parameters(), 896 + 18496 + 295040 + 1290);
  SimpleCNN fmnist(1, 28, 10);
  EXPECT_EQ(fmnist.num_parameters(), 320 + 18496 + (64 * 5 * 5 * 128 + 128) + 1290);
  EXPECT_EQ(fmnist.forward(randn({2, 1, 28, 28})).shape(), (Shape{2, 10}));
  EXPECT_EQ(cifar.forward(randn({3, 3, 32, 32})).shape(), (Shape{3, 10}));
}

// SimpleCNN pools before its ReLUs (simple_cnn.h); the guide's order, ReLU then pool, must
// give the same logits and gradients. Half the batch is blank, so each of its windows holds
// equal values (the bias), negative in some channels: ties the pool must break alike.
TEST(SimpleCnn, PoolingBeforeReluGivesTheGuidesOrderBitForBit) {
  for (DType dtype : {DType::f32, DType::f64}) {
    for (MemoryFormat format : {MemoryFormat::contiguous, MemoryFormat::channels_last}) {
      manual_seed(11);
      SimpleCNN model(3, 32, 10);
      model.to(dtype);
      for (const auto& [name, p] : model.named_parameters())
        if (name.find("bias") != std::string::npos) {
          NoGradGuard no_grad;
          copy_(p, mul(randn(p.shape(), dtype), 0.5));
        }
      Tensor x = cat({randn({3, 3, 32, 32}, dtype), zeros({3, 3, 32, 32}, dtype)}, 0).contiguous(format);
      Tensor labels = from_vector(std::vector<int64_t>{0, 1, 2, 3, 4, 5}, {6});
      auto grads = [&](auto&& forward) {
        model.zero_grad();
        Tensor logits = forward();
        cross_entropy(logits, labels).backward();
        std::vector<Tensor> out{logits.detach()};
        for (const Tensor& p : model.parameters()) out.push_back(p.grad().clone());
        return out;
      };
      auto mine = grads([&] { return model.forward(x); });
      auto guide = grads([&] {
        auto layer = [&](int i) { return model.features->named_children()[size_t(i)].second; };
        Tensor h = max_pool2d(relu(layer(0)->forward(x)), {2, 2});
        h = max_pool2d(relu(layer(3)->forward(h)), {2, 2});
        return model.classifier->forward(h);
      });
      ASSERT_EQ(mine.size(), guide.size());
      for (size_t i = 0; i < mine.size(); ++i)
        test::expect_same_bits(mine[i], guide[i],
                               std::string(dtype_name(dtype)) +
                                   (format == MemoryFormat::contiguous ? "" : " channels-last") +
                                   (i == 0 ? ": logits" : ": gradient of parameter " + std::to_string(i)));
    }
  }
}

TEST(SimpleCnn, RejectsImagesOfTheWrongShapeNamingBoth) {
  SimpleCNN model(1, 28, 10);
  try {
    model.forward(randn({2, 3, 32, 32}));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("(N, 1, 28, 28)"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("(2, 3, 32, 32)"), std::string::npos) << e.what();
  }
}

TEST(ResNet18, HasTorchvisionNamesAndTheCifarParameterCount) {
  auto model = resnet18(10, 3);
  // torchvision's resnet18 with a 3x3 stem and 10 classes: 11,173,962 parameters.
  EXPECT_EQ(model->num_parameters(), 11173962);
  auto sd = keys(model->state_dict());
  auto has = [&](const std::string& k) { return std::find(sd.begin(), sd.end(), k) != sd.end(); };
  for (const char* k : {"conv1.weight", "bn1.running_mean", "bn1.num_batches_tracked", "layer1.0.conv1.weight",
                        "layer2.0.downsample.0.weight", "layer2.0.downsample.1.running_var", "layer4.1.bn2.bias",
                        "fc.weight", "fc.bias"})
    EXPECT_TRUE(has(k)) << k;
  EXPECT_FALSE(has("layer1.0.downsample.0.weight"));
  EXPECT_EQ(model->forward(randn({2, 3, 32, 32})).shape(), (Shape{2, 10}));
  auto gray = resnet18(10, 1);
  EXPECT_EQ(gray->forward(randn({2, 1, 28, 28})).shape(), (Shape{2, 10}));
}

// A channels-last batch (MemoryFormat) trains ResNet-18 as the row-major one does, the stem's
// and every stage's output staying channels-last. The CPU's convolutions sum in another
// order in each layout, so the loss and gradients agree to rounding, not bit for bit.
TEST(ResNet18, AChannelsLastBatchStaysChannelsLastAndTrainsAlike) {
  std::vector<float> losses[2];
  std::vector<std::vector<float>> grads[2];
  manual_seed(5);
  Tensor images = randn({2, 3, 16, 16});
  Tensor labels = from_vector(std::vector<int64_t>{3, 7}, {2});
  for (int layout = 0; layout < 2; ++layout) {
    manual_seed(9);
    auto model = resnet18(10, 3);
    const MemoryFormat format = layout ? MemoryFormat::channels_last : MemoryFormat::contiguous;
    Tensor x = images.contiguous(format);
    Tensor loss = cross_entropy(model->forward(x), labels);
    loss.backward();
    // ResNet::forward's steps, to look at what each stage hands on.
    NoGradGuard no_grad;
    Tensor h = relu(model->bn1->forward(model->conv1->forward(x)));
    EXPECT_EQ(h.memory_format(), format);
    for (const auto& stage : model->stages) {
      h = stage->forward(h);
      EXPECT_EQ(h.memory_format(), format) << shape_str(h.shape());
    }
    losses[layout] = loss.to_vector<float>();
    for (const Tensor& p : model->parameters()) grads[layout].push_back(p.grad().to_vector<float>());
  }
  EXPECT_NEAR(losses[1][0], losses[0][0], 1e-5 * std::fabs(losses[0][0]));
  ASSERT_EQ(grads[1].size(), grads[0].size());
  for (size_t i = 0; i < grads[0].size(); ++i) {
    float scale = 0;
    for (float g : grads[0][i]) scale = std::max(scale, std::fabs(g));
    for (size_t j = 0; j < grads[0][i].size(); ++j)
      ASSERT_NEAR(grads[1][i][j], grads[0][i][j], 1e-4 * scale) << "parameter " << i << " element " << j;
  }
}

TEST(Conv2dLayer, InitialisesLikePyTorchAndMatchesTheOp) {
  manual_seed(3);
  Conv2d conv(4, 6, 3, {.stride = {2, 2}, .padding = {1, 1}});
  const double bound = 1.0 / std::sqrt(4.0 * 9.0);
  EXPECT_LE(max(abs(conv.weight)).item(), bound);
  EXPECT_LE(max(abs(conv.bias)).item(), bound);
  Tensor x = randn({2, 4, 9, 9});
  Tensor y = conv.forward(x);
  EXPECT_EQ(y.shape(), (Shape{2, 6, 5, 5}));
  Tensor ref = conv2d(x, conv.weight, conv.bias, {2, 2}, {1, 1});
  EXPECT_EQ(y.to_vector<float>(), ref.to_vector<float>());
  EXPECT_THROW(Conv2d(4, 6, 3, {.groups = 4}), Error);  // 4 does not divide 6
  EXPECT_THROW(conv.forward(randn({2, 3, 9, 9})), Error);
}

TEST(PoolLayers, WrapTheirOps) {
  Tensor x = randn({2, 3, 8, 8});
  EXPECT_EQ(MaxPool2d(2).forward(x).to_vector<float>(), max_pool2d(x, {2, 2}).to_vector<float>());
  EXPECT_EQ(AvgPool2d(3, 2, 1).forward(x).to_vector<float>(), avg_pool2d(x, {3, 3}, {2, 2}, {1, 1}).to_vector<float>());
  EXPECT_EQ(AdaptiveAvgPool2d(1).forward(x).shape(), (Shape{2, 3, 1, 1}));
  EXPECT_THROW(MaxPool2d(2, 2, 2), Error);  // padding more than half the kernel
}

// Trains for `steps` steps on batches drawn from the global generator (so resuming must
// restore it too), returning each step's loss.
std::vector<double> train_steps(Module& model, optim::Optimizer& opt, optim::LRScheduler& sched, int steps) {
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) {
    Tensor x = randn({8, 1, 28, 28});
    Tensor y = argmax(randn({8, 10}), 1);
    opt.zero_grad();
    Tensor loss = cross_entropy(model.forward(x), y);
    loss.backward();
    opt.step();
    sched.step();
    losses.push_back(loss.item());
  }
  return losses;
}

TEST(TrainingCheckpoint, ResumedRunFollowsTheSameLossesBitForBit) {
  const std::string path = temp_path("resume.safetensors");
  manual_seed(7);
  SimpleCNN a(1, 28, 10);
  optim::SGD sgd_a(a.parameters(), {.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-4});
  optim::LRScheduler sched_a(sgd_a, optim::cosine_annealing(10));
  train_steps(a, sgd_a, sched_a, 3);
  save_checkpoint(path, {.model = &a, .optimizer = &sgd_a, .scheduler = &sched_a, .user = {{"epoch", "2"}}});
  std::vector<double> straight = train_steps(a, sgd_a, sched_a, 4);

  manual_seed(99);  // a different start: everything must come from the file
  SimpleCNN b(1, 28, 10);
  optim::SGD sgd_b(b.parameters(), {.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-4});
  optim::LRScheduler sched_b(sgd_b, optim::cosine_annealing(10));
  auto user = load_checkpoint(path, {.model = &b, .optimizer = &sgd_b, .scheduler = &sched_b});
  EXPECT_EQ(user.at("epoch"), "2");
  std::vector<double> resumed = train_steps(b, sgd_b, sched_b, 4);
  EXPECT_EQ(straight, resumed);
  std::remove(path.c_str());
}

TEST(TrainingCheckpoint, WeightsLoadFromACheckpointAndRejectOtherModels) {
  const std::string path = temp_path("weights.safetensors");
  SimpleCNN a(1, 28, 10);
  optim::Adam adam(a.parameters(), {});
  save_checkpoint(path, {.model = &a, .optimizer = &adam});
  SimpleCNN b(1, 28, 10);
  load_weights(path, b);
  EXPECT_EQ(b.classifier->state_dict()[0].second.to_vector<float>(),
            a.classifier->state_dict()[0].second.to_vector<float>());
  SimpleCNN other(3, 32, 10);
  try {
    load_weights(path, other);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
  // A checkpoint of an Adam run cannot resume an SGD run.
  optim::SGD sgd(b.parameters(), {.lr = 0.1});
  EXPECT_THROW(load_checkpoint(path, {.model = &b, .optimizer = &sgd}), Error);
  // A plain weights file is not a training checkpoint.
  save_safetensors(path, a.state_dict());
  EXPECT_THROW(load_checkpoint(path, {.model = &b}), Error);
  std::remove(path.c_str());
}

TEST(Autocast, ProductsRunInBf16AndGradientsReachF32ParametersInF32) {
  Tensor w = randn({4, 3}).set_requires_grad();
  Tensor x = randn({2, 4});
  Tensor y;
  {
    AutocastGuard autocast(DType::bf16);
    y = matmul(x, w);
    EXPECT_EQ(y.dtype(), DType::bf16);
    Tensor c = conv2d(randn({1, 2, 5, 5}), randn({3, 2, 3, 3}));
    EXPECT_EQ(c.dtype(), DType::bf16);
    AutocastGuard off(std::nullopt);
    EXPECT_EQ(matmul(x, w).dtype(), DType::f32);
  }
  EXPECT_EQ(matmul(x, w).dtype(), DType::f32);
  sum(y.to(DType::f32)).backward();
  ASSERT_TRUE(w.grad().defined());
  EXPECT_EQ(w.grad().dtype(), DType::f32);
  // d(sum(x w))/dw = x^T 1, to bf16 precision.
  Tensor expect = sum(x, {0}).unsqueeze(1).expand({4, 3});
  auto g = w.grad().to_vector<float>(), e = expect.contiguous().to_vector<float>();
  for (size_t i = 0; i < g.size(); ++i) EXPECT_NEAR(g[i], e[i], 0.02 * (1 + std::abs(e[i])));
}

}  // namespace
}  // namespace loom::nn
