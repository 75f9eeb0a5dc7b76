// The guide's transformer as a pipeline (parallel/guide_pipeline.h): its stages hold the whole
// model's parameters under the same names, once each; 2- and 3-stage pipelines on forked CPU
// ranks over Gloo, under 1F1B and ZB-H1, train 5 AdamW steps equal to one process training
// GuideTransformer on the whole batch (losses and weights, relative 1e-5, in f64); and the
// model_parallel program under loomrun with --pp 2 prints its stages, its schedule and a
// falling loss, and names the flags of a combination it refuses.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <regex>
#include <set>

#include "engine/autograd.h"
#include "engine/ops.h"
#include "layers/models/gpt_stage.h"
#include "layers/optim/adam.h"
#include "parallel/guide_pipeline.h"
#include "ranks.h"
#include "run_command.h"

namespace loom::dist::pipeline {
namespace {

using testing::require;
using testing::run_ranks;

const nn::GuideTransformerConfig kConfig{.width = 8, .heads = 2, .layers = 6, .classes = 5};
constexpr int64_t kT = 4;
constexpr int kSteps = 5;

// The synthetic task's batch for a step, the same on every rank: inputs (rows, T, C) f64,
// targets (rows, T) i64.
nn::GuideSyntheticTask::Batch batch(int64_t rows, int step) {
  static const nn::GuideSyntheticTask task(kConfig.width, kConfig.classes);
  manual_seed(100 + uint64_t(step));
  auto b = task.sample(rows, kT);
  b.inputs = b.inputs.to(DType::f64);
  return b;
}

double relative(const Tensor& a, const Tensor& b) {
  Tensor d = sub(a, b);
  double num = std::sqrt(sum(mul(d, d)).item()), den = std::sqrt(sum(mul(b, b)).item());
  return num / std::max(den, 1e-30);
}

// The whole model in f64, as every run starts it.
std::map<std::string, Tensor> initial_weights() {
  manual_seed(7);
  nn::GuideTransformer whole(kConfig);
  whole.to(DType::f64);
  std::map<std::string, Tensor> out;
  for (auto& [name, p] : whole.named_parameters()) out[name] = p;
  return out;
}

struct Reference {
  std::vector<double> losses;
  std::map<std::string, Tensor> weights;  // after the last step
};

// One process, the whole model, the whole batch.
Reference train_alone(int64_t rows) {
  manual_seed(7);
  nn::GuideTransformer whole(kConfig);
  whole.to(DType::f64);
  optim::AdamW opt(whole.parameters(), {.lr = 1e-2});
  Reference ref;
  for (int step = 0; step < kSteps; ++step) {
    auto b = batch(rows, step);
    opt.zero_grad();
    Tensor loss = whole.loss(b.inputs, b.targets);
    loss.backward();
    opt.step();
    ref.losses.push_back(loss.item());
  }
  for (auto& [name, p] : whole.named_parameters()) ref.weights[name] = p;
  return ref;
}

TEST(GuidePipeline, StagesHoldTheModelsParametersUnderItsNamesOnceEach) {
  const std::map<std::string, Tensor> whole = initial_weights();
  for (int stages : {1, 2, 3, 6}) {
    SCOPED_TRACE(std::to_string(stages) + " stages");
    const std::vector<int64_t> cuts = dist::pipeline::stage_cuts({}, kConfig.layers, stages);
    std::set<std::string> held;
    for (int s = 0; s < stages; ++s) {
      nn::GuideTransformerStage stage(kConfig, cuts[size_t(s)], cuts[size_t(s) + 1], s == stages - 1);
      for (auto& [name, p] : stage.named_parameters()) {
        ASSERT_TRUE(whole.count(name)) << "stage " << s << " holds " << name << ", which the model does not";
        EXPECT_EQ(p.shape(), whole.at(name).shape()) << name;
        EXPECT_TRUE(held.insert(name).second) << name << " is held by two stages";
      }
    }
    EXPECT_EQ(held.size(), whole.size());
  }
}

// Builds this rank's stages with the whole model's starting weights, trains kSteps and
// compares each loss and every weight with `ref`.
void train_pipeline(std::shared_ptr<ProcessGroup> group, ScheduleKind kind, int microbatches, int64_t rows,
                    const Reference& ref) {
  PipelineOptions options{
      .schedule = kind, .microbatches = microbatches, .activation_dtype = DType::f64, .data_parallel = nullptr};
  GuidePipeline gp = make_guide_pipeline(group, kConfig, kT, options);
  const std::map<std::string, Tensor> initial = initial_weights();
  for (auto& m : gp.modules) {
    m->to(DType::f64);
    NoGradGuard no_grad;
    for (auto& [name, p] : m->named_parameters()) {
      require(initial.count(name), "stage parameter ", name, " is not the model's");
      copy_(p, initial.at(name));
    }
  }
  optim::AdamW opt(gp.parameters(), {.lr = 1e-2});
  const std::string what = std::string(schedule_name(kind)) + " on " + std::to_string(group->size()) + " stages";
  for (int step = 0; step < kSteps; ++step) {
    auto b = batch(rows, step);
    opt.zero_grad();
    const double loss = gp.pipeline->step(b.inputs, b.targets).item();
    opt.step();
    const double want = ref.losses[size_t(step)];
    require(std::abs(loss - want) <= 1e-5 * std::abs(want), what, ": step ", step, " loss ", loss,
            " but one process had ", want);
  }
  for (auto& m : gp.modules)
    for (auto& [name, p] : m->named_parameters()) {
      const double r = relative(p, ref.weights.at(name));
      require(r <= 1e-5, what, ": ", name, " differs from one process's by ", r, " (relative)");
    }
}

TEST(GuidePipeline, TwoAndThreeStagesTrainLikeOneProcessUnder1F1BAndZeroBubble) {
  for (auto kind : {ScheduleKind::one_f_one_b, ScheduleKind::zero_bubble_h1})
    for (int p : {2, 3}) {
      const int m = 2 * p;
      const int64_t rows = 2 * m;  // two rows a micro-batch
      const Reference ref = train_alone(rows);
      SCOPED_TRACE(std::string(schedule_name(kind)) + " p=" + std::to_string(p));
      run_ranks(p, [&](int, std::shared_ptr<ProcessGroup> world) { train_pipeline(world, kind, m, rows, ref); });
    }
}

std::string program(const char* name) {
  const char* path = std::getenv(name);
  return path ? path : "";
}

TEST(GuidePipeline, ModelParallelWithPp2PrintsItsScheduleAndALossThatFalls) {
  const std::string trace = ::testing::TempDir() + "/guide_pp_trace.json";
  auto r = testing::run_command(program("LOOMRUN") + " --nproc-per-node 2 " + program("MODEL_PARALLEL") +
                                    " --device cpu --pp 2 --schedule 1f1b --width 32 --heads 4 --layers 2 --batch 16"
                                    " --tokens 8 --steps 40 --lr 3e-3 --trace '" + trace + "'",
                                300);
  ASSERT_EQ(r.code, 0) << r.output;
  for (const char* line : {"stage 0 on pipeline rank 0: blocks 0-0",
                           "stage 1 on pipeline rank 1: blocks 1-1, the output layer and the loss",
                           "1f1b: 2 ranks, 2 stages, 4 micro-batches", "rank 0 | F0.0", "rank 1 | [ rA0.1 ] F0.1",
                           "bubble: measured"})
    EXPECT_NE(r.output.find(line), std::string::npos) << line << "\n" << r.output;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.output, m, std::regex("loss ([0-9.]+) -> ([0-9.]+)"))) << r.output;
  EXPECT_LT(std::stod(m[2]), 0.8 * std::stod(m[1])) << r.output;
  EXPECT_TRUE(std::filesystem::exists(trace)) << r.output;
}

