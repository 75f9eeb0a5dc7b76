// Module: registration, traversal with dotted names, in-place moves and state dicts.
// Traversal follows PyTorch's order (a module's own parameters, then its own buffers, then
// its children depth first), so state_dict() lists keys exactly as torch does.
#include "layers/module.h"

#include <set>
#include <unordered_set>

#include "engine/autograd.h"
#include "engine/ops.h"

namespace loom::nn {

Tensor Module::forward(const Tensor&) {
  LOOM_FAIL(type_name(), " has no one-input forward(): call its own forward method");
}

Tensor Module::operator()(const Tensor& input) {
  // By index, on copies: a hook may register or remove hooks.
  auto pre = forward_pre_hooks_;
  for (auto& [_, hook] : pre) hook(*this, input);
  Tensor output = forward(input);
  auto post = forward_hooks_;
  for (auto& [_, hook] : post) hook(*this, input, output);
  return output;
}

int Module::register_forward_pre_hook(ForwardPreHook hook) {
  LOOM_CHECK(hook, type_name(), ": register_forward_pre_hook needs a function");
  forward_pre_hooks_.emplace_back(next_hook_handle_, std::move(hook));
  return next_hook_handle_++;
}

int Module::register_forward_hook(ForwardHook hook) {
  LOOM_CHECK(hook, type_name(), ": register_forward_hook needs a function");
  forward_hooks_.emplace_back(next_hook_handle_, std::move(hook));
  return next_hook_handle_++;
}

void Module::remove_hook(int handle) {
  auto drop = [&](auto& list) {
    for (auto it = list.begin(); it != list.end(); ++it)
      if (it->first == handle) {
        list.erase(it);
        return true;
      }
    return false;
  };
  LOOM_CHECK(drop(forward_pre_hooks_) || drop(forward_hooks_), type_name(), ": no hook with handle ", handle,
             " is registered on this module");
}

std::shared_ptr<Module> Module::replace_module(const std::string& name, std::shared_ptr<Module> module) {
  LOOM_CHECK(module != nullptr, type_name(), ": replace_module('", name, "') got a null module");
  LOOM_CHECK(module.get() != this, type_name(), ": a module cannot be its own child ('", name, "')");
  for (auto& [n, child] : children_)
    if (n == name) return std::exchange(child, std::move(module));
  LOOM_FAIL(type_name(), ": replace_module: no child is registered as '", name, "'");
}

void Module::check_new_name(const std::string& name, const char* what) const {
  LOOM_CHECK(!name.empty(), type_name(), ": a ", what, " needs a non-empty name");
  LOOM_CHECK(name.find('.') == std::string::npos, type_name(), ": ", what, " name '", name,
             "' contains '.', which separates the levels of a state dict's keys");
  auto taken = [&](const auto& list) {
    for (const auto& [n, _] : list)
      if (n == name) return true;
    return false;
  };
  LOOM_CHECK(!taken(parameters_) && !taken(buffers_) && !taken(children_), type_name(), ": the name '", name,
             "' is already registered");
}

Tensor Module::register_parameter(const std::string& name, Tensor value) {
  check_new_name(name, "parameter");
  LOOM_CHECK(value.defined(), type_name(), ": parameter '", name, "' is an undefined tensor");
  LOOM_CHECK(value.is_leaf(), type_name(), ": parameter '", name,
             "' is the result of an op; register a leaf (detach() it, or create it directly)");
  if (is_floating(value.dtype()) && !value.requires_grad()) value.set_requires_grad(true);
  parameters_.emplace_back(name, value);
  return value;
}

Tensor Module::register_buffer(const std::string& name, Tensor value) {
  check_new_name(name, "buffer");
  LOOM_CHECK(value.defined(), type_name(), ": buffer '", name, "' is an undefined tensor");
  buffers_.emplace_back(name, value);
  return value;
}

void Module::add_child(const std::string& name, std::shared_ptr<Module> module) {
  check_new_name(name, "module");
  LOOM_CHECK(module != nullptr, type_name(), ": module '", name, "' is null");
  LOOM_CHECK(module.get() != this, type_name(), ": a module cannot be its own child ('", name, "')");
  children_.emplace_back(name, std::move(module));
}

void Module::collect(NamedTensors* out, const std::string& prefix, bool params, bool buffers) const {
  if (params)
    for (const auto& [name, t] : parameters_) out->emplace_back(prefix + name, t);
  if (buffers)
    for (const auto& [name, t] : buffers_) out->emplace_back(prefix + name, t);
  for (const auto& [name, child] : children_) child->collect(out, prefix + name + ".", params, buffers);
}

namespace {
// Keeps the first name of each tensor (tied parameters share one TensorImpl).
NamedTensors unique(NamedTensors all) {
  std::unordered_set<const TensorImpl*> seen;
  NamedTensors out;
  for (auto& [name, t] : all)
    if (seen.insert(t.impl()).second) out.emplace_back(std::move(name), t);
  return out;
}

TensorList values(const NamedTensors& named) {
  TensorList out;
  out.reserve(named.size());
  for (const auto& [_, t] : named) out.push_back(t);
  return out;
}
}  // namespace

NamedTensors Module::named_parameters() const {
  NamedTensors all;
  collect(&all, "", true, false);
  return unique(std::move(all));
}

NamedTensors Module::named_buffers() const {
  NamedTensors all;
  collect(&all, "", false, true);
  return unique(std::move(all));
}

TensorList Module::parameters() const { return values(named_parameters()); }
TensorList Module::buffers() const { return values(named_buffers()); }

std::vector<std::pair<std::string, std::shared_ptr<Module>>> Module::named_modules() {
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> out;
  // The root is not owned by a shared_ptr we can see: alias it without ownership.
  out.emplace_back("", std::shared_ptr<Module>(std::shared_ptr<Module>(), this));
  for (const auto& [name, child] : children_)
    for (auto& [sub, m] : child->named_modules()) {
      if (sub.empty()) out.emplace_back(name, child);
      else out.emplace_back(name + "." + sub, m);
    }
  return out;
}

int64_t Module::num_parameters() const {
  int64_t n = 0;
  for (const Tensor& p : parameters()) n += p.numel();
  return n;
}

void Module::train(bool on) {
  training_ = on;
  for (auto& [_, child] : children_) child->train(on);
}

namespace {
// Swaps `t`'s data for `converted` in place, and its gradient likewise.
template <class Convert>
void move_in_place(Tensor t, Convert convert) {
  NoGradGuard no_grad;
  Tensor moved = convert(t.detach());
  if (!moved.same(t)) t.set_data(moved);
  if (Tensor g = t.grad(); g.defined()) t.set_grad(convert(g));
}
}  // namespace

void Module::to(Device device) {
  for (Tensor& t : parameters()) move_in_place(t, [&](const Tensor& x) { return x.to(device); });
  for (Tensor& t : buffers()) move_in_place(t, [&](const Tensor& x) { return x.to(device); });
}

void Module::to(DType dtype) {
  LOOM_CHECK(is_floating(dtype), type_name(), ".to(", dtype_name(dtype),
             "): modules convert only to a floating-point dtype");
  auto convert = [&](const Tensor& x) { return is_floating(x.dtype()) ? x.to(dtype) : x; };
  for (Tensor& t : parameters()) move_in_place(t, convert);
  for (Tensor& t : buffers()) move_in_place(t, convert);
}

void Module::to(MemoryFormat format) {
  auto convert = [&](const Tensor& x) { return x.dim() == 4 ? x.contiguous(format) : x; };
  for (Tensor& t : parameters()) move_in_place(t, convert);
  for (Tensor& t : buffers()) move_in_place(t, convert);
}

void Module::zero_grad() {
  for (Tensor& p : parameters()) p.zero_grad();
}

NamedTensors Module::state_dict() const {
  NamedTensors all;
  collect(&all, "", true, true);
  for (auto& [_, t] : all) t = t.detach();
  return all;
}

LoadResult Module::load_state_dict(const NamedTensors& state, Strict strict) {
  std::map<std::string, Tensor> by_name;
  for (const auto& [name, t] : state)
    LOOM_CHECK(by_name.emplace(name, t).second, "load_state_dict: the key ", name, " appears twice in the state dict");
  return load_state_dict(by_name, strict);
}

LoadResult Module::load_state_dict(const std::map<std::string, Tensor>& state, Strict strict) {
  NamedTensors own;
  collect(&own, "", true, true);
  LoadResult result;
  std::vector<std::string> problems;
  std::set<std::string> expected;
  for (const auto& [name, t] : own) {
    expected.insert(name);
    auto it = state.find(name);
    if (it == state.end()) {
      result.missing_keys.push_back(name);
      continue;
    }
    LOOM_CHECK(it->second.defined(), "load_state_dict: the state dict's ", name, " is an undefined tensor");
    if (it->second.shape() != t.shape())
      problems.push_back(name + " has shape " + shape_str(it->second.shape()) + " in the file but " +
                         shape_str(t.shape()) + " in the model");
  }
  for (const auto& [name, _] : state)
    if (!expected.count(name)) result.unexpected_keys.push_back(name);

  if (strict == Strict::yes) {
    auto join = [](const std::vector<std::string>& keys) {
      std::string s;
      for (const auto& k : keys) s += (s.empty() ? "" : ", ") + k;
      return s;
    };
    if (!result.missing_keys.empty()) problems.push_back("missing from the file: " + join(result.missing_keys));
    if (!result.unexpected_keys.empty())
      problems.push_back("in the file but not in the model: " + join(result.unexpected_keys) +
                         " (Strict::no loads a model from part of a file, or a file with extra keys)");
  }
  if (problems.size() == 1) LOOM_FAIL("load_state_dict: ", problems[0]);
  if (!problems.empty()) {
    std::string all;
    for (const auto& p : problems) all += "\n  " + p;
    LOOM_FAIL("load_state_dict: ", problems.size(), " problems:", all);
  }

  NoGradGuard no_grad;
  for (const auto& [name, t] : own)
    if (auto it = state.find(name); it != state.end()) copy_(t, it->second);
  return result;
}

}  // namespace loom::nn
