// Pipeline parallelism: a model cut into stages, one process (one GPU) per stage, each
// micro-batch flowing through the stages forward and back. When a model does not fit on one
// GPU, or its layers are better spread than replicated, its layers are split by index (for a
// GPT: the embeddings and the first blocks on stage 0, ..., the last blocks, ln_f, the output
// layer and the loss on the last stage) and each rank builds only its own stage. What the
// ranks exchange is small: each stage sends its output activation to the next and receives
// its output's gradient back. What it costs is idle time, the bubble: stage 3 cannot start
// before stages 0-2 have passed it the first micro-batch. Cutting the batch into m
// micro-batches shrinks the bubble; the schedule decides in which order each rank runs its
// forwards (F) and backwards (B), and so how long the bubble is and how many micro-batches'
// activations a rank holds at once.
//
// The schedules, drawn for p = 4 ranks and m = 4 micro-batches, F and B one slot each (B
// really costs about 2 F), time to the right, micro-batch numbers in the slots:
//
//   GPipe: every forward, then every backward.
//     rank 0  F0 F1 F2 F3 .  .  .  .  .  .  B0 B1 B2 B3
//     rank 1  .  F0 F1 F2 F3 .  .  .  .  B0 B1 B2 B3 .
//     rank 2  .  .  F0 F1 F2 F3 .  .  B0 B1 B2 B3 .  .
//     rank 3  .  .  .  F0 F1 F2 F3 B0 B1 B2 B3 .  .  .
//   Bubble (p - 1) / (m + p - 1) of the time; every rank holds all m micro-batches'
//   activations at the turn: memory grows with m.
//
//   1F1B: rank r runs p - 1 - r forwards to fill the pipe, then alternates one forward and one
//   backward, then drains the backwards left.
//     rank 0  F0 F1 F2 F3 .  .  B0 .  B1 .  B2 .  B3
//     rank 1  .  F0 F1 F2 .  B0 F3 B1 .  B2 .  B3 .
//     rank 2  .  .  F0 F1 B0 F2 B1 F3 B2 .  B3 .  .
//     rank 3  .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 .  .
//   The same bubble as GPipe, but rank r never holds more than p - r micro-batches: memory no
//   longer grows with m, so m can grow and the bubble shrink.
//
//   Interleaved 1F1B (Megatron-LM): each rank holds v stages, not one (rank r holds stages r,
//   r + p, ...), so a micro-batch crosses the ranks v times, each time doing 1/v of the work.
//   The fill and drain are made of shorter slots: bubble (p - 1) / (v m + p - 1), for v times
//   the transfers. Micro-batches go through in groups of p (m must be a multiple of p).
//
//   ZB-H1 (zero bubble, Qi et al. 2023): backward split into I, the gradient of the stage's
//   input (what the rank before waits for), and W, the weights' gradients (what nobody waits
//   for). I is sent on at once; W fills the slots that were bubbles in 1F1B:
//     rank 0  F0 F1 F2 F3 .  .  I0 W0 I1 W1 I2 W2 I3 W3
//     rank 3  .  .  .  F0 I0 F1 I1 F2 I2 F3 I3 W0 W1 W2 W3
//   with the same limit of p - r micro-batches in flight as 1F1B and, at F = I = W, a third
//   of its bubble. Its memory is 1F1B's plus what each W left waiting keeps for its products:
//   the output gradients of the weight products, and for a GPT block's MLP the gradient
//   through its GELU (four times the width), which I computes anyway and W reuses. Loom's
//   builder orders the actions by simulating unit costs with priorities F (within those
//   limits), then I, then W (parallel/pipeline_schedule.cpp).
//
// How the code follows the drawings. parallel/pipeline_schedule.h turns each drawing into a
// table: per rank, the compute actions in order, and between them the transfers (receive an
// activation before a forward that needs it, send it after; the same for gradients), those
// between two computes posted together with batch_isend_irecv. The table is checked before
// the first step: every send meets its receive, in the same order on both ranks, and no
// arrangement of waits can hang. Pipeline::step() then walks its rank's row:
//
//   F  forward of (stage, micro-batch): the input is the micro-batch's data on stage 0, else
//      the activation received (a leaf requiring its gradient); the last stage returns the
//      micro-batch's loss.
//   B  backward from the stage's output, seeded with the gradient received (on the last
//      stage, 1/m: the step's loss is the mean of the micro-batches'); the input's gradient is
//      what is sent back. For ZB-H1, I is engine/autograd.h's run_backward_split with the
//      input as the only gradient wanted now, and W runs what it left.
//   sends, receives: one batch_isend_irecv per batch; its receives are waited for before the
//      next compute; its sends too on NCCL, while on Gloo they finish on their own and are
//      collected at the end of the step (see "eager" and "paired" in pipeline_schedule.h).
//      Once an activation is sent, its storage is freed unless the backward saved it: the
//      stage keeps only the graph it needs. (On Gloo "sent" is known at the end of the step
//      only, so until then each sent activation stays; its graph goes at its backward.)
//
// Evaluation (Pipeline::evaluate) runs the forward half alone: each rank's forwards of its
// stages, the micro-batches in groups of p, each group through the rank's stages in order,
// with the same derived transfers, as a schedule of its own (build_forward_schedule) checked
// by the same checker, so neither placement of sends can hang. No gradient is wanted
// (NoGradGuard): a stage's input and output go as soon as the next stage took them or the
// send finished, so a rank holds at most the activations in flight. The last stage's losses, each weighted by its
// micro-batch's rows, make the batch's mean loss, shared with the pipeline as step() shares it.
//
// Then, once per step: the gradients of parameters tied across stages (GPT's token embedding,
// used by stage 0 and by the output layer on the last stage) are summed between their holders,
// so the copies, equal at the start, stay equal; with a data-parallel group, every gradient is
// averaged over it (one all_reduce per dtype per step, not one per micro-batch: the stage's
// replicas in the other pipelines); and the caller's optimizer steps. A step on p ranks and m
// micro-batches computes the gradients of one process on the whole batch.
//
// Shapes between stages are agreed once, at the first step: every rank gathers every stage's
// declared input and output shapes, and a boundary whose two sides disagree stops all the
// ranks with both stages, their ranks and both shapes named. An activation of another shape
// is an error on its sender. A wait that fails (a stage died, or did not answer within the
// group's timeout) is rethrown with this rank's stage, the micro-batch and the action named.
//
// With tracing on (parallel/trace.h), every action is a span: forward, backward,
// backward-weight on the compute lane, send and receive on the communication lane, so the
// bubbles show in the merged timeline, and measured_bubble() gives their share of the step.
#pragma once

