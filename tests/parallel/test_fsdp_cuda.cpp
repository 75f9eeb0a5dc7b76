// FullyShardedDataParallel over NCCL on a GPU, at world size 1: one process, a group of one over
// a TcpStore on 127.0.0.1 (as bench_gpt makes it). A tiny GPT on cuda:0, one unit per block,
// takes 5 clipped AdamW steps like the same GPT trained plainly on the GPU, under ZeRO-3 and
// ZeRO-2 (TF32 off), and with bf16 parameters and f32 reduction like the same mixed precision
// done by hand; a pipeline stage sharded over NCCL likewise; and a unit's full parameters hold
// allocator memory exactly while it is gathered.
//
// Over one rank the collectives copy, so this proves FSDP's CUDA path (its copies on the compute
// stream, Work::wait() ordering them after NCCL, storages released to and re-acquired from the
// caching allocator, NCCL's all_gather, reduce_scatter(avg) and f64 all_reduce), not the
// arithmetic of shards across ranks, which test_fsdp.cpp proves on CPU ranks over Gloo.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "engine/allocator.h"
#include "engine/autograd.h"
#include "engine/ops.h"
#include "kernels/config.h"
#include "kernels/core/precision.h"
#include "layers/models/gpt.h"
#include "layers/optim/adam.h"
#include "layers/optim/clip.h"
#include "parallel/fsdp.h"
#include "parallel/gpt_pipeline.h"
#include "parallel/process_group.h"
#include "parallel/store.h"
#include "tests/common/gpu.h"
#include "tests/common/tensor_checks.h"

