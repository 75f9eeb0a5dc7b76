// train_gpt: trains a byte-level GPT on a text corpus (default: Debian's fortunes,
// /usr/share/games/fortunes) or on uint16 token shards (nanoGPT / llm.c format), then prints
// text it generates. Same conventions as train_cnn: a progress line, JSON lines, an SVG chart,
// checkpoints and --resume, data parallel under loomrun or with --gpus N (DDP, or FSDP with
// --fsdp: one unit per transformer block), pipelined with --pp (its stages sharded with
// --fsdp). Each run prints its memory plan per rank and, after the first epoch's steps, the
// measured peak beside it. `--help` lists it all. The --pp run is train_gpt_pipeline.cpp.
//
// The text is cut into non-overlapping windows of --context tokens, held out 10% at the end
// for validation, and visited in a random order each epoch (a distributed shard per rank).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <optional>
#include <random>
#include <string>

#include "data/loader.h"
#include "data/text.h"
#include "data/token_shard.h"
#include "engine/allocator.h"
#include "engine/autocast.h"
#include "engine/autograd.h"
#include "engine/ops.h"
#include "layers/layers.h"
#include "layers/optim/captured_step.h"
#include "parallel/ddp.h"
#include "parallel/device_mesh.h"
#include "parallel/fsdp.h"
#include "parallel/init.h"
#include "parallel/memory_plan.h"
#include "parallel/rendezvous.h"
#include "parallel/sharded_checkpoint.h"
#include "parallel/trace.h"
#include "samples/common/flags.h"
#include "samples/common/metrics.h"
#include "samples/common/program.h"
#include "samples/common/progress.h"
#include "samples/common/scaling.h"
#include "samples/train_gpt.h"

using namespace loom;

namespace loom::train_gpt {

// --fsdp's units: by size with --min-params N, else one unit per transformer block, as
// nanoGPT's and FSDP2's recipes shard a GPT; the embeddings, the final LayerNorm and the
// output layer tied to the token embedding are left to the root unit.
dist::FSDPOptions fsdp_options(const Options& o, nn::GPT& model) {
  dist::FSDPOptions options;
  options.reshard_after_forward =
      o.reshard_after_forward == "yes" ? dist::ReshardAfterForward::yes : dist::ReshardAfterForward::no;
  if (o.min_params > 0) options.min_num_params = o.min_params;
  else
    for (const auto& block : model.blocks) options.units.push_back({block});
  return options;
}

std::string generate(nn::GPT& model, const std::string& prompt, int64_t count, double temperature, int64_t top_k,
                     Device device, uint64_t seed) {
  NoGradGuard no_grad;
  model.eval();
  std::vector<int64_t> ids;
  for (unsigned char c : prompt) ids.push_back(c);
  std::mt19937_64 rng(seed);
  std::string out = prompt;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t start = std::max<int64_t>(0, int64_t(ids.size()) - model.config().context);
    std::vector<int64_t> window(ids.begin() + start, ids.end());
    Tensor logits = model.forward(from_vector(window, {1, int64_t(window.size())}, device));
    std::vector<float> last = logits.select(1, logits.size(1) - 1).to(Device::cpu()).to(DType::f32).to_vector<float>();
    std::vector<float> sorted = last;
    const int64_t k = std::min<int64_t>(top_k, int64_t(last.size()));
    std::nth_element(sorted.begin(), sorted.begin() + (k - 1), sorted.end(), std::greater<float>());
    const float cutoff = sorted[size_t(k - 1)], top = *std::max_element(last.begin(), last.end());
    std::vector<double> p(last.size());
    for (size_t j = 0; j < last.size(); ++j)
      p[j] = last[j] < cutoff ? 0.0 : std::exp((double(last[j]) - top) / temperature);
    const int64_t next = std::discrete_distribution<int64_t>(p.begin(), p.end())(rng);
    ids.push_back(next);
    out += char(next);
  }
  model.train();
  return out;
}

EpochLog::EpochLog(const Options& o, bool main_rank)
    : o_(o), main_rank_(main_rank), metrics_(main_rank ? o.metrics : "") {}

void EpochLog::record(int64_t epoch, int64_t step, double train_loss, double val_loss, double tokens_per_s,
                      const std::string& device, const samples::MetricRecord& extra) {
  samples::MetricRecord line{{"epoch", epoch}, {"step", step}, {"train_loss", train_loss},
                             {"val_loss", val_loss}, {"tokens_per_s", tokens_per_s}, {"config", o_.config},
                             {"precision", o_.precision}, {"device", device}};
  line.insert(line.end(), extra.begin(), extra.end());
  metrics_.write(line);
  train_curve_.emplace_back(double(epoch), train_loss);
  val_curve_.emplace_back(double(epoch), val_loss);
  if (main_rank_ && !o_.plot.empty())
    samples::write_svg_chart(o_.plot, "GPT " + o_.config,
                             {{"loss", "epoch", "cross-entropy", {{"train", train_curve_}, {"validation", val_curve_}}}});
}

