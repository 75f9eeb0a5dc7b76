// Sequential: children named "0", "1", ... run one after another, as PyTorch's
// nn.Sequential, so its state dict keys ("0.weight", "2.bias") match torch's.
//
// One pair of stages runs fused: a Conv2d with a bias followed by a MaxPool2d (as in
// SimpleCNN) runs as the convolution without its bias and max_pool2d_bias (engine/ops.h),
// which adds the bias while pooling. The values and gradients are bit for bit those of the
// two stages' own forwards; the convolution's output is read once instead of being read and
// written by an add first. Only those two exact classes are fused, not classes derived from
// them, and only when the bias has the weight's dtype.
#pragma once

#include <memory>
#include <vector>

#include "module.h"

namespace loom::nn {

class Sequential : public Module {
 public:
  Sequential() = default;
  explicit Sequential(std::vector<std::shared_ptr<Module>> modules);

  // Adds `module` as the next stage, named by its position.
  void append(std::shared_ptr<Module> module);
  size_t size() const { return named_children().size(); }
  // The i-th stage; an error past the end.
  std::shared_ptr<Module> operator[](size_t i) const;

  Tensor forward(const Tensor& input) override;
  std::string type_name() const override { return "Sequential"; }
};

}  // namespace loom::nn
