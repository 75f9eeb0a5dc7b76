// Optimizer: the base of SGD, Adam and AdamW. It holds parameter groups (torch.optim's
// param_groups: parameters sharing hyper-parameters) and per-parameter state (step count
// and named buffers such as "exp_avg"), and turns both into named tensors plus scalars
// for a training checkpoint.
//
// State is keyed by the parameter's identity (its TensorImpl), not its data, so it
// survives Module::to() and set_data() swapping its storage; buffers follow the parameter's device
// and dtype at each step. Each optimizer's arithmetic lives in one free function per
// group (sgd_update, adam_update) over lists of tensors, which hands them to the fused
// multi-tensor ops (engine/ops/optim.cpp: one CUDA launch for a whole group).
#pragma once

#include <map>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "../module.h"

namespace loom::optim {

enum class Nesterov : bool { no = false, yes = true };

// One parameter group. The fields are the union of what Loom's optimizers read, as
// torch's group dicts are: SGD reads lr, weight_decay, momentum, dampening, nesterov;
// Adam and AdamW read lr, weight_decay, beta1, beta2, eps. Schedules write lr.
struct ParamGroup {
  TensorList params;
  double lr = 1e-3;
  double weight_decay = 0;
  double momentum = 0, dampening = 0;
  Nesterov nesterov = Nesterov::no;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  // Set by make_capturable: what the step's kernels read on the parameters' device in place
  // of the host's values (f64; SGD: lr; Adam: its step size, second bias correction and
  // decoupled shrink); undefined otherwise.
  Tensor hyper_at;
};

// A parameter's state: how many updates it has had and its named buffers (torch's names:
// "momentum_buffer", "exp_avg", "exp_avg_sq"), each of the parameter's shape.
struct ParamState {
  int64_t step = 0;
  std::map<std::string, Tensor> buffers;
};

// The optimizer's state for a checkpoint. Parameters are numbered across the groups in
// order, as in torch's optimizer.state_dict(): tensors "state.<i>.<buffer>", scalars
// "state.<i>.step" and "param_groups.<g>.<field>" (and "param_groups.<g>.size").
struct OptimizerState {
  nn::NamedTensors tensors;
  std::map<std::string, double> scalars;
};

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // One update of every parameter that has a gradient; the others are skipped untouched.
  virtual void step() = 0;
  virtual std::string type_name() const = 0;
  // Drops every parameter's gradient (torch's set_to_none=True).
  void zero_grad();

  std::vector<ParamGroup>& param_groups() { return groups_; }
  const std::vector<ParamGroup>& param_groups() const { return groups_; }
  // Sets the learning rate of every group.
  void set_lr(double lr);

  // For a step captured in a CUDA graph (engine/cuda_graph.h, layers/optim/captured_step.h):
  // from now on the step's kernels read each group's values that change between steps (the
  // learning rate under a schedule, Adam's bias corrections) from the device
  // (ParamGroup::hyper_at) instead of taking them from the host at launch. An eager step()
  // writes them itself; a captured one leaves that to prepare_replay(), which must run before
  // each replay (CapturedStep does): it counts the replay's update in each parameter's step,
  // as step() would have, and writes the values for it. begin_capture() starts the list of
  // parameters the captured step updates.
  void make_capturable(Device device);
  bool capturable() const { return capturable_; }
  void begin_capture() { captured_.clear(); }
  void prepare_replay();
  // The state of `param`; nullptr before its first update.
  const ParamState* state(const Tensor& param) const;
  // The bytes of buffers the state holds once every trained parameter has had an update:
  // each one's size (its dtype) times the buffers its group keeps. What a memory plan counts
  // before the first step (parallel/memory_plan.h).
  size_t planned_state_bytes() const;

  // The name in `named` of each parameter, in the state_dict's numbering (the groups in
  // order): how a checkpoint that keeps state per parameter name finds it. A parameter `named`
  // lacks is an error naming `what` (what the optimizer should have been built on).
  std::vector<std::string> parameter_names(const nn::NamedTensors& named, const std::string& what) const;

  // The state shares the optimizer's buffers (save it before the next step).
  OptimizerState state_dict() const;
  // Restores state and group hyper-parameters saved from an optimizer of the same kind over
  // the same parameter groups; the buffers are copied onto each parameter's device and dtype.
  void load_state_dict(const OptimizerState& state);

 protected:
  Optimizer() = default;
  // Checks that the group's parameters are floating-point leaves not already in a group.
  void add_group(ParamGroup group);
  // The state of `param`, created empty on first use, its buffers on param's device/dtype.
  ParamState& state_of(const Tensor& param);
  // The buffer names this optimizer keeps per parameter (checked on load).
  virtual std::vector<std::string> buffer_names() const = 0;
  // Capturable optimizers (SGD, Adam, AdamW): how many values a group keeps on the device,
  // and their writing for an update that is step `step` of the group's parameters.
  virtual int64_t device_hyper_size() const { return 1; }
  virtual void write_hyper(const ParamGroup& group, int64_t step) const;
  // For step(), once a group: whether this update of `group` is being captured (the
  // optimizer capturable, its parameters' stream capturing).
  bool capturing_update(const ParamGroup& group) const;
  // For step(): counts an update of `state` on group `group` and returns its step count:
  // now, or (`captured`) at each replay.
  int64_t count_update(size_t group, ParamState& state, bool captured);
  // For step(): before an eager update (not `captured`) of a capturable group, writes its
  // device values.
  void write_hyper_if_eager(const ParamGroup& group, int64_t step, bool captured) const;
  // How many of them a parameter of `group` gets (all of them unless overridden).
  virtual size_t buffers_kept(const ParamGroup& group) const {
    (void)group;
    return buffer_names().size();
  }

 private:
  std::vector<ParamGroup> groups_;
  std::unordered_map<const TensorImpl*, ParamState> state_;
  bool capturable_ = false;
  std::vector<std::pair<size_t, ParamState*>> captured_;  // (group, state) a captured step updates
};

// For the update functions (sgd_update, adam_update): the fused ops they call take tensors
// of one device and one dtype, each dense in its parameter's layout, per call.
namespace detail {

// Indices into `params` grouped by (device, dtype): list order within a group, groups in
// the order of their first parameter. One group in the common case.
std::vector<std::vector<size_t>> split_by_device_and_dtype(const TensorList& params);

// Dense stand-ins for tensors a fused op updates in place: stage(t, format) is t itself when
// dense in `format`, else a copy in that layout that copy_back() writes into t afterwards.
// stage(p) keeps a parameter dense in its own layout (row-major, or channels-last) as it is.
class DenseStaging {
 public:
  Tensor stage(const Tensor& t) { return stage(t, t.memory_format()); }
  Tensor stage(const Tensor& t, MemoryFormat format);
  void copy_back() const;

 private:
  std::vector<std::pair<Tensor, Tensor>> pending_;  // (tensor, its dense copy)
};

}  // namespace detail

}  // namespace loom::optim
