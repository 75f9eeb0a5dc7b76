// Adam and AdamW, following torch.optim's update exactly (amsgrad and maximize aside).
// For each parameter p with gradient g, at its step t = 1, 2, ...:
//   Adam:  g = g + weight_decay * p          (L2 decay through the gradient)
//   AdamW: p = p * (1 - lr * weight_decay)   (decoupled decay, before the update)
//   m = beta1 * m + (1 - beta1) * g
//   v = beta2 * v + (1 - beta2) * g * g
//   p = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
// eps is added outside the square root, after the bias correction, as torch does.
#pragma once

#include "optimizer.h"

namespace loom::optim {

struct AdamOptions {
  double lr = 1e-3;
  double beta1 = 0.9, beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0;
};

// AdamW's options differ only in torch's default weight decay.
struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9, beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
};

enum class WeightDecay : bool { l2, decoupled };

class Adam : public Optimizer {
 public:
  Adam(TensorList params, AdamOptions options);
  void add_param_group(TensorList params, AdamOptions options);

  void step() override;
  std::string type_name() const override { return "Adam"; }

 protected:
  explicit Adam(WeightDecay decay) : decay_(decay) {}
  void add_group_checked(TensorList params, double lr, double beta1, double beta2, double eps, double weight_decay);
  std::vector<std::string> buffer_names() const override { return {"exp_avg", "exp_avg_sq"}; }
  int64_t device_hyper_size() const override { return 3; }
  void write_hyper(const ParamGroup& group, int64_t step) const override;

 private:
  WeightDecay decay_ = WeightDecay::l2;
};

class AdamW : public Adam {
 public:
  AdamW(TensorList params, AdamWOptions options);
  void add_param_group(TensorList params, AdamWOptions options);
  std::string type_name() const override { return "AdamW"; }
};

// One group's update over parallel lists (every grad defined; steps already counted, so
// each is >= 1). Runs as fused multi-tensor updates (adam_update_fused), one per
// (device, dtype) among the parameters.
void adam_update(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                 const TensorList& exp_avg_sqs, const std::vector<int64_t>& steps, const ParamGroup& hyper,
                 WeightDecay decay);

}  // namespace loom::optim
