// The guide's model_parallel.py in Loom: a six-block post-norm transformer whose blocks are
// spread over a list of devices in one process, the activations following them, and a
// 10-way output layer on the last device (layers/models/guide_transformer.h,
// layers/placement.h). Like the guide it prints where each block sits and the output's
// shape; then it trains a few AdamW steps on a synthetic task the model can learn (the
// guide feeds random input with no target), printing each step's loss and time.
//
// With --pp N under a launcher the same model is a pipeline over processes instead
// (parallel/guide_pipeline.h): each rank builds only its contiguous range of blocks, the last
// stage also the output layer and the loss, and each batch flows through in micro-batches in
// the order of --schedule; --dp M runs M such pipelines, each on its part of the batch.
//
//   model_parallel --devices cuda:0,cuda:1 --placement round-robin
//   model_parallel --devices cuda:0,cpu        (one GPU: the same path, over PCIe)
//   model_parallel                             (every GPU; cuda:0,cpu with one; cpu,cpu with none)
//   loomrun --nproc-per-node 2 model_parallel --device cpu --pp 2 --schedule 1f1b
//
// `model_parallel --help` lists every flag.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <set>
#include <string>
#include <vector>

#include "engine/autograd.h"
#include "engine/ops.h"
#include "layers/models/gpt_stage.h"
#include "layers/models/guide_transformer.h"
#include "layers/optim/adam.h"
#include "layers/placement.h"
#include "parallel/device_mesh.h"
#include "parallel/guide_pipeline.h"
#include "parallel/init.h"
#include "parallel/trace.h"
#include "samples/common/flags.h"
#include "samples/common/program.h"

using namespace loom;

namespace {

struct Options {
  std::string devices, placement = "round-robin";
  int64_t width = 256, heads = 8, layers = 6, classes = 10, batch = 32, tokens = 10, steps = 20, seed = 0;
  double lr = 1e-3;
  // The pipeline over processes, with --pp > 1.
  std::string device = "auto", schedule = "1f1b", trace;
  int64_t pp = 1, dp = 0, microbatches = 0, stages_per_rank = 2;

