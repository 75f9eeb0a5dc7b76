// Flatten: a view where the input's strides allow one, a copy otherwise (Tensor::flatten).
#include "layers/flatten.h"

namespace loom::nn {

Tensor Flatten::forward(const Tensor& input) { return input.flatten(start_dim_, end_dim_); }

}  // namespace loom::nn
