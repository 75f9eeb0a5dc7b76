// FullyShardedDataParallel over CPU ranks in a Gloo group. The central promise: W ranks, each
// training on its rows of a global batch with sharded parameters, gradients and AdamW state,
// follow one process trained on the whole batch (losses, clipped gradient norms and weights
// after 20 steps within 1e-5 relative), on 2, 3 and 4 ranks (uneven and empty shards), in
// ZeRO-2 and ZeRO-3, for SimpleCNN (units chosen by size) and a GPT with tied embeddings
// (units by hand; also with activation recomputation), and ResNet with units chosen by size
// (eval mode, two SGD steps). Also: ZeRO-3 holds at most the two largest units in full while ZeRO-2
// holds them all, and the allocator gets the full parameters' bytes back; accumulation under
// no_sync communicates nothing and equals the large batch; a parameter without gradient is
// named; parameters read outside a step are refused; full state dicts go out and back in.
// Sharded checkpoints: training saved and resumed across world sizes 4 -> 2 -> 1 -> 3 follows
// the run that never stopped; the export is the full state dict; a save that never got its
// index leaves the previous checkpoint in force. Mixed precision (bf16 parameters, f32 reduction
// and master shards) follows the same mixed precision done by hand in one process. train_cnn
// --fsdp on two ranks prints the losses and accuracy of its DDP run.
//
// Ranks and the single-process reference are forked children meeting through a FileStore, as
// in test_ddp.cpp; a child reports through its exit code and prints what failed.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <map>
#include <random>
#include <sstream>

#include "engine/allocator.h"
#include "engine/autograd.h"
#include "engine/ops.h"
#include "engine/serialization.h"
#include "layers/layers.h"
#include "parallel/ddp.h"
#include "parallel/device_mesh.h"
#include "parallel/fsdp.h"
#include "parallel/sharded_checkpoint.h"
#include "parallel/store.h"
#include "run_command.h"

