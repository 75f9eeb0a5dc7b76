#include "layers/optim/captured_step.h"

#include "engine/autograd.h"
#include "engine/ops.h"

namespace loom::optim {

CapturedStep::CapturedStep(Device device, std::vector<Optimizer*> optimizers, std::function<Tensor()> step,
                           int warmup)
    : device_(device), optimizers_(std::move(optimizers)), step_(std::move(step)), warmup_left_(warmup) {
  LOOM_CHECK(step_, "CapturedStep: no step function given");
  // The optimizers' state (momentum buffers) must exist before the capture: a captured first
  // update would start the buffers afresh at every replay.
  LOOM_CHECK(warmup >= 1, "CapturedStep: warmup ", warmup, "; at least 1 eager step must come before the capture");
  if (!device_.is_cuda()) return;
  for (Optimizer* opt : optimizers_) {
    LOOM_CHECK(opt, "CapturedStep: an optimizer is null");
    opt->make_capturable(device_);
  }
}

Tensor CapturedStep::run() {
  if (!device_.is_cuda()) return step_();
  if (warmup_left_ > 0) {
    --warmup_left_;
    return step_();
  }
  if (!graph_) {
    graph_ = std::make_unique<CudaGraph>(device_);
    for (Optimizer* opt : optimizers_) opt->begin_capture();
    try {
      graph_->capture([&] { loss_ = step_(); });
    } catch (...) {
      graph_.reset();
      throw;
    }
    LOOM_CHECK(!loss_.defined() || loss_.device() == device_, "CapturedStep: the step returned a loss on ",
               loss_.device().str(), "; expected it on ", device_.str(), ", where the graph runs");
  }
  for (Optimizer* opt : optimizers_) opt->prepare_replay();
  graph_->replay();
  return loss_;
}

CapturedBatchStep::CapturedBatchStep(Device device, std::vector<Optimizer*> optimizers, Step step, int warmup)
    : device_(device), optimizers_(std::move(optimizers)), step_(std::move(step)), warmup_(warmup) {
  LOOM_CHECK(step_, "CapturedBatchStep: no step function given");
  LOOM_CHECK(warmup >= 1, "CapturedBatchStep: warmup ", warmup, "; at least 1 eager step must come before the capture");
}

bool CapturedBatchStep::fits(const Tensor& inputs, const Tensor& targets) const {
  auto same = [](const Tensor& a, const Tensor& b) {
    return a.shape() == b.shape() && a.dtype() == b.dtype() && a.device() == b.device();
  };
  return same(inputs, inputs_) && same(targets, targets_);
}

Tensor CapturedBatchStep::run(const Tensor& inputs, const Tensor& targets) {
  if (!device_.is_cuda()) return step_(inputs, targets);
  if (!captured_ || !fits(inputs, targets)) {
    if (captured()) return step_(inputs, targets);
    // Not captured yet: warm up (again) on this batch's shapes.
    inputs_ = empty_like(inputs);
    targets_ = empty_like(targets);
    captured_.reset();
    captured_.emplace(device_, optimizers_, [this] { return step_(inputs_, targets_); }, warmup_);
  }
  {
    NoGradGuard no_grad;
    copy_(inputs_, inputs);
    copy_(targets_, targets);
  }
  return captured_->run();
}

}  // namespace loom::optim