double validation_loss(data::DataLoader& val_loader, const std::optional<DType>& autocast,
                       const std::function<Tensor(const data::Batch&)>& loss) {
  Tensor sum;
  int64_t batches = 0;
  NoGradGuard no_grad;
  AutocastGuard cast(autocast);
  data::Epoch val = val_loader.epoch(0);
  for (data::Batch& b : val) {
    Tensor l = loss(b);
    sum = sum.defined() ? add(sum, l) : l;
    ++batches;
  }
  return batches ? sum.item() / double(batches) : NAN;
}

// What a checkpoint to resume holds, checked against this run before any data is read: the
// program and the config first (a message that names them beats a list of missing weights).
void check_resume(const Options& o, const std::map<std::string, std::string>& saved, const samples::Flags& flags) {
  const auto entry = [&](const char* key) { return saved.count(key) ? saved.at(key) : std::string(); };
  if (!entry("model").empty() || (!entry("program").empty() && entry("program") != "train_gpt"))
    flags.fail("--resume " + o.resume + " was written by " +
               (entry("program").empty() ? std::string("train_cnn") : entry("program")) +
               (entry("model").empty() ? "" : " and holds a " + entry("model")) +
               (entry("data").empty() ? "" : " trained on " + entry("data")) +
               "; train_gpt resumes its own checkpoints");
  if (!entry("config").empty() && entry("config") != o.config)
    flags.fail("--resume " + o.resume + " holds a GPT of config " + entry("config") + "; this run is --config " +
               o.config + ": resume with --config " + entry("config"));
}

// A run with --pp resumes a pipeline checkpoint (a folder of per-stage files, whatever the
// pipeline's shape: load_pipeline_checkpoint reads each stage's parameters by name), and a run
// without it a single-file checkpoint.
void check_resume_layout(const Options& o, const std::map<std::string, std::string>& saved,
                         const samples::Flags& flags) {
  const std::string format = samples::checkpoint_format(o.resume);
  const auto entry = [&](const char* key) { return saved.count(key) ? saved.at(key) : std::string("?"); };
  const std::string pp = std::to_string(o.pp);
  if (o.pp == 1) {
    if (format == samples::kPipelineCheckpoint)
      flags.fail("--resume " + o.resume + " is a pipeline checkpoint (a folder saved by train_gpt --pp " +
                 entry("pp") + "): resume it with --pp " + entry("pp") + " under a launcher, or export its weights "
                 "to one file (export_pipeline_checkpoint, parallel/pipeline_checkpoint.h)");
    // --fsdp resumes its folders of shards, and a single file of a plain or DDP run too.
    samples::check_resume_format(flags, o.resume,
                                 o.fsdp ? std::vector<std::string>{samples::kShardedCheckpoint, samples::kFileCheckpoint}
                                        : std::vector<std::string>{samples::kFileCheckpoint});
    return;
  }
  if (format != samples::kPipelineCheckpoint)
    flags.fail("--resume " + o.resume + " is " +
               (format == samples::kFileCheckpoint ? "a single-file training checkpoint (saved without --pp)"
                                                   : "a checkpoint of format " + format) +
               ", and --pp " + pp + " resumes a pipeline checkpoint, the folder train_gpt --pp --save writes");
}

std::map<std::string, std::string> saved_entries(const Options& o, int world_size, int64_t train_windows, int64_t epoch,
                                                 int64_t batch, int64_t step) {
  return {{"epoch", std::to_string(epoch)},
          {"batch", std::to_string(batch)},
          {"step", std::to_string(step)},
          {"program", "train_gpt"},
          {"config", o.config},
          {"context", std::to_string(o.context)},
          {"batch_size", std::to_string(o.batch_size)},
          {"seed", std::to_string(o.seed)},
          {"world_size", std::to_string(world_size)},
          {"train_windows", std::to_string(train_windows)}};
}

