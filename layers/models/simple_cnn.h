// SimpleCNN: the guide's CIFAR-10 network with PyTorch's module names:
//   features   = Conv2d(C, 32, 3), MaxPool2d(2), ReLU, Conv2d(32, 64, 3), MaxPool2d(2), ReLU
//   classifier = Flatten, Linear(64 * s * s, 128), ReLU, Linear(128, classes)
// where s is the side left after the features: 6 for 3x32x32 (CIFAR-10), 5 for 1x28x28
// (Fashion-MNIST). Its state dict ("features.0.weight", ..., "classifier.3.bias") loads
// into the guide's PyTorch class unchanged, and back.
//
// The guide applies each ReLU before its pool; here it comes after. That computes the same
// function: ReLU is monotone, so the largest of a window's ReLUs is the ReLU of its largest
// value, and the gradient reaches the same element (the window's first maximum when that
// maximum is positive, no element otherwise). The only difference is the sign of a zero (a
// window of -1 and -0 gives +0 in the guide's order, -0 here), which changes no later value
// unless every term of a sum is zero; tests/layers/test_models.cpp compares both orders'
// outputs and gradients bit for bit. What it saves: the ReLU passes, forward and backward,
// run over the pooled maps, a quarter of the values, and backward keeps the pooled ReLU
// output instead of the full one. Each convolution is followed by its pool, so `features`
// (a Sequential) adds the convolution's bias while pooling (layers/sequential.h), the same
// bits without a pass over the convolution's output.
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
