// The table of differentiable op cases shared by the float64 finite-difference check
// (CPU) and the CUDA-against-CPU parity test. Adding an op to both is one row here.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "engine/ops.h"

namespace loom::test {

// How an input is drawn: values in (-2, 2), strictly positive (0.5, 2.5) for log/sqrt/pow,
// or well separated so that max/min/relu have no ties or kinks within the finite-difference step.
enum class Init { normal, positive, separated };

struct InputSpec {
  Shape shape;
  Init init = Init::normal;
};

struct OpCase {
  std::string name;
  std::vector<InputSpec> inputs;
  // Builds the op from float inputs; integer tensors it needs (indices, targets) are
  // made inside on the inputs' device.
  std::function<Tensor(const TensorList&)> fn;
  // False for an op with a kink (a ReLU) at an intermediate value the op computes itself:
  // rounded to 16 bits that value may land on the other side of the kink than in the f64
  // reference, so the CUDA parity test runs such a case in f32 only.
  bool sixteen_bit = true;
};

const std::vector<OpCase>& op_cases();

// Draws the inputs of a case deterministically (seeded by the case name) in f64 on the CPU.
TensorList make_inputs(const OpCase& c);

// Integer tensor on a device from host values.
Tensor ids(const std::vector<int64_t>& values, const Shape& shape, Device device);

}  // namespace loom::test
