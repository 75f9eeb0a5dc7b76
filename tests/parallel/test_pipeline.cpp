// Pipelines of GPT stages on forked CPU ranks over Gloo, against one process training the
// whole model on the whole batch: every schedule on 2, 3 and 4 stages, and a 2 x 2 mesh of
// pipelines and data-parallel replicas, give the same losses and weights after 10 AdamW steps
// (relative 1e-5, in f64), with the tied token embedding kept equal across its two stages.
// Also: a shape disagreement between stages names both; a stage that dies ends the others
// with the stage and the micro-batch named, and one that hangs within the timeout; 1F1B holds
// less memory than GPipe.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <map>
#include <optional>
#include <random>

#include "engine/ops.h"
#include "engine/autograd.h"
#include "layers/linear.h"
#include "layers/models/gpt.h"
#include "layers/optim/adam.h"
#include "layers/optim/clip.h"
#include "parallel/device_mesh.h"
#include "parallel/gpt_pipeline.h"
#include "ranks.h"
#include "token_batches.h"

namespace loom::dist::pipeline {
namespace {

using namespace std::chrono_literals;
using testing::require;
using testing::require_error;
using testing::run_ranks;

nn::GPTConfig small_config() {
  return {.vocab_size = 32, .context = 8, .layers = 8, .heads = 2, .width = 8};
}

// Token ids and next-token targets (rows, T), the same on every rank for a seed.
std::pair<Tensor, Tensor> batch(int64_t rows, int64_t T, int step) {
  return testing::token_batch(rows, T, 32, uint32_t(1234 + step));
}

double relative(const Tensor& a, const Tensor& b) {
  Tensor d = sub(a, b);
  double num = std::sqrt(sum(mul(d, d)).item()), den = std::sqrt(sum(mul(b, b)).item());
  return num / std::max(den, 1e-30);
}

struct Reference {
  std::vector<double> losses;
  std::map<std::string, Tensor> weights;  // after the last step
  double clip = 0;            // when > 0, each step's gradients clipped to this global norm
  std::vector<double> norms;  // the norm before each clip
};

constexpr int kSteps = 10;
const nn::GPTConfig kConfig = small_config();
constexpr int64_t kT = 8;

// One process, the whole model, the whole batch; with `clip`, gradients clipped by global norm.
Reference train_alone(int64_t rows, double clip = 0) {
  manual_seed(7);
  nn::GPT gpt(kConfig);
  gpt.to(DType::f64);
  optim::AdamW opt(gpt.parameters(), {.lr = 1e-2});
  Reference ref;
  ref.clip = clip;
  for (int step = 0; step < kSteps; ++step) {
    auto [ids, targets] = batch(rows, kT, step);
    opt.zero_grad();
    Tensor loss = gpt.loss(ids, targets);
    loss.backward();
    if (clip > 0) ref.norms.push_back(optim::clip_grad_norm_(gpt.parameters(), clip).item());
    opt.step();
    ref.losses.push_back(loss.item());
  }
  for (auto& [name, p] : gpt.named_parameters()) ref.weights[name] = p;
  ref.weights["lm_head.weight"] = gpt.lm_head;
  return ref;
}

// Builds this rank's stages, sets them to the reference's initial weights, trains kSteps on
// `rows_here` rows of each batch starting at `row0`, and compares with `ref`.
// With `shard`, each stage is sharded over `dp` by FSDP instead of replicated (over
// `shard_group` when `shard` has a replicate_group: HSDP). The reference's clipping, if any,
// is done by Pipeline::clip_grad_norm, whose norm must be the reference's.
void train_pipeline(std::shared_ptr<ProcessGroup> pp, std::shared_ptr<ProcessGroup> dp, ScheduleKind kind,
                    int microbatches, int64_t rows, int64_t row0, int64_t rows_here, const Reference& ref,
                    std::optional<FSDPOptions> shard = std::nullopt,
                    std::optional<Transfers> transfers = std::nullopt,
                    std::shared_ptr<ProcessGroup> shard_group = nullptr) {
  PipelineOptions options{.schedule = kind, .microbatches = microbatches,
                          .stages_per_rank = kind == ScheduleKind::interleaved ? 2 : 1,
                          .activation_dtype = DType::f64, .data_parallel = dp, .shard = shard,
                          .shard_group = shard_group, .transfers = transfers};
  // The reference's starting weights, by name, set before the stages are sharded.
  manual_seed(7);
  nn::GPT start(kConfig);
  start.to(DType::f64);
  std::map<std::string, Tensor> initial;
  for (auto& [name, p] : start.named_parameters()) initial[name] = p;
  initial["lm_head.weight"] = start.lm_head;
  auto gp = make_gpt_pipeline(pp, kConfig, kT, options, {}, [&](nn::GPTStage& m) {
    m.to(DType::f64);
    NoGradGuard no_grad;
    for (auto& [name, p] : m.named_parameters()) {
      require(initial.count(name), "stage parameter ", name, " is not the model's");
      copy_(p, initial[name]);
    }
  });
  optim::AdamW opt(gp.parameters(), {.lr = 1e-2});
  const std::string what = std::string(schedule_name(kind)) + " on " + std::to_string(pp->size()) + " stages" +
                           (shard ? ", sharded" : "");
  for (int step = 0; step < kSteps; ++step) {
    auto [ids, targets] = batch(rows, kT, step);
    opt.zero_grad();
    double loss =
        gp.pipeline->step(ids.slice(0, row0, row0 + rows_here), targets.slice(0, row0, row0 + rows_here)).item();
    if (ref.clip > 0) {
      const double norm = gp.pipeline->clip_grad_norm(ref.clip), want = ref.norms[size_t(step)];
      require(std::abs(norm - want) <= 1e-5 * want, what, ": step ", step, " gradient norm ", norm,
              " but one process had ", want);
    }
    opt.step();
    require(std::abs(loss - ref.losses[size_t(step)]) <= 1e-5 * std::abs(ref.losses[size_t(step)]), what, ": step ",
            step, " loss ", loss, " but one process had ", ref.losses[size_t(step)]);
  }
  // A sharded stage reduces each unit's gradients once a step, not once a micro-batch.
  for (const Stage& s : gp.pipeline->stages())
    if (s.sharded) {
      const int64_t units = int64_t(s.sharded->unit_names().size());
      require(s.sharded->memory().reduce_scatters == kSteps * units, what, ": stage ", s.index, " reduce-scattered ",
              s.sharded->memory().reduce_scatters, " times in ", kSteps, " steps of ", units, " units");
      // ZeRO-2 keeps a unit from its forward to its backward, other micro-batches' forwards
      // between them included: one all_gather per unit and micro-batch at the most.
      if (s.sharded->options().reshard_after_forward == ReshardAfterForward::no)
        require(s.sharded->memory().gathers <= kSteps * microbatches * units, what, ": ZeRO-2 stage ", s.index,
                " gathered ", s.sharded->memory().gathers, " times in ", kSteps, " steps of ", microbatches,
                " micro-batches and ", units, " units");
    }
  for (const Stage& s : gp.pipeline->stages())
    for (auto& [name, p] : s.sharded ? s.sharded->full_state_dict() : s.module->named_parameters()) {
      if (!ref.weights.count(name)) continue;  // a buffer
      double r = relative(p, ref.weights.at(name));
      require(r <= 1e-5, what, ": ", name, " differs from one process's by ", r, " (relative)");
    }
}

TEST(Pipeline, EverySchedulesTrainsLikeOneProcess) {
  for (auto kind : {ScheduleKind::gpipe, ScheduleKind::one_f_one_b, ScheduleKind::interleaved,
                    ScheduleKind::zero_bubble_h1})
    for (int p : {2, 3, 4}) {
      const int m = 2 * p;        // a multiple of p, as the interleaved schedule needs
      const int64_t rows = 2 * m;  // two rows a micro-batch
      const Reference ref = train_alone(rows);
      SCOPED_TRACE(std::string(schedule_name(kind)) + " p=" + std::to_string(p));
      run_ranks(p, [&](int, std::shared_ptr<ProcessGroup> world) {
        train_pipeline(world, nullptr, kind, m, rows, 0, rows, ref);
      });
    }
}

// The paired placement of sends, the one NCCL groups run (every send waited for with its
// batch), on Gloo ranks: the interleaved schedule's ticks included.
TEST(Pipeline, ThePairedPlacementTrainsLikeOneProcess) {
  for (auto kind : {ScheduleKind::one_f_one_b, ScheduleKind::interleaved, ScheduleKind::zero_bubble_h1})
    for (int p : {2, 4}) {
      const int m = 2 * p;
      const int64_t rows = 2 * m;
      const Reference ref = train_alone(rows);
      SCOPED_TRACE(std::string(schedule_name(kind)) + " p=" + std::to_string(p) + ", paired");
      run_ranks(p, [&](int, std::shared_ptr<ProcessGroup> world) {
        train_pipeline(world, nullptr, kind, m, rows, 0, rows, ref, std::nullopt, Transfers::paired);
      });
    }
}

TEST(Pipeline, OneStageIsOneProcess) {
  const Reference ref = train_alone(8);
  run_ranks(1, [&](int, std::shared_ptr<ProcessGroup> world) {
    train_pipeline(world, nullptr, ScheduleKind::one_f_one_b, 4, 8, 0, 8, ref);
  });
}

TEST(Pipeline, PipelinesTimesDataParallelTrainLikeOneProcess) {
  for (auto kind : {ScheduleKind::one_f_one_b, ScheduleKind::zero_bubble_h1}) {
    const int64_t rows = 16;
    const Reference ref = train_alone(rows);
    run_ranks(4, [&](int, std::shared_ptr<ProcessGroup> world) {
      DeviceMesh mesh(world, {2, 2}, {"pp", "dp"});
      const int d = mesh.coordinate("dp");
      train_pipeline(mesh.group("pp"), mesh.group("dp"), kind, 4, rows, d * rows / 2, rows / 2, ref);
    });
  }
}

// FSDP inside the stages: the 2 x 2 mesh again, each stage sharded over its data-parallel
// pair (ZeRO-3 and ZeRO-2), and 2 x 3 with uneven shards, interleaved; then HSDP inside the
// stages, 2 x (2 replicas x 2 shards) on 8 ranks. Gradients clipped by the global norm
// (summed over the shards, not over HSDP's replicas) in the 2 x 3 and HSDP cases.
TEST(Pipeline, PipelinesOfShardedStagesTrainLikeOneProcess) {
  struct Case {
    ScheduleKind kind;
    int pp, replicas, shards;
    ReshardAfterForward reshard;
    double clip;
  };
  for (const Case c : {Case{ScheduleKind::one_f_one_b, 2, 1, 2, ReshardAfterForward::yes, 0},
                       Case{ScheduleKind::gpipe, 2, 1, 2, ReshardAfterForward::no, 0},
                       Case{ScheduleKind::interleaved, 2, 1, 3, ReshardAfterForward::yes, 0.5},
                       Case{ScheduleKind::one_f_one_b, 2, 2, 2, ReshardAfterForward::yes, 0.5}}) {
    const int dp = c.replicas * c.shards;
    const int64_t rows = 4 * 2 * dp;  // 4 micro-batches of 2 rows on each pipeline
    const Reference ref = train_alone(rows, c.clip);
    SCOPED_TRACE(std::string(schedule_name(c.kind)) + " pp=" + std::to_string(c.pp) + " replicas=" +
                 std::to_string(c.replicas) + " shards=" + std::to_string(c.shards));
    run_ranks(c.pp * dp, [&](int, std::shared_ptr<ProcessGroup> world) {
      DeviceMesh mesh(world, {c.pp, c.replicas, c.shards}, {"pp", "replicate", "shard"});
      auto all = mesh.flatten({"replicate", "shard"}, "dp");
      const int d = mesh.coordinate("dp");
      FSDPOptions shard;
      shard.reshard_after_forward = c.reshard;
      if (c.replicas > 1) shard.replicate_group = mesh.group("replicate");
      train_pipeline(mesh.group("pp"), all, c.kind, 4, rows, d * rows / dp, rows / dp, ref, shard, std::nullopt,
                     c.replicas > 1 ? mesh.group("shard") : nullptr);
    });
  }
}

TEST(Pipeline, ShardedStagesRefuseTheSplitBackwardOfZb1) {
  run_ranks(2, [&](int, std::shared_ptr<ProcessGroup> world) {
    DeviceMesh mesh(world, {1, 2}, {"pp", "dp"});
    PipelineOptions options{.schedule = ScheduleKind::zero_bubble_h1, .microbatches = 2,
                            .data_parallel = mesh.group("dp"), .shard = FSDPOptions{}};
    require_error([&] { make_gpt_pipeline(mesh.group("pp"), kConfig, kT, options); },
                  {"is sharded (FSDP), and the zb1 schedule splits backward", "use 1f1b, gpipe or interleaved"});
  });
}

// Two stages of one Linear each, with declared shapes that may disagree.
std::vector<Stage> linear_stages(int rank, int last, int64_t declared_in, std::function<void(int)> on_forward = nullptr) {
  auto lin = std::make_shared<nn::Linear>(4, 4);
  Stage s;
  s.index = rank;
  s.module = lin;
  s.input_shape = [declared_in](int64_t rows) { return Shape{rows, declared_in}; };
  s.output_shape = [](int64_t rows) { return Shape{rows, 4}; };
  s.forward = [lin, on_forward, rank, last](const Tensor& x, const Tensor&) {
    if (on_forward) on_forward(rank);
    Tensor y = lin->forward(x);
    return rank == last ? sum(mul(y, y)) : y;
  };
  return {s};
}

// A stage's output need not be row-major (a transposed view, a channels-last activation):
// the send packs it, and the step's loss and gradients are those of a row-major output.
TEST(Pipeline, AStageOutputThatIsNotRowMajorIsSentPacked) {
  run_ranks(2, [](int rank, std::shared_ptr<ProcessGroup> world) {
    std::vector<float> losses, grads;
    for (bool transposed : {false, true}) {
      manual_seed(3);
      std::vector<Stage> stages = linear_stages(rank, 1, 4);
      if (transposed && rank == 0) {
        auto row_major = stages[0].forward;
        stages[0].forward = [row_major](const Tensor& x, const Tensor& t) {
          Tensor y = row_major(x, t).t().contiguous().t();  // (rows, 4), column-major in memory
          EXPECT_FALSE(y.is_contiguous());
          return y;
        };
      }
      Pipeline pipe(world, stages, {.schedule = ScheduleKind::gpipe, .microbatches = 2});
      manual_seed(4);
      losses.push_back(pipe.step(randn({4, 4}), zeros({4})).item());
      grads.push_back(stages[0].module->parameters()[0].grad().to_vector<float>()[0]);
    }
    EXPECT_EQ(losses[1], losses[0]);
    EXPECT_EQ(grads[1], grads[0]);
  });
}

TEST(Pipeline, StagesThatDisagreeOnAShapeAreBothNamed) {
  run_ranks(2, [](int rank, std::shared_ptr<ProcessGroup> world) {
    Pipeline pipe(world, linear_stages(rank, 1, rank == 1 ? 5 : 4), {.schedule = ScheduleKind::gpipe, .microbatches = 2});
    require_error([&] { pipe.step(randn({4, 4}), zeros({4})); },
                  {"stage 0 (rank 0) sends activations of shape (2, 4)", "stage 1 (rank 1) expects (2, 5)"});
  });
}

TEST(Pipeline, AStageThatDiesEndsTheOthersNamingIt) {
  // Three stages; the middle one exits during its third forward. The others must stop within
  // the timeout (5 s) and 5 s more, naming the stage they were waiting on.
  auto codes = testing::run_ranks_codes(3, [](int rank, std::shared_ptr<ProcessGroup> world) {
    int forwards = 0;
    Pipeline pipe(world, linear_stages(rank, 2, 4, [&](int r) {
                    if (r == 1 && ++forwards == 3) ::_exit(3);
                  }),
                  {.schedule = ScheduleKind::one_f_one_b, .microbatches = 4});
    auto start = std::chrono::steady_clock::now();
    std::string msg = require_error([&] { pipe.step(randn({8, 4}), zeros({8})); },
                                    {"pipeline stage " + std::to_string(rank), "micro-batch", "stage 1 (rank 1)"});
    double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    require(waited < 10.0, "rank ", rank, " took ", waited, " s to notice: ", msg);
    std::fprintf(stderr, "rank %d noticed in %.2f s: %s\n", rank, waited, msg.c_str());
  }, {.timeout = 5s}, 60);
  EXPECT_EQ(codes, (std::vector<int>{0, 3, 0}));
}

TEST(Pipeline, AStageThatHangsEndsTheOthersWithinTheTimeout) {
  // The middle stage stops answering during its second forward (it sleeps past the others'
  // 3 s timeout); the others must stop by the timeout and 5 s more, naming it.
  auto codes = testing::run_ranks_codes(3, [](int rank, std::shared_ptr<ProcessGroup> world) {
    int forwards = 0;
    Pipeline pipe(world, linear_stages(rank, 2, 4, [&](int r) {
                    if (r == 1 && ++forwards == 2) {
                      ::sleep(20);
                      ::_exit(0);
                    }
                  }),
                  {.schedule = ScheduleKind::gpipe, .microbatches = 4});
    auto start = std::chrono::steady_clock::now();
    std::string msg = require_error([&] { pipe.step(randn({8, 4}), zeros({8})); },
                                    {"pipeline stage " + std::to_string(rank), "micro-batch", "stage 1 (rank 1)"});
    double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    require(waited < 3.0 + 5.0, "rank ", rank, " took ", waited, " s to give up: ", msg);
    std::fprintf(stderr, "rank %d gave up after %.2f s: %s\n", rank, waited, msg.c_str());
    ::_exit(0);  // without waiting for the sleeping stage at teardown
  }, {.timeout = 3s}, 60);
  EXPECT_EQ(codes[0], 0);
  EXPECT_EQ(codes[2], 0);
}

TEST(Pipeline, OneFOneBHoldsLessThanGPipe) {
  // Rank 0 of two, 8 micro-batches: GPipe holds all eight micro-batches' activations at the
  // turn, 1F1B two.
  run_ranks(2, [](int rank, std::shared_ptr<ProcessGroup> world) {
    std::vector<int64_t> peak;
    for (auto kind : {ScheduleKind::gpipe, ScheduleKind::one_f_one_b}) {
      PipelineOptions options{.schedule = kind, .microbatches = 8};
      auto gp = make_gpt_pipeline(world, {.vocab_size = 32, .context = 64, .layers = 2, .heads = 2, .width = 64}, 64,
                                  options);
      auto [ids, targets] = batch(16, 64, 0);
      gp.pipeline->step(ids, targets);  // the first step also makes the gradients
      gp.pipeline->step(ids, targets);
      peak.push_back(gp.pipeline->last_step_peak_bytes());
    }
    if (rank == 0) std::fprintf(stderr, "rank 0 peak bytes: gpipe %lld, 1f1b %lld\n", (long long)peak[0], (long long)peak[1]);
    require(rank != 0 || peak[1] * 2 < peak[0], "rank 0: 1F1B held ", peak[1], " bytes at most, GPipe ", peak[0]);
  });
}

}  // namespace
}  // namespace loom::dist::pipeline
