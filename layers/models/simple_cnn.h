// SimpleCNN: the guide's CIFAR-10 network, layer for layer, with PyTorch's module names:
//   features   = Conv2d(C, 32, 3), ReLU, MaxPool2d(2), Conv2d(32, 64, 3), ReLU, MaxPool2d(2)
//   classifier = Flatten, Linear(64 * s * s, 128), ReLU, Linear(128, classes)
// where s is the side left after the features: 6 for 3x32x32 (CIFAR-10), 5 for 1x28x28
// (Fashion-MNIST). Its state dict ("features.0.weight", ..., "classifier.3.bias") loads
// into the guide's PyTorch class unchanged, and back.
#pragma once

#include <memory>

#include "../sequential.h"

namespace loom::nn {

class SimpleCNN : public Module {
 public:
  // Square images of `image_size` pixels with `in_channels` channels.
  explicit SimpleCNN(int64_t in_channels = 3, int64_t image_size = 32, int64_t num_classes = 10);

  // (N, C, S, S) -> logits (N, classes)
  Tensor forward(const Tensor& input) override;
  std::string type_name() const override { return "SimpleCNN"; }

  std::shared_ptr<Sequential> features, classifier;

 private:
  int64_t in_channels_, image_size_;
};

}  // namespace loom::nn
