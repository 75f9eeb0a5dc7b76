// Optimizer base: parameter groups, per-parameter state, and the state dict a training
// checkpoint saves (named tensors for the buffers, scalars for steps and hyper-parameters).
#include "layers/optim/optimizer.h"

#include <algorithm>
#include <unordered_set>

#include "engine/autograd.h"
#include "engine/ops.h"

namespace loom::optim {

void Optimizer::add_group(ParamGroup group) {
  LOOM_CHECK(!group.params.empty(), type_name(), ": a parameter group needs at least one parameter");
  LOOM_CHECK(group.lr >= 0, type_name(), ": learning rate must not be negative, got ", group.lr);
  LOOM_CHECK(group.weight_decay >= 0, type_name(), ": weight_decay must not be negative, got ", group.weight_decay);
  std::unordered_set<const TensorImpl*> seen;
  for (const ParamGroup& g : groups_)
    for (const Tensor& p : g.params) seen.insert(p.impl());
  for (size_t i = 0; i < group.params.size(); ++i) {
    const Tensor& p = group.params[i];
    LOOM_CHECK(p.defined(), type_name(), ": parameter ", i, " of the group is undefined");
    LOOM_CHECK(is_floating(p.dtype()), type_name(), ": parameter ", i, " is ", dtype_name(p.dtype()),
               "; only floating-point tensors can be optimised");
    LOOM_CHECK(p.is_leaf(), type_name(), ": parameter ", i,
               " is the result of an op, not a leaf; optimise the tensors a module registered");
    LOOM_CHECK(seen.insert(p.impl()).second, type_name(), ": parameter ", i,
               " appears in more than one place in the parameter groups");
  }
  if (capturable_) group.hyper_at = zeros({device_hyper_size()}, DType::f64, group.params[0].device());
  groups_.push_back(std::move(group));
}

void Optimizer::zero_grad() {
  for (ParamGroup& g : groups_)
    for (Tensor& p : g.params) p.zero_grad();
}

void Optimizer::set_lr(double lr) {
  for (ParamGroup& g : groups_) g.lr = lr;
}

void Optimizer::make_capturable(Device device) {
  for (ParamGroup& g : groups_)
    for (const Tensor& p : g.params)
      LOOM_CHECK(p.device() == device, type_name(), ": a capturable step runs on ", device.str(), " but a parameter "
                 "of shape ", shape_str(p.shape()), " is on ", p.device().str());
  for (ParamGroup& g : groups_) g.hyper_at = zeros({device_hyper_size()}, DType::f64, device);
  capturable_ = true;
}

void Optimizer::write_hyper(const ParamGroup& group, int64_t) const {
  NoGradGuard no_grad;
  fill_(group.hyper_at, group.lr);
}

bool Optimizer::capturing_update(const ParamGroup& group) const {
  return capturable_ && capturing(group.params[0].device());
}

void Optimizer::write_hyper_if_eager(const ParamGroup& group, int64_t step, bool captured) const {
  if (group.hyper_at.defined() && !captured) write_hyper(group, step);
}

int64_t Optimizer::count_update(size_t group, ParamState& state, bool captured) {
  if (!captured) return ++state.step;
  captured_.emplace_back(group, &state);
  return state.step + 1;
}

void Optimizer::prepare_replay() {
  // Each group's step count after the replay's update: one value, as the captured kernels
  // read one set of corrections per group.
  std::vector<int64_t> step(groups_.size(), -1);
  for (auto& [g, state] : captured_) {
    ++state->step;
    LOOM_CHECK(step[g] < 0 || step[g] == state->step, type_name(), ": the parameters of group ", g,
               " are at different step counts (", step[g], " and ", state->step, "); a captured step updates "
               "them as one");
    step[g] = state->step;
  }
  for (size_t g = 0; g < groups_.size(); ++g)
    if (groups_[g].hyper_at.defined()) write_hyper(groups_[g], std::max<int64_t>(step[g], 1));
}

const ParamState* Optimizer::state(const Tensor& param) const {
  auto it = state_.find(param.impl());
  return it == state_.end() ? nullptr : &it->second;
}

std::vector<std::string> Optimizer::parameter_names(const nn::NamedTensors& named, const std::string& what) const {
  std::unordered_map<const TensorImpl*, std::string> name_of;
  for (const auto& [name, t] : named) name_of.emplace(t.impl(), name);
  std::vector<std::string> out;
  for (const ParamGroup& g : groups_)
    for (const Tensor& p : g.params) {
      auto it = name_of.find(p.impl());
      LOOM_CHECK(it != name_of.end(), type_name(), ": a parameter of shape ", shape_str(p.shape()), " is none of ", what,
                 "; build the optimizer on them");
      out.push_back(it->second);
    }
  return out;
}

size_t Optimizer::planned_state_bytes() const {
  size_t bytes = 0;
  for (const ParamGroup& g : groups_)
    for (const Tensor& p : g.params)
      if (p.requires_grad()) bytes += p.nbytes() * buffers_kept(g);  // a frozen one never steps
  return bytes;
}

ParamState& Optimizer::state_of(const Tensor& param) {
  ParamState& s = state_[param.impl()];
  const MemoryFormat format = param.memory_format();
  for (auto& [_, b] : s.buffers) {
    if (b.device() != param.device() || b.dtype() != param.dtype()) b = b.to(param.device()).to(param.dtype());
    // State made before Module::to(MemoryFormat), or loaded from a checkpoint, takes the
    // parameter's layout once, so that the update reads it as it lies.
    if (b.shape() == param.shape() && !b.is_contiguous(format)) b = b.contiguous(format);
  }
  return s;
}

namespace {
// The group fields as named scalars: one list for saving and loading.
std::vector<std::pair<std::string, double*>> fields(ParamGroup& g, double* nesterov) {
  *nesterov = g.nesterov == Nesterov::yes ? 1 : 0;
  return {{"lr", &g.lr},       {"weight_decay", &g.weight_decay}, {"momentum", &g.momentum},
          {"dampening", &g.dampening}, {"nesterov", nesterov},    {"beta1", &g.beta1},
          {"beta2", &g.beta2}, {"eps", &g.eps}};
}
}  // namespace

OptimizerState Optimizer::state_dict() const {
  OptimizerState out;
  int64_t index = 0;
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    ParamGroup g = groups_[gi];
    std::string prefix = "param_groups." + std::to_string(gi) + ".";
    double nesterov;
    for (auto& [name, value] : fields(g, &nesterov)) out.scalars[prefix + name] = *value;
    out.scalars[prefix + "size"] = double(g.params.size());
    for (const Tensor& p : g.params) {
      std::string key = "state." + std::to_string(index++) + ".";
      const ParamState* s = state(p);
      if (!s) continue;
      out.scalars[key + "step"] = double(s->step);
      for (const auto& [name, b] : s->buffers) out.tensors.emplace_back(key + name, b);
    }
  }
  return out;
}

