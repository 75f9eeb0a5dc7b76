// bench_pipeline: the bubble and the memory of each pipeline schedule, measured on stages of
// equal cost, beside the schedule's formula. Every rank holds one stage of --blocks GPT blocks
// (width --width, --heads heads) on (rows, --tokens, width) activations; stage 0 reads a fixed
// random input, the last stage's loss is the mean square of its output, so the stages differ
// only by that and by stage 0 computing no input gradient. For each schedule and micro-batch
// count: --warmup steps, then --steps steps with tracing on; the measured bubble is the share
// of each step's schedule window a rank spent outside forward, backward and backward-weight,
// averaged over the ranks and steps (parallel/pipeline.h, measured_bubble), and the memory is
// the most bytes in use above the step's start on each rank (last_step_peak_bytes). Beside
// them, the mean forward, backward and (zb1) weight-half spans over all ranks, and the bubble
// the schedule's own order reaches at those costs on every rank (check_schedule's
// simulation), then at each stage's own mean spans ("per stage"): stage 0's input half is
// empty, the last stage's forward holds the loss, and an input half can cost more than its
// weight half. What the measured bubble has above the per-stage figure is the executor's:
// transfers and bookkeeping. Last, the floor no schedule of stages with those spans can go
// below (bubble_floor: the last rank waits for the first micro-batch's forwards, then has all
// its work to do).
//
//   loomrun --nproc-per-node 4 bench_pipeline --device cpu --microbatches 4,16
//
// Rank 0 prints one row per (schedule, m), each followed by every stage's own mean spans, and,
// with --json, writes them as JSON lines (the stages' spans as stageN_forward_ms and so on);
// with --trace FILE, the last row's last step as one timeline of every rank.
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "engine/ops.h"
#include "layers/checkpoint_text.h"
#include "layers/models/gpt.h"
#include "parallel/init.h"
#include "parallel/pipeline.h"
#include "parallel/trace.h"
#include "samples/common/flags.h"
#include "samples/common/metrics.h"
#include "samples/common/program.h"

using namespace loom;
using namespace loom::dist::pipeline;

namespace {

struct Options {
  std::string device = "cpu", schedules = "gpipe,1f1b,zb1", microbatches = "4,16", json, trace;
  int64_t blocks = 2, width = 128, heads = 4, tokens = 64, rows = 2, warmup = 2, steps = 5, timeout_s = 300;
};

// One stage: --blocks GPT blocks; the last stage ends in the mean square of its output.
class EqualStage : public nn::Module {
 public:
  EqualStage(const Options& o, bool last) : last_(last) {
    for (int64_t i = 0; i < o.blocks; ++i)
      blocks_.push_back(register_module(std::to_string(i), std::make_shared<nn::GPTBlock>(o.width, o.heads, o.blocks)));
  }
  Tensor forward(const Tensor& x) override {
    Tensor h = x;
    for (auto& b : blocks_) h = b->forward(h);
    return last_ ? mean(mul(h, h)) : h;
  }
  std::string type_name() const override { return "EqualStage"; }