#include <functional>
#include <map>
#include <set>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "../layers/module.h"
#include "fsdp.h"
#include "pipeline_schedule.h"
#include "process_group.h"

namespace loom::dist::pipeline {

// One stage of the model, as this rank builds it.
struct Stage {
  int index = 0;                       // 0 .. stages - 1
  std::shared_ptr<nn::Module> module;  // its parameters
  // Stage 0 gets the micro-batch's inputs, the others the activation from the stage before.
  // The last stage returns the micro-batch's mean loss (a scalar), the others their output.
  // `targets` is the micro-batch's targets (used by the last stage).
  std::function<Tensor(const Tensor& input, const Tensor& targets)> forward;
  // The activation shapes for a micro-batch of `rows` rows: what the stage takes (not asked of
  // stage 0) and gives (not asked of the last stage).
  std::function<Shape(int64_t rows)> input_shape, output_shape;
  // Set when the module is sharded over the data-parallel group (PipelineOptions::shard):
  // `forward` runs inside it, and the executor tells it which backward reduces.
  std::shared_ptr<FullyShardedDataParallel> sharded;
};

struct PipelineOptions {
  ScheduleKind schedule = ScheduleKind::one_f_one_b;
  int microbatches = 4;
  int stages_per_rank = 1;  // virtual stages per rank: 2 or more for the interleaved schedule
  Device device = Device::cpu();
  DType activation_dtype = DType::f32;
  // When set, the replicas of this rank's stages in the other pipelines: gradients are
  // averaged over it once per step.
  std::shared_ptr<ProcessGroup> data_parallel;
  // When set (with data_parallel), each stage is sharded over data_parallel by FSDP
  // (parallel/fsdp.h) instead of replicated: a stage's units are gathered for each
  // micro-batch's forward and backward, the full gradients are kept over the step's
  // micro-batches and reduce-scattered by the stage's last backward, once per step, and the
  // optimizer steps on the shards. Not with the zb1 schedule, whose split backward FSDP does
  // not follow.
  std::optional<FSDPOptions> shard;
  // HSDP inside stages (fsdp.h, step 8): with shard->replicate_group set, each stage is
  // sharded over shard_group and replicated over shard->replicate_group, and data_parallel
  // holds both (every replica of the stage: DeviceMesh::flatten({"replicate", "shard"})), over
  // which the loss is averaged. Unset, a stage is sharded over data_parallel.
  std::shared_ptr<ProcessGroup> shard_group;
  // The placement of sends (pipeline_schedule.h) on a Gloo group: unset, eager; paired runs
  // the placement an NCCL group always runs, so CPU ranks can prove it.
  std::optional<Transfers> transfers;
};

// The block ranges of a model of `layers` blocks cut into `stages` stages: `cuts`, stages + 1
// increasing indices from 0 to layers (stage s holds blocks [cuts[s], cuts[s + 1])), checked,
// or when empty an even cut (the first stages one block more where it does not divide).
// Throws naming the cuts, the blocks and the stages.
std::vector<int64_t> stage_cuts(std::vector<int64_t> cuts, int64_t layers, int stages);

class Pipeline {
 public:
  // `group`: the ranks of one pipeline, stage s on group rank s % size. `stages`: this rank's,
  // as schedule().stages_of(rank) lists them. Builds and checks the schedule.
  Pipeline(std::shared_ptr<ProcessGroup> group, std::vector<Stage> stages, PipelineOptions options);
  ~Pipeline();
  Pipeline(const Pipeline&) = delete;
  Pipeline& operator=(const Pipeline&) = delete;

