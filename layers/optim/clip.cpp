// clip_grad_norm_: one sum of squares per gradient (a tensor op on its device), summed on
// the first gradient's device, one read of the total, then an in-place scale if needed.
#include "layers/optim/clip.h"

#include <cmath>

#include "engine/autograd.h"
#include "engine/ops.h"

namespace loom::optim {

double clip_grad_norm_(const TensorList& params, double max_norm) {
  LOOM_CHECK(max_norm >= 0, "clip_grad_norm_: max_norm must not be negative, got ", max_norm);
  NoGradGuard no_grad;
  TensorList grads, squares;
  for (const Tensor& p : params) {
    Tensor g = p.grad();
    if (!g.defined()) continue;
    grads.push_back(g);
    Tensor wide = g.dtype() == DType::f64 ? g : g.to(DType::f32);
    squares.push_back(sum(mul(wide, wide)).to(DType::f64));
  }
  if (grads.empty()) return 0.0;
  const Device home = squares.front().device();
  for (Tensor& s : squares) s = s.to(home);
  const double total = std::sqrt(sum(stack(squares, 0)).item());
  const double coef = max_norm / (total + 1e-6);
  if (coef < 1)
    for (const Tensor& g : grads) mul_(g, coef);
  return total;
}

}  // namespace loom::optim