 private:
  bool last_;
  std::vector<std::shared_ptr<nn::GPTBlock>> blocks_;
};

int run(int argc, char** argv) {
  Options o;
  samples::Flags flags("bench_pipeline",
                       "Measures each pipeline schedule's bubble and memory on equal stages (one per rank), beside\n"
                       "the schedule's formula. Run it under a launcher, one rank per stage.");
  flags.add("device", &o.device, "cpu, or cuda (one GPU per rank)", {}, "DEVICE");
  flags.add("schedules", &o.schedules, "comma-separated: gpipe, 1f1b, interleaved, zb1", {}, "LIST");
  flags.add("microbatches", &o.microbatches, "comma-separated micro-batch counts", {}, "LIST");
  flags.add("blocks", &o.blocks, "GPT blocks a stage", 1, 64);
  flags.add("width", &o.width, "block width", 8, 1 << 14);
  flags.add("heads", &o.heads, "attention heads (must divide --width)", 1, 256);
  flags.add("tokens", &o.tokens, "tokens a sequence", 1, 1 << 16);
  flags.add("rows", &o.rows, "sequences a micro-batch", 1, 1 << 16);
  flags.add("warmup", &o.warmup, "untimed steps first", 0, 1000);
  flags.add("steps", &o.steps, "measured steps", 1, 100000);
  flags.add("timeout-s", &o.timeout_s, "seconds before a stuck transfer ends the run", 1);
  flags.add("json", &o.json, "append one JSON line per row here", {}, "FILE");
  flags.add("trace", &o.trace, "write the last row's last step as a Chrome-trace / Perfetto timeline of every rank",
            {}, "FILE");
  const auto positional = flags.parse(argc, argv);
  samples::reject_positional(flags, positional, "");
  if (o.width % o.heads != 0)
    flags.fail("--heads " + std::to_string(o.heads) + " does not divide --width " + std::to_string(o.width));
  std::vector<ScheduleKind> kinds;
  for (const std::string& name : nn::checkpoint_text::split_list(o.schedules)) kinds.push_back(parse_schedule(name));
  std::vector<int> counts;
  for (const std::string& m : nn::checkpoint_text::split_list(o.microbatches)) {
    char* end = nullptr;
    long v = std::strtol(m.c_str(), &end, 10);
    if (*end != '\0' || v < 1) flags.fail("--microbatches: '" + m + "' is not a positive count");
    counts.push_back(int(v));
  }
  if (kinds.empty() || counts.empty()) flags.fail("--schedules and --microbatches must each name at least one");

  dist::DistContext ctx = dist::init_distributed(o.device, std::chrono::seconds(o.timeout_s));
  if (!ctx.active) flags.fail("run it under a launcher with 2 or more ranks (loomrun --nproc-per-node 4 ...)");
  const int p = ctx.size, rank = ctx.rank;
  const bool main_rank = ctx.is_main();
  samples::MetricsLog log(main_rank ? o.json : "");
  if (main_rank)
    std::printf("bench_pipeline: %d stages of %lld blocks (width %lld, %lld heads), micro-batches of %lld x %lld "
                "tokens, on %s; %lld measured steps after %lld\n"
                "%-12s %4s %10s %10s %10s %10s %10s %14s %14s %12s %20s\n",
                p, (long long)o.blocks, (long long)o.width, (long long)o.heads, (long long)o.rows,
                (long long)o.tokens, ctx.device.str().c_str(), (long long)o.steps, (long long)o.warmup, "schedule",
                "m", "bubble", "formula", "at costs", "per stage", "floor", "peak rank 0", "peak max", "step ms", "F / B (I) / W ms");
  if (main_rank && !o.trace.empty()) dist::trace::write_chrome_trace(o.trace, {});  // fails now, not at the end
  dist::trace::set_enabled(false);
  for (ScheduleKind kind : kinds)
    for (int m : counts) {
      if (kind == ScheduleKind::interleaved && m % p != 0) {
        if (main_rank) std::printf("%-12s %4d   (skipped: m must be a multiple of %d)\n", schedule_name(kind), m, p);
        continue;
      }
      PipelineOptions options{.schedule = kind, .microbatches = m,
                              .stages_per_rank = kind == ScheduleKind::interleaved ? 2 : 1, .device = ctx.device};
      const int v = options.stages_per_rank;
      std::vector<Stage> stages;
      manual_seed(uint64_t(rank));
      for (int s = rank; s < p * v; s += p) {
        auto module = std::make_shared<EqualStage>(o, s == p * v - 1);
        module->to(ctx.device);
        Stage st;
        st.index = s;
        st.module = module;
        st.forward = [module](const Tensor& x, const Tensor&) { return module->forward(x); };
        const int64_t T = o.tokens, C = o.width;
        st.input_shape = st.output_shape = [T, C](int64_t rows) { return Shape{rows, T, C}; };
        stages.push_back(std::move(st));
      }
      Pipeline pipe(ctx.group, std::move(stages), options);
      Tensor input = randn({o.rows * m, o.tokens, o.width}, DType::f32, ctx.device);
      Tensor targets = zeros({o.rows * m}, DType::f32, ctx.device);
      double bubble = 0, ms = 0;
      int64_t peak = 0;
      // Each stage's forward, backward (the input half under zb1) and weight-half spans: their
      // total milliseconds and counts (6 numbers a stage, this rank's stages filled), for the
      // costs the schedule is simulated at.
      const int stage_count = p * v;
      std::vector<double> spans(size_t(6 * stage_count), 0.0);
      for (int64_t step = 0; step < o.warmup + o.steps; ++step) {
        const bool measured = step >= o.warmup;
        dist::trace::clear();
        dist::trace::set_enabled(measured, ctx.device);
        for (auto& s : pipe.stages()) s.module->zero_grad();
        const auto start = std::chrono::steady_clock::now();
        pipe.step(input, targets);
        const double elapsed = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
        if (!measured) continue;
        bubble += pipe.measured_bubble();
        for (const dist::trace::Event& e : dist::trace::events()) {
          const int k = e.category == dist::trace::Category::forward           ? 0
                        : e.category == dist::trace::Category::backward        ? 1
                        : e.category == dist::trace::Category::backward_weight ? 2
                                                                               : -1;
          if (k < 0 || e.stage < 0 || e.stage >= stage_count) continue;
          spans[size_t(6 * e.stage + 2 * k)] += double(e.end_ns - e.start_ns) / 1e6;
          spans[size_t(6 * e.stage + 2 * k + 1)] += 1;
        }
        ms += elapsed;
        peak = std::max(peak, pipe.last_step_peak_bytes());
        dist::trace::set_enabled(false);
        const bool last_row = kind == kinds.back() && m == counts.back();
        if (last_row && step + 1 == o.warmup + o.steps && !o.trace.empty()) {
          dist::trace::write_merged_trace(ctx.group.get(), ctx.device, o.trace);
          if (main_rank) std::printf("wrote the timeline of the last step of %s at m = %d to %s\n",
                                     schedule_name(kind), m, o.trace.c_str());
        }
      }
      bubble /= double(o.steps);
      ms /= double(o.steps);
      // Rank 0's peak and the largest over ranks.
      Tensor peaks = zeros({p}, DType::f64);
      peaks.data<double>()[rank] = double(peak);
      if (ctx.device.is_cuda()) peaks = peaks.to(ctx.device);
      ctx.group->all_reduce(peaks)->wait();
      std::vector<double> all = peaks.to(Device::cpu()).to_vector<double>();
      double peak_max = 0;
      for (double b : all) peak_max = std::max(peak_max, b);
      const double formula = kind == ScheduleKind::zero_bubble_h1
                                 ? check_schedule(pipe.schedule(), {.forward = 1, .backward = 2, .backward_input = 1,
                                                                    .backward_weight = 1}).bubble()
                                 : formula_bubble(kind, p, m, v);
      // The mean span of each kind, over every stage (printed) and per stage, and the bubble
      // the schedule's own order reaches at each stage's costs (the same on every rank; see
      // the header comment).
      Tensor totals = from_vector(spans, {int64_t(spans.size())});
      if (ctx.device.is_cuda()) totals = totals.to(ctx.device);
      ctx.group->all_reduce(totals)->wait();
      const std::vector<double> t = totals.to(Device::cpu()).to_vector<double>();
      auto mean_of = [&](int first, int last, int k) {
        double sum = 0, count = 0;
        for (int st = first; st < last; ++st) {
          sum += t[size_t(6 * st + 2 * k)];
          count += t[size_t(6 * st + 2 * k + 1)];
        }
        return count > 0 ? sum / count : 0.0;
      };
      const bool split = kind == ScheduleKind::zero_bubble_h1;
      auto costs_of = [&](int first, int last) {
        const double f = mean_of(first, last, 0), b = mean_of(first, last, 1), w = mean_of(first, last, 2);
        return split ? Costs{.forward = f, .backward = b + w, .backward_input = b, .backward_weight = w}
                     : Costs{.forward = f, .backward = b, .backward_input = b / 2, .backward_weight = b / 2};
      };
      const double f = mean_of(0, stage_count, 0), b = mean_of(0, stage_count, 1), w = mean_of(0, stage_count, 2);
      std::vector<Costs> stage_costs;
      for (int st = 0; st < stage_count; ++st) stage_costs.push_back(costs_of(st, st + 1));
      const bool timed = f > 0 && b + w > 0;
      const double at_costs = timed ? check_schedule(pipe.schedule(), costs_of(0, stage_count)).bubble() : 0.0;
      const double at_stage_costs = timed ? check_schedule(pipe.schedule(), stage_costs).bubble() : 0.0;
      const double floor = timed ? bubble_floor(pipe.schedule(), stage_costs) : 0.0;
      if (main_rank) {
        char costs_text[64];
        std::snprintf(costs_text, sizeof costs_text, split ? "%.2f / %.2f / %.2f" : "%.2f / %.2f", f, b, w);
        std::printf("%-12s %4d %9.1f%% %9.1f%% %9.1f%% %9.1f%% %9.1f%% %14.0f %14.0f %12.1f %20s\n",
                    schedule_name(kind), m, 100 * bubble, 100 * formula, 100 * at_costs, 100 * at_stage_costs,
                    100 * floor, all[0], peak_max, ms, costs_text);
        // Each stage's own mean spans: what "per stage" and "floor" were computed from.
        std::string per_stage = "  per stage F / B (I) / W ms:";
        samples::MetricRecord record{{"schedule", schedule_name(kind)}, {"microbatches", m}, {"ranks", p},
                                     {"blocks", o.blocks}, {"width", o.width}, {"heads", o.heads},
                                     {"bubble", bubble}, {"formula", formula}, {"bubble_at_costs", at_costs},
                                     {"bubble_at_stage_costs", at_stage_costs}, {"bubble_floor", floor},
                                     {"forward_ms", f}, {"backward_ms", b}, {"weight_ms", w},
                                     {"peak_bytes_rank0", all[0]}, {"peak_bytes_max", peak_max}, {"step_ms", ms},
                                     {"device", ctx.device.str()}};
        for (int st = 0; st < stage_count; ++st) {
          const double sf = mean_of(st, st + 1, 0), sb = mean_of(st, st + 1, 1), sw = mean_of(st, st + 1, 2);
          char text[64];
          std::snprintf(text, sizeof text, split ? "  %d: %.2f / %.2f / %.2f" : "  %d: %.2f / %.2f", st, sf, sb, sw);
          per_stage += text;
          const std::string key = "stage" + std::to_string(st);
          record.push_back({key + "_forward_ms", sf});
          record.push_back({key + "_backward_ms", sb});
          record.push_back({key + "_weight_ms", sw});
        }
        std::printf("%s\n", per_stage.c_str());
        std::fflush(stdout);
        log.write(record);
      }
    }
  if (main_rank)
    std::printf("(formula: (p-1)/(m+p-1) for gpipe and 1f1b, (p-1)/(vm+p-1) interleaved, zb1 its unit-cost "
                "simulation with F = I = W; at costs: the schedule simulated at the mean measured spans, F forward, "
                "B backward (zb1: its input half I), W zb1's weight half; per stage: simulated at each stage's own "
                "mean spans; floor: no schedule of stages with those spans goes below it)\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return samples::run_guarded("bench_pipeline", [&] { return run(argc, argv); });
}
