// Conv2d: PyTorch's initialisation and the engine's conv2d op, whose backward it inherits.
#include "layers/conv.h"

#include <cmath>

#include "engine/ops.h"

namespace loom::nn {

Conv2d::Conv2d(int64_t in_channels, int64_t out_channels, int kernel_size, Conv2dOptions options)
    : Conv2d(in_channels, out_channels, {kernel_size, kernel_size}, options) {}

Conv2d::Conv2d(int64_t in_channels, int64_t out_channels, std::array<int, 2> kernel_size, Conv2dOptions options)
    : in_channels_(in_channels), out_channels_(out_channels), kernel_(kernel_size), options_(options) {
  LOOM_CHECK(in_channels > 0 && out_channels > 0, "Conv2d(", in_channels, ", ", out_channels,
             "): the channel counts must be positive");
  LOOM_CHECK(kernel_size[0] > 0 && kernel_size[1] > 0, "Conv2d: kernel size must be positive, got (", kernel_size[0],
             ", ", kernel_size[1], ")");
  LOOM_CHECK(options.groups > 0 && in_channels % options.groups == 0 && out_channels % options.groups == 0,
             "Conv2d(", in_channels, ", ", out_channels, "): groups = ", options.groups,
             " must divide both channel counts");
  const int64_t fan_in = in_channels / options.groups * kernel_size[0] * kernel_size[1];
  const double bound = 1.0 / std::sqrt(double(fan_in));
  weight = Tensor::empty({out_channels, in_channels / options.groups, kernel_size[0], kernel_size[1]});
  uniform_(weight, -bound, bound);
  register_parameter("weight", weight);
  if (options.bias == Bias::yes) {
    bias = Tensor::empty({out_channels});
    uniform_(bias, -bound, bound);
    register_parameter("bias", bias);
  }
}

namespace {

void check_input(const Tensor& input, int64_t in_channels, int64_t out_channels) {
  LOOM_CHECK(input.dim() == 4 && input.size(1) == in_channels, "Conv2d(", in_channels, ", ", out_channels,
             "): expected input (N, ", in_channels, ", H, W), got ", shape_str(input.shape()));
}

}  // namespace

Tensor Conv2d::forward(const Tensor& input) {
  check_input(input, in_channels_, out_channels_);
  return conv2d(input, weight, bias, options_.stride, options_.padding, options_.dilation, options_.groups);
}

Tensor Conv2d::forward_without_bias(const Tensor& input) {
  check_input(input, in_channels_, out_channels_);
  return conv2d(input, weight, Tensor(), options_.stride, options_.padding, options_.dilation, options_.groups);
}

}  // namespace loom::nn