  // A parameter that stage 0 and the last stage both hold (each rank passes its copies:
  // undefined where it holds none, the same tensor twice where it holds both). The last
  // stage's copy is set to stage 0's now, and their gradients are summed every step. Every
  // rank of the group calls it.
  void tie(const Tensor& on_first_stage, const Tensor& on_last_stage);

  // One training step's forward and backward over `inputs` and `targets` (rows along dim 0,
  // cut into microbatches equal parts; each rank passes the same batch, the ranks that do not
  // use one may pass it all the same). Gradients are added into the stages' parameters (the
  // caller zeroes them before and steps after). Returns the batch's mean loss, on every rank,
  // as a one-element f32 tensor on the pipeline's device (reading it waits for the step).
  Tensor step(const Tensor& inputs, const Tensor& targets);

  // The batch's mean loss with no gradient: `inputs` and `targets` as for step(), cut into
  // min(microbatches, rows) micro-batches whose sizes differ by one row at most, each one's
  // loss weighted by its rows (a loss that is a mean over rows, as GPT's, comes out as one
  // process computes it on the whole batch). Returned on every rank of the group, as step()
  // returns it, but not averaged over options.data_parallel: each pipeline evaluates the
  // batch it is given. Parameters and gradients are left as they are.
  Tensor evaluate(const Tensor& inputs, const Tensor& targets);

  // The global gradient norm over every stage of the pipeline (tied parameters counted once),
  // then every gradient scaled so the norm is at most max_norm, as nn::clip_grad_norm_ does
  // for one process. Every rank of the group calls it. Returns the norm before clipping.
  double clip_grad_norm(double max_norm);

