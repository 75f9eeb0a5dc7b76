// BatchNorm1d / BatchNorm2d over the engine's batch_norm op, which owns the arithmetic and
// the gradient; the layer keeps the state, picks batch or running statistics from the
// mode, and adapts tensors of another dtype (a converted module) to the op's rules.
#include "layers/batch_norm.h"

#include <algorithm>
#include <utility>

#include "engine/autograd.h"
#include "engine/ops.h"

namespace loom::nn {

BatchNorm::BatchNorm(int64_t num_features, double eps, double momentum, Affine affine, TrackRunningStats track,
                     std::vector<int> ranks, const char* layout)
    : num_features_(num_features), eps_(eps), momentum_(momentum), ranks_(std::move(ranks)), layout_(layout) {
  LOOM_CHECK(num_features > 0, "BatchNorm(", num_features, "): the number of features must be positive");
  LOOM_CHECK(eps >= 0, "BatchNorm: eps must not be negative, got ", eps);
  if (affine == Affine::yes) {
    weight = register_parameter("weight", ones({num_features}));
    bias = register_parameter("bias", zeros({num_features}));
  }
  if (track == TrackRunningStats::yes) {
    running_mean = register_buffer("running_mean", zeros({num_features}));
    running_var = register_buffer("running_var", ones({num_features}));
    num_batches_tracked = register_buffer("num_batches_tracked", scalar_tensor(0, DType::i64));
  }
}

Tensor BatchNorm::forward(const Tensor& input) { return run(input, nullptr); }

Tensor BatchNorm::forward_relu(const Tensor& input, const Tensor& residual) { return run(input, &residual); }

Tensor BatchNorm::run(const Tensor& input, const Tensor* residual) {
  LOOM_CHECK(input.defined(), type_name(), ": the input is an undefined tensor");
  const bool rank_ok = std::find(ranks_.begin(), ranks_.end(), input.dim()) != ranks_.end();
  LOOM_CHECK(rank_ok, type_name(), "(", num_features_, ") expects input ", layout_, ", got ",
             shape_str(input.shape()));
  if (input.size(1) != num_features_) {
    const bool channels_last = input.dim() > 2 && input.size(-1) == num_features_;
    const char* fix = input.dim() == 4 ? ": is the input channels-last? use x.permute({0, 3, 1, 2})"
                                       : ": are the channels last? use x.transpose(1, 2)";
    LOOM_FAIL(type_name(), "(", num_features_, ") expects input ", layout_, " with C = ", num_features_, ", got ",
              shape_str(input.shape()), channels_last ? fix : "");
  }
  const DType acc = input.dtype() == DType::f64 ? DType::f64 : DType::f32;
  const bool tracking = running_mean.defined();
  const bool update = is_training() && tracking;

  // The op wants running statistics in the accumulation type; a converted module's are
  // copied into it and the updated values written back.
  Tensor rm = running_mean, rv = running_var;
  if (tracking && rm.dtype() != acc) {
    NoGradGuard no_grad;
    rm = running_mean.to(acc);
    rv = running_var.to(acc);
  }
  Tensor w = weight.defined() ? weight.to(acc) : weight, b = bias.defined() ? bias.to(acc) : bias;
  const bool batch_stats = is_training() || !tracking;
  Tensor y = residual ? batch_norm_relu(input, *residual, rm, rv, w, b, batch_stats, momentum_, eps_)
                      : batch_norm(input, rm, rv, w, b, batch_stats, momentum_, eps_);
  if (update) {
    NoGradGuard no_grad;
    if (!rm.same(running_mean)) {
      copy_(running_mean, rm);
      copy_(running_var, rv);
    }
    add_(num_batches_tracked, scalar_tensor(1, DType::i64, num_batches_tracked.device()));
  }
  return y;
}

BatchNorm1d::BatchNorm1d(int64_t num_features, double eps, double momentum, Affine affine, TrackRunningStats track)
    : BatchNorm(num_features, eps, momentum, affine, track, {2, 3}, "(N, C) or (N, C, L)") {}

BatchNorm2d::BatchNorm2d(int64_t num_features, double eps, double momentum, Affine affine, TrackRunningStats track)
    : BatchNorm(num_features, eps, momentum, affine, track, {4}, "(N, C, H, W)") {}

}  // namespace loom::nn