TEST(GuidePipeline, ModelParallelNamesTheFlagsItCannotCombine) {
  struct Case {
    std::string args;
    std::vector<std::string> expected;
  };
  const std::vector<Case> cases = {
      {"--pp 2 --devices cpu,cpu", {"--devices", "--pp 2"}},
      {"--pp 2 --placement contiguous", {"--placement", "--pp 2"}},
      {"--schedule zb1", {"--schedule sets up a pipeline", "--pp is 1"}},
      {"--pp 2 --batch 30", {"--batch 30 does not cut into --dp 1 x --microbatches 4"}},
      {"--pp 2 --layers 1", {"--pp 2 asks for 2 stages, but --layers is 1"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.args);
    auto r = testing::run_command(program("LOOMRUN") + " --nproc-per-node 2 " + program("MODEL_PARALLEL") +
                                      " --device cpu --width 16 --heads 2 --steps 1 " + c.args,
                                  120);
    EXPECT_NE(r.code, 0) << r.output;
    for (const std::string& e : c.expected) EXPECT_NE(r.output.find(e), std::string::npos) << e << "\n" << r.output;
    EXPECT_EQ(r.output.find("terminate called"), std::string::npos) << r.output;
  }
}

}  // namespace
}  // namespace loom::dist::pipeline
