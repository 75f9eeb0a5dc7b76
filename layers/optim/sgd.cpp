// SGD: gathers each group's parameters that have a gradient, with their momentum buffers,
// and runs sgd_update over them under NoGradGuard. sgd_update splits a group by device and
// dtype and calls the fused op on each part; a parameter dense in neither row-major nor
// channels-last order is updated through a row-major copy written back afterwards.
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
  for (size_t gi = 0; gi < param_groups().size(); ++gi) {
    const ParamGroup& g = param_groups()[gi];
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
    if (params.empty()) continue;
    const bool captured = capturing_update(g);
    write_hyper_if_eager(g, 0, captured);
    sgd_update(params, grads, buffers, g);
    for (size_t i = 0; i < states.size(); ++i) {
      count_update(gi, *states[i], captured);
      if (buffers[i].defined()) states[i]->buffers["momentum_buffer"] = buffers[i];
    }
  }
}

void sgd_update(const TensorList& params, const TensorList& grads, TensorList& momentum_buffers,
                const ParamGroup& h) {
  LOOM_CHECK(grads.size() == params.size() && momentum_buffers.size() == params.size(), "sgd_update: ",
             params.size(), " params, ", grads.size(), " grads and ", momentum_buffers.size(),
             " momentum buffers; the lists run in parallel");
  NoGradGuard no_grad;
  for (const std::vector<size_t>& part : detail::split_by_device_and_dtype(params)) {
    detail::DenseStaging staging;
    TensorList ps, gs, bufs;
    for (size_t i : part) {
      LOOM_CHECK(grads[i].defined(), "sgd_update: grads[", i,
                 "] is undefined; pass only parameters that have a gradient");
      ps.push_back(staging.stage(params[i]));
      const MemoryFormat format = ps.back().memory_format();  // every list in the parameter's layout
      gs.push_back(grads[i].to(params[i].dtype()).contiguous(format));
      // An optimizer-owned buffer can simply be replaced by a copy in that layout.
      bufs.push_back(momentum_buffers[i].defined() ? momentum_buffers[i].contiguous(format) : Tensor());
    }
    sgd_update_fused(ps, gs, bufs, h.lr, h.momentum, h.dampening, h.weight_decay, h.nesterov == Nesterov::yes,
                     h.hyper_at);
    staging.copy_back();
    for (size_t k = 0; k < part.size(); ++k) momentum_buffers[part[k]] = bufs[k];
  }
}

}  // namespace loom::optim
