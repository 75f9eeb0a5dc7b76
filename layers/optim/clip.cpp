// clip_grad_norm_: one sum of squares per gradient (a tensor op on its device), summed on
// the first gradient's device, then every gradient multiplied in place by the clamped scale
// factor, a tensor on that device (copied once to any other device a gradient is on).
#include "layers/optim/clip.h"

#include <algorithm>
#include <tuple>
#include <vector>

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

void scale_grads_to_norm(const TensorList& params, const Tensor& norm, double max_norm) {
  NoGradGuard no_grad;
  LOOM_CHECK(norm.defined() && norm.numel() == 1 && norm.dtype() == DType::f64,
             "scale_grads_to_norm: the norm must be a one-element f64 tensor");
  // min(1, max_norm / (norm + 1e-6)) in f64, 0-dim so that it broadcasts to any gradient (a
  // scalar parameter's too); a NaN norm gives NaN, as torch's does.
  const Tensor coef =
      minimum(rdiv(add(norm.reshape({}), 1e-6), max_norm), ones({}, DType::f64, norm.device()));
  // The factor on each gradient's device, in f64 for f64 gradients and in f32 for the rest: a
  // 16-bit gradient is multiplied in f32 and rounded once, so a tiny factor (a blown-up
  // norm) does not underflow in the gradient's own precision.
  std::vector<std::tuple<Device, DType, Tensor>> coef_as;
  for (const Tensor& p : params) {
    const Tensor& g = p.grad();
    if (!g.defined() || g.numel() == 0) continue;
    const DType wide = g.dtype() == DType::f64 ? DType::f64 : DType::f32;
    auto it = std::find_if(coef_as.begin(), coef_as.end(), [&](const auto& c) {
      return std::get<0>(c) == g.device() && std::get<1>(c) == wide;
    });
    if (it == coef_as.end()) it = coef_as.insert(coef_as.end(), {g.device(), wide, coef.to(wide).to(g.device())});
    const Tensor& c = std::get<2>(*it);
    if (g.dtype() == wide) mul_(g, c);
    else copy_(g, mul(g.to(wide), c).to(g.dtype()));
  }
}

Tensor clip_grad_norm_(const TensorList& params, double max_norm) {
  LOOM_CHECK(max_norm >= 0, "clip_grad_norm_: max_norm must not be negative, got ", max_norm);
  Device home = Device::cpu();
  for (const Tensor& p : params)
    if (p.grad().defined()) {
      home = p.grad().device();
      break;
    }
  Tensor norm = sqrt(grad_squared_sum(params, home));
  scale_grads_to_norm(params, norm, max_norm);
  return norm;
}

}  // namespace loom::optim