namespace loom::dist {
namespace {

using namespace std::chrono_literals;

// ---- processes -----------------------------------------------------------------------------

std::string temp_path(const std::string& stem) {
  static std::atomic<int> counter{0};
  return (std::filesystem::path(::testing::TempDir()) /
          (stem + "_" + std::to_string(::getpid()) + "_" + std::to_string(counter++)))
      .string();
}

pid_t fork_child(const std::function<void()>& body) {
  pid_t pid = ::fork();
  if (pid == 0) {
    ::alarm(180);
    ::setenv("LOOM_NUM_THREADS", "1", 1);
    int code = 1;
    try {
      body();
      code = 0;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "child %d: %s\n", ::getpid(), e.what());
    }
    ::_exit(code);
  }
  return pid;
}

int exit_code(pid_t pid) {
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

using RankBody = std::function<void(int rank, std::shared_ptr<ProcessGroup> group)>;

void run_ranks(int world, const RankBody& body) {
  std::string store_path = temp_path("fsdp_store");
  ProcessGroupOptions options;
  options.timeout = 60s;
  std::vector<pid_t> ranks;
  for (int rank = 0; rank < world; ++rank)
    ranks.push_back(fork_child([&, rank] {
      auto store = std::make_shared<FileStore>(store_path, world, 60s);
      body(rank, new_gloo_group(store, rank, world, options));
    }));
  for (int rank = 0; rank < world; ++rank) EXPECT_EQ(exit_code(ranks[rank]), 0) << "rank " << rank;
  std::filesystem::remove(store_path);
}

void run_alone(const std::function<void()>& body) { EXPECT_EQ(exit_code(fork_child(body)), 0); }

// ---- checks inside children ------------------------------------------------------------------

template <class... Parts>
void require(bool ok, const Parts&... parts) {
  if (ok) return;
  std::ostringstream os;
  (os << ... << parts);
  throw std::runtime_error(os.str());
}

std::string require_error(const std::function<void()>& fn, const std::vector<std::string>& parts) {
  try {
    fn();
  } catch (const Error& e) {
    std::string msg = e.what();
    for (const std::string& p : parts) require(msg.find(p) != std::string::npos, "'", p, "' missing from: ", msg);
    return msg;
  }
  throw std::runtime_error("expected a loom::Error");
}

double relative_difference(const Tensor& a, const Tensor& b) {
  std::vector<double> x = a.to_vector<double>(), y = b.to_vector<double>();
  require(x.size() == y.size(), "sizes differ: ", x.size(), " and ", y.size());
  double diff = 0, scale = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    diff = std::max(diff, std::abs(x[i] - y[i]));
    scale = std::max(scale, std::abs(y[i]));
  }
  return diff / std::max(scale, 1e-30);
}

// Every tensor of `want` but the series "losses" and "norms" is in `got` and close to it.
void require_close(const nn::NamedTensors& got, const std::map<std::string, Tensor>& want, double rtol) {
  std::map<std::string, Tensor> by_name(got.begin(), got.end());
  for (const auto& [name, w] : want) {
    if (name == "losses" || name == "norms") continue;
    require(by_name.count(name) == 1, name, " is missing");
    double d = relative_difference(by_name.at(name), w);
    require(d <= rtol, name, " differs from the reference by ", d, " (relative), more than ", rtol);
  }
}

// ---- models and data -------------------------------------------------------------------------

enum class Model { cnn, gpt, gpt_recompute };
constexpr int64_t kBatch = 12;  // divisible by 2, 3 and 4: every rank's mean has the same weight
constexpr int64_t kSeq = 16;

struct Batch {
  Tensor x, y;
};

Batch global_batch(Model model, int step) {
  manual_seed(1000 + step);
  std::mt19937 gen{uint32_t(step)};
  if (model == Model::cnn) {
    std::vector<int64_t> labels(kBatch);
    for (auto& l : labels) l = int64_t(gen() % 10);
    return {randn({kBatch, 1, 28, 28}), from_vector(labels, {kBatch})};
  }
  std::vector<int64_t> ids(kBatch * kSeq), targets(kBatch * kSeq);
  for (auto& i : ids) i = int64_t(gen() % 256);
  for (auto& t : targets) t = int64_t(gen() % 256);
  return {from_vector(ids, {kBatch, kSeq}), from_vector(targets, {kBatch, kSeq})};
}

Batch rows(const Batch& b, int part, int parts) {
  int64_t n = b.x.size(0);
  int64_t lo = part * n / parts, hi = (part + 1) * n / parts;
  return {b.x.slice(0, lo, hi).contiguous(), b.y.slice(0, lo, hi).contiguous()};
}

nn::GPTConfig tiny_gpt(int layers) {
  nn::GPTConfig c = nn::GPTConfig::named("tiny");
  c.layers = layers;
  c.context = kSeq;
  return c;
}

std::shared_ptr<nn::Module> make_model(Model model, uint64_t seed, int gpt_layers = 2) {
  manual_seed(seed);
  if (model == Model::cnn) return std::make_shared<nn::SimpleCNN>(1, 28, 10);
  nn::GPTConfig config = tiny_gpt(gpt_layers);
  config.recompute = model == Model::gpt_recompute;
  return std::make_shared<nn::GPT>(config);
}

Tensor loss_of(nn::Module& model, Model kind, const Batch& b) {
  if (kind == Model::cnn) return cross_entropy(model.forward(b.x), b.y);
  return static_cast<nn::GPT&>(model).loss(b.x, b.y);
}

// SimpleCNN by size (features.3, classifier.1 and classifier.3 become units; features.0 is
// left to the root); GPT by hand: the embeddings (the output layer's tied weight with them),
// then each block; ln_f is left to the root.
FSDPOptions fsdp_options(nn::Module& model, Model kind, ReshardAfterForward reshard) {
  FSDPOptions o;
  o.reshard_after_forward = reshard;
  if (kind == Model::cnn) {
    o.min_num_params = 1000;
  } else {
    auto& gpt = static_cast<nn::GPT&>(model);
    o.units.push_back({gpt.wte, gpt.wpe});
    for (auto& block : gpt.blocks) o.units.push_back({block});
  }
  return o;
}

// eps = 1e-3: where a gradient is near zero, Adam's m / sqrt(v) is near +-1 whatever its
// size, so the order of a float sum (W ranks against one) could flip an update by lr; a
// larger eps keeps the update proportional to such gradients and the comparison sharp.
optim::AdamWOptions adamw_options() {
  optim::AdamWOptions o;
  o.lr = 1e-2;
  o.eps = 1e-3;
  o.weight_decay = 0.1;
  return o;
}

constexpr double kMaxNorm = 0.5;

// One process on whole batches: AdamW with clipping; saves the weights, losses and norms,
// and, when `checkpoint` is given, a single-file training checkpoint after `checkpoint_at` steps.
void train_reference(Model kind, const std::string& path, int steps, const std::string& checkpoint = "",
                     int checkpoint_at = -1) {
  auto model = make_model(kind, 0);
  optim::AdamW opt(model->parameters(), adamw_options());
  std::vector<float> losses, norms;
  for (int step = 0; step < steps; ++step) {
    if (step == checkpoint_at) nn::save_checkpoint(checkpoint, {.model = model.get(), .optimizer = &opt});
    opt.zero_grad();
    Tensor loss = loss_of(*model, kind, global_batch(kind, step));
    loss.backward();
    losses.push_back(float(loss.item()));
    norms.push_back(float(optim::clip_grad_norm_(model->parameters(), kMaxNorm).item()));
    opt.step();
  }
  nn::NamedTensors out = model->state_dict();
  out.emplace_back("losses", from_vector(losses, {steps}));
  out.emplace_back("norms", from_vector(norms, {steps}));
  save_safetensors(path, out);
}

// ---- tests -----------------------------------------------------------------------------------

struct TrainingCase {
  Model model;
  int world;
  ReshardAfterForward reshard;
};

std::string case_name(const TrainingCase& c) {
  const char* model = c.model == Model::cnn ? "SimpleCNN" : c.model == Model::gpt ? "TinyGPT" : "TinyGPTRecompute";
  return std::string(model) + "World" + std::to_string(c.world) +
         (c.reshard == ReshardAfterForward::yes ? "ZeRO3" : "ZeRO2");
}

void PrintTo(const TrainingCase& c, std::ostream* os) { *os << case_name(c); }

class FsdpTraining : public ::testing::TestWithParam<TrainingCase> {};

TEST_P(FsdpTraining, RanksOnShardsEqualOneProcessOnTheGlobalBatch) {
  constexpr int kSteps = 20;
  const TrainingCase c = GetParam();
  std::string reference = temp_path("fsdp_reference") + ".safetensors";
  run_alone([&] { train_reference(c.model, reference, kSteps); });
  run_ranks(c.world, [&](int rank, std::shared_ptr<ProcessGroup> group) {
    auto want = load_safetensors_map(reference);
    auto model = make_model(c.model, rank);  // the ranks start differently: FSDP broadcasts rank 0's
    FullyShardedDataParallel fsdp(model, group, fsdp_options(*model, c.model, c.reshard));
    require(fsdp.unit_names().size() >= 4, "expected at least four units, got ", fsdp.unit_names().size());
    optim::AdamW opt(fsdp.parameters(), adamw_options());
    std::vector<double> want_losses = want.at("losses").to_vector<double>();
    std::vector<double> want_norms = want.at("norms").to_vector<double>();
    for (int step = 0; step < kSteps; ++step) {
      opt.zero_grad();
      Batch mine = rows(global_batch(c.model, step), rank, c.world);
      Tensor loss = fsdp.call([&] { return loss_of(*model, c.model, mine); });
      loss.backward();
      Tensor mean_loss = loss.detach().reshape({1}).clone();
      group->all_reduce(mean_loss, ReduceOp::avg)->wait();
      const double norm = fsdp.clip_grad_norm_(kMaxNorm);
      opt.step();
      const double dl = std::abs(mean_loss.item() - want_losses[step]) / std::abs(want_losses[step]);
      const double dn = std::abs(norm - want_norms[step]) / std::abs(want_norms[step]);
      require(dl <= 1e-5, "step ", step, ": loss ", mean_loss.item(), " against ", want_losses[step]);
      require(dn <= 1e-5, "step ", step, ": gradient norm ", norm, " against ", want_norms[step]);
    }
    require(want_norms.front() > kMaxNorm, "the clipping never acted: the first norm is ", want_norms.front());
    require_close(fsdp.full_state_dict(), want, 1e-5);
  });
  std::filesystem::remove(reference);
}

INSTANTIATE_TEST_SUITE_P(
    Fsdp, FsdpTraining,
    ::testing::Values(TrainingCase{Model::cnn, 2, ReshardAfterForward::yes},
                      TrainingCase{Model::cnn, 3, ReshardAfterForward::no},
                      TrainingCase{Model::cnn, 4, ReshardAfterForward::yes},
                      TrainingCase{Model::gpt, 2, ReshardAfterForward::no},
                      TrainingCase{Model::gpt, 3, ReshardAfterForward::yes},
                      TrainingCase{Model::gpt, 4, ReshardAfterForward::no},
                      TrainingCase{Model::gpt_recompute, 2, ReshardAfterForward::yes}),
    [](const auto& info) { return case_name(info.param); });

TEST(FsdpShards, UnevenAndEmptyShardsCoverEveryRowOnce) {
  // Linear(5, 3): weight 3 rows, bias 3 rows; on 4 ranks one row each and none on rank 3.
  run_ranks(4, [](int rank, std::shared_ptr<ProcessGroup> group) {
    manual_seed(7);
    auto lin = std::make_shared<nn::Linear>(5, 3);
    nn::NamedTensors before = lin->state_dict();
    std::map<std::string, Tensor> want;
    for (auto& [name, t] : before) want.emplace(name, t.clone());
    FullyShardedDataParallel fsdp(lin, group);
    for (const auto& [name, shard] : fsdp.named_parameters())
      require(shard.size(0) == (rank < 3 ? 1 : 0), name, " has ", shard.size(0), " rows on rank ", rank);
    nn::NamedTensors full = fsdp.full_state_dict();
    require_close(full, want, 0);
    // A step with an empty shard in AdamW.
    optim::AdamW opt(fsdp.parameters(), adamw_options());
    sum(fsdp.forward(ones({2, 5}))).backward();
    opt.step();
    require(fsdp.named_parameters()[1].second.grad().defined(), "the bias shard got no gradient");
  });
}

// ZeRO-3 holds at most two units, a prefetch in flight included; ZeRO-2 all.
TEST(FsdpMemory, ZeRO3HoldsAtMostTheTwoLargestUnitsAndZeRO2HoldsThemAll) {
  run_ranks(2, [](int rank, std::shared_ptr<ProcessGroup> group) {
    for (auto [reshard, prefetch] : {std::pair{ReshardAfterForward::yes, false}, std::pair{ReshardAfterForward::yes, true},
                                     std::pair{ReshardAfterForward::no, true}}) {
      auto model = make_model(Model::gpt, 0, 6);
      size_t total = 0;
      for (const Tensor& p : model->parameters()) total += p.nbytes();
      const size_t before = memory::stats(Device::cpu()).allocated;
      FSDPOptions options = fsdp_options(*model, Model::gpt, reshard);
      options.prefetch = prefetch;
      FullyShardedDataParallel fsdp(model, group, options);
      const size_t after = memory::stats(Device::cpu()).allocated;
      const FSDPMemory m0 = fsdp.memory();
      require(m0.full_parameter_bytes == 0, "full parameters held after wrapping: ", m0.full_parameter_bytes);
      require(m0.shard_parameter_bytes <= total / 2 + 4096, "shards of ", m0.shard_parameter_bytes, " bytes for ",
              total, " bytes on two ranks");
      // The allocator got the full values back: what wrapping added is the shards and no more.
      require(after <= before - total + m0.shard_parameter_bytes + 64 * 1024, "the allocator holds ", after,
              " bytes after wrapping, ", before, " before, for ", total, " bytes of parameters");
      // The units' sizes, largest first.
      std::vector<size_t> unit_bytes;
      for (const auto& names : fsdp.unit_assignment()) {
        size_t bytes = 0;
        for (const auto& [name, t] : model->named_parameters())
          if (std::find(names.begin(), names.end(), name) != names.end()) bytes += t.nbytes();
        unit_bytes.push_back(bytes);
      }
      std::sort(unit_bytes.rbegin(), unit_bytes.rend());
      optim::AdamW opt(fsdp.parameters(), adamw_options());
      for (int step = 0; step < 3; ++step) {
        opt.zero_grad();
        Batch mine = rows(global_batch(Model::gpt, step), rank, 2);
        fsdp.call([&] { return loss_of(*model, Model::gpt, mine); }).backward();
        opt.step();
      }
      const FSDPMemory m = fsdp.memory();
      // With prefetch too: the unit before goes when the one arriving is issued (fsdp.h, step 3).
      const size_t bound = unit_bytes[0] + unit_bytes[1];
      if (rank == 0)
        std::fprintf(stderr, "%s, prefetch %s: parameters %zu bytes, shards %zu bytes per rank, full parameters at "
                     "most %zu bytes (two largest units %zu), %lld all_gathers issued ahead\n",
                     reshard == ReshardAfterForward::yes ? "ZeRO-3" : "ZeRO-2", prefetch ? "on" : "off", total,
                     m.shard_parameter_bytes, m.peak_full_parameter_bytes, bound, (long long)m.prefetches);
      require(m.full_parameter_bytes == 0, "full parameters held after the step: ", m.full_parameter_bytes);
      require(!prefetch || m.prefetches > 0, "prefetch on, and nothing was issued ahead");
      if (reshard == ReshardAfterForward::yes)
        require(m.peak_full_parameter_bytes <= bound, "ZeRO-3 held ", m.peak_full_parameter_bytes,
                " bytes of full parameters; the two largest units have ", bound);
      else
        require(m.peak_full_parameter_bytes == total, "ZeRO-2 held ", m.peak_full_parameter_bytes,
                " bytes of full parameters at most, the model has ", total);
    }
  });
}

// Prefetching changes when each all_gather is issued, never what it gathers: the same steps
// with and without it give the same losses and weights to the bit, and with it every unit but
// the first of each pass arrives prefetched from the second step on. Also with the token and
// the position embeddings in units of their own: one kernel reads both, so the second one's
// gather must not release the first while that kernel runs (the release and the prefetch wait
// for the op to end).
TEST(FsdpPrefetch, TheNextUnitIsGatheredAheadAndTheStepsAreBitForBitTheSame) {
  for (bool split_embeddings : {false, true})
  run_ranks(2, [split_embeddings](int rank, std::shared_ptr<ProcessGroup> group) {
    std::vector<std::vector<double>> losses;
    std::vector<nn::NamedTensors> states;
    std::vector<int64_t> gathers;
    for (bool prefetch : {true, false}) {
      auto model = make_model(Model::gpt, 0, 6);
      FSDPOptions options = fsdp_options(*model, Model::gpt, ReshardAfterForward::yes);
      if (split_embeddings) {
        auto& gpt = static_cast<nn::GPT&>(*model);
        options.units.front() = {gpt.wte};
        options.units.insert(options.units.begin() + 1, {gpt.wpe});
      }
      options.prefetch = prefetch;
      FullyShardedDataParallel fsdp(model, group, options);
      optim::AdamW opt(fsdp.parameters(), adamw_options());
      losses.emplace_back();
      std::vector<int64_t> prefetches;
      for (int step = 0; step < 3; ++step) {
        opt.zero_grad();
        Batch mine = rows(global_batch(Model::gpt, step), rank, 2);
        Tensor loss = fsdp.call([&] { return loss_of(*model, Model::gpt, mine); });
        loss.backward();
        opt.step();
        losses.back().push_back(loss.item());
        prefetches.push_back(fsdp.memory().prefetches);
      }
      const int64_t units = int64_t(fsdp.unit_names().size());
      if (rank == 0)
        std::fprintf(stderr, "prefetch %s: %lld, %lld, %lld all_gathers issued ahead after each step (%lld units)\n",
                     prefetch ? "on" : "off", (long long)prefetches[0], (long long)prefetches[1],
                     (long long)prefetches[2], (long long)units);
      if (!prefetch) {
        require(prefetches[2] == 0, "prefetch off, yet ", prefetches[2], " all_gathers were issued ahead");
      } else {
        // The first step records the order of each pass; each later one prefetches in both.
        require(prefetches[0] == 0, "the first step prefetched ", prefetches[0], " units before knowing the order");
        // Forward: after each unit but the last; backward: after each of the 6 blocks but the
        // last (the embeddings' backward reads no weight, the root is still held from forward).
        // With the embeddings split, the op that gathers the token embedding reads the
        // position embedding itself before it ends: that one is gathered on demand.
        const int64_t forward = units - 1 - (split_embeddings ? 1 : 0);
        for (int step = 1; step < 3; ++step)
          require(prefetches[step] - prefetches[step - 1] == forward + (6 - 1), "step ", step, " prefetched ",
                  prefetches[step] - prefetches[step - 1], " units; the ", units, " units run one after the other");
      }
      require(fsdp.memory().full_parameter_bytes == 0, "full parameters held after the steps");
      gathers.push_back(fsdp.memory().gathers);
      states.push_back(fsdp.full_state_dict());
    }
    require(losses[0] == losses[1], "the losses differ with and without prefetch");
    require(gathers[0] == gathers[1], "prefetching wasted all_gathers: ", gathers[0], " with it, ", gathers[1],
            " without");
    for (size_t i = 0; i < states[0].size(); ++i)
      require(relative_difference(states[0][i].second, states[1][i].second) == 0, states[0][i].first,
              " differs with and without prefetch");
  });
}

// SimpleCNN's units (the root first, then features.3, classifier.1 and classifier.3): the
// prefetch releases nothing early when it has nothing to issue (after the last unit of a
// pass), so the units backward finds held are the ones the first step recorded, and the same
// all-gathers run with and without prefetch, to the same weights.
TEST(FsdpPrefetch, ASimpleCnnIssuesTheSameAllGathersWithAndWithoutIt) {
  run_ranks(2, [](int rank, std::shared_ptr<ProcessGroup> group) {
    std::vector<int64_t> gathers, prefetches;
    std::vector<std::vector<double>> losses;
    std::vector<nn::NamedTensors> states;
    for (bool prefetch : {true, false}) {
      auto model = make_model(Model::cnn, 0);
      FSDPOptions options = fsdp_options(*model, Model::cnn, ReshardAfterForward::yes);
      options.prefetch = prefetch;
      FullyShardedDataParallel fsdp(model, group, options);
      optim::AdamW opt(fsdp.parameters(), adamw_options());
      losses.emplace_back();
      for (int step = 0; step < 3; ++step) {
        opt.zero_grad();
        Batch mine = rows(global_batch(Model::cnn, step), rank, 2);
        Tensor loss = fsdp.call([&] { return loss_of(*model, Model::cnn, mine); });
        loss.backward();
        opt.step();
        losses.back().push_back(loss.item());
      }
      gathers.push_back(fsdp.memory().gathers);
      prefetches.push_back(fsdp.memory().prefetches);
      states.push_back(fsdp.full_state_dict());
    }
    require(prefetches[0] > 0 && prefetches[1] == 0, "prefetches: ", prefetches[0], " with, ", prefetches[1],
            " without");
    require(gathers[0] == gathers[1], "all_gathers: ", gathers[0], " with prefetch, ", gathers[1], " without");
    require(losses[0] == losses[1], "the losses differ with and without prefetch");
    for (size_t i = 0; i < states[0].size(); ++i)
      require(relative_difference(states[0][i].second, states[1][i].second) == 0, states[0][i].first,
              " differs with and without prefetch");
  });
}

TEST(FsdpNoSync, MicroBatchesUnderNoSyncThenOneSyncedBackwardEqualTheLargeBatch) {
  constexpr int kSteps = 3, kWorld = 2, kMicro = 3;  // 6 rows per rank, 2 per micro-batch
  std::string reference = temp_path("fsdp_nosync_reference") + ".safetensors";
  run_alone([&] { train_reference(Model::cnn, reference, kSteps); });
  run_ranks(kWorld, [&](int rank, std::shared_ptr<ProcessGroup> group) {
    auto model = make_model(Model::cnn, 0);
    FullyShardedDataParallel fsdp(model, group, fsdp_options(*model, Model::cnn, ReshardAfterForward::yes));
    optim::AdamW opt(fsdp.parameters(), adamw_options());
    for (int step = 0; step < kSteps; ++step) {
      Batch mine = rows(global_batch(Model::cnn, step), rank, kWorld);
      opt.zero_grad();
      for (int k = 0; k < kMicro; ++k) {
        Batch micro = rows(mine, k, kMicro);
        auto loss = [&] { return mul(fsdp.call([&] { return loss_of(*model, Model::cnn, micro); }), 1.0 / kMicro); };
        if (k + 1 < kMicro) {
          auto guard = fsdp.no_sync();
          Tensor l = loss();
          int64_t before = group->sequence_number();
          l.backward();
          // ZeRO-3 gathers again in backward, but reduces nothing.
          require(fsdp.parameters()[0].grad().defined() == false, "a backward under no_sync reduced gradients");
          require(group->sequence_number() > before, "the backward gathered nothing");
        } else {
          loss().backward();
        }
      }
      fsdp.clip_grad_norm_(kMaxNorm);
      opt.step();
    }
    require_close(fsdp.full_state_dict(), load_safetensors_map(reference), 1e-5);
  });
  std::filesystem::remove(reference);
}

// A pipeline stage's order without a pipeline: a forward that fails, then every
// micro-batch's forward, an evaluation under NoGradGuard between them and their backwards,
// and the backwards with only the last synchronised (set_gradient_sync); ZeRO-3 and ZeRO-2
// reach the large batch's weights, and nothing stays gathered.
TEST(FsdpNoSync, ForwardsBeforeTheirBackwardsWithAnEvaluationBetweenEqualTheLargeBatch) {
  constexpr int kSteps = 3, kWorld = 2, kMicro = 3;
  std::string reference = temp_path("fsdp_forwards_first_reference") + ".safetensors";
  run_alone([&] { train_reference(Model::cnn, reference, kSteps); });
  for (ReshardAfterForward reshard : {ReshardAfterForward::yes, ReshardAfterForward::no})
    run_ranks(kWorld, [&](int rank, std::shared_ptr<ProcessGroup> group) {
      auto model = make_model(Model::cnn, 0);
      FullyShardedDataParallel fsdp(model, group, fsdp_options(*model, Model::cnn, reshard));
      optim::AdamW opt(fsdp.parameters(), adamw_options());
      for (int step = 0; step < kSteps; ++step) {
        Batch mine = rows(global_batch(Model::cnn, step), rank, kWorld);
        opt.zero_grad();
        try {
          fsdp.call([&]() -> Tensor {
            (void)loss_of(*model, Model::cnn, mine);
            throw std::runtime_error("a forward that fails");
          });
        } catch (const std::runtime_error&) {
        }
        std::vector<Tensor> losses;
        for (int k = 0; k < kMicro; ++k) {
          Batch micro = rows(mine, k, kMicro);
          losses.push_back(mul(fsdp.call([&] { return loss_of(*model, Model::cnn, micro); }), 1.0 / kMicro));
        }
        {
          NoGradGuard evaluation;
          (void)fsdp.call([&] { return loss_of(*model, Model::cnn, mine); });
        }
        for (int k = 0; k < kMicro; ++k) {
          fsdp.set_gradient_sync(k + 1 == kMicro);
          losses[size_t(k)].backward();
          require(fsdp.parameters()[0].grad().defined() == (k + 1 == kMicro),
                  "after backward ", k, " of ", kMicro, " the shards ", k + 1 == kMicro ? "have no" : "have a",
                  " gradient");
        }
        require(fsdp.memory().full_parameter_bytes == 0, "full parameters held after the step: ",
                fsdp.memory().full_parameter_bytes);
        fsdp.clip_grad_norm_(kMaxNorm);
        opt.step();
      }
      // Out of the step: the state dict reads the shards (a step still open would refuse).
      require_close(fsdp.full_state_dict(), load_safetensors_map(reference), 1e-5);
    });
  std::filesystem::remove(reference);
}

// fc1 always takes part; fc2 only when use_fc2.
class TwoLayers : public nn::Module {
 public:
  TwoLayers() {
    fc1 = register_module("fc1", std::make_shared<nn::Linear>(4, 3));
    fc2 = register_module("fc2", std::make_shared<nn::Linear>(3, 2));
  }
  Tensor forward(const Tensor& x) override {
    Tensor h = fc1->forward(x);
    return use_fc2 ? fc2->forward(h) : h;
  }
  std::shared_ptr<nn::Linear> fc1, fc2;
  bool use_fc2 = true;
};

TEST(FsdpErrors, ChannelsLastParametersAreRefusedSayingWhy) {
  run_ranks(2, [](int, std::shared_ptr<ProcessGroup> group) {
    auto model = std::make_shared<nn::Conv2d>(3, 4, 3);
    model->to(MemoryFormat::channels_last);
    require_error([&] { FullyShardedDataParallel fsdp(model, group); },
                  {"parameter weight is not row-major", "Module::to(MemoryFormat)",
                   "leave the module's parameters row-major"});
  });
}

TEST(FsdpErrors, UnusedParametersAreNamedAndReadingOutsideAStepIsRefused) {
  run_ranks(2, [](int, std::shared_ptr<ProcessGroup> group) {
    auto model = std::make_shared<TwoLayers>();
    FSDPOptions options;
    options.units = {{model->fc1}, {model->fc2}};
    FullyShardedDataParallel fsdp(model, group, options);
    Tensor x = ones({2, 4});
    model->use_fc2 = false;
    std::string msg = require_error([&] { sum(fsdp.forward(x)).backward(); },
                                    {"did not receive a gradient", ": fc2.weight, fc2.bias.", "set_requires_grad(false)"});
    require(msg.find("fc1") == std::string::npos, "fc1 took part but is named: ", msg);
    require_error([&] { (void)model->fc1->weight.to_vector<float>(); },
                  {"unit 'fc1'", "outside a step", "full_state_dict"});
    // Recovers: a step that uses everything works, and evaluation releases what it gathered.
    model->use_fc2 = true;
    fsdp.zero_grad();
    sum(fsdp.forward(x)).backward();
    require(fsdp.parameters()[0].grad().defined(), "no gradient after a full step");
    {
      NoGradGuard no_grad;
      fsdp.forward(x);
    }
    require(fsdp.memory().full_parameter_bytes == 0, "evaluation left units gathered");
  });
}

// A model whose every parameter is frozen trains nothing, so its forwards with gradients on owe
// no backward: each releases its units as an evaluation does, under ZeRO-3 and ZeRO-2. A
// backward that runs through it to an input requiring a gradient gathers the weights it reads
// again and gives that input the frozen model's gradient.
TEST(FsdpErrors, AForwardWithNothingToTrainOwesNoBackward) {
  for (ReshardAfterForward reshard : {ReshardAfterForward::yes, ReshardAfterForward::no})
    run_ranks(2, [&](int, std::shared_ptr<ProcessGroup> group) {
      manual_seed(3);
      auto model = std::make_shared<TwoLayers>();
      for (Tensor& p : model->parameters()) p.set_requires_grad(false);
      // The input's gradient one process computes with the same frozen weights.
      Tensor x = ones({2, 4});
      x.set_requires_grad();
      sum(model->forward(x)).backward();
      const Tensor want = x.grad().clone();
      x.zero_grad();
      FSDPOptions options;
      options.units = {{model->fc1}, {model->fc2}};
      options.reshard_after_forward = reshard;
      FullyShardedDataParallel fsdp(model, group, options);
      for (int i = 0; i < 2; ++i) {
        Tensor y = fsdp.forward(x.detach());
        require(!y.requires_grad(), "a frozen model's output requires a gradient");
        require(fsdp.memory().full_parameter_bytes == 0, "forward ", i, " left ", fsdp.memory().full_parameter_bytes,
                " bytes of full parameters gathered");
      }
      Tensor y = fsdp.forward(x);
      require(y.requires_grad() && fsdp.memory().full_parameter_bytes == 0,
              "a frozen forward to an input requiring a gradient kept its units, or gave no gradient to follow");
      sum(y).backward();
      require(x.grad().defined() && relative_difference(x.grad(), want) <= 1e-12, "the input's gradient through the frozen "
              "model is not one process's");
    });
}

TEST(FsdpStateDict, AFullStateDictLoadsBackIntoShardsOnAnotherWorldSize) {
  std::string path = temp_path("fsdp_state") + ".safetensors";
  run_ranks(3, [&](int rank, std::shared_ptr<ProcessGroup> group) {
    auto model = make_model(Model::gpt, 5);
    FullyShardedDataParallel fsdp(model, group, fsdp_options(*model, Model::gpt, ReshardAfterForward::yes));
    nn::NamedTensors state = fsdp.full_state_dict();
    bool tied = false;
    for (const auto& [name, t] : state) tied |= name == "lm_head.weight";
    require(tied, "the tied output weight is missing from the full state dict");
    if (rank == 0) save_safetensors(path, state);
  });
  run_ranks(2, [&](int, std::shared_ptr<ProcessGroup> group) {
    auto model = make_model(Model::gpt, 99);  // other values, replaced by the load
    FullyShardedDataParallel fsdp(model, group, fsdp_options(*model, Model::gpt, ReshardAfterForward::yes));
    auto saved = load_safetensors_map(path);
    nn::NamedTensors named(saved.begin(), saved.end());
    fsdp.load_full_state_dict(named);
    for (const auto& [name, t] : fsdp.full_state_dict())
      require(relative_difference(t, saved.at(name)) == 0, name, " differs after the load");
  });
  std::filesystem::remove(path);
}

// A ResNet of one block per stage (seed 11), and a batch of four CIFAR-sized images.
std::shared_ptr<nn::ResNet> make_small_resnet() {
  manual_seed(11);
  return std::make_shared<nn::ResNet>(std::array<int, 4>{1, 1, 1, 1}, 10, 3);
}

Batch resnet_batch(uint64_t seed) {
  manual_seed(seed);
  std::vector<int64_t> labels{1, 3, 5, 7};
  return Batch{randn({4, 3, 32, 32}), from_vector(labels, {4})};
}

TEST(FsdpPolicy, ResNetUnitsBySizeTrainLikeOneProcess) {
  // ResNet with one block per stage. min_num_params 100000, bottom-up: every convolution of at
  // least 100k weights becomes a unit (layer2.0.conv2, 147k, ...); what is left below, never
  // 100k together in one subtree, goes to the root. In eval mode BatchNorm normalises with its
  // running statistics, so each rank's rows are treated as in the whole batch.
  constexpr int kSteps = 2;
  auto make = [] {
    auto m = make_small_resnet();
    m->eval();
    return m;
  };
  auto batch = [](int step) { return resnet_batch(2000 + step); };
  optim::SGDOptions sgd;
  sgd.lr = 0.1;
  sgd.momentum = 0.9;
  std::string reference = temp_path("fsdp_resnet") + ".safetensors";
  run_alone([&] {
    auto model = make();
    optim::SGD opt(model->parameters(), sgd);
    for (int step = 0; step < kSteps; ++step) {
      opt.zero_grad();
      Batch b = batch(step);
      cross_entropy(model->forward(b.x), b.y).backward();
      opt.step();
    }
    save_safetensors(reference, model->state_dict());
  });
  run_ranks(2, [&](int rank, std::shared_ptr<ProcessGroup> group) {
    auto model = make();
    FSDPOptions options;
    options.min_num_params = 100000;
    FullyShardedDataParallel fsdp(model, group, options);
    std::string units;
    for (const auto& name : fsdp.unit_names()) units += "[" + name + "]";
    require(units == "[layer2.0.conv2][layer3.0.conv1][layer3.0.conv2][layer4.0.conv1][layer4.0.conv2]"
                     "[layer4.0.downsample.0][]",
            "units ", units);
    optim::SGD opt(fsdp.parameters(), sgd);
    for (int step = 0; step < kSteps; ++step) {
      opt.zero_grad();
      Batch mine = rows(batch(step), rank, 2);
      cross_entropy(fsdp.forward(mine.x), mine.y).backward();
      opt.step();
    }
    require_close(fsdp.full_state_dict(), load_safetensors_map(reference), 1e-5);
  });
  std::filesystem::remove(reference);
}

// In training mode each rank's BatchNorm normalises its own rows and updates its own running
// statistics. With average_buffers FSDP averages them after each backward, as DDP's
// sync_buffers_average does: both end with the same parameters and the same statistics on
// every rank; without it the ranks' statistics part.
TEST(FsdpBuffers, AveragedBatchNormStatisticsAreDdpsOnEveryRank) {
  constexpr int kSteps = 3;
  auto make = [] { return make_small_resnet(); };
  auto batch = [](int step) { return resnet_batch(3000 + step); };
  optim::SGDOptions sgd;
  sgd.lr = 0.05;
  sgd.momentum = 0.9;
  const std::string stem = temp_path("fsdp_buffers");
  auto file = [&](const std::string& kind, int rank) { return stem + "_" + kind + std::to_string(rank) + ".safetensors"; };
  run_ranks(2, [&](int rank, std::shared_ptr<ProcessGroup> group) {
    auto model = make();
    DDPOptions options;
    options.sync_buffers_average = true;
    DistributedDataParallel ddp(model, group, options);
    optim::SGD opt(model->parameters(), sgd);
    for (int step = 0; step < kSteps; ++step) {
      opt.zero_grad();
      Batch mine = rows(batch(step), rank, 2);
      cross_entropy(ddp.forward(mine.x), mine.y).backward();
      opt.step();
    }
    save_safetensors(file("ddp", rank), model->state_dict());
  });
  for (bool average : {true, false}) {
    run_ranks(2, [&](int rank, std::shared_ptr<ProcessGroup> group) {
      auto model = make();
      FSDPOptions options;
      options.min_num_params = 100000;
      options.average_buffers = average;
      FullyShardedDataParallel fsdp(model, group, options);
      optim::SGD opt(fsdp.parameters(), sgd);
      for (int step = 0; step < kSteps; ++step) {
        opt.zero_grad();
        Batch mine = rows(batch(step), rank, 2);
        cross_entropy(fsdp.forward(mine.x), mine.y).backward();
        opt.step();
      }
      save_safetensors(file(average ? "avg" : "own", rank), fsdp.full_state_dict());
    });
  }
  run_alone([&] {
    const auto ddp = load_safetensors_map(file("ddp", 0));
    for (int rank = 0; rank < 2; ++rank) {
      const auto avg = load_safetensors_map(file("avg", rank));
      for (const auto& [name, t] : ddp)
        require(relative_difference(avg.at(name), t) <= 1e-5, "rank ", rank, ": ", name, " differs from DDP's by ",
                relative_difference(avg.at(name), t));
    }
    const auto own0 = load_safetensors_map(file("own", 0)), own1 = load_safetensors_map(file("own", 1));
    require(relative_difference(own0.at("bn1.running_mean"), own1.at("bn1.running_mean")) > 1e-3,
            "without average_buffers the ranks' statistics should part");
  });
  for (const char* kind : {"ddp", "avg", "own"})
    for (int rank = 0; rank < 2; ++rank) std::filesystem::remove(file(kind, rank));
}

// One process with FSDP's mixed precision by hand: the model computes in bf16, f32 master
// copies of its parameters take the clipped AdamW steps and are cast back into it.
void train_mixed_reference(const std::string& path, int steps) {
  auto model = make_model(Model::cnn, 0);
  nn::NamedTensors masters;
  for (const auto& [name, p] : model->named_parameters()) {
    Tensor master = p.detach().clone();
    master.set_requires_grad(true);
    masters.emplace_back(name, master);
  }
  model->to(DType::bf16);
  TensorList master_list;
  for (const auto& [_, m] : masters) master_list.push_back(m);
  optim::AdamW opt(master_list, adamw_options());
  TensorList params = model->parameters();
  std::vector<float> losses, norms;
  for (int step = 0; step < steps; ++step) {
    model->zero_grad();
    opt.zero_grad();
    Batch b = global_batch(Model::cnn, step);
    Tensor loss = cross_entropy(model->forward(b.x.to(DType::bf16)).to(DType::f32), b.y);
    loss.backward();
    losses.push_back(float(loss.item()));
    NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) master_list[i].set_grad(params[i].grad().to(DType::f32));
    norms.push_back(float(optim::clip_grad_norm_(master_list, kMaxNorm).item()));
    opt.step();
    for (size_t i = 0; i < params.size(); ++i) copy_(params[i], master_list[i]);
  }
  masters.emplace_back("losses", from_vector(losses, {steps}));
  masters.emplace_back("norms", from_vector(norms, {steps}));
  save_safetensors(path, masters);
}

