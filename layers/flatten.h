// Flatten: merges dims start_dim..end_dim into one, as PyTorch's nn.Flatten (which
// defaults to start_dim = 1, keeping the batch dimension): (N, C, H, W) -> (N, C*H*W).
#pragma once

#include "module.h"

namespace loom::nn {

class Flatten : public Module {
 public:
  explicit Flatten(int start_dim = 1, int end_dim = -1) : start_dim_(start_dim), end_dim_(end_dim) {}

  Tensor forward(const Tensor& input) override;
  std::string type_name() const override { return "Flatten"; }

 private:
  int start_dim_, end_dim_;
};

}  // namespace loom::nn
