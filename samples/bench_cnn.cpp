// bench_cnn: training throughput of SimpleCNN and ResNet-18 on one GPU, the number
// samples/bench_cnn_torch.py measures for PyTorch with the same model, batch, precision and
// optimizer (SGD with momentum 0.9, weight decay 5e-4). Synthetic images already on the GPU,
// so the figure is the engine's: forward, loss, backward, optimizer step.
//   bench_cnn [--model simplecnn|resnet18] [--image 1x28x28|3x32x32] [--batch N]
//             [--precision f32|bf16] [--warmup N] [--steps N] [--ddp] [--json FILE]
//             [--no-cudnn-graph] [--no-graph] [--device cuda|cpu] [--channels-last]
//             [--profile-step] [--no-conv-autotuning]
// --device cpu steps the model on the CPU (eagerly, in f32, timed by the host's clock): its
// step time and the most memory a step holds, where there is no GPU. --channels-last lays the
// batch out channels-last (MemoryFormat), which the CNN ops then keep, and on the GPU
// (without --ddp) the model's 4-d weights too (Module::to(MemoryFormat)).
// By default the step is captured as one CUDA graph after the first eager steps and
// replayed (layers/optim/captured_step.h), as train_cnn does: SimpleCNN's step is bound by
// kernel launches otherwise. --no-graph times eager steps. The peak memory of a captured
// step is the capture's (its allocations are the eager step's; replays allocate nothing).
// --ddp runs eagerly (its all-reduce runs on a stream of its own, outside the graph);
// it also runs the step through DistributedDataParallel over an NCCL group of one rank,
// alternating rounds of plain and DDP steps of the same model: the cost of data
// parallelism's machinery (hooks, buckets, the all-reduce) on one GPU.
// --no-cudnn-graph runs the convolutions through cuDNN's convolution API alone
// (Options::cudnn_graph_api, engine/options.h); --no-conv-autotuning takes the heuristics'
// first plan for each convolution instead of the fastest of its candidates
// (Options::conv_autotuning).
// --profile-step runs one more step after the timed ones between cudaProfilerStart and
// cudaProfilerStop, so that `ncu --profile-from-start off` sees exactly one step (a replay of
// the captured graph, unless --no-graph).
// Steps are bracketed by CUDA events and the median is reported. Prints one JSON object
// (images/s, ms per step, peak memory, the memory a step starts with and what its forward pass
// adds; with --ddp the DDP step and the plain one beside it)
// and appends it to --json.
#include <algorithm>
#include <chrono>
#include <functional>
#include <tuple>
#include <vector>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>

#include "engine/allocator.h"
#include "engine/autocast.h"
#include "engine/autograd.h"
#include "engine/ops.h"
#include "engine/options.h"
#include "layers/layers.h"
#include "layers/optim/captured_step.h"
#include "parallel/ddp.h"
#include "samples/common/flags.h"
#include "samples/common/metrics.h"
#include "samples/common/step_timing.h"

using namespace loom;

