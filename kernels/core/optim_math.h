// The per-element arithmetic of the optimizer updates (SGD, Adam, AdamW), shared by the CPU
// and CUDA multi-tensor kernels so the two cannot drift apart. It follows torch.optim (the
// formulas are on SgdHyper and AdamHyper in kernels/table.h) in the accumulation type A:
// f32 for f32, bf16 and f16, f64 for f64. The hyper-parameters arrive as doubles and are
// rounded to A once; the per-tensor Adam scalars (bias corrections) are computed in double
// by adam_tensor_scalars and rounded to A once, on the host, for both devices.
#pragma once

#include <cmath>
#include <cstdint>

#include "host_device.h"

namespace loom::optim_math {

LOOM_HOST_DEVICE float root(float x) { return sqrtf(x); }
LOOM_HOST_DEVICE double root(double x) { return sqrt(x); }

template <class A> struct Sgd {
  A lr, momentum, keep, weight_decay;  // keep = 1 - dampening
  bool nesterov;

  static Sgd make(double lr, double momentum, double dampening, double weight_decay, bool nesterov) {
    return {A(lr), A(momentum), A(1 - dampening), A(weight_decay), nesterov};
  }

  // The new parameter from p and gradient g; b is the momentum buffer (read unless first,
  // written), untouched when momentum is 0.
  LOOM_HOST_DEVICE A step(A p, A g, A& b, bool first) const {
    if (weight_decay != A(0)) g += weight_decay * p;
    if (momentum != A(0)) {
      b = first ? g : momentum * b + keep * g;
      g = nesterov ? g + momentum * b : b;
    }
    return p - lr * g;
  }
};

// What Adam needs per tensor, from its step count t: lr / (1 - beta1^t) and
// sqrt(1 - beta2^t).
template <class A> struct AdamTensor {
  A step_size, bias_correction2_sqrt;
};

template <class A>
AdamTensor<A> adam_tensor_scalars(double lr, double beta1, double beta2, int64_t step) {
  const double t = double(step);
  return {A(lr / (1 - std::pow(beta1, t))), A(std::sqrt(1 - std::pow(beta2, t)))};
}

template <class A> struct Adam {
  A beta1, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay;
  A decay;  // 1 - lr * weight_decay, the decoupled (AdamW) shrink
  bool decoupled;

  static Adam make(double lr, double beta1, double beta2, double eps, double weight_decay, bool decoupled) {
    return {A(beta1), A(1 - beta1), A(beta2), A(1 - beta2), A(eps), A(weight_decay), A(1 - lr * weight_decay),
            decoupled};
  }

  // The new parameter from p and gradient g; m and v (exp_avg, exp_avg_sq) read and written.
  LOOM_HOST_DEVICE A step(A p, A g, A& m, A& v, AdamTensor<A> s) const {
    if (weight_decay != A(0)) {
      if (decoupled) p *= decay;
      else g += weight_decay * p;
    }
    m = beta1 * m + one_minus_beta1 * g;
    v = beta2 * v + one_minus_beta2 * g * g;
    const A denom = root(v) / s.bias_correction2_sqrt + eps;
    return p - s.step_size * m / denom;
  }
};

}  // namespace loom::optim_math
