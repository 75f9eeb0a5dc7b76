// SGD with momentum, dampening, Nesterov momentum and L2 weight decay, following
// torch.optim.SGD's update exactly (for each parameter p with gradient g):
//   g = g + weight_decay * p
//   b = g                                   on p's first step (no dampening),
//   b = momentum * b + (1 - dampening) * g  afterwards         (when momentum != 0)
//   g = g + momentum * b  with Nesterov,  else  g = b
//   p = p - lr * g
#pragma once

#include "optimizer.h"

namespace loom::optim {

struct SGDOptions {
  double lr = 1e-3;
  double momentum = 0;
  double dampening = 0;
  double weight_decay = 0;
  Nesterov nesterov = Nesterov::no;
};

class SGD : public Optimizer {
 public:
  SGD(TensorList params, SGDOptions options);
  void add_param_group(TensorList params, SGDOptions options);

  void step() override;
  std::string type_name() const override { return "SGD"; }

 protected:
  std::vector<std::string> buffer_names() const override { return {"momentum_buffer"}; }
  // A momentum buffer only where the group has momentum.
  size_t buffers_kept(const ParamGroup& group) const override { return group.momentum != 0 ? 1 : 0; }
};

// One group's update over parallel lists (every grad defined). An undefined momentum
// buffer is this parameter's first step: it is created here. Runs as fused multi-tensor
// updates (sgd_update_fused), one per (device, dtype) among the parameters.
void sgd_update(const TensorList& params, const TensorList& grads, TensorList& momentum_buffers,
                const ParamGroup& hyper);

}  // namespace loom::optim
