// Training with channels-last parameters (Module::to(MemoryFormat)) against row-major ones
// on any device: test_channels_last_params.cpp runs it on the CPU, test_channels_last_cuda.cpp
// on cuda:0.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/autograd.h"
#include "engine/ops.h"
#include "layers/models/simple_cnn.h"
#include "layers/optim/adam.h"
#include "layers/optim/sgd.h"
#include "tests/common/tensor_checks.h"

namespace loom::test {

using MakeOptimizer = std::function<std::unique_ptr<optim::Optimizer>(const TensorList&)>;

// Three steps of SimpleCNN on 3x12x12 images on `device`, the batch in `batch_format` and
// the parameters in `format`; returns the model.
inline std::shared_ptr<nn::SimpleCNN> train_simple_cnn(Device device, MemoryFormat batch_format,
                                                       MemoryFormat format, const MakeOptimizer& make) {
  manual_seed(31);
  auto net = std::make_shared<nn::SimpleCNN>(3, 12, 10);
  net->to(device);
  net->to(format);
  std::unique_ptr<optim::Optimizer> opt = make(net->parameters());
  for (int step = 0; step < 3; ++step) {
    manual_seed(100 + step);
    const Tensor x = randn({8, 3, 12, 12}).to(device).contiguous(batch_format);
    const Tensor y = from_vector(std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7}, {8}).to(device);
    net->zero_grad();
    cross_entropy(net->forward(x), y).backward();
    opt->step();
  }
  return net;
}

// Training with channels-last parameters against row-major ones, each parameter bit for bit
// and the 4-d ones still channels-last.
inline void expect_same_training(Device device, MemoryFormat batch_format, const MakeOptimizer& make,
                                 const std::string& what) {
  const auto rows = train_simple_cnn(device, batch_format, MemoryFormat::contiguous, make);
  const auto cl = train_simple_cnn(device, batch_format, MemoryFormat::channels_last, make);
  const nn::NamedTensors a = rows->named_parameters(), b = cl->named_parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    const MemoryFormat want = b[i].second.dim() == 4 ? MemoryFormat::channels_last : MemoryFormat::contiguous;
    EXPECT_EQ(b[i].second.memory_format(), want) << a[i].first << ", " << what;
    expect_same_bits(b[i].second, a[i].second, a[i].first + ", " + what);
  }
}

inline std::unique_ptr<optim::Optimizer> momentum_sgd(const TensorList& p) {
  return std::make_unique<optim::SGD>(p, optim::SGDOptions{.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-3});
}

inline std::unique_ptr<optim::Optimizer> adamw(const TensorList& p) {
  return std::make_unique<optim::AdamW>(p, optim::AdamWOptions{.lr = 1e-2});
}

}  // namespace loom::test
