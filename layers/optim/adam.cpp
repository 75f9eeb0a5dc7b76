// Adam and AdamW: state creation (zero moments on a parameter's first step), then
// adam_update over each group's parameters that have a gradient, under NoGradGuard.
// adam_update splits a group by device and dtype and calls the fused op on each part;
// every list is taken in its parameter's layout (row-major, or channels-last), and a tensor
// dense in neither is updated through a copy written back afterwards.
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
  for (size_t gi = 0; gi < param_groups().size(); ++gi) {
    const ParamGroup& g = param_groups()[gi];
    TensorList params, grads, exp_avgs, exp_avg_sqs;
    std::vector<int64_t> steps;
    const bool captured = capturing_update(g);
    for (const Tensor& p : g.params) {
      if (!p.grad().defined()) continue;
      ParamState& s = state_of(p);
      if (s.buffers.empty()) {
        // In the parameter's layout, so that the update reads them as they lie.
        for (const char* name : {"exp_avg", "exp_avg_sq"}) {
          Tensor zero = Tensor::empty(p.shape(), p.dtype(), p.device(), p.memory_format());
          zero_(zero);
          s.buffers[name] = zero;
        }
      }
      params.push_back(p);
      grads.push_back(p.grad());
      exp_avgs.push_back(s.buffers["exp_avg"]);
      exp_avg_sqs.push_back(s.buffers["exp_avg_sq"]);
      steps.push_back(count_update(gi, s, captured));
    }
    if (params.empty()) continue;
    write_hyper_if_eager(g, steps[0], captured);
    adam_update(params, grads, exp_avgs, exp_avg_sqs, steps, g, decay_);
  }
}

void adam_update(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                 const TensorList& exp_avg_sqs, const std::vector<int64_t>& steps, const ParamGroup& h,
                 WeightDecay decay) {
  const size_t n = params.size();
  LOOM_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && steps.size() == n,
             "adam_update: ", n, " params, ", grads.size(), " grads, ", exp_avgs.size(), " exp_avgs, ",
             exp_avg_sqs.size(), " exp_avg_sqs and ", steps.size(), " steps; the lists run in parallel");
  NoGradGuard no_grad;
  for (const std::vector<size_t>& part : detail::split_by_device_and_dtype(params)) {
    detail::DenseStaging staging;
    TensorList ps, gs, ms, vs;
    std::vector<int64_t> part_steps;
    for (size_t i : part) {
      LOOM_CHECK(grads[i].defined(), "adam_update: grads[", i,
                 "] is undefined; pass only parameters that have a gradient");
      ps.push_back(staging.stage(params[i]));
      const MemoryFormat format = ps.back().memory_format();  // every list in the parameter's layout
      gs.push_back(grads[i].to(params[i].dtype()).contiguous(format));
      ms.push_back(staging.stage(exp_avgs[i], format));
      vs.push_back(staging.stage(exp_avg_sqs[i], format));
      part_steps.push_back(steps[i]);
    }
    adam_update_fused(ps, gs, ms, vs, part_steps, h.lr, h.beta1, h.beta2, h.eps, h.weight_decay,
                      decay == WeightDecay::decoupled, h.hyper_at);
    staging.copy_back();
  }
}

void Adam::write_hyper(const ParamGroup& g, int64_t step) const {
  // The doubles adam_step's host side computes for an update at step `step`
  // (kernels/core/optim_math.h: adam_tensor_scalars and Adam::make's decay), which the kernel
  // rounds as the host would.
  const double t = double(step);
  const double values[3] = {g.lr / (1 - std::pow(g.beta1, t)), std::sqrt(1 - std::pow(g.beta2, t)),
                            1 - g.lr * g.weight_decay};
  NoGradGuard no_grad;
  for (int64_t k = 0; k < 3; ++k) fill_(g.hyper_at.slice(0, k, k + 1), values[k]);
}

}  // namespace loom::optim
