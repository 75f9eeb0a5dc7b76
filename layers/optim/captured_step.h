// CapturedStep: a training step of static shapes run as one CUDA graph (engine/cuda_graph.h)
// instead of hundreds of kernel launches. The step is written once, as for eager training:
//
//   Tensor x = empty(batch shape), y = empty(targets shape);   // static: copied into per batch
//   optim::CapturedStep step(device, {&opt}, [&] {
//     opt.zero_grad();                                          // gradients set to none
//     Tensor loss = cross_entropy(model.forward(x), y);
//     loss.backward();
//     opt.step();
//     return loss;
//   });
//   for (batch : data) { copy_(x, batch.images); copy_(y, batch.labels); step.run(); }
//
// On a GPU the first `warmup` calls run the step eagerly: cuDNN and cuBLAS choose their plans
// and the optimizers make their state there, since a capture records a step's kernels, not
// its first-time choices. The next call captures the step and replays it, and every call
// after replays it: the same kernels on the same addresses, so the results are those of
// eager steps, bit for bit (tests/layers/test_captured_step_cuda.cpp). The optimizers become
// capturable (Optimizer::make_capturable): what they change between steps (the learning
// rate under a schedule, Adam's bias corrections) lives on the device and is written before
// each replay, and each replay counts as a step in their state.
// On the CPU every call runs the step eagerly.
//
// What the step may do is what a capture allows (engine/cuda_graph.h): no reads of GPU
// values on the host, no copies from host memory, no random ops (dropout); each is refused
// with an error that names it, at the capture. Shapes must not change: a batch of another
// size goes through the step's function directly (eagerly), or through a CapturedStep of
// its own.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "engine/cuda_graph.h"
#include "optimizer.h"

namespace loom::optim {

class CapturedStep {
 public:
  CapturedStep(Device device, std::vector<Optimizer*> optimizers, std::function<Tensor()> step, int warmup = 2);

  // One training step; returns its loss. After the capture this is the graph's own tensor,
  // which the next call overwrites: read or copy it before then.
  Tensor run();
  // Whether the calls now replay a graph.
  bool captured() const { return graph_ && graph_->captured(); }
  // Bytes the graph's pool holds (0 before the capture and on the CPU).
  size_t pool_bytes() const { return graph_ ? graph_->pool_bytes() : 0; }

 private:
  Device device_;
  std::vector<Optimizer*> optimizers_;
  std::function<Tensor()> step_;
  int warmup_left_;
  std::unique_ptr<CudaGraph> graph_;
  Tensor loss_;
};

// A training loop's step over (inputs, targets) batches, captured as above: the step is
// written for any batch,
//
//   optim::CapturedBatchStep step(device, {&opt}, [&](const Tensor& x, const Tensor& y) {
//     opt.zero_grad(); ... return loss; });
//   for (batch : data) loss = step.run(batch.inputs, batch.targets);
//
// and the graph is made for the shapes of the batches it warms up on: a batch of those shapes
// and dtypes is copied into the graph's static tensors and the graph replayed; a batch of any
// other shape (an epoch's last, smaller one) runs the step eagerly on its own tensors, so a
// changed shape never replays a graph made for another. Before the capture, a batch of new
// shapes starts the warm-up again on them (a run resumed at an epoch's short last batch then
// captures on the next full one). On the CPU every call runs the step eagerly on the batch
// given.
class CapturedBatchStep {
 public:
  using Step = std::function<Tensor(const Tensor& inputs, const Tensor& targets)>;
  CapturedBatchStep(Device device, std::vector<Optimizer*> optimizers, Step step, int warmup = 2);
  CapturedBatchStep(const CapturedBatchStep&) = delete;  // its graph's step refers to this object
  CapturedBatchStep& operator=(const CapturedBatchStep&) = delete;

  // One step on this batch; returns its loss (for a replay, the graph's tensor, which the next
  // replay overwrites: read or copy it before then).
  Tensor run(const Tensor& inputs, const Tensor& targets);
  bool captured() const { return captured_ && captured_->captured(); }

 private:
  bool fits(const Tensor& inputs, const Tensor& targets) const;

  Device device_;
  std::vector<Optimizer*> optimizers_;
  Step step_;
  int warmup_;
  Tensor inputs_, targets_;  // the graph's static batch
  std::optional<CapturedStep> captured_;
};

}  // namespace loom::optim