TEST(FsdpMixedPrecision, Bf16ParametersWithF32ReductionFollowTheSameMixedPrecisionInOneProcess) {
  constexpr int kSteps = 10;
  std::string reference = temp_path("fsdp_mixed_reference") + ".safetensors";
  run_alone([&] { train_mixed_reference(reference, kSteps); });
  // On one rank the reduction is the identity: FSDP's arithmetic is the reference's, to the
  // bit but for the order of the clipping's sum. On two, each rank's bf16 gradient of its rows
  // is rounded before the f32 average, where the reference rounds the whole batch's: the first
  // step's gradient norm agrees to 1e-4, and after it the bf16 weights cast from slightly
  // different masters round apart by their last bit now and then, so the losses of the
  // following steps agree to 1e-2 (2.5e-3 measured), no closer.
  for (auto [world, rtol] : {std::pair{1, 1e-5}, std::pair{2, 1e-2}}) {
    run_ranks(world, [&, world = world, rtol = rtol](int rank, std::shared_ptr<ProcessGroup> group) {
      auto want = load_safetensors_map(reference);
      std::vector<double> want_losses = want.at("losses").to_vector<double>();
      std::vector<double> want_norms = want.at("norms").to_vector<double>();
      auto model = make_model(Model::cnn, rank);
      FSDPOptions options = fsdp_options(*model, Model::cnn, ReshardAfterForward::yes);
      options.param_dtype = DType::bf16;
      options.reduce_dtype = DType::f32;
      FullyShardedDataParallel fsdp(model, group, options);
      for (const Tensor& p : model->parameters()) require(p.dtype() == DType::bf16, "a parameter is not bf16");
      for (const Tensor& s : fsdp.parameters()) require(s.dtype() == DType::f32, "a shard is not f32");
      optim::AdamW opt(fsdp.parameters(), adamw_options());
      double worst = 0;
      for (int step = 0; step < kSteps; ++step) {
        opt.zero_grad();
        Batch mine = rows(global_batch(Model::cnn, step), rank, world);
        Tensor loss = fsdp.call([&] { return cross_entropy(model->forward(mine.x.to(DType::bf16)).to(DType::f32), mine.y); });
        loss.backward();
        for (const Tensor& s : fsdp.parameters()) require(s.grad().dtype() == DType::f32, "a shard's gradient is not f32");
        Tensor mean_loss = loss.detach().reshape({1}).clone();
        group->all_reduce(mean_loss, ReduceOp::avg)->wait();
        const double norm = fsdp.clip_grad_norm_(kMaxNorm);
        opt.step();
        worst = std::max(worst, std::abs(mean_loss.item() - want_losses[step]) / std::abs(want_losses[step]));
        const double dn = std::abs(norm - want_norms[step]) / std::abs(want_norms[step]);
        require((step > 0 && world > 1) || dn <= 1e-4, "world ", world, ", step ", step, ": gradient norm ", norm,
                " against ", want_norms[step]);
      }
      require(worst <= rtol, "world ", world, ": losses differ by up to ", worst, " (relative), more than ", rtol);
      if (world == 1) require_close(fsdp.full_state_dict(), want, 1e-5);
      if (rank == 0) std::fprintf(stderr, "world %d: losses within %.3g of the reference\n", world, worst);
    });
  }
  std::filesystem::remove(reference);
}