int main(int argc, char** argv) {
  std::string model_name = "resnet18", image = "3x32x32", precision, json;
  int64_t batch = 256, warmup = 10, steps = 50;
  std::string device = "cuda";
  bool ddp = false, bucket_view = false, cudnn_graph = options().cudnn_graph_api, graph = true, profile_step = false;
  bool conv_autotuning = options().conv_autotuning;
  bool channels_last = false;
  samples::Flags flags("bench_cnn", "Training throughput of a CNN on the GPU with synthetic data.");
  flags.add("model", &model_name, "the network", {"simplecnn", "resnet18"});
  flags.add("image", &image, "image shape", {"1x28x28", "3x32x32"});
  flags.add("batch", &batch, "images per step", 1);
  flags.add("precision", &precision, "f32 (TF32 products) or bf16 autocast (default: bf16 on a GPU, f32 on the CPU)",
            {"f32", "bf16"});
  flags.add("warmup", &warmup, "untimed steps first", 0);
  flags.add("steps", &steps, "timed steps", 1);
  flags.add_switch("ddp", &ddp, "train through DistributedDataParallel (NCCL, one rank)");
  flags.add_switch("bucket-view", &bucket_view, "with --ddp: gradients stay views into the buckets (no copy back)");
  flags.add("json", &json, "append the result here as a JSON line", {}, "FILE");
  flags.add_switch("cudnn-graph", &cudnn_graph, "convolutions on cuDNN's graph API plans (else its convolution API)");
  flags.add_switch("conv-autotuning", &conv_autotuning,
                   "each convolution shape runs the fastest of cuDNN's plans, timed once (else its heuristics' first)");
  flags.add_switch("graph", &graph, "capture the step as one CUDA graph after 2 eager steps and replay it (not with --ddp)");
  flags.add("device", &device, "where the step runs", {"cuda", "cpu"});
  flags.add_switch("channels-last", &channels_last, "the batch laid out channels-last (N, H, W, C in memory)");
  flags.add_switch("profile-step", &profile_step, "after the timed steps, one step inside cudaProfilerStart/Stop");
  if (const std::vector<std::string> positional = flags.parse(argc, argv); !positional.empty())
    flags.fail("unexpected argument '" + positional[0] + "': this program takes only --flags");
  const bool on_cpu = device == "cpu";
  if (precision.empty()) precision = on_cpu ? "f32" : "bf16";
  if (on_cpu && ddp) flags.fail("--ddp: DDP here runs over NCCL, on a GPU; not with --device cpu");
  if (on_cpu && profile_step) flags.fail("--profile-step: the profiler range is a GPU's (not with --device cpu)");
  if (ddp && profile_step) flags.fail("--profile-step profiles the plain step, not the --ddp one: pass one of them");
  if (on_cpu && precision != "f32") flags.fail("--precision " + precision + ": the CPU steps in f32 only");
  if (ddp || on_cpu) graph = false;
  constexpr int kEagerFirst = 2;  // the steps before the capture (CapturedStep's warmup)
  if (graph && warmup <= kEagerFirst)
    flags.fail("--warmup " + std::to_string(warmup) + ": with the step captured (the default), at least " +
               std::to_string(kEagerFirst + 1) + " untimed steps come first (" + std::to_string(kEagerFirst) +
               " eager, then the capture); or pass --no-graph");
  Options run_options = options();
  run_options.cudnn_graph_api = cudnn_graph;
  run_options.conv_autotuning = conv_autotuning;
  set_options(run_options);
  try {
    if (!on_cpu && cuda_device_count() == 0) flags.fail("needs a GPU and none is visible (--device cpu runs on the CPU)");
    const Device dev = on_cpu ? Device::cpu() : Device::cuda(0);
    const int64_t c = image[0] - '0', side = image == "1x28x28" ? 28 : 32;
    manual_seed(0);
    std::shared_ptr<nn::Module> model;
    if (model_name == "simplecnn") model = std::make_shared<nn::SimpleCNN>(c, side, 10);
    else model = nn::resnet18(10, c);
    model->to(dev);
    // On the GPU the weights follow a channels-last batch (cuDNN's NHWC kernels read them
    // that way), so no step converts one; DDP takes row-major parameters.
    if (channels_last && !on_cpu && !ddp) model->to(MemoryFormat::channels_last);
    model->train();
    optim::SGD opt(model->parameters(), {.lr = 0.01, .momentum = 0.9, .weight_decay = 5e-4});
    std::shared_ptr<nn::Module> trained = model;
    if (ddp) {
      auto store = std::make_shared<dist::TcpStore>("127.0.0.1", 0, dist::TcpStore::Role::server);
      dist::DDPOptions options;
      options.gradient_as_bucket_view = bucket_view;
      trained = std::make_shared<dist::DistributedDataParallel>(model, dist::new_nccl_group(store, 0, 1, dev), options);
    }
    Tensor x = randn({batch, c, side, side}, DType::f32, dev);
    if (channels_last) x = x.contiguous(MemoryFormat::channels_last);
    Tensor y = argmax(randn({batch, 10}, DType::f32, dev), 1);
    std::optional<DType> cast = precision == "bf16" ? std::optional<DType>(DType::bf16) : std::nullopt;
    // With --ddp, each timed step leaves four marks (start, forward done, backward done,
    // optimizer done), each a host clock reading and an event on the compute stream: the host's
    // time to issue each phase and the GPU's time to run it, per kind of step (DDP's hooks,
    // copies and all-reduce launches run in backward).
    using Clock = std::chrono::steady_clock;
    struct Marks {
      std::vector<Clock::time_point> host;
      std::vector<std::unique_ptr<Event>> gpu;
    } plain_marks, ddp_marks;
    bool timing = false;
    auto mark = [&](Marks& marks) {
      if (!timing) return;
      marks.host.push_back(Clock::now());
      marks.gpu.push_back(std::make_unique<Event>());
      marks.gpu.back()->record(compute_stream(dev));
    };
    // Where the memory goes, read on the second eager step (momentum exists by then): what the
    // step holds once the gradients are dropped (weights, momentum, the batch) and what the
    // forward pass adds (the activations kept for backward, with the loss). The peak minus
    // both is backward's: gradients, and workspace.
    int64_t plain_steps = 0;
    double start_mib = 0, forward_mib = 0;
    auto allocated_mib = [&] { return double(memory::stats(dev).allocated) / (1 << 20); };
    auto step = [&](const std::shared_ptr<nn::Module>& net, Marks& marks) {
      const bool probe = net == model && plain_steps++ == 1;  // not the --ddp steps
      mark(marks);
      opt.zero_grad();
      if (probe) start_mib = allocated_mib();
      Tensor loss;
      {
        AutocastGuard guard(cast);
        loss = cross_entropy(net->forward(x).to(DType::f32), y);
      }
      if (probe) forward_mib = allocated_mib() - start_mib;
      mark(marks);
      loss.backward();
      mark(marks);
      opt.step();
      mark(marks);
      return loss;
    };
    std::function<void()> plain = [&] { step(model, plain_marks); },
                          data_parallel = [&] { step(trained, ddp_marks); };
    std::optional<optim::CapturedStep> captured;
    if (graph) {
      captured.emplace(dev, std::vector<optim::Optimizer*>{&opt}, [&] { return step(model, plain_marks); }, kEagerFirst);
      plain = [&] { captured->run(); };
    }
    for (int64_t i = 0; i < warmup; ++i) {
      // A captured step's memory is counted over its capture, which allocates as an eager step.
      if (graph && i == kEagerFirst) {
        synchronize(dev);
        memory::reset_peak(dev);
      }
      plain();
      if (ddp) data_parallel();
    }
    synchronize(dev);
    if (!graph) memory::reset_peak(dev);
    std::vector<double> plain_ms, ddp_ms;
    if (ddp) {
      // Plain and DDP steps of the same model in alternating rounds, so both see the same clocks.
      timing = true;
      std::tie(plain_ms, ddp_ms) = samples::alternating_steps(plain, data_parallel, 6, std::max<int64_t>(1, steps / 6),
                                                              dev);
      // Median ms of one phase (0 forward, 1 backward, 2 optimizer) on the host or the GPU;
      // the rounds ended synchronised, so every event is complete.
      auto phase_ms = [](const Marks& m, int phase, bool on_gpu) {
        std::vector<double> ms;
        for (size_t i = 0; i + 3 < m.host.size(); i += 4)
          ms.push_back(on_gpu ? m.gpu[i + phase + 1]->elapsed_ms_since(*m.gpu[i + phase])
                              : std::chrono::duration<double, std::milli>(m.host[i + phase + 1] - m.host[i + phase]).count());
        return samples::median(ms);
      };
      // One line: each phase as plain -> ddp with DDP's extra, host first, then GPU, e.g.
      //   ... host fwd 3.10->3.12 (+0.02) bwd ... | GPU fwd ...
      const char* const phase_names[] = {"fwd", "bwd", "opt"};
      std::string line = "bench_cnn --ddp: median ms per phase, plain->ddp (+ddp's extra):";
      for (bool on_gpu : {false, true}) {
        line += on_gpu ? " | GPU" : " host";
        double plain_sum = 0, ddp_sum = 0;
        for (int phase = 0; phase < 3; ++phase) {
          const double a = phase_ms(plain_marks, phase, on_gpu), b = phase_ms(ddp_marks, phase, on_gpu);
          plain_sum += a;
          ddp_sum += b;
          char text[64];
          std::snprintf(text, sizeof text, " %s %.3f->%.3f (%+.3f)", phase_names[phase], a, b, b - a);
          line += text;
        }
        char text[64];
        std::snprintf(text, sizeof text, ", sum %.3f->%.3f (%+.1f%%)", plain_sum, ddp_sum,
                      100.0 * (ddp_sum / plain_sum - 1));
        line += text;
      }
      std::fprintf(stderr, "%s\n", line.c_str());
    } else {
      plain_ms = samples::timed_steps(plain, steps, dev);
    }
    if (profile_step) samples::profiled_step(plain, dev);
    const double step_ms = samples::median(ddp ? ddp_ms : plain_ms);
    const double peak_mib = double(memory::stats(dev).peak_allocated) / (1 << 20);
    samples::MetricRecord record{{"engine", std::string("loom")},
                                 {"model", model_name},
                                 {"image", image},
                                 {"batch", batch},
                                 {"precision", precision},
                                 {"ddp", int64_t(ddp) + int64_t(ddp && bucket_view)},
                                 {"graph", int64_t(graph)},
                                 {"channels_last", int64_t(channels_last)},
                                 {"conv_autotuning", int64_t(conv_autotuning)},
                                 {"images_per_s", double(batch) / (step_ms * 1e-3)},
                                 {"ms_per_step", step_ms},
                                 {"peak_mib", peak_mib},
                                 {"start_mib", start_mib},
                                 {"forward_mib", forward_mib}};
    if (ddp) record.push_back({"plain_ms_per_step", samples::median(plain_ms)});
    std::printf("%s\n", samples::to_json(record).c_str());
    if (!json.empty()) samples::MetricsLog(json).write(record);
    return 0;
  } catch (const Error& e) {
    std::fprintf(stderr, "bench_cnn: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {  // std::bad_alloc and the like: a message, not std::terminate
    std::fprintf(stderr, "bench_cnn: %s\n", e.what());
    return 1;
  }
}
