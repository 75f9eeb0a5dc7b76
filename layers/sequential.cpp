// Sequential: the stages are the module's children, so naming, traversal and moves come
// from Module unchanged.
#include "layers/sequential.h"

#include <typeinfo>

#include "engine/ops.h"
#include "layers/conv.h"
#include "layers/pool.h"

namespace loom::nn {

Sequential::Sequential(std::vector<std::shared_ptr<Module>> modules) {
  for (auto& m : modules) append(std::move(m));
}

void Sequential::append(std::shared_ptr<Module> module) { register_module(std::to_string(size()), std::move(module)); }

std::shared_ptr<Module> Sequential::operator[](size_t i) const {
  LOOM_CHECK(i < size(), "Sequential: index ", i, " is past the last of its ", size(), " stages");
  return named_children()[i].second;
}

namespace {

// The stage as a T when it is exactly a T (a derived class may override forward), else null.
template <class T> T* exactly(const std::shared_ptr<Module>& stage) {
  return typeid(*stage) == typeid(T) ? static_cast<T*>(stage.get()) : nullptr;
}

}  // namespace

Tensor Sequential::forward(const Tensor& input) {
  Tensor x = input;
  const auto& stages = named_children();
  for (size_t i = 0; i < stages.size(); ++i) {
    Conv2d* conv = exactly<Conv2d>(stages[i].second);
    MaxPool2d* pool = i + 1 < stages.size() ? exactly<MaxPool2d>(stages[i + 1].second) : nullptr;
    if (conv && pool && conv->bias.defined() && conv->bias.dtype() == conv->weight.dtype()) {
      const Tensor y = conv->forward_without_bias(x);
      x = max_pool2d_bias(y, conv->bias.to(y.dtype()), pool->kernel_size(), pool->stride(), pool->padding());
      ++i;
      continue;
    }
    x = stages[i].second->forward(x);
  }
  return x;
}

}  // namespace loom::nn