// ---- HSDP --------------------------------------------------------------------------------------

// Rows of `shards` ranks shard the model, `replicas` such rows replicate it (fsdp.h, step 8);
// every world rank trains on its own rows of the global batch. The run must be the one
// process's on the whole batch, as plain FSDP's is; then a checkpoint saved by the first row
// loads into plain FSDP on 3 ranks with the same values.
void train_hybrid(Model kind, int replicas, int shards, ReshardAfterForward reshard) {
  constexpr int kSteps = 12;
  const int world = replicas * shards;
  std::string reference = temp_path("hsdp_reference") + ".safetensors", dir = temp_path("hsdp_ckpt");
  std::string full = temp_path("hsdp_full") + ".safetensors";
  run_alone([&] { train_reference(kind, reference, kSteps); });
  run_ranks(world, [&](int rank, std::shared_ptr<ProcessGroup> group) {
    auto want = load_safetensors_map(reference);
    DeviceMesh mesh(group, {replicas, shards}, {"replicate", "shard"});
    auto model = make_model(kind, rank);  // the ranks start differently: HSDP broadcasts rank 0's
    auto fsdp = hybrid_shard(model, mesh, fsdp_options(*model, kind, reshard));
    require(fsdp->group().size() == shards && fsdp->replicate_group()->size() == replicas, "the groups are ",
            fsdp->group().size(), " x ", fsdp->replicate_group()->size());
    optim::AdamW opt(fsdp->parameters(), adamw_options());
    std::vector<double> want_losses = want.at("losses").to_vector<double>();
    std::vector<double> want_norms = want.at("norms").to_vector<double>();
    for (int step = 0; step < kSteps; ++step) {
      opt.zero_grad();
      Batch mine = rows(global_batch(kind, step), rank, world);
      Tensor loss = fsdp->call([&] { return loss_of(*model, kind, mine); });
      loss.backward();
      Tensor mean_loss = loss.detach().reshape({1}).clone();
      group->all_reduce(mean_loss, ReduceOp::avg)->wait();
      const double norm = fsdp->clip_grad_norm_(kMaxNorm);
      opt.step();
      const double dl = std::abs(mean_loss.item() - want_losses[step]) / std::abs(want_losses[step]);
      const double dn = std::abs(norm - want_norms[step]) / std::abs(want_norms[step]);
      require(dl <= 1e-5, "step ", step, ": loss ", mean_loss.item(), " against ", want_losses[step]);
      require(dn <= 1e-5, "step ", step, ": gradient norm ", norm, " against ", want_norms[step]);
    }
    nn::NamedTensors state = fsdp->full_state_dict();
    require_close(state, want, 1e-5);
    save_sharded_checkpoint(dir, *fsdp, &opt);
    if (rank == 0) save_safetensors(full, state);
  });
  std::vector<std::string> files;
  for (const auto& e : std::filesystem::directory_iterator(dir)) files.push_back(e.path().filename().string());
  EXPECT_EQ(int(files.size()), 1 + shards) << "the first row alone writes: an index and one file per shard";
  run_ranks(3, [&](int, std::shared_ptr<ProcessGroup> group) {
    auto model = make_model(kind, 9);
    FullyShardedDataParallel fsdp(model, group, fsdp_options(*model, kind, ReshardAfterForward::yes));
    load_sharded_checkpoint(dir, fsdp);
    auto want = load_safetensors_map(full);
    for (const auto& [name, t] : fsdp.full_state_dict())
      require(relative_difference(t, want.at(name)) == 0, name, " differs after the load");
  });
  std::filesystem::remove_all(dir);
  std::filesystem::remove(reference);
  std::filesystem::remove(full);
}

