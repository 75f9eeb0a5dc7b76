// Pipeline::evaluate on forked CPU ranks over Gloo, against one process computing the whole
// model's loss on the whole batch: on 2 ranks under 1F1B's layout and the interleaved one (4
// stages, two a rank), for a batch that cuts into the micro-batches, one that does not (7
// rows into 4) and one of fewer rows than micro-batches, equal within 1e-5 relative (f64),
// on every rank, and no parameter gets a gradient. Between training steps it changes nothing:
// the steps around it give the losses of steps without it.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <random>

#include "engine/autograd.h"
#include "engine/ops.h"
#include "layers/models/gpt.h"
#include "layers/optim/adam.h"
#include "parallel/gpt_pipeline.h"
#include "ranks.h"
#include "token_batches.h"

namespace loom::dist::pipeline {
namespace {

using testing::require;
using testing::run_ranks;

const nn::GPTConfig kConfig{.vocab_size = 32, .context = 8, .layers = 4, .heads = 2, .width = 8};
constexpr int64_t kT = 8;

// Token ids and next-token targets (rows, T), the same on every rank for a seed.
std::pair<Tensor, Tensor> batch(int64_t rows, int seed) {
  return testing::token_batch(rows, kT, 32, uint32_t(99 + seed));
}

// The whole GPT of seed 7 in f64.
std::unique_ptr<nn::GPT> whole_model() {
  manual_seed(7);
  auto gpt = std::make_unique<nn::GPT>(kConfig);
  gpt->to(DType::f64);
  return gpt;
}

// This rank's stages, set to whole_model()'s weights by name.
GPTPipeline pipeline(std::shared_ptr<ProcessGroup> group, ScheduleKind kind) {
  const PipelineOptions options{.schedule = kind, .microbatches = 4,
                                .stages_per_rank = kind == ScheduleKind::interleaved ? 2 : 1,
                                .activation_dtype = DType::f64};
  GPTPipeline gp = make_gpt_pipeline(group, kConfig, kT, options);
  const auto gpt = whole_model();
  std::map<std::string, Tensor> weights;
  for (auto& [name, p] : gpt->named_parameters()) weights[name] = p;
  weights["lm_head.weight"] = gpt->lm_head;
  NoGradGuard no_grad;
  for (auto& m : gp.modules) {
    m->to(DType::f64);
    for (auto& [name, p] : m->named_parameters()) {
      require(weights.count(name), "stage parameter ", name, " is not the model's");
      copy_(p, weights.at(name));
    }
  }
  return gp;
}

void evaluates_like_one_process(ScheduleKind kind) {
  run_ranks(2, [&](int rank, std::shared_ptr<ProcessGroup> world) {
    GPTPipeline gp = pipeline(world, kind);
    const auto gpt = whole_model();
    for (int64_t rows : {8, 7, 3}) {
      auto [ids, targets] = batch(rows, int(rows));
      const double want = gpt->loss(ids, targets).item();
      const double got = gp.pipeline->evaluate(ids, targets).item();
      require(std::abs(got - want) <= 1e-5 * std::abs(want), schedule_name(kind), ", rank ", rank, ", ", rows,
              " rows: the pipeline's loss is ", got, ", one process's ", want);
    }
    for (const auto& m : gp.modules)
      for (const auto& [name, p] : m->named_parameters())
        require(!p.grad().defined(), "rank ", rank, ": ", name, " got a gradient from evaluate");
  });
}

TEST(PipelineEvaluate, EqualsOneProcessOnTwoRanks) { evaluates_like_one_process(ScheduleKind::one_f_one_b); }

TEST(PipelineEvaluate, EqualsOneProcessOnTwoRanksOfTwoStagesEach) {
  evaluates_like_one_process(ScheduleKind::interleaved);
}

// Training steps with an evaluation between them give the losses of training steps alone.
TEST(PipelineEvaluate, LeavesTrainingAsItWas) {
  run_ranks(2, [&](int, std::shared_ptr<ProcessGroup> world) {
    auto train = [&](bool evaluate) {
      GPTPipeline gp = pipeline(world, ScheduleKind::one_f_one_b);
      optim::AdamW opt(gp.parameters(), {.lr = 1e-2});
      std::vector<double> losses;
      for (int step = 0; step < 3; ++step) {
        auto [ids, targets] = batch(8, 100 + step);
        opt.zero_grad();
        losses.push_back(gp.pipeline->step(ids, targets).item());
        opt.step();
        if (evaluate) {
          auto [vi, vt] = batch(5, 200 + step);
          gp.pipeline->evaluate(vi, vt);
        }
      }
      return losses;
    };
    const std::vector<double> plain = train(false), evaluated = train(true);
    require(plain == evaluated, "the steps' losses changed when evaluations ran between them");
  });
}

}  // namespace
}  // namespace loom::dist::pipeline
