// Dropout: in training mode zeroes each element with probability p and scales the
// survivors by 1 / (1 - p), so the expected value is unchanged and evaluation needs no
// rescaling; in eval mode it is the identity. The mask comes from loom::rand (Philox), so a
// seeded run drops the same elements on the CPU and on any GPU.
#pragma once

#include "module.h"

namespace loom::nn {

class Dropout : public Module {
 public:
  explicit Dropout(double p = 0.5);

  Tensor forward(const Tensor& input) override;  // any shape
  std::string type_name() const override { return "Dropout"; }
  double p() const { return p_; }

 private:
  double p_;
};

}  // namespace loom::nn
