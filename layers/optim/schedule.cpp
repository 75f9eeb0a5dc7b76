// Schedules: the closed forms of torch.optim.lr_scheduler, and the scheduler that writes
// them into an optimizer's groups.
#include "layers/optim/schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace loom::optim {

Schedule step_lr(int64_t step_size, double gamma) {
  LOOM_CHECK(step_size > 0, "StepLR: step_size must be positive, got ", step_size);
  return [=](int64_t step, double base_lr) { return base_lr * std::pow(gamma, double(step / step_size)); };
}

Schedule cosine_annealing(int64_t t_max, double eta_min) {
  LOOM_CHECK(t_max > 0, "CosineAnnealingLR: t_max must be positive, got ", t_max);
  return [=](int64_t step, double base_lr) {
    return eta_min + (base_lr - eta_min) * (1 + std::cos(std::numbers::pi * double(step) / double(t_max))) / 2;
  };
}

Schedule linear_lr(double start_factor, double end_factor, int64_t total_iters) {
  LOOM_CHECK(start_factor > 0 && start_factor <= 1 && end_factor >= 0 && end_factor <= 1,
             "LinearLR: factors must lie in (0, 1] (start) and [0, 1] (end), got ", start_factor, " and ", end_factor);
  LOOM_CHECK(total_iters > 0, "LinearLR: total_iters must be positive, got ", total_iters);
  return [=](int64_t step, double base_lr) {
    double progress = double(std::min(step, total_iters)) / double(total_iters);
    return base_lr * (start_factor + (end_factor - start_factor) * progress);
  };
}

Schedule one_cycle(const OneCycleOptions& o) {
  LOOM_CHECK(o.max_lr > 0, "OneCycleLR: max_lr must be positive, got ", o.max_lr);
  LOOM_CHECK(o.total_steps > 0, "OneCycleLR: total_steps must be positive, got ", o.total_steps);
  LOOM_CHECK(o.pct_start > 0 && o.pct_start < 1, "OneCycleLR: pct_start must lie in (0, 1), got ", o.pct_start);
  const double initial = o.max_lr / o.div_factor, min_lr = initial / o.final_div_factor;
  struct Phase {
    double end_step, start_lr, end_lr;
  };
  const double up = o.pct_start * double(o.total_steps);
  std::vector<Phase> phases;
  if (o.three_phase == ThreePhase::yes)
    phases = {{up - 1, initial, o.max_lr}, {2 * up - 2, o.max_lr, initial}, {double(o.total_steps) - 1, initial, min_lr}};
  else
    phases = {{up - 1, initial, o.max_lr}, {double(o.total_steps) - 1, o.max_lr, min_lr}};
  const Anneal anneal = o.anneal;
  const int64_t total = o.total_steps;
  return [=](int64_t step, double) {
    LOOM_CHECK(step <= total, "OneCycleLR: step ", step, " is past total_steps ", total);
    double start_step = 0;
    for (size_t i = 0; i < phases.size(); ++i) {
      const Phase& p = phases[i];
      if (double(step) <= p.end_step || i + 1 == phases.size()) {
        double pct = (double(step) - start_step) / (p.end_step - start_step);
        if (anneal == Anneal::linear) return (p.end_lr - p.start_lr) * pct + p.start_lr;
        return p.end_lr + (p.start_lr - p.end_lr) / 2 * (std::cos(std::numbers::pi * pct) + 1);
      }
      start_step = p.end_step;
    }
    return min_lr;
  };
}

Schedule sequential(Schedule first, int64_t milestone, Schedule second) {
  LOOM_CHECK(milestone >= 0, "SequentialLR: the milestone must not be negative, got ", milestone);
  return [=](int64_t step, double base_lr) {
    return step < milestone ? first(step, base_lr) : second(step - milestone, base_lr);
  };
}

LRScheduler::LRScheduler(Optimizer& optimizer, Schedule schedule)
    : optimizer_(optimizer), schedule_(std::move(schedule)) {
  for (const ParamGroup& g : optimizer_.param_groups()) base_lrs_.push_back(g.lr);
  apply();
}

void LRScheduler::step() {
  ++last_step_;
  apply();
}

void LRScheduler::apply() {
  auto& groups = optimizer_.param_groups();
  LOOM_CHECK(groups.size() == base_lrs_.size(), "LRScheduler: the optimizer had ", base_lrs_.size(),
             " parameter groups when the scheduler was made and has ", groups.size(), " now");
  for (size_t g = 0; g < groups.size(); ++g) groups[g].lr = schedule_(last_step_, base_lrs_[g]);
}

std::vector<double> LRScheduler::last_lr() const {
  std::vector<double> out;
  for (const ParamGroup& g : optimizer_.param_groups()) out.push_back(g.lr);
  return out;
}

std::map<std::string, double> LRScheduler::state_dict() const {
  std::map<std::string, double> out{{"last_step", double(last_step_)}};
  for (size_t g = 0; g < base_lrs_.size(); ++g) out["base_lr." + std::to_string(g)] = base_lrs_[g];
  return out;
}

void LRScheduler::load_state_dict(const std::map<std::string, double>& state) {
  auto get = [&](const std::string& key) {
    auto it = state.find(key);
    LOOM_CHECK(it != state.end(), "LRScheduler load_state_dict: the checkpoint has no ", key);
    return it->second;
  };
  std::vector<double> base(base_lrs_.size());
  for (size_t g = 0; g < base.size(); ++g) base[g] = get("base_lr." + std::to_string(g));
  last_step_ = int64_t(get("last_step"));
  base_lrs_ = std::move(base);
  apply();
}

}  // namespace loom::optim
