// clip_grad_norm_: one sum of squares per gradient (a tensor op on its device), summed on
// the first gradient's device, one read of the total, then an in-place scale if needed.
#include "layers/optim/clip.h"

#include <cmath>

#include "engine/autograd.h"
#include "engine/ops.h"

namespace loom::optim {

Tensor grad_squared_sum(const TensorList& params, Device device) {
  NoGradGuard no_grad;
  TensorList squares;
  for (const Tensor& p : params) {
    Tensor g = p.grad();
    if (!g.defined() || g.numel() == 0) continue;
    Tensor wide = g.dtype() == DType::f64 ? g : g.to(DType::f32);
    squares.push_back(sum(mul(wide, wide)).to(DType::f64).to(device));
  }
  return squares.empty() ? zeros({1}, DType::f64, device) : sum(stack(squares, 0)).reshape({1});
}

void scale_grads_to_norm(const TensorList& params, double norm, double max_norm) {
  NoGradGuard no_grad;
  const double coef = max_norm / (norm + 1e-6);
  if (coef >= 1) return;
  for (const Tensor& p : params)
    if (p.grad().defined()) mul_(p.grad(), coef);
}

double clip_grad_norm_(const TensorList& params, double max_norm) {
  LOOM_CHECK(max_norm >= 0, "clip_grad_norm_: max_norm must not be negative, got ", max_norm);
  Device home = Device::cpu();
  for (const Tensor& p : params)
    if (p.grad().defined()) {
      home = p.grad().device();
      break;
    }
  const double total = std::sqrt(grad_squared_sum(params, home).item());
  scale_grads_to_norm(params, total, max_norm);
  return total;
}

}  // namespace loom::optim
