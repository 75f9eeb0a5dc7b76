// A convolution's bias added while pooling (max_pool2d_bias, engine/ops.h; Sequential's
// Conv2d + MaxPool2d, layers/sequential.h), on any device: the values and every gradient
// are the bits of the add and the pooling run one after the other.
// test_conv_pool_fusion.cpp runs these on the CPU, test_layers_cuda.cpp on cuda:0.
#pragma once

#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/autograd.h"
#include "engine/ops.h"
#include "layers/activation.h"
#include "layers/conv.h"
#include "layers/pool.h"
#include "layers/sequential.h"
#include "tests/common/tensor_checks.h"

namespace loom::test {

struct PoolWindow {
  std::array<int, 2> kernel, stride, padding;
};

// max_pool2d_bias(x, b) against max_pool2d(x + b): y, dx and db bit for bit, in `dtype` and
// `format` on `device`, with gradients wanted for both, x alone and b alone. Half the channels
// get a bias much larger than x, so that many window elements round to the same sum (in bf16
// above all): the gradient must still reach the first of them, as it does after a separate
// add. A NaN and both infinities sit among the values.
inline void expect_max_pool_bias_is_add_then_pool(Device device, DType dtype, MemoryFormat format, PoolWindow win) {
  const std::string what = std::string(dtype_name(dtype)) +
                           (format == MemoryFormat::channels_last ? " channels-last" : " NCHW") + " window " +
                           std::to_string(win.kernel[0]) + " stride " + std::to_string(win.stride[0]) + " pad " +
                           std::to_string(win.padding[0]) + " on " + device.str();
  manual_seed(11);
  const int64_t c = 6;
  const Shape shape{3, c, 9, 13};
  std::vector<double> values = mul(randn(shape), 0.01).to(DType::f64).to_vector<double>();
  values[5] = std::nan("");
  values[200] = std::numeric_limits<double>::infinity();
  values[401] = -std::numeric_limits<double>::infinity();
  const Tensor x0 = from_vector(values, shape).to(dtype).to(device).contiguous(format);
  const Tensor b0 =
      add(randn({c}), from_vector(std::vector<double>{64, 0, 64, 0, 64, 0}, {c})).to(dtype).to(device);
  for (const auto& [x_grad, b_grad] : {std::pair{true, true}, std::pair{true, false}, std::pair{false, true}}) {
    const std::string wants = what + (x_grad && b_grad ? ", both gradients" : x_grad ? ", dx alone" : ", dbias alone");
    TensorList outputs, grads;
    for (bool fused : {true, false}) {
      Tensor x = x0.detach(), b = b0.detach();
      if (x_grad) x.set_requires_grad();
      if (b_grad) b.set_requires_grad();
      Tensor y = fused ? max_pool2d_bias(x, b, win.kernel, win.stride, win.padding)
                       : max_pool2d(add(x, b.reshape({1, c, 1, 1})), win.kernel, win.stride, win.padding);
      manual_seed(12);
      const Tensor gy = randn(y.shape()).to(dtype).to(device);
      sum(mul(y, gy)).backward();
      outputs.push_back(y);
      grads.push_back(x.grad());
      grads.push_back(b.grad());
    }
    EXPECT_EQ(outputs[0].memory_format(), format) << wants;
    expect_same_bits(outputs[0], outputs[1], "y, " + wants);
    if (x_grad) expect_same_bits(grads[0], grads[2], "dx, " + wants);
    else EXPECT_FALSE(grads[0].defined()) << wants;
    if (b_grad) expect_same_bits(grads[1], grads[3], "dbias, " + wants);
    else EXPECT_FALSE(grads[1].defined()) << wants;
  }
}

// Conv2d(bias) -> MaxPool2d -> ReLU -> Conv2d(bias) -> MaxPool2d in one Sequential (fused)
// against the same modules' forwards one by one: the output and every parameter's
// gradient bit for bit, in f32 on `device`.
inline void expect_sequential_fusion_changes_no_bit(Device device, MemoryFormat format) {
  const std::string what = std::string(format == MemoryFormat::channels_last ? "channels-last" : "NCHW") +
                           " on " + device.str();
  manual_seed(21);
  auto conv1 = std::make_shared<nn::Conv2d>(3, 8, 3), conv2 = std::make_shared<nn::Conv2d>(8, 16, 3);
  auto pool1 = std::make_shared<nn::MaxPool2d>(2), pool2 = std::make_shared<nn::MaxPool2d>(2);
  auto relu = std::make_shared<nn::ReLU>();
  nn::Sequential net({conv1, pool1, relu, conv2, pool2});
  net.to(device);
  const Tensor x = randn({4, 3, 16, 17}).to(device).contiguous(format);
  const Tensor fused = net.forward(x);
  sum(mul(fused, fused)).backward();
  std::vector<Tensor> fused_grads;
  for (const auto& [name, p] : net.named_parameters()) fused_grads.push_back(p.grad().clone());
  net.zero_grad();
  Tensor h = x;
  for (size_t i = 0; i < net.size(); ++i) h = net[i]->forward(h);
  sum(mul(h, h)).backward();
  // The last pair ran fused, the stage-by-stage run did not.
  ASSERT_TRUE(fused.grad_fn() && h.grad_fn()) << what;
  EXPECT_EQ(fused.grad_fn()->name, "max_pool2d_bias") << what;
  EXPECT_EQ(h.grad_fn()->name, "max_pool2d") << what;
  expect_same_bits(fused, h, "output, " + what);
  size_t k = 0;
  for (const auto& [name, p] : net.named_parameters()) expect_same_bits(fused_grads[k++], p.grad(), name + ", " + what);
}

}  // namespace loom::test