TEST(FsdpHybrid, TwoReplicasOfTwoShardsTrainTinyGptAsOneProcess) {
  train_hybrid(Model::gpt, 2, 2, ReshardAfterForward::yes);
}

TEST(FsdpHybrid, TwoReplicasOfTwoShardsTrainSimpleCnnAsOneProcessUnderZeRO2) {
  train_hybrid(Model::cnn, 2, 2, ReshardAfterForward::no);
}

TEST(FsdpHybrid, AMeshOfOtherDimensionsIsRefused) {
  run_ranks(2, [&](int, std::shared_ptr<ProcessGroup> group) {
    DeviceMesh mesh(group, {2}, {"dp"});
    auto model = make_model(Model::cnn, 0);
    try {
      hybrid_shard(model, mesh);
      require(false, "a one-dimensional mesh must be refused");
    } catch (const Error& e) {
      require(std::string(e.what()).find("HSDP takes two, \"replicate\" and \"shard\"") != std::string::npos,
              e.what());
    }
  });
}

// ---- sharded checkpoints ---------------------------------------------------------------------

// Trains steps [from, to) of the tiny GPT on `world` ranks, resuming from `load_dir` when given
// and saving into `save_dir`; every step's loss must equal the single-process reference's.
void train_segment(int world, int from, int to, const std::string& load_dir, const std::string& save_dir,
                   const std::string& reference) {
  run_ranks(world, [&](int rank, std::shared_ptr<ProcessGroup> group) {
    auto want = load_safetensors_map(reference);
    std::vector<double> want_losses = want.at("losses").to_vector<double>();
    auto model = make_model(Model::gpt, load_dir.empty() ? 0 : 50 + rank);  // a resumed run's values are loaded
    FullyShardedDataParallel fsdp(model, group, fsdp_options(*model, Model::gpt, ReshardAfterForward::yes));
    optim::AdamW opt(fsdp.parameters(), adamw_options());
    // A folder of shards, or a single-file checkpoint of one process.
    if (load_dir.ends_with(".safetensors")) load_checkpoint_into_shards(load_dir, fsdp, &opt);
    else if (!load_dir.empty()) load_sharded_checkpoint(load_dir, fsdp, &opt);
    for (int step = from; step < to; ++step) {
      opt.zero_grad();
      Batch mine = rows(global_batch(Model::gpt, step), rank, world);
      Tensor loss = fsdp.call([&] { return loss_of(*model, Model::gpt, mine); });
      loss.backward();
      Tensor mean_loss = loss.detach().reshape({1}).clone();
      group->all_reduce(mean_loss, ReduceOp::avg)->wait();
      fsdp.clip_grad_norm_(kMaxNorm);
      opt.step();
      const double d = std::abs(mean_loss.item() - want_losses[step]) / std::abs(want_losses[step]);
      require(d <= 1e-5, "world ", world, ", step ", step, ": loss ", mean_loss.item(), " against ",
              want_losses[step]);
    }
    save_sharded_checkpoint(save_dir, fsdp, &opt);
    if (to == 20) require_close(fsdp.full_state_dict(), want, 1e-5);
  });
}