  const Schedule& schedule() const { return schedule_; }
  // The schedule's check at equal costs (check_schedule's defaults): its theoretical bubble,
  // and the most micro-batches each rank holds at once.
  const Simulation& simulation() const { return simulation_; }
  const std::vector<Stage>& stages() const { return stages_; }
  int rank() const { return group_->rank(); }

  // The last step's bubble: the share of the pipeline's rank-time (every rank, from the step's
  // start to the last rank's end) spent outside forward, backward and backward-weight spans,
  // as the formulas count it (every rank calls it). Needs tracing on (parallel/trace.h)
  // during the step; throws otherwise.
  double measured_bubble();
  // Bytes of memory in use on the pipeline's device at the most, during the last step, above
  // what was in use when it started: the activations and gradients the schedule held.
  int64_t last_step_peak_bytes() const { return peak_bytes_; }

 private:
  struct MicrobatchState;
  Stage& local_stage(int stage);
  void agree_on_shapes(int64_t rows);
  // Walks this rank's row of `schedule` over the micro-batches given; returns the last stage's
  // losses summed (each times loss_weights[micro-batch] when given), or an undefined tensor
  // on a rank without the last stage.
  Tensor run_schedule(const Schedule& schedule, const std::vector<Tensor>& inputs, const std::vector<Tensor>& targets,
                      const std::vector<double>& loss_weights);
  void run_compute(const Action& a, const std::vector<Tensor>& inputs, const std::vector<Tensor>& targets);
  void run_batch(const std::vector<Action>& batch);
  void post_receives_ahead(const std::vector<Action>& row, size_t from);
  Tensor receive_buffer(const Action& a);
  void wait_for(const WorkPtr& work, const Action& a);
  void release_if_unshared(const Tensor& sent, const Action& a);
  // Waits for the eager sends that are done (all of them when `all`), freeing what they sent.
  void finish_sends(bool all);
  void sum_tied_gradients();
  void average_over_data_parallel();
  std::string where(const Action& a) const;
  std::string peer_text(const Action& a) const;  // "stage 2 (rank 2)": the other end of a transfer

  std::shared_ptr<ProcessGroup> group_;
  std::vector<Stage> stages_;
  PipelineOptions options_;
  Schedule schedule_;
  Simulation simulation_;
  int64_t agreed_rows_ = -1;
  // What run_schedule walks: the schedule (training's, or an evaluation's) and the rows of
  // each of its micro-batches.
  const Schedule* running_ = nullptr;
  std::vector<int64_t> running_rows_;
  std::map<int, Schedule> evaluation_schedules_;  // by micro-batch count, built on first use
  Tensor tied_first_, tied_last_;
  bool tied_ = false;
  std::vector<std::unique_ptr<MicrobatchState>> state_;  // per (local stage, micro-batch)
  struct PendingSend {
    WorkPtr work;
    Tensor tensor;
    Action action;
  };
  std::vector<PendingSend> pending_sends_;
  // Receives posted before their batch (Gloo: see run_schedule), by the receiving action.
  struct EarlyReceive {
    Action action;
    Tensor tensor;
    WorkPtr work;
  };
  std::vector<EarlyReceive> early_receives_;
  std::vector<EarlyReceive>::iterator find_early_receive(const Action& a);
  bool receive_ahead_ = false;
  // Per local stage (as stages_ lists them): the micro-batch of its last backward in the
  // schedule, the one that reduces a sharded stage's gradients.
  std::vector<int> last_backward_;
  int64_t peak_bytes_ = 0;
  int64_t step_start_ns_ = 0, step_end_ns_ = 0;
};

// A model built as pipeline stages on this rank: its stage modules, in stage order, and the
// Pipeline over them (what make_gpt_pipeline and make_guide_pipeline return).
template <class M>
struct ModelPipeline {
  std::vector<std::shared_ptr<M>> modules;
  std::unique_ptr<Pipeline> pipeline;

