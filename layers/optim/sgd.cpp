// SGD: gathers each group's parameters that have a gradient, with their momentum buffers,
// and runs sgd_update over them under NoGradGuard.
#include "layers/optim/sgd.h"

#include "engine/autograd.h"
#include "engine/ops.h"

namespace loom::optim {

SGD::SGD(TensorList params, SGDOptions options) { add_param_group(std::move(params), options); }

void SGD::add_param_group(TensorList params, SGDOptions o) {
  LOOM_CHECK(o.momentum >= 0, "SGD: momentum must not be negative, got ", o.momentum);
  LOOM_CHECK(o.nesterov == Nesterov::no || (o.momentum > 0 && o.dampening == 0),
             "SGD: Nesterov momentum needs momentum > 0 and dampening = 0 (got momentum ", o.momentum,
             ", dampening ", o.dampening, ")");
  ParamGroup g;
  g.params = std::move(params);
  g.lr = o.lr;
  g.momentum = o.momentum;
  g.dampening = o.dampening;
  g.weight_decay = o.weight_decay;
  g.nesterov = o.nesterov;
  add_group(std::move(g));
}

void SGD::step() {
  NoGradGuard no_grad;
  for (const ParamGroup& g : param_groups()) {
    TensorList params, grads, buffers;
    std::vector<ParamState*> states;
    for (const Tensor& p : g.params) {
      if (!p.grad().defined()) continue;
      ParamState& s = state_of(p);
      auto it = s.buffers.find("momentum_buffer");
      params.push_back(p);
      grads.push_back(p.grad());
      buffers.push_back(it == s.buffers.end() ? Tensor() : it->second);
      states.push_back(&s);
    }
    sgd_update(params, grads, buffers, g);
    for (size_t i = 0; i < states.size(); ++i) {
      ++states[i]->step;
      if (buffers[i].defined()) states[i]->buffers["momentum_buffer"] = buffers[i];
    }
  }
}

void sgd_update(const TensorList& params, const TensorList& grads, TensorList& momentum_buffers,
                const ParamGroup& h) {
  for (size_t i = 0; i < params.size(); ++i) {
    Tensor d_p = grads[i];
    if (h.weight_decay != 0) d_p = add(d_p, mul(params[i], h.weight_decay));
    if (h.momentum != 0) {
      Tensor& buf = momentum_buffers[i];
      if (!buf.defined()) {
        buf = d_p.clone();
      } else {
        mul_(buf, h.momentum);
        add_(buf, d_p, 1 - h.dampening);
      }
      d_p = h.nesterov == Nesterov::yes ? add(d_p, mul(buf, h.momentum)) : buf;
    }
    add_(params[i], d_p, -h.lr);
  }
}

}  // namespace loom::optim