TEST(FsdpShardedCheckpoint, TrainingResumedAtOtherWorldSizesFollowsTheRunThatNeverStopped) {
  std::string reference = temp_path("fsdp_ckpt_reference") + ".safetensors";
  run_alone([&] { train_reference(Model::gpt, reference, 20); });
  std::vector<std::string> dirs;
  for (int i = 0; i < 4; ++i) dirs.push_back(temp_path("fsdp_ckpt"));
  train_segment(4, 0, 5, "", dirs[0], reference);
  train_segment(2, 5, 10, dirs[0], dirs[1], reference);
  train_segment(1, 10, 15, dirs[1], dirs[2], reference);
  train_segment(3, 15, 20, dirs[2], dirs[3], reference);
  for (const auto& d : dirs) std::filesystem::remove_all(d);
  std::filesystem::remove(reference);
}

TEST(FsdpShardedCheckpoint, ASingleProcessCheckpointLoadsIntoShardsAndTrainingGoesOn) {
  std::string reference = temp_path("fsdp_single_reference") + ".safetensors";
  std::string single = temp_path("fsdp_single_ckpt") + ".safetensors", dir = temp_path("fsdp_single_next");
  run_alone([&] { train_reference(Model::gpt, reference, 20, single, 10); });
  // Ten steps of one process, then ten on three ranks (uneven shards) from its checkpoint.
  train_segment(3, 10, 20, single, dir, reference);
  std::filesystem::remove_all(dir);
  std::filesystem::remove(single);
  std::filesystem::remove(reference);
}

