// Pooling layers over NCHW tensors, as PyTorch's nn.MaxPool2d, nn.AvgPool2d and
// nn.AdaptiveAvgPool2d; each wraps the engine op of the same name and holds no state.
// A stride left out equals the kernel size, as in PyTorch.
#pragma once

#include <array>
#include <optional>

#include "module.h"

namespace loom::nn {

class MaxPool2d : public Module {
 public:
  explicit MaxPool2d(int kernel_size, std::optional<int> stride = std::nullopt, int padding = 0);
  Tensor forward(const Tensor& input) override;
  std::string type_name() const override { return "MaxPool2d"; }
  std::array<int, 2> kernel_size() const { return kernel_; }
  std::array<int, 2> stride() const { return stride_; }
  std::array<int, 2> padding() const { return padding_; }

 private:
  std::array<int, 2> kernel_, stride_, padding_;
};

class AvgPool2d : public Module {
 public:
  explicit AvgPool2d(int kernel_size, std::optional<int> stride = std::nullopt, int padding = 0);
  Tensor forward(const Tensor& input) override;
  std::string type_name() const override { return "AvgPool2d"; }

 private:
  std::array<int, 2> kernel_, stride_, padding_;
};

// Mean down to a fixed (OH, OW); (1, 1) is global average pooling (ResNet's head).
class AdaptiveAvgPool2d : public Module {
 public:
  explicit AdaptiveAvgPool2d(std::array<int, 2> output_size) : output_size_(output_size) {}
  explicit AdaptiveAvgPool2d(int output_size) : output_size_{output_size, output_size} {}
  Tensor forward(const Tensor& input) override;
  std::string type_name() const override { return "AdaptiveAvgPool2d"; }

 private:
  std::array<int, 2> output_size_;
};

}  // namespace loom::nn
