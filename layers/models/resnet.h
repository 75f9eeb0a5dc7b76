// ResNet-18 for 32x32 images (CIFAR): torchvision's resnet18 with the stem adapted to small
// inputs, as is standard for CIFAR — a 3x3 stride-1 first convolution and no max pool —
// so the four stages run at 32, 16, 8 and 4 pixels. Module names follow torchvision
// (conv1, bn1, layer1.0.conv1, layer2.0.downsample.0, fc, ...), so a torchvision model
// with the same stem exchanges state dicts with it. Initialisation also follows
// torchvision: convolutions kaiming_normal_(fan_out, relu), BatchNorm weight 1 and bias 0,
// the classifier PyTorch's Linear default.
#pragma once

#include <memory>

#include "../batch_norm.h"
#include "../conv.h"
#include "../linear.h"
#include "../sequential.h"

namespace loom::nn {

// Two 3x3 convolutions with BatchNorm and a shortcut (a 1x1 strided convolution with
// BatchNorm where the shape changes): relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x)).
// Each ReLU, and the add before the second, runs inside its BatchNorm's kernels
// (BatchNorm::forward_relu), with the values and gradients of the separate ops.
class BasicBlock : public Module {
 public:
  BasicBlock(int64_t in_channels, int64_t out_channels, int stride);
  Tensor forward(const Tensor& input) override;
  std::string type_name() const override { return "BasicBlock"; }

  std::shared_ptr<Conv2d> conv1, conv2;
  std::shared_ptr<BatchNorm2d> bn1, bn2;
  std::shared_ptr<Sequential> downsample;  // null when the shortcut is the identity
};

class ResNet : public Module {
 public:
  // blocks_per_stage: {2, 2, 2, 2} is ResNet-18.
  ResNet(std::array<int, 4> blocks_per_stage, int64_t num_classes = 10, int64_t in_channels = 3);
  // (N, C, H, W) -> logits (N, classes)
  Tensor forward(const Tensor& input) override;
  std::string type_name() const override { return "ResNet"; }

  std::shared_ptr<Conv2d> conv1;
  std::shared_ptr<BatchNorm2d> bn1;
  std::array<std::shared_ptr<Sequential>, 4> stages;  // layer1 .. layer4
  std::shared_ptr<Linear> fc;

 private:
  int64_t in_channels_;
};

std::shared_ptr<ResNet> resnet18(int64_t num_classes = 10, int64_t in_channels = 3);

}  // namespace loom::nn
