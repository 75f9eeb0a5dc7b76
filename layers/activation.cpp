// Activations: one engine op each; their gradients are the ops' own.
#include "layers/activation.h"

#include "engine/ops.h"

namespace loom::nn {

Tensor ReLU::forward(const Tensor& input) { return relu(input); }
Tensor GELU::forward(const Tensor& input) { return gelu(input); }
Tensor Tanh::forward(const Tensor& input) { return tanh(input); }

}  // namespace loom::nn
