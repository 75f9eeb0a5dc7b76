#include "layers/models/simple_cnn.h"

#include "layers/activation.h"
#include "layers/conv.h"
#include "layers/flatten.h"
#include "layers/linear.h"
#include "layers/pool.h"

namespace loom::nn {

SimpleCNN::SimpleCNN(int64_t in_channels, int64_t image_size, int64_t num_classes)
    : in_channels_(in_channels), image_size_(image_size) {
  // Two (3x3 valid convolution, 2x2 max pool) stages: s -> (s - 2) / 2, twice.
  const int64_t side = ((image_size - 2) / 2 - 2) / 2;
  LOOM_CHECK(in_channels > 0 && num_classes > 0, "SimpleCNN: channels and classes must be positive, got ",
             in_channels, " and ", num_classes);
  LOOM_CHECK(image_size >= 10, "SimpleCNN: images must be at least 10x10 pixels for its two conv/pool stages, got ",
             image_size);
  features = register_module("features", std::make_shared<Sequential>(std::vector<std::shared_ptr<Module>>{
                                             std::make_shared<Conv2d>(in_channels, 32, 3),
                                             std::make_shared<MaxPool2d>(2),
                                             std::make_shared<ReLU>(),  // after the pool: simple_cnn.h
                                             std::make_shared<Conv2d>(32, 64, 3),
                                             std::make_shared<MaxPool2d>(2),
                                             std::make_shared<ReLU>(),
                                         }));
  classifier = register_module("classifier", std::make_shared<Sequential>(std::vector<std::shared_ptr<Module>>{
                                                 std::make_shared<Flatten>(),
                                                 std::make_shared<Linear>(64 * side * side, 128),
                                                 std::make_shared<ReLU>(),
                                                 std::make_shared<Linear>(128, num_classes),
                                             }));
}

Tensor SimpleCNN::forward(const Tensor& input) {
  LOOM_CHECK(input.dim() == 4 && input.size(1) == in_channels_ && input.size(2) == image_size_ &&
                 input.size(3) == image_size_,
             "SimpleCNN: expected images (N, ", in_channels_, ", ", image_size_, ", ", image_size_, "), got ",
             shape_str(input.shape()));
  return classifier->forward(features->forward(input));
}

}  // namespace loom::nn
