// Pooling layers: argument checks at construction, the engine ops at forward.
#include "layers/pool.h"

#include "engine/ops.h"

namespace loom::nn {
namespace {

void check_window(const char* layer, int kernel, int stride, int padding) {
  LOOM_CHECK(kernel > 0, layer, ": kernel_size must be positive, got ", kernel);
  LOOM_CHECK(stride > 0, layer, ": stride must be positive, got ", stride);
  LOOM_CHECK(padding >= 0 && 2 * padding <= kernel, layer, ": padding must be between 0 and half the kernel (",
             kernel / 2, "), got ", padding);
}

}  // namespace

MaxPool2d::MaxPool2d(int kernel_size, std::optional<int> stride, int padding)
    : kernel_{kernel_size, kernel_size},
      stride_{stride.value_or(kernel_size), stride.value_or(kernel_size)},
      padding_{padding, padding} {
  check_window("MaxPool2d", kernel_size, stride_[0], padding);
}

Tensor MaxPool2d::forward(const Tensor& input) { return max_pool2d(input, kernel_, stride_, padding_); }

AvgPool2d::AvgPool2d(int kernel_size, std::optional<int> stride, int padding)
    : kernel_{kernel_size, kernel_size},
      stride_{stride.value_or(kernel_size), stride.value_or(kernel_size)},
      padding_{padding, padding} {
  check_window("AvgPool2d", kernel_size, stride_[0], padding);
}

Tensor AvgPool2d::forward(const Tensor& input) { return avg_pool2d(input, kernel_, stride_, padding_); }

Tensor AdaptiveAvgPool2d::forward(const Tensor& input) { return adaptive_avg_pool2d(input, output_size_); }

}  // namespace loom::nn