void Optimizer::load_state_dict(const OptimizerState& saved) {
  const std::string what = type_name() + " load_state_dict: ";
  auto scalar = [&](const std::string& key) {
    auto it = saved.scalars.find(key);
    LOOM_CHECK(it != saved.scalars.end(), what, "the checkpoint has no ", key,
               " (is it the state of a different optimizer or of other parameter groups?)");
    return it->second;
  };
  LOOM_CHECK(!saved.scalars.count("param_groups." + std::to_string(groups_.size()) + ".size"), what,
             "the checkpoint has more parameter groups than this optimizer's ", groups_.size());
  std::map<std::string, Tensor> tensors;
  for (const auto& [name, t] : saved.tensors) tensors.emplace(name, t);
  const std::vector<std::string> known = buffer_names();

  // Check everything before changing anything.
  std::unordered_map<const TensorImpl*, ParamState> loaded;
  int64_t index = 0;
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    double size = scalar("param_groups." + std::to_string(gi) + ".size");
    LOOM_CHECK(size == double(groups_[gi].params.size()), what, "group ", gi, " has ", size,
               " parameters in the checkpoint but ", groups_[gi].params.size(), " here");
    for (const Tensor& p : groups_[gi].params) {
      std::string key = "state." + std::to_string(index++) + ".";
      auto step = saved.scalars.find(key + "step");
      if (step == saved.scalars.end()) continue;
      ParamState s;
      s.step = int64_t(step->second);
      for (auto it = tensors.lower_bound(key); it != tensors.end() && it->first.starts_with(key); ++it) {
        std::string name = it->first.substr(key.size());
        LOOM_CHECK(std::find(known.begin(), known.end(), name) != known.end(), what, "the checkpoint's ", it->first,
                   " is not a buffer of ", type_name());
        LOOM_CHECK(it->second.shape() == p.shape(), what, it->first, " has shape ", shape_str(it->second.shape()),
                   " in the checkpoint but its parameter has shape ", shape_str(p.shape()));
        NoGradGuard no_grad;
        s.buffers[name] = it->second.to(p.device()).to(p.dtype()).clone();
      }
      loaded[p.impl()] = std::move(s);
    }
  }
  std::vector<ParamGroup> groups = groups_;
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    std::string prefix = "param_groups." + std::to_string(gi) + ".";
    double nesterov;
    for (auto& [name, value] : fields(groups[gi], &nesterov)) *value = scalar(prefix + name);
    groups[gi].nesterov = nesterov != 0 ? Nesterov::yes : Nesterov::no;
  }
  groups_ = std::move(groups);
  state_ = std::move(loaded);
}

namespace detail {

std::vector<std::vector<size_t>> split_by_device_and_dtype(const TensorList& params) {
  std::vector<std::vector<size_t>> groups;
  for (size_t i = 0; i < params.size(); ++i) {
    LOOM_CHECK(params[i].defined(), "optimizer update: params[", i, "] is an undefined tensor");
    auto same = [&](const std::vector<size_t>& g) {
      const Tensor& p = params[g.front()];
      return p.device() == params[i].device() && p.dtype() == params[i].dtype();
    };
    auto it = std::find_if(groups.begin(), groups.end(), same);
    if (it == groups.end()) groups.push_back({i});
    else it->push_back(i);
  }
  return groups;
}

Tensor DenseStaging::stage(const Tensor& t, MemoryFormat format) {
  if (t.is_contiguous(format)) return t;
  Tensor copy = t.contiguous(format);
  pending_.emplace_back(t, copy);
  return copy;
}

void DenseStaging::copy_back() const {
  NoGradGuard no_grad;
  for (const auto& [t, copy] : pending_) copy_(t, copy);
}

}  // namespace detail

}  // namespace loom::optim
