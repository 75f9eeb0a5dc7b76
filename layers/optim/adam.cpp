// Adam and AdamW: state creation (zero moments on a parameter's first step), then
// adam_update over each group's parameters that have a gradient, under NoGradGuard.
#include "layers/optim/adam.h"

#include <cmath>

#include "engine/autograd.h"
#include "engine/ops.h"

namespace loom::optim {

Adam::Adam(TensorList params, AdamOptions o) : decay_(WeightDecay::l2) {
  add_param_group(std::move(params), o);
}

void Adam::add_param_group(TensorList params, AdamOptions o) {
  add_group_checked(std::move(params), o.lr, o.beta1, o.beta2, o.eps, o.weight_decay);
}

AdamW::AdamW(TensorList params, AdamWOptions o) : Adam(WeightDecay::decoupled) {
  add_param_group(std::move(params), o);
}

void AdamW::add_param_group(TensorList params, AdamWOptions o) {
  add_group_checked(std::move(params), o.lr, o.beta1, o.beta2, o.eps, o.weight_decay);
}

void Adam::add_group_checked(TensorList params, double lr, double beta1, double beta2, double eps,
                             double weight_decay) {
  LOOM_CHECK(beta1 >= 0 && beta1 < 1 && beta2 >= 0 && beta2 < 1, type_name(), ": betas must lie in [0, 1), got (",
             beta1, ", ", beta2, ")");
  LOOM_CHECK(eps >= 0, type_name(), ": eps must not be negative, got ", eps);
  ParamGroup g;
  g.params = std::move(params);
  g.lr = lr;
  g.beta1 = beta1;
  g.beta2 = beta2;
  g.eps = eps;
  g.weight_decay = weight_decay;
  add_group(std::move(g));
}

void Adam::step() {
  NoGradGuard no_grad;
  for (const ParamGroup& g : param_groups()) {
    TensorList params, grads, exp_avgs, exp_avg_sqs;
    std::vector<int64_t> steps;
    for (const Tensor& p : g.params) {
      if (!p.grad().defined()) continue;
      ParamState& s = state_of(p);
      if (s.buffers.empty()) {
        s.buffers["exp_avg"] = zeros_like(p);
        s.buffers["exp_avg_sq"] = zeros_like(p);
      }
      params.push_back(p);
      grads.push_back(p.grad());
      exp_avgs.push_back(s.buffers["exp_avg"]);
      exp_avg_sqs.push_back(s.buffers["exp_avg_sq"]);
      steps.push_back(++s.step);
    }
    adam_update(params, grads, exp_avgs, exp_avg_sqs, steps, g, decay_);
  }
}

void adam_update(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                 const TensorList& exp_avg_sqs, const std::vector<int64_t>& steps, const ParamGroup& h,
                 WeightDecay decay) {
  for (size_t i = 0; i < params.size(); ++i) {
    const Tensor &p = params[i], &m = exp_avgs[i], &v = exp_avg_sqs[i];
    Tensor g = grads[i];
    if (h.weight_decay != 0) {
      if (decay == WeightDecay::decoupled) mul_(p, 1 - h.lr * h.weight_decay);
      else g = add(g, mul(p, h.weight_decay));
    }
    mul_(m, h.beta1);
    add_(m, g, 1 - h.beta1);
    mul_(v, h.beta2);
    add_(v, mul(g, g), 1 - h.beta2);
    const double t = double(steps[i]);
    const double bias_correction1 = 1 - std::pow(h.beta1, t);
    const double bias_correction2_sqrt = std::sqrt(1 - std::pow(h.beta2, t));
    Tensor denom = add(mul(sqrt(v), 1 / bias_correction2_sqrt), h.eps);
    add_(p, div(m, denom), -h.lr / bias_correction1);
  }
}

}  // namespace loom::optim