  nn::GuideTransformerConfig config() const {
    return {.width = width, .heads = heads, .layers = layers, .classes = classes};
  }
};

// Every visible GPU; with one GPU, it and the CPU; without, the CPU twice.
std::string default_devices() {
  const int gpus = cuda_device_count();
  if (gpus == 0) return "cpu,cpu";
  if (gpus == 1) return "cuda:0,cpu";
  std::string list;
  for (int i = 0; i < gpus; ++i) list += (i ? ",cuda:" : "cuda:") + std::to_string(i);
  return list;
}

void synchronize_all(const std::vector<Device>& devices) {
  for (const Device& d : devices) synchronize(d);
}

void print_step(int64_t step, double loss, std::chrono::steady_clock::time_point start) {
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  std::printf("step %4lld  loss %.4f  %8.2f ms\n", (long long)step, loss, ms);
}

// The guide's way: every block in this process, on `devices`.
int train_in_one_process(const Options& o, const std::vector<Device>& devices) {
  manual_seed(uint64_t(o.seed));
  nn::GuideTransformer model(o.config());
  model.place(devices, nn::parse_placement_policy(o.placement));
  std::printf("%lld blocks of width %lld, %lld heads, %lld parameters, placed %s over %s:\n", (long long)o.layers,
              (long long)o.width, (long long)o.heads, (long long)model.num_parameters(), o.placement.c_str(),
              o.devices.c_str());
  std::fputs(model.placement().table().c_str(), stdout);

  // The guide's demo: random input of (batch, tokens, width) through the model.
  {
    NoGradGuard no_grad;
    Tensor y = model.forward(randn({o.batch, o.tokens, o.width}));
    std::printf("output shape: %s on %s\n", shape_str(y.shape()).c_str(), y.device().str().c_str());
  }

  std::set<std::string> seen;
  std::vector<Device> distinct;
  for (const Device& d : devices)
    if (seen.insert(d.str()).second) distinct.push_back(d);
  optim::AdamW opt(model.parameters(), {.lr = o.lr, .weight_decay = 0.0});
  nn::GuideSyntheticTask task(o.width, o.classes, uint64_t(o.seed) + 1);
  std::printf("training %lld steps on a synthetic task (loss starts near ln %lld = %.3f)\n", (long long)o.steps,
              (long long)o.classes, std::log(double(o.classes)));
  double first = 0, last = 0;
  for (int64_t step = 0; step < o.steps; ++step) {
    auto data = task.sample(o.batch, o.tokens);
    synchronize_all(distinct);
    const auto start = std::chrono::steady_clock::now();
    opt.zero_grad();
    Tensor loss = model.loss(data.inputs, data.targets);
    loss.backward();
    opt.step();
    const double value = loss.item();
    synchronize_all(distinct);
    (step == 0 ? first : last) = value;
    print_step(step, value, start);
  }
  if (o.steps > 1) std::printf("loss %.4f -> %.4f\n", first, last);
  return 0;
}

// --pp N: the blocks cut over N ranks (times --dp pipelines), each rank holding only its own.
// Every rank draws the same batches (one data seed), and each pipeline trains on its part.
int train_pipelined(Options& o, const samples::Flags& flags) {
  using namespace dist::pipeline;
  dist::DistContext ctx = dist::init_distributed(o.device, std::chrono::seconds(600));
  const std::string pp_text = "--pp " + std::to_string(o.pp);
  if (!ctx.active)
    flags.fail(pp_text + " needs " + std::to_string(o.pp) + " or more ranks: start it under loomrun (loomrun "
               "--nproc-per-node " + std::to_string(o.pp) + " model_parallel " + pp_text + "), torchrun, mpirun or srun");
  if (o.dp == 0) o.dp = ctx.size / o.pp;
  if (o.pp * o.dp != ctx.size)
    flags.fail(pp_text + " x --dp " + std::to_string(o.dp) + " is " + std::to_string(o.pp * o.dp) + " ranks, but " +
               std::to_string(ctx.size) + " were started");
  if (o.microbatches == 0) o.microbatches = 2 * o.pp;
  if (o.batch % (o.dp * o.microbatches) != 0)
    flags.fail("--batch " + std::to_string(o.batch) + " does not cut into --dp " + std::to_string(o.dp) +
               " x --microbatches " + std::to_string(o.microbatches) + " equal parts");
  PipelineOptions options;
  options.schedule = parse_schedule(o.schedule);
  options.microbatches = int(o.microbatches);
  options.stages_per_rank = options.schedule == ScheduleKind::interleaved ? int(o.stages_per_rank) : 1;
  options.device = ctx.device;
  const int stages = int(o.pp) * options.stages_per_rank;
  if (o.layers < stages)
    flags.fail(pp_text + (options.stages_per_rank > 1 ? " x --stages-per-rank " + std::to_string(o.stages_per_rank)
                                                      : std::string()) +
               " asks for " + std::to_string(stages) + " stages, but --layers is " + std::to_string(o.layers) +
               ": a stage holds one block or more");

  dist::DeviceMesh mesh(ctx.group, {int(o.pp), int(o.dp)}, {"pp", "dp"});
  options.data_parallel = o.dp > 1 ? mesh.group("dp") : nullptr;
  // The same seed on a stage's replicas, so they start equal; another for each stage.
  manual_seed(uint64_t(o.seed) * 1000 + 1 + uint64_t(mesh.coordinate("pp")));
  GuidePipeline gp = make_guide_pipeline(mesh.group("pp"), o.config(), o.tokens, options);
  int64_t held = 0;
  for (const Tensor& p : gp.parameters()) held += p.numel();
  optim::AdamW opt(gp.parameters(), {.lr = o.lr, .weight_decay = 0.0});
  nn::GuideSyntheticTask task(o.width, o.classes, uint64_t(o.seed) + 1);
  manual_seed(uint64_t(o.seed) * 1000);  // the data: the same batches on every rank

  const bool main_rank = ctx.is_main();
  if (main_rank) {
    std::printf("%lld blocks of width %lld, %lld heads, as a pipeline of %d stages on %lld x %lld ranks (pp x dp), "
                "%s schedule, %lld micro-batches of %lld, on %s; rank 0 holds %lld parameters\n",
                (long long)o.layers, (long long)o.width, (long long)o.heads, stages, (long long)o.pp, (long long)o.dp,
                o.schedule.c_str(), (long long)o.microbatches, (long long)(o.batch / o.dp / o.microbatches),
                ctx.device.str().c_str(), (long long)held);
    const std::vector<int64_t> cuts = dist::pipeline::stage_cuts({}, o.layers, stages);
    for (int s = 0; s < stages; ++s)
      std::printf("  stage %d on pipeline rank %d: blocks %lld-%lld%s\n", s, s % int(o.pp), (long long)cuts[size_t(s)],
                  (long long)cuts[size_t(s) + 1] - 1, s == stages - 1 ? ", the output layer and the loss" : "");
    if (o.dp > 1) std::fputs(mesh.table().c_str(), stdout);
    std::fputs(gp.pipeline->schedule().table().c_str(), stdout);
    std::printf("training %lld steps on a synthetic task (loss starts near ln %lld = %.3f)\n", (long long)o.steps,
                (long long)o.classes, std::log(double(o.classes)));
    std::fflush(stdout);
  }
  if (!o.trace.empty()) {
    if (main_rank) dist::trace::write_chrome_trace(o.trace, {});  // fails now, not after training
    dist::trace::set_enabled(true, ctx.device);
  }
  const int64_t rows = o.batch / o.dp, row0 = mesh.coordinate("dp") * rows;
  double first = 0, last = 0, bubble_sum = 0;
  for (int64_t step = 0; step < o.steps; ++step) {
    auto data = task.sample(o.batch, o.tokens);
    Tensor inputs = data.inputs.slice(0, row0, row0 + rows).to(ctx.device);
    Tensor targets = data.targets.slice(0, row0, row0 + rows).to(ctx.device);
    const auto start = std::chrono::steady_clock::now();
    opt.zero_grad();
    const double value = gp.pipeline->step(inputs, targets).item();
    opt.step();
    synchronize(ctx.device);
    if (!o.trace.empty()) bubble_sum += gp.pipeline->measured_bubble();
    (step == 0 ? first : last) = value;
    if (main_rank) print_step(step, value, start);
  }
  if (main_rank) {
    if (o.steps > 1) std::printf("loss %.4f -> %.4f\n", first, last);
    if (!o.trace.empty() && o.steps > 0)
      std::printf("bubble: measured %.1f%%, schedule %.1f%% at equal stages\n", 100.0 * bubble_sum / double(o.steps),
                  100.0 * gp.pipeline->simulation().bubble());
  }
  if (!o.trace.empty()) {
    dist::trace::write_merged_trace(ctx.group.get(), ctx.device, o.trace);
    if (main_rank) std::printf("wrote the step timeline of %d rank(s) to %s\n", ctx.size, o.trace.c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  samples::Flags flags("model_parallel",
                       "the guide's six-block transformer split over devices in one process (layer-wise model "
                       "parallelism), or with --pp over processes as a pipeline; prints the placement and trains a "
                       "few steps on a synthetic task");
  Options o;
  o.devices = default_devices();
  flags.add("devices", &o.devices, "devices for the blocks, in order, separated by commas (cuda:0,cuda:1; cuda:0,cpu; "
                                   "cpu,cpu); the output layer goes on the last",
            {}, "LIST");
  flags.add("placement", &o.placement, "how blocks are dealt to the devices", {"round-robin", "contiguous"});
  flags.add("width", &o.width, "embedding width (the guide's embed_dim)", 1, 1 << 16);
  flags.add("heads", &o.heads, "attention heads (must divide --width)", 1, 1 << 10);
  flags.add("layers", &o.layers, "transformer blocks", 1, 1 << 10);
  flags.add("classes", &o.classes, "width of the output layer", 2, 1 << 16);
  flags.add("batch", &o.batch, "sequences a step", 1, 1 << 20);
  flags.add("tokens", &o.tokens, "positions a sequence", 1, 1 << 20);
  flags.add("steps", &o.steps, "training steps", 0, 1 << 30);
  flags.add("lr", &o.lr, "AdamW learning rate", 0.0, 10.0);
  flags.add("seed", &o.seed, "seed of the initialisation and the data", 0);
  flags.add("pp", &o.pp, "pipeline stages: the blocks cut over this many ranks, one process each (under a launcher)",
            1, 1024);
  flags.add("dp", &o.dp, "with --pp: data-parallel pipelines, each on its part of the batch (0: ranks / pp)", 0, 1024);
  flags.add("schedule", &o.schedule, "with --pp: the pipeline schedule", {"gpipe", "1f1b", "interleaved", "zb1"});
  flags.add("microbatches", &o.microbatches, "with --pp: micro-batches a step in each pipeline (0: 2 x pp)", 0, 4096);
  flags.add("stages-per-rank", &o.stages_per_rank, "with --schedule interleaved: virtual stages per rank", 2, 64);
  flags.add("trace", &o.trace,
            "with --pp: write every rank's step timeline here as Chrome-trace JSON (ui.perfetto.dev) and print the "
            "measured bubble",
            {}, "FILE");
  flags.add("device", &o.device, "with --pp: each rank's device (auto: the GPU of its local rank, else the CPU)",
            {"auto", "cpu", "cuda"});
  flags.parse(argc, argv);
  if (o.width % o.heads != 0)
    flags.fail("--heads " + std::to_string(o.heads) + " does not divide --width " + std::to_string(o.width));

  if (o.pp > 1) {
    for (const char* flag : {"devices", "placement"})
      if (flags.given(flag))
        flags.fail(std::string("--") + flag + " places the blocks on devices of one process, and --pp " +
                   std::to_string(o.pp) + " cuts them over ranks, each on the device its launcher gives it: drop --" +
                   flag + " (--device cpu|cuda|auto picks the ranks' devices)");
    if (flags.given("stages-per-rank") && o.schedule != "interleaved")
      flags.fail("--stages-per-rank " + std::to_string(o.stages_per_rank) + " is for --schedule interleaved, not " +
                 o.schedule);
    return samples::run_guarded("model_parallel", [&] { return train_pipelined(o, flags); });
  }
  for (const char* flag : {"dp", "schedule", "microbatches", "stages-per-rank", "trace", "device"})
    if (flags.given(flag))
      flags.fail(std::string("--") + flag + " sets up a pipeline over processes, and --pp is 1 (give --pp N under "
                 "loomrun, or --devices LIST to split the model in this process)");

  std::vector<Device> devices;
  try {
    devices = nn::parse_device_list(o.devices);
  } catch (const Error& e) {
    flags.fail("--devices: " + std::string(e.what()));
  }
  for (const Device& d : devices)
    if (d.is_cuda() && d.index >= cuda_device_count())
      flags.fail("--devices " + o.devices + ": " + d.str() + " is not visible (" +
                 std::to_string(cuda_device_count()) + " GPU(s) here; expected cpu or cuda:0 to cuda:N-1)");
  return samples::run_guarded("model_parallel", [&] { return train_in_one_process(o, devices); });
}
