// What one rank's memory holds in a training step, planned before the first step from the
// model, the optimizer and the strategy, and set beside the allocator's measured peak once a
// few steps have run (train_cnn and train_gpt print both).
//
//   held between steps      parameters   the whole model (plain, DDP), a stage's (pipeline),
//                                        or the shards (FSDP)
//                           gradients    as large as the trainable parameters they belong to
//                           optimizer    the buffers the optimizer keeps per parameter
//                                        (SGD's momentum; Adam's two moments)
//                           buckets      DDP: the bucket buffers the gradients are averaged in,
//                                        kept from step to step (with gradient_as_bucket_view
//                                        the gradients are those buffers: none more)
//   added inside a step     gathered     FSDP: the full parameters held at once at most (ZeRO-3:
//                                        the two largest units, prefetch included; ZeRO-2:
//                                        every unit), and the largest unit's
//                                        full gradients with their reduce-scatter buffer (a
//                                        pipeline's sharded stages with several micro-batches:
//                                        every unit's full gradients, kept until the stage's
//                                        last backward of the step)
//                           activations  what a forward and its backward hold at their peak
//                                        beyond the parameters and their gradients: the saved
//                                        activations, their gradients, the workspaces.
//                                        Measured on a probe step of one row and of two and
//                                        extrapolated to the rank's rows (a pipeline rank: to a
//                                        micro-batch's, times the micro-batches its schedule
//                                        holds at once)
//
// The plan leaves out the batches the data loader holds, the buffers of the communication
// libraries, and what the caching allocator keeps cached; the measured peak (the allocator's
// live bytes) includes the batches.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "../layers/module.h"
#include "../layers/optim/optimizer.h"

namespace loom::dist {

class FullyShardedDataParallel;
class DistributedDataParallel;
namespace pipeline {
class Pipeline;
}

struct MemoryPlan {
  std::string strategy;  // "plain", "DDP", "FSDP ZeRO-3", "pipeline stage 1 of 2", ...
  size_t parameters = 0;
  size_t gradients = 0;
  size_t optimizer_state = 0;
  size_t buckets = 0;
  size_t gathered = 0;
  size_t activations = 0;

  size_t between_steps() const { return parameters + gradients + optimizer_state + buckets; }
  size_t total() const { return between_steps() + gathered + activations; }
  // The plan as lines of "  name  MB", the total last, and the measured peak beside it when
  // given ("measured peak 12.3 MB, 104% of the plan").
  std::string table(std::optional<size_t> measured_peak = std::nullopt) const;
  // "memory after 20 steps: peak 68.7 MB on this rank, 102% of the plan's 67.2 MB": the
  // allocator's peak on `device` since its count stood at `allocated_before` (taken before the
  // model was built), after `steps` steps.
  std::string measured_line(Device device, size_t allocated_before, int64_t steps) const;
};

// The activations' bytes of a step of `rows` rows (see above): `forward(r)` runs the model on
// r rows with gradients on and returns a scalar loss; backward runs from it, and the
// allocator's peak on `device` above where it started, less the parameters' gradients, is
// what the step held. Measured at one row and at two, extrapolated linearly. The module's
// buffers (BatchNorm's statistics), its parameters' gradients and the generator are put back
// afterwards, so a probe does not change training; the device's peak is reset.
size_t activation_bytes(nn::Module& module, Device device, int64_t rows,
                        const std::function<Tensor(int64_t rows)>& forward);

// The plain or data-parallel plan: every parameter of `model` on this rank, its gradient
// where it is trained, the optimizer's buffers, and with `ddp` its buckets.
MemoryPlan plan_replicated(const nn::Module& model, const optim::Optimizer& optimizer, size_t activations,
                           const DistributedDataParallel* ddp = nullptr);

// The FSDP plan: the shards, their gradients and optimizer state, and the units gathered at
// once (FSDPOptions' reshard_after_forward and prefetch decide how many).
MemoryPlan plan_sharded(const FullyShardedDataParallel& fsdp, const optim::Optimizer& optimizer,
                        size_t activations);

// A pipeline rank's plan: its stages' parameters (their shards, when sharded), gradients and
// optimizer state, the most a sharded stage gathers with the full gradients its stages keep
// over the micro-batches, and `microbatch_activations` (what one
// micro-batch through this rank's stages holds) times the most micro-batches the schedule
// has this rank hold at once.
MemoryPlan plan_pipeline(const pipeline::Pipeline& pipe, const optim::Optimizer& optimizer,
                         size_t microbatch_activations);

}  // namespace loom::dist