// A folder whose index is another kind of checkpoint's (a pipeline's) is not written into:
// every rank stops with a message, and the folder keeps what it held.
TEST(FsdpShardedCheckpoint, AFolderOfAnotherKindOfCheckpointIsRefusedOnEveryRank) {
  const std::string dir = temp_path("fsdp_other_kind");
  std::filesystem::create_directories(dir);
  const std::string index = dir + "/index.safetensors";
  save_safetensors(index, {}, {{"format", "loom-pipeline-1"}, {"generation", "4"}});
  run_ranks(2, [&](int rank, std::shared_ptr<ProcessGroup> group) {
    auto model = make_model(Model::gpt, 5);
    FullyShardedDataParallel fsdp(model, group, fsdp_options(*model, Model::gpt, ReshardAfterForward::yes));
    try {
      save_sharded_checkpoint(dir, fsdp);
      require(false, "saving into a pipeline checkpoint's folder must fail");
    } catch (const Error& e) {
      const std::string want = rank == 0 ? "format 'loom-pipeline-1', not a sharded one" : "rank 0 could not read";
      require(std::string(e.what()).find(want) != std::string::npos, e.what());
    }
  });
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) files += e.is_regular_file();
  EXPECT_EQ(files, 1);
  EXPECT_EQ(load_safetensors_metadata(index).at("format"), "loom-pipeline-1");
  std::filesystem::remove_all(dir);
}

TEST(FsdpShardedCheckpoint, TheExportIsTheFullStateDictAndAnUnindexedSaveIsIgnored) {
  std::string dir = temp_path("fsdp_ckpt"), exported = temp_path("fsdp_export") + ".safetensors";
  std::string full = temp_path("fsdp_full") + ".safetensors";
  run_ranks(3, [&](int rank, std::shared_ptr<ProcessGroup> group) {
    auto model = make_model(Model::gpt, 3);
    FullyShardedDataParallel fsdp(model, group, fsdp_options(*model, Model::gpt, ReshardAfterForward::no));
    save_sharded_checkpoint(dir, fsdp);
    if (rank == 0) save_safetensors(full, fsdp.full_state_dict());
    else fsdp.full_state_dict();
  });
  // A later save killed before its index: a newer generation's file, and no index naming it.
  std::filesystem::copy_file(std::filesystem::path(dir) / "shard-g1-00000-of-00003.safetensors",
                             std::filesystem::path(dir) / "shard-g2-00000-of-00002.safetensors");
  run_alone([&] {
    export_consolidated_safetensors(dir, exported);
    auto got = load_safetensors_map(exported), want = load_safetensors_map(full);
    require(got.size() == want.size() && got.count("lm_head.weight"), got.size(), " tensors exported, ",
            want.size(), " in the full state dict");
    for (const auto& [name, t] : want) require(relative_difference(got.at(name), t) == 0, name, " differs");
  });
  run_ranks(2, [&](int, std::shared_ptr<ProcessGroup> group) {
    auto model = make_model(Model::gpt, 4);
    FullyShardedDataParallel fsdp(model, group, fsdp_options(*model, Model::gpt, ReshardAfterForward::yes));
    load_sharded_checkpoint(dir, fsdp);
    auto want = load_safetensors_map(full);
    for (const auto& [name, t] : fsdp.full_state_dict())
      require(relative_difference(t, want.at(name)) == 0, name, " differs after the load");
    save_sharded_checkpoint(dir, fsdp);  // generation 2 replaces the stray file and generation 1
  });
  std::vector<std::string> files;
  for (const auto& e : std::filesystem::directory_iterator(dir)) files.push_back(e.path().filename().string());
  std::sort(files.begin(), files.end());
  EXPECT_EQ(files, (std::vector<std::string>{"index.safetensors", "shard-g2-00000-of-00002.safetensors",
                                             "shard-g2-00001-of-00002.safetensors"}));
  std::filesystem::remove_all(dir);
  std::filesystem::remove(exported);
  std::filesystem::remove(full);
}

TEST(FsdpShardedCheckpoint, TheScheduleTheGeneratorAndTheCallersEntriesComeBack) {
  std::string dir = temp_path("fsdp_ckpt_extras");
  run_ranks(2, [&](int, std::shared_ptr<ProcessGroup> group) {
    auto model = make_model(Model::gpt, 5);
    FullyShardedDataParallel fsdp(model, group, fsdp_options(*model, Model::gpt, ReshardAfterForward::yes));
    optim::AdamW opt(fsdp.parameters(), adamw_options());
    optim::LRScheduler sched(opt, optim::cosine_annealing(100, 1e-4));
    for (int i = 0; i < 7; ++i) sched.step();
    manual_seed(42);
    randn({3});  // the generator moves on from its seed
    const auto rng = rng_state();
    save_sharded_checkpoint(dir, fsdp, &opt, {.scheduler = &sched, .user = {{"epoch", "3"}, {"batch", "0"}}});
    const std::map<std::string, double> saved_schedule = sched.state_dict();
    const std::vector<double> saved_lr = sched.last_lr();

    optim::AdamW fresh_opt(fsdp.parameters(), adamw_options());
    optim::LRScheduler fresh(fresh_opt, optim::cosine_annealing(100, 1e-4));
    manual_seed(9);
    const auto user = load_sharded_checkpoint(dir, fsdp, &fresh_opt, &fresh);
    require(user == std::map<std::string, std::string>{{"epoch", "3"}, {"batch", "0"}}, "the caller's entries differ");
    require(fresh.state_dict() == saved_schedule, "the schedule's state differs after the load");
    require(fresh.last_lr() == saved_lr, "the learning rate differs after the load: ", fresh.last_lr()[0], " against ",
            saved_lr[0]);
    require(rng_state() == rng, "the generator's state differs after the load");
  });
  // A checkpoint saved without a schedule cannot restore one: an error naming the index.
  std::string bare = temp_path("fsdp_ckpt_bare");
  run_ranks(1, [&](int, std::shared_ptr<ProcessGroup> group) {
    auto model = make_model(Model::gpt, 5);
    FullyShardedDataParallel fsdp(model, group, fsdp_options(*model, Model::gpt, ReshardAfterForward::yes));
    optim::AdamW opt(fsdp.parameters(), adamw_options());
    optim::LRScheduler sched(opt, optim::cosine_annealing(100, 1e-4));
    save_sharded_checkpoint(bare, fsdp, &opt);
    try {
      load_sharded_checkpoint(bare, fsdp, &opt, &sched);
      require(false, "loading a schedule from a checkpoint saved without one must fail");
    } catch (const Error& e) {
      require(std::string(e.what()).find("holds no learning-rate schedule state") != std::string::npos, e.what());
    }
  });
  std::filesystem::remove_all(dir);
  std::filesystem::remove_all(bare);
}

// ---- train_cnn --fsdp ------------------------------------------------------------------------

// The epoch lines ("epoch 1: train loss ...") of train_cnn on CPU ranks under loomrun.
std::string train_cnn_epochs(const std::string& extra, int ranks = 2) {
  const char* loomrun = std::getenv("LOOMRUN");
  const char* train_cnn = std::getenv("TRAIN_CNN");
  if (!loomrun || !train_cnn) return "";
  std::string command = std::string(loomrun) + " --nproc-per-node " + std::to_string(ranks) + " " + train_cnn +
                        " --device cpu --epochs 1 --max-steps 12 --subset 1024 --test-subset 200 --quiet "
                        "--metrics '' --plot '' " + extra + " 2>&1";
  FILE* pipe = ::popen(command.c_str(), "r");
  std::string out, lines;
  char buf[4096];
  while (pipe && std::fgets(buf, sizeof buf, pipe)) out += buf;
  EXPECT_EQ(pipe ? ::pclose(pipe) : -1, 0) << out;
  std::stringstream in(out);
  for (std::string line; std::getline(in, line);)
    if (line.find("epoch 1:") != std::string::npos) lines += line.substr(0, line.find(" (")) + "\n";
  EXPECT_FALSE(lines.empty()) << out;
  return lines;
}

