// Activations as modules, for Sequential: each wraps the engine op of the same name and
// holds no state.
#pragma once

#include "module.h"

namespace loom::nn {

class ReLU : public Module {
 public:
  Tensor forward(const Tensor& input) override;  // any shape
  std::string type_name() const override { return "ReLU"; }
};

// The tanh approximation, the engine's gelu: PyTorch's nn.GELU(approximate="tanh")
// (GPT-2's choice). nn.GELU() without arguments uses erf and differs by up to about 1e-3.
class GELU : public Module {
 public:
  Tensor forward(const Tensor& input) override;  // any shape
  std::string type_name() const override { return "GELU"; }
};

class Tanh : public Module {
 public:
  Tensor forward(const Tensor& input) override;  // any shape
  std::string type_name() const override { return "Tanh"; }
};

}  // namespace loom::nn