int run(int argc, char** argv) {
  Options o;
  samples::Flags flags("train_gpt",
                       "Trains a GPT on text (bytes as tokens; default Debian's fortunes) or token shards, then\n"
                       "generates text from it.");
  flags.add("config", &o.config,
            "model size (tiny: 2 x 64; guide: the guide's 6 blocks of 256; gpt2-124m: 12 x 768; auto: guide on "
            "a GPU, tiny on the CPU)",
            {"auto", "tiny", "guide", "gpt2-124m"});
  flags.add("data", &o.data, "a text file or a folder of them, read as bytes", {}, "PATH");
  flags.add("shards", &o.shards, "uint16 token shards instead (a glob, e.g. 'fineweb_train_*.bin')", {}, "GLOB");
  flags.add("epochs", &o.epochs, "passes over the training windows (0: 3 on a GPU, 1 on the CPU)", 0);
  flags.add("batch-size", &o.batch_size, "sequences per step (per rank)", 1);
  flags.add("context", &o.context, "tokens per sequence (at most the config's context)", 2);
  flags.add("lr", &o.lr, "peak learning rate (AdamW, cosine decay)", 0);
  flags.add("weight-decay", &o.weight_decay, "AdamW weight decay", 0);
  flags.add("clip", &o.clip, "clip the gradients' global norm (0: no clipping)", 0);
  flags.add("precision", &o.precision, "f32, or bf16 autocast (f32 master weights); auto: bf16 on a GPU",
            {"auto", "f32", "bf16"});
  flags.add_switch("graph", &o.graph,
                   "on one GPU, capture the training step as one CUDA graph after 2 eager steps and replay it "
                   "(not under DDP, FSDP or --pp, nor with --trace; a smaller last batch runs eagerly)");
  flags.add_switch("recompute", &o.recompute,
                   "recompute each block's activations in backward: less memory, about a third more compute");
  flags.add("device", &o.device, "cpu, cuda or cuda:N (auto: the first GPU, else the CPU)", {}, "DEVICE");
  flags.add("workers", &o.workers, "data-loader threads", 0, 64);
  flags.add("max-steps", &o.max_steps, "stop after this many steps (0: no limit)", 0);
  flags.add("gpus", &o.gpus, "data-parallel over N GPUs of this node (starts N ranks)", 0, 1024);
  flags.add("timeout-s", &o.timeout_s, "data parallel: seconds before a stuck collective ends the run", 1);
  flags.add_switch("fsdp", &o.fsdp,
                   "data parallel (under a launcher or --gpus N): shard parameters, gradients and optimizer state "
                   "over the ranks (parallel/fsdp.h) instead of replicating them (DDP); one unit per transformer "
                   "block; --save writes a sharded checkpoint (a folder, every rank writing its shards). With --pp, "
                   "each stage sharded over its --dp group (with --hsdp N: over --dp / N ranks, replicated N times), "
                   "--save writing a pipeline checkpoint of every rank's rows (not with zb1). Not with --scaling");
  flags.add("reshard-after-forward", &o.reshard_after_forward,
            "FSDP: free a unit's full parameters after its forward (yes: ZeRO-3) or keep them until its backward "
            "(no: ZeRO-2)",
            {"yes", "no"});
  flags.add("min-params", &o.min_params,
            "FSDP: units by size instead, a module with at least this many parameters becoming one (0: one unit "
            "per transformer block)",
            0);
  flags.add("hsdp", &o.hsdp,
            "FSDP: hybrid sharding (HSDP): N replicas, each sharding the model over ranks / N consecutive ranks "
            "(one node's GPUs), their gradients averaged between replicas",
            1);
  flags.add("save", &o.save,
            "write a training checkpoint here after every epoch (a file; with --fsdp or --pp, a folder)", {}, "PATH");
  flags.add("resume", &o.resume, "continue the run saved in this checkpoint (a file, or --fsdp's or --pp's folder)",
            {}, "PATH");
  flags.add("seed", &o.seed, "seed for weights, data order and sampling", 0);
  flags.add("generate", &o.generate, "bytes to generate at the end (0: none)", 0);
  flags.add("temperature", &o.temperature, "sampling temperature", 1e-3);
  flags.add("top-k", &o.top_k, "sample among the k likeliest tokens", 1);
  flags.add("prompt", &o.prompt, "text the generation starts from", {}, "TEXT");
  flags.add("metrics", &o.metrics, "append one JSON line per epoch here (\"\": none)", {}, "FILE");
  flags.add("plot", &o.plot, "draw the loss curves here as SVG (\"\": none)", {}, "FILE");
  flags.add("scaling", &o.scaling,
            "run the same training on 1, 2, 4, ... N ranks and report speedup and efficiency (table, "
            "--metrics JSON lines, --plot SVG); add --device cpu for CPU ranks",
            0, 1024);
  flags.add("pp", &o.pp, "pipeline stages: the model's blocks cut over this many ranks (under a launcher)", 1, 1024);
  flags.add("dp", &o.dp, "with --pp: data-parallel pipelines (0: ranks / pp)", 0, 1024);
  flags.add("schedule", &o.schedule, "with --pp: the pipeline schedule", {"gpipe", "1f1b", "interleaved", "zb1"});
  flags.add("microbatches", &o.microbatches, "with --pp: micro-batches per step (0: 2 x pp)", 0, 4096);
  flags.add("stages-per-rank", &o.stages_per_rank, "with --schedule interleaved: virtual stages per rank", 2, 64);
  flags.add("trace", &o.trace,
            "write every rank's step timeline here as Chrome-trace JSON (ui.perfetto.dev): forward, backward, the "
            "optimizer, DDP's all-reduces, FSDP's gathers and reduce-scatters; with --pp each stage's work and "
            "sends, and the measured bubble",
            {}, "FILE");
  flags.add_switch("allow-nonfinite", &o.allow_nonfinite,
                   "train on even when the resumed weights or the loss hold NaN or infinity (default: stop, naming "
                   "the parameter or the step)");
  const std::vector<std::string> positional = flags.parse(argc, argv);
  samples::reject_positional(flags, positional, positional.empty() ? "" : "did you mean --data " + positional[0] + "?");
  if (flags.given("data") && !o.shards.empty())
    flags.fail("--data " + o.data + " and --shards " + o.shards + " both name the training data: give one");
  if (o.generate > 0 && o.shards.empty() && o.prompt.empty())
    flags.fail("--prompt is empty: generation continues a text of at least one byte (or --generate 0 for none)");
  for (const char* unused : {"prompt", "temperature", "top-k"}) {
    if (!flags.given(unused)) continue;
    if (o.generate == 0) flags.fail(std::string("--") + unused + " shapes the generated text, and --generate 0 asks for none");
    if (!o.shards.empty())
      flags.fail(std::string("--") + unused + " shapes the generated text, and a run on --shards generates none "
                 "(its tokens are not bytes)");
  }
  const bool pipelined = o.pp > 1;
  for (const char* flag : {"reshard-after-forward", "min-params", "hsdp"})
    if (!o.fsdp && flags.given(flag)) flags.fail(std::string("--") + flag + " is FSDP's: add --fsdp");
  if (o.fsdp) {
    // With --pp, each stage is sharded over its data-parallel group (PipelineOptions::shard).
    if (pipelined && o.schedule == "zb1")
      flags.fail("--fsdp with --pp shards each stage, and --schedule zb1 splits backward into halves FSDP does not "
                 "follow: use --schedule 1f1b, gpipe or interleaved");
    if (flags.given("scaling"))
      flags.fail("--fsdp with --scaling is not available: the scaling runs measure DDP; drop one of them");
    if (o.gpus <= 1 && !dist::launched_with_rank())
      flags.fail("--fsdp shards over several ranks, and no launcher started this one: start it with loomrun "
                 "--nproc-per-node N (or torchrun, mpirun, srun), or with --gpus N");
  }
  if (!pipelined)
    for (const char* flag : {"dp", "schedule", "microbatches", "stages-per-rank"})
      if (flags.given(flag)) flags.fail(std::string("--") + flag + " sets up a pipeline, and --pp is 1 (give --pp N)");
  if (pipelined) {
    for (const char* flag : {"scaling", "gpus"})
      if (flags.given(flag))
        flags.fail(std::string("--") + flag + " is not available with --pp yet (scaling runs and --gpus start "
                   "data-parallel ranks; start a pipeline's ranks under loomrun, torchrun, mpirun or srun)");
    if (flags.given("stages-per-rank") && o.schedule != "interleaved")
      flags.fail("--stages-per-rank " + std::to_string(o.stages_per_rank) + " is for --schedule interleaved, not " +
                 o.schedule);
  }
  if (o.scaling > 0 && flags.given("trace"))
    flags.fail("--trace with --scaling is not available: every scaling run would write the same file; trace one run "
               "under a launcher");
  if (o.scaling > 0 && !dist::launched_with_rank()) {
    samples::ScalingOptions so;
    so.max_ranks = int(o.scaling);
    so.throughput_key = "tokens_per_s";
    so.unit = "tok/s";
    so.json_path = o.metrics == "train_gpt.jsonl" ? "train_gpt_scaling.jsonl" : o.metrics;
    so.svg_path = o.plot == "train_gpt.svg" ? "train_gpt_scaling.svg" : o.plot;
    for (const char* flag : {"generate", "prompt", "temperature", "top-k"}) so.drop_flags.push_back(flag);
    so.extra_args = {"--generate", "0"};  // measure training only
    so.quiet_flag = false;
    return samples::run_scaling(argc, argv, so);
  }
  if (o.gpus > 1 && !dist::launched_with_rank()) {
    if (cuda_device_count() < o.gpus)
      flags.fail("--gpus " + std::to_string(o.gpus) + ": only " + std::to_string(cuda_device_count()) +
                 " GPU(s) are visible");
    return dist::relaunch(argc, argv, int(o.gpus), "gpus");
  }
  // A checkpoint to resume is looked at (its header alone) before any data is read.
  const std::map<std::string, std::string> saved =
      o.resume.empty() ? std::map<std::string, std::string>{} : samples::checkpoint_entries(flags, o.resume, "train_gpt");
  dist::DistContext ctx = dist::init_distributed(o.device, std::chrono::seconds(o.timeout_s));
  const Device device = ctx.device;
  const bool main_rank = ctx.is_main();
  if (o.hsdp > 1 && (!ctx.active || ctx.size % o.hsdp != 0))
    flags.fail("--hsdp " + std::to_string(o.hsdp) + ": the " + std::to_string(ctx.size) +
               " rank(s) started do not divide into that many replicas of equal size");
  // A pipelined run saves its checkpoint as a folder.
  if (main_rank) {
    const bool folder = pipelined || o.fsdp;
    samples::check_output_paths(flags, {{"--save", folder ? std::string() : o.save}, {"--plot", o.plot}});
    if (folder)
      samples::check_output_folders(flags, {{"--save", o.save}},
                                    pipelined ? samples::kPipelineCheckpoint : samples::kShardedCheckpoint);
  }
  // With no flags: on a GPU the guide's model in bf16 for 3 epochs (about 20 s on an H200,
  // enough to write text with words in it); on the CPU the tiny one for an epoch.
  const bool on_gpu = device.is_cuda();
  if (o.config == "auto") o.config = on_gpu ? "guide" : "tiny";
  if (o.precision == "auto") o.precision = on_gpu ? "bf16" : "f32";
  if (o.epochs == 0) {
    o.epochs = on_gpu ? 3 : 1;
    if (!on_gpu && main_rank)
      std::printf("no GPU: training the %s config for %lld epoch on the CPU (--config guide --epochs N for more)\n",
                  o.config.c_str(), (long long)o.epochs);
  }
  nn::GPTConfig config = nn::GPTConfig::named(o.config);
  config.recompute = o.recompute;
  if (o.context > config.context) flags.fail("--context " + std::to_string(o.context) + " is longer than the " +
                                             o.config + " config's " + std::to_string(config.context));
  if (!o.resume.empty()) {
    check_resume(o, saved, flags);
    check_resume_layout(o, saved, flags);
  }

  // ---- data: a token stream, split 90/10 into training and validation ----------------
  data::TokenShard all;
  if (!o.shards.empty()) {
    for (const std::string& path : data::glob_shards(o.shards)) {
      data::TokenShard s = data::load_token_shard(path, config.vocab_size);
      all.tokens.insert(all.tokens.end(), s.tokens.begin(), s.tokens.end());
    }
  } else {
    if (config.vocab_size < data::kByteVocab)
      flags.fail("--config " + o.config + " has a vocabulary of " + std::to_string(config.vocab_size) +
                 ", fewer than the 256 byte values of text input");
    if (!std::filesystem::exists(o.data))
      flags.fail("--data " + o.data + " does not exist (install Debian's fortunes package for the default corpus)");
    all = data::load_text(o.data);
  }
  const size_t split = all.tokens.size() * 9 / 10;
  data::TokenShard train_tokens{{all.tokens.begin(), all.tokens.begin() + int64_t(split)}};
  data::TokenShard val_tokens{{all.tokens.begin() + int64_t(split), all.tokens.end()}};
  auto train_set = std::make_shared<data::TokenWindowDataset>(train_tokens, o.context);
  auto val_set = std::make_shared<data::TokenWindowDataset>(val_tokens, o.context);
  if (train_set->size() < o.batch_size * (pipelined ? o.dp : ctx.size))
    flags.fail("the corpus gives " + std::to_string(train_set->size()) + " training windows of " +
               std::to_string(o.context) + " tokens, fewer than one batch on every rank");
  // A pipeline's ranks all read their pipeline's batches: the data is sharded over the
  // pipelines (ranks laid out as a pp x dp mesh, dp the faster dimension).
  if (pipelined) {
    if (!ctx.active) flags.fail("--pp " + std::to_string(o.pp) + " needs " + std::to_string(o.pp) +
                                " or more ranks: start it under loomrun, torchrun, mpirun or srun");
    if (o.dp == 0) o.dp = ctx.size / o.pp;
    if (o.pp * o.dp != ctx.size)
      flags.fail("--pp " + std::to_string(o.pp) + " x --dp " + std::to_string(o.dp) + " is " +
                 std::to_string(o.pp * o.dp) + " ranks, but " + std::to_string(ctx.size) + " were started");
    if (o.hsdp > 1 && o.dp % o.hsdp != 0)
      flags.fail("--hsdp " + std::to_string(o.hsdp) + " with --pp: the " + std::to_string(o.dp) +
                 " data-parallel ranks of a stage (--dp) do not divide into that many replicas of equal size");
    if (o.microbatches == 0) o.microbatches = 2 * o.pp;
    if (o.batch_size % o.microbatches != 0)
      flags.fail("--batch-size " + std::to_string(o.batch_size) + " does not cut into --microbatches " +
                 std::to_string(o.microbatches) + " equal parts");
  }
  const int data_rank = pipelined ? int(ctx.rank % o.dp) : ctx.rank;
  const int data_ranks = pipelined ? int(o.dp) : ctx.size;
  std::shared_ptr<data::Sampler> sampler;
  if (ctx.active)
    sampler = std::make_shared<data::DistributedSampler>(train_set->size(), data_rank, data_ranks, data::Shuffle::yes,
                                                         uint64_t(o.seed), data::DropLast::no);
  else
    sampler = std::make_shared<data::RandomSampler>(train_set->size(), uint64_t(o.seed));
  data::LoaderOptions lo;
  lo.batch_size = o.batch_size;
  lo.num_workers = int(o.workers);
  lo.device = device;
  lo.drop_last = data::DropLast::yes;
  data::DataLoader train_loader(train_set, sampler, lo);
  data::LoaderOptions vo = lo;
  vo.drop_last = data::DropLast::no;
  data::DataLoader val_loader(val_set, std::make_shared<data::SequentialSampler>(val_set->size()), vo);
  const int64_t steps_per_epoch = train_loader.num_batches();
  const int64_t total_steps = o.max_steps > 0 ? std::min(o.max_steps, steps_per_epoch * o.epochs)
                                              : steps_per_epoch * o.epochs;
  dist::check_same_on_every_rank(ctx,
                                 {{"tokens", int64_t(all.tokens.size())},
                                  {"training windows", train_set->size()},
                                  {"batch size", o.batch_size},
                                  {"steps per epoch", steps_per_epoch},
                                  {"steps in all", total_steps}},
                                 "start every rank with the same --data or --shards, --context, --batch-size, "
                                 "--epochs and --max-steps, and the same copy of the data");
  if (!o.resume.empty())
    samples::check_saved_settings(
        flags, o.resume, pipelined ? with_pipelines(flags, o.resume, saved) : saved,
        {{"batch_size", "--batch-size", std::to_string(o.batch_size), "its data position counts batches of that size"},
         {"context", "--context", std::to_string(o.context), "its data position counts windows of that length"},
         {"seed", "--seed", std::to_string(o.seed), "its data position is a place in that seed's order"},
         pipelined ? samples::SavedSetting{"pipelines", "--dp", std::to_string(o.dp),
                                           "it was saved within an epoch, and its data position is a place in each "
                                           "pipeline's shard of the data (a checkpoint saved at an epoch's end "
                                           "resumes at any --dp; --pp and --schedule may change anywhere)",
                                           true}
                   : samples::saved_rank_count(ctx.size),
         {"train_windows", "the training window count", std::to_string(train_set->size()),
          "its data position is a place in that many windows (the same data)"}});

  if (pipelined)
    return train_pipelined(o, ctx, config, flags, train_loader, val_loader, steps_per_epoch, total_steps,
                           train_set->size());

  // ---- model and optimizer -------------------------------------------------------------
  const size_t allocated_before_model = memory::stats(device).allocated;
  manual_seed(uint64_t(o.seed));
  auto model = std::make_shared<nn::GPT>(config);
  model->to(device);
  const std::optional<DType> autocast = o.precision == "bf16" ? std::optional<DType>(DType::bf16) : std::nullopt;
  // What a step of this rank's batch holds, from a probe step of one and two random windows
  // before any wrapper shards the weights (parallel/memory_plan.h); on rank 0, which prints it.
  const size_t activations =
      !main_rank ? 0 : dist::activation_bytes(*model, device, o.batch_size, [&](int64_t rows) {
        AutocastGuard cast(autocast);
        Tensor ids = mul(rand({rows, o.context}, DType::f32, device), double(config.vocab_size)).to(DType::i64);
        return model->loss(ids, ids);
      });
  std::shared_ptr<dist::DistributedDataParallel> ddp;
  std::unique_ptr<dist::FullyShardedDataParallel> fsdp;
  if (o.fsdp) {
    if (o.hsdp > 1) {
      // Replicas along the mesh's rows, shards along its columns: a row is consecutive ranks.
      dist::DeviceMesh mesh(ctx.group, {int(o.hsdp), ctx.size / int(o.hsdp)}, {"replicate", "shard"});
      if (main_rank) std::printf("HSDP: %lld replicas, each sharded over %d ranks\n%s", (long long)o.hsdp,
                                 ctx.size / int(o.hsdp), mesh.table().c_str());
      fsdp = dist::hybrid_shard(model, mesh, fsdp_options(o, *model));
    } else {
      fsdp = std::make_unique<dist::FullyShardedDataParallel>(model, ctx.group, fsdp_options(o, *model));
    }
    if (main_rank) {
      size_t bytes = 0;
      for (const Tensor& p : model->parameters()) bytes += p.nbytes();
      std::printf("FSDP (%s): %zu units; parameters %.3f MB in all, %.3f MB of shards on rank 0\n",
                  o.reshard_after_forward == "yes" ? "ZeRO-3" : "ZeRO-2", fsdp->unit_names().size(),
                  double(bytes) / 1e6, double(fsdp->memory().shard_parameter_bytes) / 1e6);
    }
  } else if (ctx.active) {
    dist::DDPOptions options;
    options.gradient_as_bucket_view = true;
    ddp = std::make_shared<dist::DistributedDataParallel>(model, ctx.group, options);
  }
  // Under FSDP the model computes only inside fsdp->call (its parameters are gathered there,
  // in training and validation alike) and the optimizer steps this rank's shards.
  auto model_loss = [&](const Tensor& inputs, const Tensor& targets) {
    auto loss = [&] { return model->loss(inputs, targets); };
    return fsdp ? fsdp->call(loss) : ddp ? ddp->call(loss) : loss();
  };
  optim::AdamW opt(fsdp ? fsdp->parameters() : model->parameters(),
                   {.lr = o.lr, .beta1 = 0.9, .beta2 = 0.95, .weight_decay = o.weight_decay});
  optim::LRScheduler sched(opt, optim::cosine_annealing(std::max<int64_t>(total_steps, 1), o.lr * 0.1));
  const dist::MemoryPlan plan =
      fsdp ? dist::plan_sharded(*fsdp, opt, activations) : dist::plan_replicated(*model, opt, activations, ddp.get());
  int64_t epoch = 0, batch = 0, step = 0;
  if (!o.resume.empty()) {
    const samples::ResumedAt at = samples::resume_data_parallel(o.resume, "train_gpt", *model, fsdp.get(), opt,
                                                                sched, ctx, steps_per_epoch, o.allow_nonfinite);
    epoch = at.epoch, batch = at.batch, step = at.step;
  }
  if (main_rank)
    std::printf("train_gpt: GPT %s (%lld parameters; %lld layers, width %lld, %lld heads) on %lld tokens "
                "(%lld training windows of %lld), batch %lld, %s on %s%s\n",
                o.config.c_str(), (long long)model->num_parameters(), (long long)config.layers,
                (long long)config.width, (long long)config.heads, (long long)all.tokens.size(),
                (long long)train_set->size(), (long long)o.context, (long long)o.batch_size, o.precision.c_str(),
                device.str().c_str(), ctx.active ? (", " + std::to_string(ctx.size) + " ranks").c_str() : "");
  if (main_rank) std::printf("%s\n", plan.table().c_str());

  auto train_step = [&](const Tensor& inputs, const Tensor& targets) {
    opt.zero_grad();
    Tensor loss;
    {
      dist::trace::Span forward_span("forward", dist::trace::Category::forward);
      AutocastGuard cast(autocast);
      loss = model_loss(inputs, targets);
    }
    {
      dist::trace::Span backward_span("backward", dist::trace::Category::backward);
      loss.backward();
    }
    dist::trace::Span optimizer_span("optimizer", dist::trace::Category::optimizer);
    if (o.clip > 0 && fsdp) fsdp->clip_grad_norm_(o.clip);
    else if (o.clip > 0) optim::clip_grad_norm_(model->parameters(), o.clip);
    opt.step();
    return loss;
  };
  // The step as one CUDA graph (layers/optim/captured_step.h) where everything in it can be
  // captured: one GPU, one process, neither DDP nor FSDP (whose clipping reads the norm
  // summed over the ranks), no trace. Full batches are copied into the graph's static
  // tensors; a smaller last batch runs eagerly.
  const bool graphed = o.graph && device.is_cuda() && !ctx.active && !fsdp && !ddp && o.trace.empty();
  std::optional<optim::CapturedBatchStep> captured;
  if (graphed) captured.emplace(device, std::vector<optim::Optimizer*>{&opt}, train_step);
  if (main_rank && graphed) std::printf("  the step is captured as one CUDA graph (--no-graph: eager)\n");

  EpochLog log(o, main_rank);
  samples::start_step_trace(o.trace, ctx, device);
  memory::reset_peak(device);
  bool plan_measured = false;
  for (; epoch < o.epochs && step < total_steps; ++epoch, batch = 0) {
    samples::Progress progress("epoch " + std::to_string(epoch + 1) + "/" + std::to_string(o.epochs),
                               steps_per_epoch, "tok");
    const auto start = std::chrono::steady_clock::now();
    Tensor loss_sum;
    int64_t steps = 0;
    data::Epoch batches = train_loader.epoch(epoch, batch);
    for (data::Batch& b : batches) {
      dist::trace::Span step_span("step", dist::trace::Category::step);
      Tensor loss = captured ? captured->run(b.inputs, b.targets) : train_step(b.inputs, b.targets);
      sched.step();
      ++step, ++batch, ++steps;
      // A captured step's loss is the graph's, rewritten by the next replay: the sum starts
      // from a copy.
      Tensor l = loss.detach();
      loss_sum = loss_sum.defined() ? add(loss_sum, l) : l.clone();
      // Reading the loss waits for the GPU: it is checked where the progress line reads it
      // (on the CPU, every step).
      if (!o.allow_nonfinite && (!device.is_cuda() || batch % 10 == 0 || batch == steps_per_epoch))
        samples::check_finite_loss(l.item(), step, !device.is_cuda());
      if (main_rank && (batch % 10 == 0 || batch == steps_per_epoch))
        progress.update(batch, batch * o.batch_size * o.context, l.item(),
                        samples::device_note(device, batches.stall_seconds()));
      if (step >= total_steps) break;
    }
    if (main_rank) progress.finish();
    // The plan beside the allocator's peak since the model was built, once.
    if (main_rank && steps > 0 && !plan_measured) {
      plan_measured = true;
      std::printf("%s\n", plan.measured_line(device, allocated_before_model, steps).c_str());
    }
    const double train_loss = dist::mean_over_ranks(ctx, steps ? loss_sum.item() / double(steps) : NAN);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const double val_loss = validation_loss(val_loader, autocast, [&](const data::Batch& b) {
      auto loss = [&] { return model->loss(b.inputs, b.targets); };
      return fsdp ? fsdp->call(loss) : loss();
    });
    const double tokens_per_s = double(steps * o.batch_size * o.context * ctx.size) / seconds;
    if (main_rank) {
      std::printf("epoch %lld: train loss %.4f  validation loss %.4f  %.0f tok/s\n", (long long)epoch + 1,
                  train_loss, val_loss, tokens_per_s);
      if (fsdp)
        std::printf("FSDP: at most %.3f MB of full parameters held at once on rank 0\n",
                    double(fsdp->memory().peak_full_parameter_bytes) / 1e6);
      std::fflush(stdout);
    }
    log.record(epoch + 1, step, train_loss, val_loss, tokens_per_s, device.str());
    const bool finished = batch >= steps_per_epoch;
    const std::map<std::string, std::string> user =
        saved_entries(o, ctx.size, train_set->size(), finished ? epoch + 1 : epoch, finished ? 0 : batch, step);
    // Rank 0 writes the whole model; under FSDP every rank writes its shards into the folder.
    if (!o.save.empty() && fsdp)
      dist::save_sharded_checkpoint(o.save, *fsdp, &opt, {.scheduler = &sched, .user = user});
    else if (!o.save.empty() && main_rank)
      nn::save_checkpoint(o.save, {.model = model.get(), .optimizer = &opt, .scheduler = &sched, .user = user});
  }
  samples::write_step_trace(o.trace, ctx, device);
  if (o.generate > 0 && o.shards.empty()) {
    // A sharded model cannot run alone: its full weights (gathered on every rank, a
    // collective) go into a plain GPT on rank 0, which generates.
    std::shared_ptr<nn::GPT> whole = model;
    if (fsdp) {
      nn::NamedTensors full = fsdp->full_state_dict();
      if (main_rank) {
        whole = std::make_shared<nn::GPT>(config);
        whole->to(device);
        whole->load_state_dict(full);
      }
    }
    if (main_rank)
      std::printf("\n--- sample (temperature %.2f, top-k %lld) ---\n%s\n", o.temperature, (long long)o.top_k,
                  generate(*whole, o.prompt, o.generate, o.temperature, o.top_k, device, uint64_t(o.seed)).c_str());
  }
  return 0;
}

}  // namespace loom::train_gpt

int main(int argc, char** argv) {
  return samples::run_guarded("train_gpt", [&] { return train_gpt::run(argc, argv); });
}