TEST(FsdpTrainCnn, FsdpFlagTrainsAsDdpDoes) {
  if (!std::getenv("LOOMRUN") || !std::getenv("TRAIN_CNN")) GTEST_SKIP() << "LOOMRUN and TRAIN_CNN are not set";
  const std::string ddp = train_cnn_epochs("");
  EXPECT_EQ(train_cnn_epochs("--fsdp --min-params 1000"), ddp);
  EXPECT_EQ(train_cnn_epochs("--fsdp --reshard-after-forward no"), ddp);
}

// train_cnn --fsdp on `ranks` CPU ranks: its exit code and output.
testing::RunResult train_cnn_fsdp(int ranks, const std::string& extra) {
  return testing::run_command(std::string(std::getenv("LOOMRUN")) + " --nproc-per-node " + std::to_string(ranks) +
                                  " " + std::getenv("TRAIN_CNN") +
                                  " --device cpu --fsdp --min-params 1000 --subset 512 --test-subset 200 --schedule none "
                                  "--batch-size 64 --quiet --metrics '' --plot '' " + extra,
                              240);
}

// The line "epoch N: ..." of a run's output, up to its timing.
std::string epoch_line(const std::string& output, int epoch) {
  std::stringstream in(output);
  const std::string tag = "epoch " + std::to_string(epoch) + ":";
  for (std::string line; std::getline(in, line);)
    if (line.find(tag) != std::string::npos) return line.substr(line.find(tag), line.find(" (") - line.find(tag));
  return "";
}

TEST(FsdpTrainCnn, ASavedShardedRunResumesWhereItStoppedAndAtAnotherRankCount) {
  if (!std::getenv("LOOMRUN") || !std::getenv("TRAIN_CNN")) GTEST_SKIP() << "LOOMRUN and TRAIN_CNN are not set";
  const std::string dir = temp_path("train_cnn_fsdp_ckpt");
  const testing::RunResult straight = train_cnn_fsdp(2, "--epochs 2");
  ASSERT_EQ(straight.code, 0) << straight.output;
  // Stopped after epoch 1 (--max-steps: 512 images over 2 ranks of 64 are 4 steps an epoch;
  // --schedule none, so that the stop does not shorten a schedule), then resumed from the
  // folder of shards for epoch 2.
  const testing::RunResult first = train_cnn_fsdp(2, "--epochs 2 --max-steps 4 --save " + dir);
  ASSERT_EQ(first.code, 0) << first.output;
  EXPECT_TRUE(std::filesystem::exists(std::filesystem::path(dir) / "index.safetensors")) << first.output;
  EXPECT_TRUE(std::filesystem::exists(std::filesystem::path(dir) / "shard-g1-00001-of-00002.safetensors"));
  const testing::RunResult resumed = train_cnn_fsdp(2, "--epochs 2 --resume " + dir);
  ASSERT_EQ(resumed.code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resumed " + dir + " at epoch 2, batch 0"), std::string::npos) << resumed.output;
  ASSERT_FALSE(epoch_line(straight.output, 2).empty()) << straight.output;
  EXPECT_EQ(epoch_line(resumed.output, 2), epoch_line(straight.output, 2));

  // Saved at an epoch's end, the shards load on another rank count.
  const testing::RunResult three = train_cnn_fsdp(3, "--epochs 2 --resume " + dir);
  ASSERT_EQ(three.code, 0) << three.output;
  EXPECT_NE(three.output.find("resumed " + dir + " at epoch 2"), std::string::npos) << three.output;
  // An epoch is 2 whole steps on 3 ranks (170 images each, 64 a step): the run goes on from
  // step 2, not 4.
  EXPECT_NE(three.output.find("saved on 2 ranks, resumed on 3: an epoch is 2 steps here, so the run goes on from "
                              "step 2 (step 4 there)"),
            std::string::npos)
      << three.output;
  EXPECT_NE(epoch_line(three.output, 2), "") << three.output;

  // Mid-epoch, the data position needs the same rank count: refused, naming it.
  const std::string mid = temp_path("train_cnn_fsdp_mid");
  const testing::RunResult part = train_cnn_fsdp(2, "--epochs 2 --max-steps 6 --save-every 6 --save " + mid);
  ASSERT_EQ(part.code, 0) << part.output;
  const testing::RunResult other = train_cnn_fsdp(3, "--epochs 2 --resume " + mid);
  EXPECT_EQ(other.code, 2) << other.output;
  EXPECT_NE(other.output.find("was saved with the rank count 2, this run has the rank count 3"), std::string::npos)
      << other.output;
  std::filesystem::remove_all(dir);
  std::filesystem::remove_all(mid);
}

TEST(FsdpTrainCnn, CheckpointsOfEitherKindResumeAndFilesInTheWayAreNamed) {
  if (!std::getenv("LOOMRUN") || !std::getenv("TRAIN_CNN")) GTEST_SKIP() << "LOOMRUN and TRAIN_CNN are not set";
  const std::string dir = temp_path("train_cnn_fsdp_kind"), file = temp_path("train_cnn_plain") + ".safetensors";
  ASSERT_EQ(train_cnn_fsdp(2, "--epochs 1 --max-steps 2 --save " + dir).code, 0);
  // A folder of shards given to a run without --fsdp.
  const testing::RunResult plain = testing::run_command(
      std::string(std::getenv("TRAIN_CNN")) + " --device cpu --subset 512 --epochs 1 --metrics '' --plot '' --resume " +
          dir,
      60);
  EXPECT_EQ(plain.code, 2) << plain.output;
  EXPECT_NE(plain.output.find("--resume " + dir + " is a sharded checkpoint"), std::string::npos) << plain.output;
  EXPECT_NE(plain.output.find("resume it with --fsdp"), std::string::npos) << plain.output;
  // A single-file checkpoint of one process, saved at an epoch's end, resumes under --fsdp
  // on two ranks: each takes its rows of the weights and of the optimizer's state.
  ASSERT_EQ(testing::run_command(std::string(std::getenv("TRAIN_CNN")) +
                                     " --device cpu --subset 512 --test-subset 200 --batch-size 64 --schedule none "
                                     "--epochs 1 --quiet --metrics '' --plot '' --save " + file,
                                 120)
                .code,
            0);
  const testing::RunResult sharded = train_cnn_fsdp(2, "--epochs 2 --resume " + file);
  EXPECT_EQ(sharded.code, 0) << sharded.output;
  EXPECT_NE(sharded.output.find("resumed " + file + " at epoch 2, batch 0"), std::string::npos) << sharded.output;
  EXPECT_NE(sharded.output.find("saved on 1 ranks, resumed on 2"), std::string::npos) << sharded.output;
  EXPECT_NE(epoch_line(sharded.output, 2), "") << sharded.output;
  // --save naming a file, or a folder of other files: refused before any work, nothing touched.
  const testing::RunResult onto_file = train_cnn_fsdp(2, "--epochs 1 --save " + file);
  EXPECT_EQ(onto_file.code, 2) << onto_file.output;
  EXPECT_NE(onto_file.output.find("--save " + file + " is a file"), std::string::npos) << onto_file.output;
  const std::string busy = temp_path("train_cnn_busy");
  std::filesystem::create_directories(busy);
  std::ofstream(std::filesystem::path(busy) / "notes.txt") << "keep me\n";
  const testing::RunResult onto_busy = train_cnn_fsdp(2, "--epochs 1 --save " + busy);
  EXPECT_EQ(onto_busy.code, 2) << onto_busy.output;
  EXPECT_NE(onto_busy.output.find("holds other files (notes.txt) and no checkpoint"), std::string::npos)
      << onto_busy.output;
  EXPECT_TRUE(std::filesystem::exists(std::filesystem::path(busy) / "notes.txt"));
  std::filesystem::remove_all(dir);
  std::filesystem::remove_all(busy);
  std::filesystem::remove(file);
}

TEST(FsdpTrainCnn, HybridShardingOnFourRanksTrainsAsDdpDoes) {
  if (!std::getenv("LOOMRUN") || !std::getenv("TRAIN_CNN")) GTEST_SKIP() << "LOOMRUN and TRAIN_CNN are not set";
  EXPECT_EQ(train_cnn_epochs("--fsdp --hsdp 2 --min-params 1000", 4), train_cnn_epochs("", 4));
  const testing::RunResult odd = train_cnn_fsdp(3, "--epochs 1 --hsdp 2");
  EXPECT_EQ(odd.code, 2) << odd.output;
  EXPECT_NE(odd.output.find("--hsdp 2: the 3 rank(s) started do not divide into that many replicas"),
            std::string::npos) << odd.output;
}

}  // namespace
}  // namespace loom::dist
