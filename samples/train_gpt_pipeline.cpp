// train_gpt --pp N: the model cut into stages over a pp x dp mesh of ranks
// (parallel/pipeline.h), each rank building and training only its own stages; the plain, DDP
// and FSDP runs and the flags are in train_gpt.cpp.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>

#include "engine/allocator.h"
#include "engine/autocast.h"
#include "engine/autograd.h"
#include "engine/ops.h"
#include "layers/layers.h"
#include "parallel/device_mesh.h"
#include "parallel/gpt_pipeline.h"
#include "parallel/memory_plan.h"
#include "parallel/pipeline_checkpoint.h"
#include "parallel/pipeline_gather.h"
#include "parallel/trace.h"
#include "samples/common/metrics.h"
#include "samples/common/program.h"
#include "samples/common/progress.h"
#include "samples/train_gpt.h"

namespace loom::train_gpt {

namespace {

// A pipelined run's: the same, and the pipeline's shape.
std::map<std::string, std::string> pipeline_entries(const Options& o, int world_size, int stages, int64_t train_windows,
                                                    int64_t epoch, int64_t batch, int64_t step) {
  std::map<std::string, std::string> entries = saved_entries(o, world_size, train_windows, epoch, batch, step);
  entries.emplace("pp", std::to_string(o.pp));
  entries.emplace("schedule", o.schedule);
  entries.emplace("stages", std::to_string(stages));
  return entries;
}

}  // namespace

std::map<std::string, std::string> with_pipelines(const samples::Flags& flags, const std::string& path,
                                                  std::map<std::string, std::string> saved) {
  const int64_t ranks = samples::checkpoint_integer(path, saved, "world_size", "train_gpt");
  const int64_t pp = samples::checkpoint_integer(path, saved, "pp", "train_gpt");
  if (pp < 1 || ranks % pp != 0)
    flags.fail("--resume " + path + " says it was saved by " + std::to_string(ranks) + " ranks at --pp " +
               std::to_string(pp) + "; expected a whole number of pipelines");
  saved["pipelines"] = std::to_string(ranks / pp);
  return saved;
}

// --pp N: the model cut into stages over a pp x dp mesh of ranks (parallel/pipeline.h);
// each rank builds only its stages, trains with the schedule chosen, and the loss and
// throughput are reported per epoch, with the validation loss over the plain run's batches
// (Pipeline::evaluate, forward only: every pipeline evaluates them all, as every rank of a
// data-parallel run does); for generation the first pipeline's ranks send their stages to
// rank 0 (parallel/pipeline_gather.h), which builds the whole GPT and generates from it. --save
// writes a pipeline checkpoint after every epoch
// (parallel/pipeline_checkpoint.h: a folder, one file per pipeline rank, or per rank of a
// stage sharded with --fsdp) and --resume
// continues one exactly.
int train_pipelined(Options& o, dist::DistContext& ctx, const nn::GPTConfig& config, const samples::Flags& flags,
                    data::DataLoader& train_loader, data::DataLoader& val_loader, int64_t steps_per_epoch,
                    int64_t total_steps, int64_t train_windows) {
  using namespace dist::pipeline;
  const bool main_rank = ctx.is_main();
  // With --hsdp R, a stage's --dp ranks are R replicas of dp / R shards each, "dp" naming them
  // all (the loss is averaged over it, and the data cut by it).
  const bool hybrid = o.fsdp && o.hsdp > 1;
  dist::DeviceMesh mesh = hybrid ? dist::DeviceMesh(ctx.group, {int(o.pp), int(o.hsdp), int(o.dp / o.hsdp)},
                                                    {"pp", "replicate", "shard"})
                                 : dist::DeviceMesh(ctx.group, {int(o.pp), int(o.dp)}, {"pp", "dp"});
  if (hybrid) mesh.flatten({"replicate", "shard"}, "dp");
  PipelineOptions options;
  options.schedule = parse_schedule(o.schedule);
  options.microbatches = int(o.microbatches);
  options.stages_per_rank = options.schedule == ScheduleKind::interleaved ? int(o.stages_per_rank) : 1;
  options.device = ctx.device;
  options.data_parallel = o.dp > 1 || o.fsdp ? mesh.group("dp") : nullptr;
  if (o.fsdp) {
    // Each stage sharded over its data-parallel group: a unit per block (make_gpt_pipeline),
    // or by size with --min-params.
    dist::FSDPOptions shard;
    shard.reshard_after_forward =
        o.reshard_after_forward == "yes" ? dist::ReshardAfterForward::yes : dist::ReshardAfterForward::no;
    shard.min_num_params = o.min_params;
    if (hybrid) {
      shard.replicate_group = mesh.group("replicate");
      options.shard_group = mesh.group("shard");
    }
    options.shard = shard;
  }
  const int stages = int(o.pp) * options.stages_per_rank;
  if (config.layers < stages)
    flags.fail("--pp " + std::to_string(o.pp) + (options.stages_per_rank > 1 ? " x --stages-per-rank " +
               std::to_string(options.stages_per_rank) : std::string()) + " asks for " + std::to_string(stages) +
               " stages, but the " + o.config + " config has " + std::to_string(config.layers) + " blocks");
  // The same seed on a stage's replicas, so they start equal.
  manual_seed(uint64_t(o.seed) * 1000 + uint64_t(mesh.coordinate("pp")));
  // What one micro-batch holds in this rank's stages, from a probe step of each before any
  // is sharded (parallel/memory_plan.h).
  const std::optional<DType> autocast = o.precision == "bf16" ? std::optional<DType>(DType::bf16) : std::nullopt;
  const int64_t rows = o.batch_size / o.microbatches;
  size_t microbatch_activations = 0;
  const size_t allocated_before_model = memory::stats(ctx.device).allocated;
  GPTPipeline gp = make_gpt_pipeline(mesh.group("pp"), config, o.context, options, {}, [&](nn::GPTStage& stage) {
    if (!main_rank) return;  // rank 0 prints the plan
    stage.to(ctx.device);
    stage.train();
    microbatch_activations += dist::activation_bytes(stage, ctx.device, rows, [&](int64_t r) {
      AutocastGuard cast(autocast);
      Tensor ids = mul(rand({r, o.context}, DType::f32, ctx.device), double(config.vocab_size)).to(DType::i64);
      Tensor x = stage.is_first() ? ids : randn({r, o.context, config.width}, DType::f32, ctx.device);
      return stage.is_last() ? stage.loss(x, ids) : sum(stage.forward(x).to(DType::f32));
    });
  });
  int64_t held = 0;
  for (const Tensor& p : gp.parameters()) held += p.numel();
  optim::AdamW opt(gp.parameters(), {.lr = o.lr, .beta1 = 0.9, .beta2 = 0.95, .weight_decay = o.weight_decay});
  optim::LRScheduler sched(opt, optim::cosine_annealing(std::max<int64_t>(total_steps, 1), o.lr * 0.1));
  const dist::MemoryPlan plan = dist::plan_pipeline(*gp.pipeline, opt, microbatch_activations);
  PipelineCheckpoint checkpoint{.pipeline = gp.pipeline.get(), .world = ctx.group.get(),
                                .replica = mesh.coordinate("dp"), .optimizer = &opt, .scheduler = &sched, .user = {}};
  int64_t epoch = 0, batch = 0, step = 0;
  if (!o.resume.empty()) {
    const auto user = load_pipeline_checkpoint(o.resume, checkpoint);
    epoch = samples::checkpoint_integer(o.resume, user, "epoch", "train_gpt");
    batch = samples::checkpoint_integer(o.resume, user, "batch", "train_gpt");
    step = samples::checkpoint_integer(o.resume, user, "step", "train_gpt");
    const int64_t saved_dp = std::stoll(with_pipelines(flags, o.resume, user).at("pipelines"));
    const int64_t moved = resumed_pipeline_step(saved_dp, o.dp, epoch, batch, step, steps_per_epoch, sched);
    if (main_rank && moved != step)
      std::printf("saved at --dp %lld, resumed at --dp %lld: an epoch is %lld steps here, so the run goes on from step "
                  "%lld (step %lld there)\n",
                  (long long)saved_dp, (long long)o.dp, (long long)steps_per_epoch, (long long)moved, (long long)step);
    step = moved;
    if (!o.allow_nonfinite)
      for (const Stage& stage : gp.pipeline->stages())
        samples::check_finite_parameters(stage.sharded ? stage.sharded->named_parameters()
                                                       : stage.module->named_parameters(),
                                         "--resume " + o.resume);
    if (main_rank)
      std::printf("resumed %s at epoch %lld, batch %lld (step %lld)\n", o.resume.c_str(), (long long)epoch + 1,
                  (long long)batch, (long long)step);
  }
  if (main_rank) {
    std::printf("train_gpt: GPT %s (%lld layers, width %lld) as a pipeline of %d stages on %lld x %lld ranks "
                "(pp x dp), %s schedule, %lld micro-batches of %lld, %s on %s; rank 0 holds %lld parameters\n%s",
                o.config.c_str(), (long long)config.layers, (long long)config.width, stages, (long long)o.pp,
                (long long)o.dp, o.schedule.c_str(), (long long)o.microbatches,
                (long long)(o.batch_size / o.microbatches), o.precision.c_str(), ctx.device.str().c_str(),
                (long long)held, mesh.table().c_str());
    if (hybrid)
      std::printf("HSDP inside stages: each stage's %lld data-parallel ranks are %lld replicas, each sharded over %lld\n",
                  (long long)o.dp, (long long)o.hsdp, (long long)(o.dp / o.hsdp));
    if (o.microbatches <= 8) std::printf("%s", gp.pipeline->schedule().table().c_str());
    std::printf("%s\n", plan.table().c_str());
    std::fflush(stdout);
  }
  samples::start_step_trace(o.trace, ctx, ctx.device);
  EpochLog log(o, main_rank);
  memory::reset_peak(ctx.device);
  bool plan_measured = false;
  for (; epoch < o.epochs && step < total_steps; ++epoch, batch = 0) {
    samples::Progress progress("epoch " + std::to_string(epoch + 1) + "/" + std::to_string(o.epochs),
                               steps_per_epoch, "tok");
    const auto start = std::chrono::steady_clock::now();
    Tensor loss_sum;
    double bubble_sum = 0;
    int64_t steps = 0;
    data::Epoch batches = train_loader.epoch(epoch, batch);
    for (data::Batch& b : batches) {
      opt.zero_grad();
      Tensor loss;
      {
        AutocastGuard cast(autocast);
        loss = gp.pipeline->step(b.inputs, b.targets);
      }
      if (o.clip > 0) gp.pipeline->clip_grad_norm(o.clip);
      opt.step();
      sched.step();
      ++step, ++batch, ++steps;
      loss_sum = loss_sum.defined() ? add(loss_sum, loss) : loss;
      if (!o.trace.empty()) bubble_sum += gp.pipeline->measured_bubble();
      // Reading the loss waits for the GPU: read where the progress line shows it (on the CPU,
      // every step), as the data-parallel loop does.
      if (!ctx.device.is_cuda() || batch % 10 == 0 || batch == steps_per_epoch) {
        const double value = loss.item();
        if (!o.allow_nonfinite) samples::check_finite_loss(value, step, !ctx.device.is_cuda());
        if (main_rank && (batch % 10 == 0 || batch == steps_per_epoch))
          progress.update(batch, batch * o.batch_size * o.context, value, samples::device_note(ctx.device, 0));
      }
      if (step >= total_steps) break;
    }
    if (main_rank) progress.finish();
    // The plan beside the allocator's peak since the stages were built, once.
    if (main_rank && steps > 0 && !plan_measured) {
      plan_measured = true;
      std::printf("%s\n", plan.measured_line(ctx.device, allocated_before_model, steps).c_str());
    }
    // Every rank holds its pipeline's loss: the mean over the ranks is the pipelines' mean.
    const double train_loss = dist::mean_over_ranks(ctx, steps ? loss_sum.item() / double(steps) : NAN);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const double tokens_per_s = double(steps * o.batch_size * o.context * o.dp) / seconds;
    const double val_loss = validation_loss(val_loader, autocast, [&](const data::Batch& b) {
      return gp.pipeline->evaluate(b.inputs, b.targets);
    });
    if (main_rank) {
      std::printf("epoch %lld: train loss %.4f  validation loss %.4f  %.0f tok/s", (long long)epoch + 1, train_loss,
                  val_loss, tokens_per_s);
      if (!o.trace.empty() && steps)
        std::printf("  bubble: measured %.1f%%, schedule %.1f%% at equal stages", 100.0 * bubble_sum / double(steps),
                    100.0 * gp.pipeline->simulation().bubble());
      std::printf("\n");
      std::fflush(stdout);
    }
    log.record(epoch + 1, step, train_loss, val_loss, tokens_per_s, ctx.device.str(),
               {{"pp", o.pp}, {"schedule", o.schedule}});
    if (!o.save.empty()) {
      const bool finished = batch >= steps_per_epoch;
      checkpoint.user = pipeline_entries(o, ctx.size, stages, train_windows, finished ? epoch + 1 : epoch,
                                         finished ? 0 : batch, step);
      save_pipeline_checkpoint(o.save, checkpoint);
    }
  }
  samples::write_step_trace(o.trace, ctx, ctx.device);
  if (o.generate > 0 && o.shards.empty()) {
    // A sharded stage's full values come from its shards over the --dp group (every rank).
    nn::NamedTensors stage_state;
    for (const Stage& s : gp.pipeline->stages())
      for (auto& entry : s.sharded ? s.sharded->full_state_dict() : s.module->state_dict()) stage_state.push_back(entry);
    if (mesh.coordinate("dp") != 0) return 0;
    const nn::NamedTensors whole_state = gather_state_dicts(*mesh.group("pp"), stage_state);
    if (main_rank) {
      nn::GPT whole(config);
      whole.to(ctx.device);
      whole.load_state_dict(whole_state);
      std::printf("\n--- sample (temperature %.2f, top-k %lld) ---\n%s\n", o.temperature, (long long)o.top_k,
                  generate(whole, o.prompt, o.generate, o.temperature, o.top_k, ctx.device, uint64_t(o.seed)).c_str());
    }
  }
  return 0;
}

}  // namespace loom::train_gpt
