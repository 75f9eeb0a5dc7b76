// Sequential: the stages are the module's children, so naming, traversal and moves come
// from Module unchanged.
#include "layers/sequential.h"

namespace loom::nn {

Sequential::Sequential(std::vector<std::shared_ptr<Module>> modules) {
  for (auto& m : modules) append(std::move(m));
}

void Sequential::append(std::shared_ptr<Module> module) { register_module(std::to_string(size()), std::move(module)); }

std::shared_ptr<Module> Sequential::operator[](size_t i) const {
  LOOM_CHECK(i < size(), "Sequential: index ", i, " is past the last of its ", size(), " stages");
  return named_children()[i].second;
}

Tensor Sequential::forward(const Tensor& input) {
  Tensor x = input;
  for (const auto& [_, stage] : named_children()) x = stage->forward(x);
  return x;
}

}  // namespace loom::nn
