// Conv2d: PyTorch's nn.Conv2d over NCHW tensors, with its default initialisation
// (kaiming_uniform_ with a = sqrt(5): weight and bias ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)),
// fan_in = in_channels / groups * KH * KW), so a model starts where PyTorch's would.
// CUDA runs cuDNN (algorithm chosen once per shape); the CPU runs im2col + GEMM.
#pragma once

#include <array>

#include "linear.h"  // Bias
#include "module.h"

namespace loom::nn {

struct Conv2dOptions {
  std::array<int, 2> stride{1, 1};
  std::array<int, 2> padding{0, 0};
  std::array<int, 2> dilation{1, 1};
  int groups = 1;
  Bias bias = Bias::yes;
};

class Conv2d : public Module {
 public:
  // A square kernel; `options` gives stride, padding, dilation, groups and bias.
  Conv2d(int64_t in_channels, int64_t out_channels, int kernel_size, Conv2dOptions options = {});
  Conv2d(int64_t in_channels, int64_t out_channels, std::array<int, 2> kernel_size, Conv2dOptions options = {});

  // (N, C_in, H, W) -> (N, C_out, OH, OW)
  Tensor forward(const Tensor& input) override;
  // The convolution alone, the bias left out: forward adds the bias to this.
  Tensor forward_without_bias(const Tensor& input);
  std::string type_name() const override { return "Conv2d"; }

  int64_t in_channels() const { return in_channels_; }
  int64_t out_channels() const { return out_channels_; }
  const Conv2dOptions& options() const { return options_; }

  Tensor weight;  // (C_out, C_in / groups, KH, KW)
  Tensor bias;    // (C_out,); undefined with Bias::no

 private:
  int64_t in_channels_, out_channels_;
  std::array<int, 2> kernel_;
  Conv2dOptions options_;
};

}  // namespace loom::nn
