// Module: the base of every layer and model. It owns named parameters, buffers and child
// modules in registration order, and derives from them what a training program needs:
// PyTorch's dotted names ("features.0.weight"), so a PyTorch state dict maps one to one;
// train/eval mode; moving to a device or dtype; and checkpoint state.
//
// Parameters are Tensor handles, so a layer keeps its own handle (`weight`) to the tensor it
// registered and an optimizer keeps another. to(Device) and to(DType) therefore never
// replace a parameter: they swap its data in place through Tensor::set_data, so every
// handle held elsewhere (an optimizer, a DDP bucket, a layer's member) stays valid and
// sees the moved data. load_state_dict likewise copies values into the existing tensors.
//
// Hooks (PyTorch's register_forward_pre_hook / register_forward_hook) run when a module is
// called through operator(): pre-hooks before forward, hooks after it with its output. A
// parent whose forward calls child->forward() directly, as Loom's models do, skips the
// child's hooks; that is why parallel/fsdp.h gathers on first use of a parameter's storage
// rather than from hooks.
//
// A module is owned through std::shared_ptr (children are shared_ptr) and is not copyable:
// a copy would alias the parameters it appears to duplicate.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "../engine/tensor.h"

namespace loom::nn {

// Named tensors in a fixed order (registration order, depth first): the form of a state
// dict, and the form save_safetensors takes.
using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

// Whether load_state_dict requires the keys to match the model's exactly.
enum class Strict : bool { no = false, yes = true };

// What a non-strict load_state_dict left out (strict loads throw instead).
struct LoadResult {
  std::vector<std::string> missing_keys;     // in the model, not in the state dict
  std::vector<std::string> unexpected_keys;  // in the state dict, not in the model
};

class Module {
 public:
  Module() = default;
  virtual ~Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  // The computation of a one-input module. Modules whose forward takes something else
  // define their own method and leave this one, which throws, alone.
  virtual Tensor forward(const Tensor& input);
  // forward(input) between the forward pre-hooks and the forward hooks.
  Tensor operator()(const Tensor& input);
  // "Linear", "Sequential", ...: used in error messages.
  virtual std::string type_name() const { return "Module"; }

  // ---- registration (names: non-empty, no '.', unique within this module) ----------
  // Registers a parameter; a floating-point one is marked as requiring a gradient.
  // Registering a tensor that another module also registered ties the two (GPT's shared
  // embedding and output weights): it is one parameter, listed once by parameters().
  Tensor register_parameter(const std::string& name, Tensor value);
  // Registers a buffer: state saved in state_dict() but not trained (running statistics).
  Tensor register_buffer(const std::string& name, Tensor value);
  template <class M>
  std::shared_ptr<M> register_module(const std::string& name, std::shared_ptr<M> module) {
    add_child(name, module);
    return module;
  }

  // Puts `module` in the place of the child registered as `name` (same name, same position
  // in traversal) and returns the child it replaces. Members a parent keeps to the old
  // child are not changed: a parent that calls a typed member sees no replacement.
  std::shared_ptr<Module> replace_module(const std::string& name, std::shared_ptr<Module> module);

  // ---- hooks (see the header comment) -------------------------------------------------
  using ForwardPreHook = std::function<void(Module& module, const Tensor& input)>;
  using ForwardHook = std::function<void(Module& module, const Tensor& input, const Tensor& output)>;
  // Each returns a handle for remove_hook; hooks run in the order registered.
  int register_forward_pre_hook(ForwardPreHook hook);
  int register_forward_hook(ForwardHook hook);
  // Removes a hook registered on this module; an unknown handle is an error.
  void remove_hook(int handle);

  // ---- traversal (depth first, registration order, dotted names) ---------------------
  // Each parameter once: a tied parameter appears under the first name that reaches it.
  NamedTensors named_parameters() const;
  TensorList parameters() const;
  NamedTensors named_buffers() const;
  TensorList buffers() const;
  const std::vector<std::pair<std::string, std::shared_ptr<Module>>>& named_children() const { return children_; }
  // This module (name "") and all its descendants.
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> named_modules();
  // Number of elements over all parameters (tied ones counted once).
  int64_t num_parameters() const;

  // ---- mode ---------------------------------------------------------------------------
  // Sets training mode here and in every descendant (Dropout, BatchNorm read it).
  void train(bool on = true);
  void eval() { train(false); }
  bool is_training() const { return training_; }

  // ---- placement: in place, see the header comment -----------------------------------
  // Moves parameters (with their gradients) and buffers to `device`.
  void to(Device device);
  // Converts floating-point parameters (with their gradients) and buffers to `dtype`;
  // integer buffers keep their dtype, as in PyTorch.
  void to(DType dtype);
  // Lays every 4-d parameter (with its gradient) and buffer out in `format`, values and
  // shapes unchanged, as PyTorch's module.to(memory_format=...): channels-last keeps a
  // convolution's weight (C_out, KH, KW, C_in) in memory, the layout cuDNN's NHWC kernels
  // read, and the gradients then come in that layout (engine/autograd.h), so a channels-last
  // step on a GPU converts no weight (the CPU's convolutions read the weight row-major and
  // convert it). DDP and FSDP take row-major parameters only and refuse others.
  void to(MemoryFormat format);
  // Drops every parameter's gradient (PyTorch's set_to_none=True).
  void zero_grad();

  // ---- checkpoints --------------------------------------------------------------------
  // Parameters and buffers under PyTorch's names; the tensors share the module's data
  // (detached). Tied parameters appear under every name, as in PyTorch.
  NamedTensors state_dict() const;
  // Copies `state` into the module's tensors in place (converting dtype and device). Shape
  // mismatches always throw; with Strict::yes so do missing and unexpected keys, all named
  // in one message. Nothing is copied when it throws.
  LoadResult load_state_dict(const NamedTensors& state, Strict strict = Strict::yes);
  LoadResult load_state_dict(const std::map<std::string, Tensor>& state, Strict strict = Strict::yes);

 private:
  void add_child(const std::string& name, std::shared_ptr<Module> module);
  void check_new_name(const std::string& name, const char* what) const;
  // Visits every parameter (dedup = false: every name, as state_dict lists them).
  void collect(NamedTensors* out, const std::string& prefix, bool params, bool buffers) const;

  std::vector<std::pair<int, ForwardPreHook>> forward_pre_hooks_;
  std::vector<std::pair<int, ForwardHook>> forward_hooks_;
  int next_hook_handle_ = 0;
  NamedTensors parameters_, buffers_;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_;
  bool training_ = true;
};

}  // namespace loom::nn
