// Learning-rate schedules as closed-form functions of the step, with torch.optim.lr_scheduler's
// formulas and defaults, so a schedule can be checked by hand and resumed from a step count
// alone. A Schedule maps (step, base_lr) to the learning rate after `step` calls of
// scheduler.step(); base_lr is the group's lr when the LRScheduler was made.
//
//   StepLR:            base_lr * gamma^floor(step / step_size)
//   CosineAnnealingLR: eta_min + (base_lr - eta_min) * (1 + cos(pi * step / t_max)) / 2
//   LinearLR (warm-up): base_lr * (start + (end - start) * min(step, total_iters) / total_iters)
//   OneCycleLR:        from max_lr/div_factor up to max_lr over the first pct_start of
//                      total_steps, then down to max_lr/(div_factor*final_div_factor),
//                      annealed by cosine or linearly (base_lr is not used)
// OneCycleLR here schedules only the learning rate; torch's also cycles momentum by default.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "optimizer.h"

namespace loom::optim {

using Schedule = std::function<double(int64_t step, double base_lr)>;

Schedule step_lr(int64_t step_size, double gamma = 0.1);
Schedule cosine_annealing(int64_t t_max, double eta_min = 0);
Schedule linear_lr(double start_factor = 1.0 / 3, double end_factor = 1.0, int64_t total_iters = 5);

enum class Anneal { cos, linear };
enum class ThreePhase : bool { no = false, yes = true };
struct OneCycleOptions {
  double max_lr = 0;
  int64_t total_steps = 0;
  double pct_start = 0.3;
  Anneal anneal = Anneal::cos;
  double div_factor = 25;
  double final_div_factor = 1e4;
  ThreePhase three_phase = ThreePhase::no;
};
Schedule one_cycle(const OneCycleOptions& options);

// `first` for steps below `milestone`, then `second` counted from the milestone (torch's
// SequentialLR): sequential(linear_lr(0.01, 1, 100), 100, cosine_annealing(900)) is a
// warm-up then cosine decay.
Schedule sequential(Schedule first, int64_t milestone, Schedule second);

// Applies a schedule to an optimizer's groups. Call step() after each optimizer.step().
class LRScheduler {
 public:
  // Takes each group's current lr as its base and sets the step-0 learning rate.
  LRScheduler(Optimizer& optimizer, Schedule schedule);

  void step();
  int64_t last_step() const { return last_step_; }
  // The learning rate of each group, as last set.
  std::vector<double> last_lr() const;

  // For training checkpoints: "last_step" and "base_lr.<group>".
  std::map<std::string, double> state_dict() const;
  void load_state_dict(const std::map<std::string, double>& state);

 private:
  void apply();

  Optimizer& optimizer_;
  Schedule schedule_;
  std::vector<double> base_lrs_;
  int64_t last_step_ = 0;
};

}  // namespace loom::optim
