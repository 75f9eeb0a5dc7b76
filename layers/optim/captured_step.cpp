#include "layers/optim/captured_step.h"

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

}  // namespace loom::optim