  // Every parameter of this rank's stages, each once (a tied one may be held twice): what its
  // optimizer steps. A sharded stage's are its shards.
  TensorList parameters() const {
    TensorList out;
    std::set<const void*> seen;
    for (const Stage& s : pipeline->stages())
      for (const Tensor& p : s.sharded ? s.sharded->parameters() : s.module->parameters())
        if (seen.insert(p.impl()).second) out.push_back(p);
    return out;
  }
};

// FSDP's units for one stage module (PipelineOptions::shard): lists of its submodules, as
// FSDPOptions::units takes them. Empty: the options' own units or size policy.
template <class M>
using StageUnits = std::function<std::vector<std::vector<std::shared_ptr<nn::Module>>>(M& stage)>;

// This rank's stages of a model of `layers` blocks whose stages pass the residual stream
// (rows, T, C) on: `make(stage, first_block, end_block, last)` builds one stage's module, which
// offers forward(x) and, on the last stage, loss(x, targets). The blocks are cut by stage_cuts;
// the modules are moved to options.device.
template <class M, class Make>
ModelPipeline<M> make_residual_pipeline(std::shared_ptr<ProcessGroup> group, int64_t layers, int64_t T, int64_t C,
                                        PipelineOptions options, std::vector<int64_t> cuts, Make make,
                                        StageUnits<M> units = {}) {
  LOOM_CHECK(group != nullptr, "pipeline: no process group");
  LOOM_CHECK(T >= 1, "pipeline: ", T, " tokens a sequence; expected 1 or more");
  const int v = options.schedule == ScheduleKind::interleaved ? options.stages_per_rank : 1;
  const int stages = group->size() * v;
  cuts = stage_cuts(std::move(cuts), layers, stages);
  ModelPipeline<M> out;
  std::vector<Stage> built;
  for (int s = group->rank(); s < stages; s += group->size()) {
    const bool last = s == stages - 1;
    std::shared_ptr<M> module = make(s, cuts[size_t(s)], cuts[size_t(s) + 1], last);
    module->to(options.device);
    out.modules.push_back(module);
    Stage st;
    st.index = s;
    st.module = module;
    if (last)
      st.forward = [module](const Tensor& x, const Tensor& targets) { return module->loss(x, targets); };
    else
      st.forward = [module](const Tensor& x, const Tensor&) { return module->forward(x); };
    if (options.shard) {
      LOOM_CHECK(options.data_parallel != nullptr, "pipeline: PipelineOptions::shard shards each stage over the "
                 "data-parallel group, and options.data_parallel is not set");
      const auto& replicas = options.shard->replicate_group;
      LOOM_CHECK(!replicas || options.shard_group, "pipeline: PipelineOptions::shard has a replicate_group (HSDP), "
                 "and options.shard_group, the group each stage is sharded over, is not set");
      const std::shared_ptr<ProcessGroup> over = options.shard_group ? options.shard_group : options.data_parallel;
      LOOM_CHECK(over->size() * (replicas ? replicas->size() : 1) == options.data_parallel->size(), "pipeline: the ",
                 "stages are sharded over ", over->size(), " ranks", replicas ? " times " : "",
                 replicas ? std::to_string(replicas->size()) + " replicas" : std::string(), ", but data_parallel has ",
                 options.data_parallel->size(), " ranks; it must hold every replica of a stage");
      FSDPOptions fsdp = *options.shard;
      if (units) fsdp.units = units(*module);
      st.sharded = fully_shard(module, over, fsdp);
      st.forward = [run = st.forward, sharded = st.sharded](const Tensor& x, const Tensor& targets) {
        return sharded->call([&] { return run(x, targets); });
      };
    }
    st.input_shape = st.output_shape = [T, C](int64_t rows) { return Shape{rows, T, C}; };
    built.push_back(std::move(st));
  }
  out.pipeline = std::make_unique<Pipeline>(group, std::move(built), options);
  return out;
}

}  // namespace loom::dist::pipeline
