#include "layers/models/resnet.h"

#include <cmath>
#include <string>

#include "engine/autograd.h"
#include "engine/ops.h"

namespace loom::nn {
namespace {

// torchvision's kaiming_normal_(mode="fan_out", nonlinearity="relu"): N(0, 2 / fan_out).
std::shared_ptr<Conv2d> make_conv(int64_t in, int64_t out, int kernel, int stride) {
  Conv2dOptions o;
  o.stride = {stride, stride};
  o.padding = {kernel / 2, kernel / 2};
  o.bias = Bias::no;
  auto conv = std::make_shared<Conv2d>(in, out, kernel, o);
  NoGradGuard no_grad;
  normal_(conv->weight, 0.0, std::sqrt(2.0 / double(out * kernel * kernel)));
  return conv;
}

}  // namespace

BasicBlock::BasicBlock(int64_t in_channels, int64_t out_channels, int stride) {
  conv1 = register_module("conv1", make_conv(in_channels, out_channels, 3, stride));
  bn1 = register_module("bn1", std::make_shared<BatchNorm2d>(out_channels));
  conv2 = register_module("conv2", make_conv(out_channels, out_channels, 3, 1));
  bn2 = register_module("bn2", std::make_shared<BatchNorm2d>(out_channels));
  if (stride != 1 || in_channels != out_channels) {
    downsample = register_module(
        "downsample", std::make_shared<Sequential>(std::vector<std::shared_ptr<Module>>{
                          make_conv(in_channels, out_channels, 1, stride), std::make_shared<BatchNorm2d>(out_channels)}));
  }
}

Tensor BasicBlock::forward(const Tensor& x) {
  Tensor out = bn1->forward_relu(conv1->forward(x));
  return bn2->forward_relu(conv2->forward(out), downsample ? downsample->forward(x) : x);
}

ResNet::ResNet(std::array<int, 4> blocks_per_stage, int64_t num_classes, int64_t in_channels)
    : in_channels_(in_channels) {
  LOOM_CHECK(in_channels > 0 && num_classes > 0, "ResNet: channels and classes must be positive, got ", in_channels,
             " and ", num_classes);
  conv1 = register_module("conv1", make_conv(in_channels, 64, 3, 1));
  bn1 = register_module("bn1", std::make_shared<BatchNorm2d>(64));
  int64_t channels = 64;
  for (int s = 0; s < 4; ++s) {
    LOOM_CHECK(blocks_per_stage[s] > 0, "ResNet: every stage needs at least one block, stage ", s + 1, " has ",
               blocks_per_stage[s]);
    const int64_t out = 64 << s;
    auto stage = std::make_shared<Sequential>();
    for (int b = 0; b < blocks_per_stage[s]; ++b) {
      stage->append(std::make_shared<BasicBlock>(channels, out, b == 0 && s > 0 ? 2 : 1));
      channels = out;
    }
    stages[s] = register_module("layer" + std::to_string(s + 1), stage);
  }
  fc = register_module("fc", std::make_shared<Linear>(512, num_classes));
}

Tensor ResNet::forward(const Tensor& input) {
  LOOM_CHECK(input.dim() == 4 && input.size(1) == in_channels_, "ResNet: expected images (N, ", in_channels_,
             ", H, W), got ", shape_str(input.shape()));
  Tensor x = bn1->forward_relu(conv1->forward(input));
  for (const auto& stage : stages) x = stage->forward(x);
  x = adaptive_avg_pool2d(x, {1, 1}).flatten(1);
  return fc->forward(x);
}

std::shared_ptr<ResNet> resnet18(int64_t num_classes, int64_t in_channels) {
  return std::make_shared<ResNet>(std::array<int, 4>{2, 2, 2, 2}, num_classes, in_channels);
}

}  // namespace loom::nn