namespace loom::dist {
namespace {

using ::loom::test::relative_difference;
using ::loom::test::Tf32Off;

#define LOOM_REQUIRE_NCCL()                                                       \
  do {                                                                            \
    LOOM_REQUIRE_CUDA();                                                          \
    if (!LOOM_WITH_NCCL) GTEST_SKIP() << "Loom was built without NCCL: skipping"; \
  } while (0)

const Device kGpu = Device::cuda(0);
constexpr int kSteps = 5;
constexpr int64_t kBatch = 4, kSeq = 32;
constexpr double kMaxNorm = 0.5;

// A group of one on cuda:0; the store lives as long as the group.
struct OneRank {
  std::shared_ptr<TcpStore> store = std::make_shared<TcpStore>("127.0.0.1", 0, TcpStore::Role::server);
  std::shared_ptr<ProcessGroup> group = new_nccl_group(store, 0, 1, kGpu);
};

std::shared_ptr<nn::GPT> make_gpt() {
  manual_seed(0);
  auto model = std::make_shared<nn::GPT>(nn::GPTConfig::named("tiny"));
  model->to(kGpu);
  return model;
}

// One unit per block; the embeddings, the tied output layer and ln_f form the root unit.
FSDPOptions per_block(nn::GPT& model, ReshardAfterForward reshard) {
  FSDPOptions o;
  o.reshard_after_forward = reshard;
  for (const auto& block : model.blocks) o.units.push_back({block});
  return o;
}

struct Batch {
  Tensor ids, targets;  // (kBatch, kSeq), i64, on the GPU
};

Batch batch(int step) {
  std::mt19937 gen{uint32_t(step)};
  std::vector<int64_t> ids(kBatch * kSeq), targets(kBatch * kSeq);
  for (auto& i : ids) i = int64_t(gen() % 256);
  for (auto& t : targets) t = int64_t(gen() % 256);
  return {from_vector(ids, {kBatch, kSeq}, kGpu), from_vector(targets, {kBatch, kSeq}, kGpu)};
}

// As in test_fsdp.cpp: eps = 1e-3 keeps Adam's update proportional to gradients near zero,
// whose sign the order of a float sum could otherwise flip into a whole lr of difference.
optim::AdamWOptions adamw_options() { return {.lr = 1e-2, .eps = 1e-3, .weight_decay = 0.1}; }

// What a run leaves to compare: each step's loss and gradient norm, and the f32 weights.
struct Trained {
  std::vector<double> losses, norms;
  std::map<std::string, Tensor> weights;
};

Trained train_plain() {
  auto model = make_gpt();
  optim::AdamW opt(model->parameters(), adamw_options());
  Trained out;
  for (int step = 0; step < kSteps; ++step) {
    opt.zero_grad();
    Batch b = batch(step);
    Tensor loss = model->loss(b.ids, b.targets);
    loss.backward();
    out.losses.push_back(loss.item());
    out.norms.push_back(optim::clip_grad_norm_(model->parameters(), kMaxNorm).item());
    opt.step();
  }
  for (const auto& [name, t] : model->state_dict()) out.weights.emplace(name, t.detach().clone());
  return out;
}

// FSDP's mixed precision by hand (as in test_fsdp.cpp): the model computes in bf16, f32
// master copies of its parameters take the clipped steps and are cast back into it.
Trained train_mixed_plain() {
  auto model = make_gpt();
  nn::NamedTensors masters;
  for (const auto& [name, p] : model->named_parameters()) {
    Tensor master = p.detach().clone();
    master.set_requires_grad(true);
    masters.emplace_back(name, master);
  }
  model->to(DType::bf16);
  TensorList params = model->parameters(), master_list;
  for (const auto& [_, m] : masters) master_list.push_back(m);
  optim::AdamW opt(master_list, adamw_options());
  Trained out;
  for (int step = 0; step < kSteps; ++step) {
    model->zero_grad();
    opt.zero_grad();
    Batch b = batch(step);
    Tensor loss = model->loss(b.ids, b.targets);
    loss.backward();
    out.losses.push_back(loss.to(DType::f32).item());
    NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) master_list[i].set_grad(params[i].grad().to(DType::f32));
    out.norms.push_back(optim::clip_grad_norm_(master_list, kMaxNorm).item());
    opt.step();
    for (size_t i = 0; i < params.size(); ++i) copy_(params[i], master_list[i]);
  }
  // The masters, under the parameters' names (the tied output layer under the embedding's).
  for (const auto& [name, m] : masters) out.weights.emplace(name, m.detach().clone());
  return out;
}

// The allocator's live bytes on cuda:0 once they reach `expected`, or after two seconds. The
// group holds a collective's buffers until its end event has passed and its watchdog, which
// looks every 100 ms, drops them; so right after a collective they may still count.
size_t settled_allocated(size_t expected = SIZE_MAX) {
  synchronize(kGpu);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  size_t bytes = memory::stats(kGpu).allocated;
  while (bytes != expected && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    bytes = memory::stats(kGpu).allocated;
  }
  return bytes;
}

enum class Precision { f32, bf16 };

struct TrainingCase {
  ReshardAfterForward reshard;
  Precision precision;
  double rtol;
};

std::string case_name(const TrainingCase& c) {
  return std::string(c.reshard == ReshardAfterForward::yes ? "ZeRO3" : "ZeRO2") +
         (c.precision == Precision::bf16 ? "Bf16Parameters" : "F32");
}

void PrintTo(const TrainingCase& c, std::ostream* os) { *os << case_name(c); }

class FsdpCudaTraining : public ::testing::TestWithParam<TrainingCase> {};

TEST_P(FsdpCudaTraining, OneRankOverNcclTrainsLikeThePlainGptOnTheGpu) {
  LOOM_REQUIRE_NCCL();
  Tf32Off tf32_off;
  const TrainingCase c = GetParam();
  const bool mixed = c.precision == Precision::bf16;
  const Trained want = mixed ? train_mixed_plain() : train_plain();
  ASSERT_GT(want.norms.front(), kMaxNorm) << "the clipping never acted";

  OneRank one;
  auto model = make_gpt();
  FSDPOptions options = per_block(*model, c.reshard);
  if (mixed) {
    options.param_dtype = DType::bf16;
    options.reduce_dtype = DType::f32;
  }
  FullyShardedDataParallel fsdp(model, one.group, options);
  ASSERT_EQ(fsdp.unit_names(), (std::vector<std::string>{"transformer.h.0", "transformer.h.1", ""}));
  for (const Tensor& s : fsdp.parameters()) {
    EXPECT_TRUE(s.device() == kGpu);
    EXPECT_EQ(s.dtype(), DType::f32);  // the shards: the master weights
  }
  for (const Tensor& p : model->parameters()) EXPECT_EQ(p.dtype(), mixed ? DType::bf16 : DType::f32);
  optim::AdamW opt(fsdp.parameters(), adamw_options());
  size_t allocated_after_first_step = 0;
  double worst_loss = 0, worst_weight = 0;  // relative differences, printed for the record
  for (int step = 0; step < kSteps; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    opt.zero_grad();
    Batch b = batch(step);
    Tensor loss = fsdp.call([&] { return model->loss(b.ids, b.targets); });
    loss.backward();
    for (const Tensor& s : fsdp.parameters()) ASSERT_EQ(s.grad().dtype(), DType::f32);
    const double l = loss.to(DType::f32).item();
    const double norm = fsdp.clip_grad_norm_(kMaxNorm);
    opt.step();
    EXPECT_NEAR(l, want.losses[size_t(step)], c.rtol * std::abs(want.losses[size_t(step)]));
    worst_loss = std::max(worst_loss, std::abs(l - want.losses[size_t(step)]) / std::abs(want.losses[size_t(step)]));
    EXPECT_NEAR(norm, want.norms[size_t(step)], c.rtol * std::abs(want.norms[size_t(step)]));
    // Between steps no unit is gathered: every full parameter's storage is released.
    EXPECT_EQ(fsdp.memory().full_parameter_bytes, 0u);
    for (const auto& [name, p] : model->named_parameters()) EXPECT_TRUE(p.storage()->is_released()) << name;
    // From the first step on (which made Adam's state) the same bytes are live between steps.
    if (step == 0) allocated_after_first_step = settled_allocated();
    else EXPECT_EQ(settled_allocated(allocated_after_first_step), allocated_after_first_step);
  }
  // From the second step on, units arrived prefetched (their all_gathers issued on NCCL's
  // stream ahead of their first read), and the steps above followed the plain run all the same.
  EXPECT_GT(fsdp.memory().prefetches, 0);
  // ZeRO-3 held at most two units in full and a third arriving (with three units, up to all of
  // them); ZeRO-2 all three at the turn from forward to backward.
  size_t all_bytes = 0;
  for (const Tensor& p : model->parameters()) all_bytes += p.nbytes();
  if (c.reshard == ReshardAfterForward::yes) EXPECT_LE(fsdp.memory().peak_full_parameter_bytes, all_bytes);
  else EXPECT_EQ(fsdp.memory().peak_full_parameter_bytes, all_bytes);

  std::map<std::string, Tensor> got;
  for (const auto& [name, t] : fsdp.full_state_dict()) got.emplace(name, t);
  for (const auto& [name, w] : want.weights) {
    ASSERT_TRUE(got.count(name)) << name << " is missing from the full state dict";
    EXPECT_EQ(got.at(name).dtype(), DType::f32) << name;
    const double d = relative_difference(got.at(name), w);
    EXPECT_LE(d, c.rtol) << name;
    worst_weight = std::max(worst_weight, d);
  }
  std::fprintf(stderr, "%s: losses within %.3g, weights within %.3g of the plain run (relative)\n",
               case_name(c).c_str(), worst_loss, worst_weight);
}

// f32: the same kernels on the same values, but for the order of atomic sums (attention's
// backward, the embeddings' backward) and of the clipping's norm: 1e-5 (on an H200: equal
// losses, weights within 1.8e-7). bf16: the same mixed-precision arithmetic, but those atomic
// sums run in another order on every run, and where one rounds a bf16 gradient apart by its
// last bit (2^-8 relative) Adam carries it into the f32 masters: 1e-2 (on an H200, over three
// runs: losses within 2.9e-5, weights within 3.0e-3).
INSTANTIATE_TEST_SUITE_P(Fsdp, FsdpCudaTraining,
                         ::testing::Values(TrainingCase{ReshardAfterForward::yes, Precision::f32, 1e-5},
                                           TrainingCase{ReshardAfterForward::no, Precision::f32, 1e-5},
                                           TrainingCase{ReshardAfterForward::yes, Precision::bf16, 1e-2}),
                         [](const auto& info) { return case_name(info.param); });

// FSDP inside a pipeline stage (PipelineOptions::shard) on the GPU: one stage over a pipeline
// group of one, sharded over a data-parallel group of one, 4 micro-batches of one row under
// GPipe (every forward before the backwards). The full gradients are kept over the
// micro-batches and reduce-scattered once a step;
// the losses, the clipped norms and the weights follow the plain run on the whole batch.
TEST(FsdpCudaPipeline, AShardedStageOverNcclTrainsLikeThePlainGpt) {
  LOOM_REQUIRE_NCCL();
  Tf32Off tf32_off;
  const Trained want = train_plain();
  std::map<std::string, Tensor> initial;
  for (const auto& [name, p] : make_gpt()->named_parameters()) initial.emplace(name, p.to(Device::cpu()));
  OneRank pp, dp;
  pipeline::PipelineOptions options{.schedule = pipeline::ScheduleKind::gpipe, .microbatches = int(kBatch),
                                    .device = kGpu, .data_parallel = dp.group, .shard = FSDPOptions{}};
  auto gp = pipeline::make_gpt_pipeline(pp.group, nn::GPTConfig::named("tiny"), kSeq, options, {},
                                        [&](nn::GPTStage& stage) {
                                          NoGradGuard no_grad;
                                          for (auto& [name, p] : stage.named_parameters()) copy_(p, initial.at(name));
                                        });
  ASSERT_EQ(gp.pipeline->stages().size(), 1u);
  FullyShardedDataParallel& fsdp = *gp.pipeline->stages()[0].sharded;
  optim::AdamW opt(gp.parameters(), adamw_options());
  for (int step = 0; step < kSteps; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    opt.zero_grad();
    Batch b = batch(step);
    const double l = gp.pipeline->step(b.ids, b.targets).item();
    const double norm = gp.pipeline->clip_grad_norm(kMaxNorm);
    opt.step();
    EXPECT_NEAR(l, want.losses[size_t(step)], 1e-5 * std::abs(want.losses[size_t(step)]));
    EXPECT_NEAR(norm, want.norms[size_t(step)], 1e-5 * std::abs(want.norms[size_t(step)]));
    EXPECT_EQ(fsdp.memory().full_parameter_bytes, 0u);
  }
  EXPECT_EQ(fsdp.memory().reduce_scatters, kSteps * int64_t(fsdp.unit_names().size()));
  std::map<std::string, Tensor> got;
  for (const auto& [name, t] : fsdp.full_state_dict()) got.emplace(name, t);
  double worst = 0;
  for (const auto& [name, w] : want.weights) {
    if (!got.count(name)) continue;  // a name the stage does not hold (the tied output layer)
    const double d = relative_difference(got.at(name), w);
    EXPECT_LE(d, 1e-5) << name;
    worst = std::max(worst, d);
  }
  std::fprintf(stderr, "sharded pipeline stage: weights within %.3g of the plain run (relative)\n", worst);
}

class FsdpCudaMemory : public ::testing::TestWithParam<ReshardAfterForward> {};

// Reading one weight of a unit gathers the whole unit into freshly acquired storage; the
// allocator's live bytes rise by exactly the unit's full parameters (in its size classes) and
// fall back when the unit is released: by ZeRO-3 when a third unit is gathered, by either at
// the end of an evaluation's call.
TEST_P(FsdpCudaMemory, AUnitsFullParametersHoldAllocatorMemoryOnlyWhileGathered) {
  LOOM_REQUIRE_NCCL();
  const ReshardAfterForward reshard = GetParam();
  OneRank one;
  auto model = make_gpt();
  const size_t before = settled_allocated();
  FullyShardedDataParallel fsdp(model, one.group, per_block(*model, reshard));
  std::map<std::string, Tensor> params;
  for (const auto& [name, p] : model->named_parameters()) params.emplace(name, p);
  std::vector<size_t> unit_bytes;  // block 0, block 1, the root
  for (const auto& names : fsdp.unit_assignment()) {
    size_t bytes = 0;
    for (const std::string& name : names) bytes += memory::size_class(params.at(name).nbytes());
    unit_bytes.push_back(bytes);
  }
  ASSERT_EQ(unit_bytes.size(), 3u);
  const size_t b0 = unit_bytes[0], b1 = unit_bytes[1], root = unit_bytes[2];
  auto released = [&](const Tensor& p) { return p.storage()->is_released(); };

  // Over one rank a shard holds every row: the shards took the full parameters' place.
  const size_t wrapped = settled_allocated(before);
  EXPECT_EQ(wrapped, before);
  for (const auto& [name, p] : params) EXPECT_TRUE(released(p)) << name;

  NoGradGuard no_grad;
  auto read = [](const Tensor& weight) { (void)sum(weight); };
  const Tensor& in_block0 = model->blocks[0]->ln_1->weight;
  const Tensor& in_block1 = model->blocks[1]->ln_1->weight;
  fsdp.call([&] {
    EXPECT_EQ(settled_allocated(wrapped), wrapped);
    read(in_block0);
    EXPECT_EQ(settled_allocated(wrapped + b0), wrapped + b0);
    read(in_block1);
    EXPECT_EQ(settled_allocated(wrapped + b0 + b1), wrapped + b0 + b1);
    read(model->wte->weight);
    if (reshard == ReshardAfterForward::yes) {
      EXPECT_EQ(settled_allocated(wrapped + b1 + root), wrapped + b1 + root);
      EXPECT_TRUE(released(in_block0));
    } else {
      EXPECT_EQ(settled_allocated(wrapped + b0 + b1 + root), wrapped + b0 + b1 + root);
      EXPECT_FALSE(released(in_block0));
    }
    EXPECT_FALSE(released(in_block1));
    EXPECT_FALSE(released(model->lm_head));  // tied: the embedding's storage
    return 0;
  });
  EXPECT_EQ(settled_allocated(wrapped), wrapped);
  for (const auto& [name, p] : params) EXPECT_TRUE(released(p)) << name;
  EXPECT_EQ(fsdp.memory().full_parameter_bytes, 0u);
}

INSTANTIATE_TEST_SUITE_P(Fsdp, FsdpCudaMemory,
                         ::testing::Values(ReshardAfterForward::yes, ReshardAfterForward::no),
                         [](const auto& info) { return std::string(info.param == ReshardAfterForward::yes ? "ZeRO3" : "ZeRO2"); });

}  // namespace
}  // namespace loom::dist
