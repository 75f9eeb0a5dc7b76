// Sequential: children named "0", "1", ... run one after another, as PyTorch's
// nn.Sequential, so its state dict keys ("0.weight", "2.bias") match torch's.
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
