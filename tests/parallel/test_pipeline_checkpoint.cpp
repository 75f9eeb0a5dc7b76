// Pipeline checkpoints (parallel/pipeline_checkpoint.h) on forked CPU ranks over Gloo: a
// checkpoint loaded into pipelines built from another seed gives back every parameter,
// optimizer buffer, schedule and generator bit for bit, and the next step's loss is the
// continued run's (2 ranks with two stages each, and 2 x 2 pipelines times replicas); a save
// that never wrote its index leaves the previous checkpoint loadable and its files go at the
// next save; the export is a plain GPT's state dict giving the pipeline's loss; a checkpoint
// loads into pipelines of another layout, each entry bit for bit by name. Then train_gpt --pp
// under loomrun: a run killed after its first epoch's save and resumed ends with the
// uninterrupted run's losses, on the same layout or another (4 ranks, or interleaved); what
// cannot resume is refused by name; the validation loss printed is one process's on the
// saved weights.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <random>
#include <regex>
#include <set>
#include <thread>

#include "data/dataset.h"
#include "data/loader.h"
#include "data/text.h"
#include "engine/autograd.h"
#include "engine/ops.h"
#include "engine/serialization.h"
#include "layers/checkpoint.h"
#include "layers/models/gpt.h"
#include "layers/optim/adam.h"
#include "parallel/device_mesh.h"
#include "parallel/fsdp.h"
#include "parallel/gpt_pipeline.h"
#include "parallel/pipeline_checkpoint.h"
#include "parallel/pipeline_gather.h"
#include "ranks.h"
#include "token_batches.h"
#include "run_command.h"

namespace loom::dist::pipeline {
namespace {

namespace fs = std::filesystem;
using testing::require;
using testing::run_ranks;
using testing::temp_path;

const nn::GPTConfig kConfig{.vocab_size = 32, .context = 8, .layers = 4, .heads = 2, .width = 8};
constexpr int64_t kT = 8, kRows = 8;

// Token ids and next-token targets (kRows, kT), the same on every rank for a step.
std::pair<Tensor, Tensor> batch(int step) { return testing::token_batch(kRows, kT, 32, uint32_t(1234 + step)); }

// One rank's part of a pipelined training: the GPT's stages on the mesh's "pp" group (its
// replicas on "dp"), AdamW and a cosine schedule, the replicas seeded alike.
struct Training {
  const DeviceMesh& mesh;
  GPTPipeline gp;
  std::unique_ptr<optim::AdamW> opt;
  std::unique_ptr<optim::LRScheduler> sched;

  // With `shard`, each stage is sharded over the "dp" group (f32 only); on a mesh with
  // "replicate" and "shard" dimensions ("dp" flattened from them), over "shard" and
  // replicated along "replicate" (HSDP).
  Training(const DeviceMesh& mesh, uint64_t seed, ScheduleKind kind, DType dtype = DType::f32,
           const nn::GPTConfig& config = kConfig, std::optional<FSDPOptions> shard = std::nullopt)
      : mesh(mesh) {
    manual_seed(seed + uint64_t(mesh.coordinate("pp")));
    PipelineOptions options{.schedule = kind, .microbatches = 2,
                            .stages_per_rank = kind == ScheduleKind::interleaved ? 2 : 1, .activation_dtype = dtype,
                            .data_parallel = mesh.size("dp") > 1 || shard ? mesh.group("dp") : nullptr,
                            .shard = shard};
    const auto& names = mesh.names();
    if (shard && std::find(names.begin(), names.end(), "replicate") != names.end()) {
      options.shard->replicate_group = mesh.group("replicate");
      options.shard_group = mesh.group("shard");
    }
    gp = make_gpt_pipeline(mesh.group("pp"), config, kT, options);
    if (!shard)
      for (auto& m : gp.modules) m->to(dtype);
    opt = std::make_unique<optim::AdamW>(gp.parameters(), optim::AdamWOptions{.lr = 1e-2});
    sched = std::make_unique<optim::LRScheduler>(*opt, optim::cosine_annealing(20, 1e-3));
  }

  // One step on this replica's rows of batch(step); returns the pipeline's loss.
  double step(int step) {
    auto [ids, targets] = batch(step);
    const int64_t rows = kRows / mesh.size("dp"), row0 = rows * mesh.coordinate("dp");
    opt->zero_grad();
    const double loss = gp.pipeline->step(ids.slice(0, row0, row0 + rows), targets.slice(0, row0, row0 + rows)).item();
    gp.pipeline->clip_grad_norm(1.0);
    opt->step();
    sched->step();
    return loss;
  }

  PipelineCheckpoint checkpoint(std::map<std::string, std::string> user = {}) {
    return {.pipeline = gp.pipeline.get(), .world = mesh.world().get(), .replica = mesh.coordinate("dp"),
            .optimizer = opt.get(), .scheduler = sched.get(), .user = std::move(user)};
  }
};

// Everything a checkpoint restores on a rank, copied.
struct Snapshot {
  std::map<std::string, Tensor> tensors;  // the stages' state dicts and the optimizer's buffers
  std::map<std::string, double> scalars;  // the optimizer's and the schedule's
  std::pair<uint64_t, uint64_t> rng;
};

Snapshot snapshot(const Training& t) {
  Snapshot s;
  for (const Stage& stage : t.gp.pipeline->stages()) {
    if (stage.sharded) {  // its shards and its buffers: the full parameters exist only in a step
      for (const auto& [name, p] : stage.sharded->named_parameters()) s.tensors[name] = p.clone();
      for (const auto& [name, b] : stage.module->named_buffers()) s.tensors[name] = b.clone();
    } else {
      for (const auto& [name, p] : stage.module->state_dict()) s.tensors[name] = p.clone();
    }
  }
  const optim::OptimizerState o = t.opt->state_dict();
  for (const auto& [key, b] : o.tensors) s.tensors["optimizer." + key] = b.clone();
  for (const auto& [key, v] : o.scalars) s.scalars["optimizer." + key] = v;
  for (const auto& [key, v] : t.sched->state_dict()) s.scalars["scheduler." + key] = v;
  s.rng = rng_state();
  return s;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape() || a.dtype() != b.dtype()) return false;
  const Tensor ca = a.contiguous(), cb = b.contiguous();
  return std::memcmp(ca.data_ptr(), cb.data_ptr(), ca.nbytes()) == 0;
}

// Throws naming the first entry of `got` that is not `want`'s bit for bit.
void require_same(const Snapshot& got, const Snapshot& want, const std::string& what) {
  require(got.tensors.size() == want.tensors.size(), what, ": ", got.tensors.size(), " tensors, expected ",
          want.tensors.size());
  for (const auto& [name, t] : want.tensors) {
    require(got.tensors.count(name), what, ": no ", name);
    require(same_bits(got.tensors.at(name), t), what, ": ", name, " differs from the saved one");
  }
  require(got.scalars == want.scalars, what, ": the optimizer's or the schedule's scalars differ");
  require(got.rng == want.rng, what, ": the random generator differs");
}

// Saves after three steps, loads into pipelines built from another seed, and steps once more.
void save_load_continue(int world_size, ScheduleKind kind) {
  const std::string dir = temp_path("pipeline_ckpt");
  run_ranks(world_size, [&](int, std::shared_ptr<ProcessGroup> world) {
    DeviceMesh mesh(world, {2, world_size / 2}, {"pp", "dp"});
    Snapshot saved;
    double continued = 0;
    {
      Training a(mesh, 7, kind);
      for (int s = 0; s < 3; ++s) a.step(s);
      save_pipeline_checkpoint(dir, a.checkpoint({{"epoch", "1"}, {"note", "after three steps"}}));
      saved = snapshot(a);
      continued = a.step(3);
    }
    Training b(mesh, 99, kind);
    require(!same_bits(snapshot(b).tensors.begin()->second, saved.tensors.begin()->second),
            "the other seed's pipeline starts equal to the saved one: the test proves nothing");
    const auto user = load_pipeline_checkpoint(dir, b.checkpoint());
    require(user == std::map<std::string, std::string>{{"epoch", "1"}, {"note", "after three steps"}},
            "the caller's entries did not come back");
    require_same(snapshot(b), saved, "loaded");
    const double resumed = b.step(3);
    require(resumed == continued, "the step after the load gives loss ", resumed, ", the continued run ", continued);
  });
  fs::remove_all(dir);
}

TEST(PipelineCheckpoint, LoadsBitForBitAndContinuesLikeTheRunThatSavedOnTwoRanksOfTwoStages) {
  save_load_continue(2, ScheduleKind::interleaved);
}

TEST(PipelineCheckpoint, LoadsBitForBitAndContinuesLikeTheRunThatSavedOnTwoPipelinesOfTwoRanks) {
  save_load_continue(4, ScheduleKind::one_f_one_b);
}

TEST(PipelineCheckpoint, ASaveKilledBeforeItsIndexLeavesThePreviousOneAndItsFilesGoAtTheNextSave) {
  const std::string dir = temp_path("pipeline_ckpt_killed");
  run_ranks(2, [&](int rank, std::shared_ptr<ProcessGroup> world) {
    DeviceMesh mesh(world, {2, 1}, {"pp", "dp"});
    Training a(mesh, 7, ScheduleKind::one_f_one_b);
    for (int s = 0; s < 2; ++s) a.step(s);
    save_pipeline_checkpoint(dir, a.checkpoint());
    const Snapshot first = snapshot(a);
    // The next save, killed after the stage files of generation 2 and before the index: its
    // files hold the weights of a step later.
    a.step(2);
    nn::NamedTensors later;
    for (const auto& m : a.gp.modules)
      for (const auto& entry : m->state_dict()) later.push_back(entry);
    save_safetensors(dir + "/stage-g2-0000" + std::to_string(rank) + "-of-00002.safetensors", later);
    // And a shard file of generation 2 that a killed save of sharded stages left behind.
    if (rank == 0) save_safetensors(dir + "/stage-g2-00000-of-00002-shard-00001-of-00002.safetensors", later);
    world->barrier()->wait();

    Training b(mesh, 99, ScheduleKind::one_f_one_b);
    load_pipeline_checkpoint(dir, b.checkpoint());
    require_same(snapshot(b), first, "loaded past the unfinished save");

    // The next save is generation 2 over the leftovers; generation 1's files and the stray
    // shard file are removed.
    save_pipeline_checkpoint(dir, b.checkpoint());
    std::set<std::string> files;
    for (const auto& e : fs::directory_iterator(dir)) files.insert(e.path().filename().string());
    const std::set<std::string> expected{"index.safetensors", "stage-g2-00000-of-00002.safetensors",
                                         "stage-g2-00001-of-00002.safetensors"};
    require(files == expected, "the folder holds ", files.size(), " files after the save, expected the index and "
            "generation 2's two");
    Training c(mesh, 5, ScheduleKind::one_f_one_b);
    load_pipeline_checkpoint(dir, c.checkpoint());
    require_same(snapshot(c), first, "loaded after the save over the leftovers");
  });
  fs::remove_all(dir);
}

TEST(PipelineCheckpoint, AnotherModelIsRefusedNamingBothAndChangesNothing) {
  const std::string dir = temp_path("pipeline_ckpt_other");
  run_ranks(2, [&](int rank, std::shared_ptr<ProcessGroup> world) {
    DeviceMesh mesh(world, {2, 1}, {"pp", "dp"});
    Training a(mesh, 7, ScheduleKind::one_f_one_b);
    a.step(0);
    save_pipeline_checkpoint(dir, a.checkpoint());
    // Refused, and the pipeline it was asked to load into keeps its own values.
    auto refused = [&](Training& t, const std::vector<std::string>& parts) {
      const Snapshot before = snapshot(t);
      testing::require_error([&] { load_pipeline_checkpoint(dir, t.checkpoint()); }, parts);
      require_same(snapshot(t), before, "after a refused load");
    };
    const nn::GPTConfig wider{.vocab_size = 32, .context = 8, .layers = 4, .heads = 2, .width = 16};
    Training wide(mesh, 9, ScheduleKind::one_f_one_b, DType::f32, wider);
    const std::string first = rank == 0 ? "transformer.wte.weight" : "transformer.h.2.ln_1.weight";
    const Shape saved_shape = rank == 0 ? Shape{32, 8} : Shape{8}, wide_shape = rank == 0 ? Shape{32, 16} : Shape{16};
    refused(wide, {dir, first, shape_str(saved_shape), shape_str(wide_shape)});
    // Two blocks where four were saved: the last stage's blocks do not run on into ln_f there.
    // (Stage 0's blocks are the saved model's first: it sees nothing wrong on its own.)
    const nn::GPTConfig shorter{.vocab_size = 32, .context = 8, .layers = 2, .heads = 2, .width = 8};
    Training short_model(mesh, 9, ScheduleKind::one_f_one_b, DType::f32, shorter);
    if (rank == 1) refused(short_model, {dir, "holds transformer.h.2.", "transformer.ln_f.weight", "2 stages"});
  });
  fs::remove_all(dir);
}

// The state of a rank by name, as a pipeline checkpoint files it: the stages' state dicts,
// "optim.<parameter>.<buffer>" and "step.<parameter>" (one value), so that pipelines of two
// layouts can be compared entry by entry.
std::map<std::string, Tensor> state_by_name(const Training& t) {
  std::map<std::string, Tensor> out;
  std::map<const void*, std::string> name_of;
  for (const auto& m : t.gp.modules) {
    for (const auto& [name, p] : m->state_dict()) out[name] = p.clone();
    for (const auto& [name, p] : m->named_parameters()) name_of.emplace(p.impl(), name);
  }
  std::vector<std::string> names;
  for (const auto& group : t.opt->param_groups())
    for (const Tensor& p : group.params) names.push_back(name_of.at(p.impl()));
  // "state.<i>.<rest>" -> parameter i's name and the rest.
  auto split = [&](const std::string& key) {
    const size_t dot = key.find('.', 6);
    return std::pair{names.at(std::stoul(key.substr(6, dot - 6))), key.substr(dot + 1)};
  };
  const optim::OptimizerState o = t.opt->state_dict();
  for (const auto& [key, b] : o.tensors) {
    auto [name, buffer] = split(key);
    out["optim." + name + "." + buffer] = b.clone();
  }
  for (const auto& [key, v] : o.scalars)
    if (key.starts_with("state.")) out["step." + split(key).first] = full({1}, v, DType::f64, Device::cpu());
  return out;
}

// A folder whose index is another kind of checkpoint's (a sharded one) is not written into:
// every rank stops before writing, rank 0 naming the format, and the folder is as it was.
TEST(PipelineCheckpoint, AFolderOfAnotherKindOfCheckpointIsRefusedOnEveryRank) {
  const std::string dir = temp_path("pipeline_ckpt_other_kind");
  fs::create_directories(dir);
  save_safetensors(dir + "/index.safetensors", {}, {{"format", "loom-sharded-1"}, {"generation", "3"}});
  run_ranks(2, [&](int rank, std::shared_ptr<ProcessGroup> world) {
    DeviceMesh mesh(world, {2, 1}, {"pp", "dp"});
    Training a(mesh, 7, ScheduleKind::one_f_one_b);
    const std::vector<std::string> want =
        rank == 0 ? std::vector<std::string>{"save_pipeline_checkpoint(" + dir + ")", "format 'loom-sharded-1'",
                                             "new or empty folder"}
                  : std::vector<std::string>{"rank 0 could not read the index in " + dir};
    testing::require_error([&] { save_pipeline_checkpoint(dir, a.checkpoint()); }, want);
  });
  int files = 0;
  for (const auto& e : fs::directory_iterator(dir)) files += e.is_regular_file();
  EXPECT_EQ(files, 1);
  EXPECT_EQ(load_safetensors_metadata(dir + "/index.safetensors").at("format"), "loom-sharded-1");
  fs::remove_all(dir);
}

// A stage of a linear layer and a learned scalar scale.
class ScaledLinear : public nn::Module {
 public:
  ScaledLinear() {
    lin = register_module("lin", std::make_shared<nn::Linear>(4, 4));
    scale = register_parameter("scale", randn({}));
  }
  Tensor forward(const Tensor& x) override { return mul(lin->forward(x), scale); }
  Tensor loss(const Tensor& x, const Tensor& targets) { Tensor d = sub(forward(x), targets);
    return mean(mul(d, d)); }
  std::shared_ptr<nn::Linear> lin;
  Tensor scale;
};

// A one-stage pipeline of ScaledLinear on 2 ranks, sharded over them (the scalar's one row,
// and its optimizer state's, on shard 0; none on shard 1) or replicated, AdamW.
struct ScaledTraining {
  ModelPipeline<ScaledLinear> gp;
  std::unique_ptr<optim::AdamW> opt;
  int rank;
  ScaledTraining(const DeviceMesh& mesh, uint64_t seed, bool sharded) : rank(mesh.coordinate("dp")) {
    manual_seed(seed);
    PipelineOptions options{.schedule = ScheduleKind::one_f_one_b, .microbatches = 2,
                            .data_parallel = mesh.group("dp")};
    if (sharded) options.shard = FSDPOptions{};
    gp = make_residual_pipeline<ScaledLinear>(mesh.group("pp"), 1, 3, 4, options, {},
                                              [](int, int64_t, int64_t, bool) {
                                                return std::make_shared<ScaledLinear>();
                                              });
    opt = std::make_unique<optim::AdamW>(gp.parameters(), optim::AdamWOptions{.lr = 1e-2});
  }
  double step(int s) {
    manual_seed(uint64_t(100 + s));
    Tensor x = randn({4, 3, 4}), y = randn({4, 3, 4});
    opt->zero_grad();
    const double loss = gp.pipeline->step(x.slice(0, 2 * rank, 2 * rank + 2), y.slice(0, 2 * rank, 2 * rank + 2)).item();
    opt->step();
    return loss;
  }
  PipelineCheckpoint checkpoint(const DeviceMesh& mesh) {
    return {.pipeline = gp.pipeline.get(), .world = mesh.world().get(), .replica = rank, .optimizer = opt.get(),
            .scheduler = nullptr, .user = {}};
  }
};

// The scalar's rows and its optimizer state's load into the sharded stage again bit for bit
// (shard 0 holding them, shard 1 none), and into a replicated stage, whose next step is the
// sharded one's.
TEST(PipelineCheckpoint, AShardedScalarParameterAndItsOptimizerStateLoadBack) {
  const std::string dir = temp_path("pipeline_ckpt_scalar");
  run_ranks(2, [&](int rank, std::shared_ptr<ProcessGroup> world) {
    DeviceMesh mesh(world, {1, 2}, {"pp", "dp"});
    std::map<std::string, Tensor> saved;
    double continued = 0;
    {
      ScaledTraining a(mesh, 7, true);
      for (int s = 0; s < 2; ++s) a.step(s);
      save_pipeline_checkpoint(dir, a.checkpoint(mesh));
      for (const auto& [name, t] : a.gp.pipeline->stages()[0].sharded->named_parameters()) saved[name] = t.clone();
      for (const auto& [key, t] : a.opt->state_dict().tensors) saved["optimizer." + key] = t.clone();
      continued = a.step(2);
    }
    ScaledTraining b(mesh, 99, true);
    load_pipeline_checkpoint(dir, b.checkpoint(mesh));
    std::map<std::string, Tensor> loaded;
    for (const auto& [name, t] : b.gp.pipeline->stages()[0].sharded->named_parameters()) loaded[name] = t.clone();
    for (const auto& [key, t] : b.opt->state_dict().tensors) loaded["optimizer." + key] = t.clone();
    require(loaded.size() == saved.size(), "rank ", rank, ": ", loaded.size(), " tensors loaded, ", saved.size(),
            " saved");
    for (const auto& [name, t] : saved)
      require(loaded.count(name) && same_bits(loaded.at(name), t), "rank ", rank, ": ", name, " did not load back");
    require(saved.at("scale").numel() == (rank == 0 ? 1 : 0), "rank ", rank, " holds ", saved.at("scale").numel(),
            " rows of the scalar");
    require(b.step(2) == continued, "the sharded stage's step after the load is not the saving run's");
    ScaledTraining c(mesh, 99, false);
    load_pipeline_checkpoint(dir, c.checkpoint(mesh));
    const double whole = c.step(2);
    require(std::abs(whole - continued) <= 1e-6 * std::abs(continued), "the replicated stage's step after the load ",
            "gives ", whole, ", the saving run ", continued);
  });
  fs::remove_all(dir);
}

// One stage holding both ends of GPT's tied embedding keeps one optimizer state for it; loaded
// into two stages, the last stage's copy (lm_head.weight) gets that state too, so the step after
// the load is the continued run's within 1e-5 (on 2 ranks: 1 x 2 saves, 2 x 1 loads).
TEST(PipelineCheckpoint, OneStageWithBothEndsOfTheTiedEmbeddingGivesBothCopiesItsOptimizerState) {
  const std::string dir = temp_path("pipeline_ckpt_tied");
  run_ranks(2, [&](int rank, std::shared_ptr<ProcessGroup> world) {
    std::map<std::string, Tensor> saved;
    double continued = 0;
    {
      DeviceMesh mesh(world, {1, 2}, {"pp", "dp"});
      Training a(mesh, 7, ScheduleKind::one_f_one_b);
      for (int s = 0; s < 3; ++s) a.step(s);
      save_pipeline_checkpoint(dir, a.checkpoint());
      saved = state_by_name(a);
      continued = a.step(3);
    }
    DeviceMesh mesh(world, {2, 1}, {"pp", "dp"});
    Training b(mesh, 99, ScheduleKind::one_f_one_b);
    load_pipeline_checkpoint(dir, b.checkpoint());
    const std::map<std::string, Tensor> loaded = state_by_name(b);
    const std::string held = rank == 0 ? "transformer.wte.weight" : "lm_head.weight";
    for (const std::string buffer : {"optim.", "step."}) {
      const std::string key = buffer == "step." ? "step." + held : "optim." + held + ".exp_avg";
      const std::string source =
          buffer == "step." ? "step.transformer.wte.weight" : "optim.transformer.wte.weight.exp_avg";
      require(loaded.count(key), "rank ", rank, ": no ", key, " after the load");
      require(same_bits(loaded.at(key), saved.at(source)), "rank ", rank, ": ", key, " is not the saved ", source);
    }
    const double resumed = b.step(3);
    require(std::abs(resumed - continued) <= 1e-5 * std::abs(continued), "the step after the load gives ", resumed,
            ", the saving run ", continued);
  });
  fs::remove_all(dir);
}

// Saved by one layout, loaded by another: every entry a rank of the new layout holds is, bit
// for bit, what the rank that held it had saved, and the next step's loss is the saving
// run's within 1e-5 (the same sums, in other orders). Saved by 2 stages on a 2 x 2 mesh;
// loaded into 4 stages on 4 ranks (1F1B), into 4 stages two a rank on 2 x 2 (interleaved),
// and into one stage on 1 x 4.
TEST(PipelineCheckpoint, SavedByTwoStagesItLoadsIntoFourOrOneBitForBitByName) {
  const std::string dir = temp_path("pipeline_ckpt_layout"), saved_dir = temp_path("pipeline_ckpt_layout_state");
  fs::create_directories(saved_dir);
  run_ranks(4, [&](int rank, std::shared_ptr<ProcessGroup> world) {
    double continued = 0;
    {
      DeviceMesh mesh(world, {2, 2}, {"pp", "dp"});
      Training a(mesh, 7, ScheduleKind::one_f_one_b);
      for (int s = 0; s < 3; ++s) a.step(s);
      save_pipeline_checkpoint(dir, a.checkpoint({{"epoch", "1"}}));
      nn::NamedTensors mine;
      for (auto& [name, t] : state_by_name(a)) mine.emplace_back(name, t);
      save_safetensors(saved_dir + "/rank" + std::to_string(rank) + ".safetensors", mine);
      continued = a.step(3);
    }
    world->barrier()->wait();
    std::map<std::string, Tensor> saved;
    for (int r = 0; r < 4; ++r)
      for (auto& [name, t] : load_safetensors(saved_dir + "/rank" + std::to_string(r) + ".safetensors").tensors)
        saved.emplace(name, t);
    struct Layout {
      std::vector<int> mesh;
      ScheduleKind kind;
    };
    for (const Layout& layout : {Layout{{4, 1}, ScheduleKind::one_f_one_b}, Layout{{2, 2}, ScheduleKind::interleaved},
                                 Layout{{1, 4}, ScheduleKind::one_f_one_b}}) {
      DeviceMesh mesh(world, layout.mesh, {"pp", "dp"});
      Training b(mesh, 99, layout.kind);
      const std::string what = std::to_string(b.gp.pipeline->schedule().stages) + " stages on " +
                               std::to_string(layout.mesh[0]) + " x " + std::to_string(layout.mesh[1]) + ", rank " +
                               std::to_string(rank);
      const auto user = load_pipeline_checkpoint(dir, b.checkpoint());
      require(user.at("epoch") == "1", what, ": the caller's entries did not come back");
      const std::map<std::string, Tensor> loaded = state_by_name(b);
      int optimizer_entries = 0;
      for (const auto& [name, t] : loaded) {
        require(saved.count(name), what, ": ", name, " was not saved");
        require(same_bits(t, saved.at(name)), what, ": ", name, " differs from the saved one");
        optimizer_entries += name.starts_with("optim.");
      }
      require(optimizer_entries > 0, what, ": no optimizer state was loaded");
      const double resumed = b.step(3);
      require(std::abs(resumed - continued) <= 1e-5 * std::abs(continued), what, ": the step after the load gives ",
              resumed, ", the saving run ", continued);
    }
  });
  fs::remove_all(dir);
  fs::remove_all(saved_dir);
}

TEST(PipelineCheckpoint, ExportsAPlainGptStateDictThatGivesThePipelinesLoss) {
  const std::string dir = temp_path("pipeline_ckpt_export"), path = temp_path("pipeline_export") + ".safetensors";
  run_ranks(2, [&](int rank, std::shared_ptr<ProcessGroup> world) {
    DeviceMesh mesh(world, {2, 1}, {"pp", "dp"});
    Training a(mesh, 7, ScheduleKind::interleaved, DType::f64);  // rank 0 holds stages 0 and 2
    for (int s = 0; s < 2; ++s) a.step(s);
    save_pipeline_checkpoint(dir, a.checkpoint());
    const double pipeline_loss = a.step(2);  // the loss of the saved weights on batch(2)
    if (rank != 0) return;
    export_pipeline_checkpoint(dir, path);
    manual_seed(1);
    nn::GPT gpt(kConfig);
    gpt.to(DType::f64);
    nn::load_weights(path, gpt);
    std::vector<std::string> names, expected;
    for (const auto& [name, t] : load_safetensors(path).tensors) names.push_back(name);
    for (const auto& [name, t] : gpt.state_dict()) expected.push_back(name);
    require(names == expected, "the export's names are not nn::GPT::state_dict()'s, in its order");
    auto [ids, targets] = batch(2);
    const double loss = gpt.loss(ids, targets).item();
    // In f64 throughout, but Pipeline::step reports its loss as f32: equal to f32's rounding.
    require(std::abs(loss - pipeline_loss) <= 1e-6 * std::abs(loss), "the exported GPT's loss is ", loss,
            ", the pipeline's ", pipeline_loss);
  });
  fs::remove_all(dir);
  fs::remove(path);
}

// Every stage's parameters and buffers at their whole values, by name; a sharded stage's
// gathered over its data-parallel group (every rank of the group calls this).
std::map<std::string, Tensor> whole_values(const Training& t) {
  std::map<std::string, Tensor> out;
  for (const Stage& s : t.gp.pipeline->stages())
    for (const auto& [name, v] : s.sharded ? s.sharded->full_state_dict() : s.module->state_dict())
      out[name] = v.clone();
  return out;
}

// Stages sharded by FSDP (ZeRO-3) over their data-parallel pairs on a 2 x 2 mesh save their
// rows: a file per rank of a stage, none of them whole, and the export puts them together into
// a plain GPT's state dict holding the stages' whole values. The checkpoint loads back bit for
// bit on the same layout (shards, optimizer state, schedule, generator; the next two losses
// identical) and into other layouts, each holding the export's values bit for bit, its next
// two losses the saving run's within 1e-5: whole stages on 2 x 2 (GPipe), one stage sharded
// over 4 ranks (width 6: rows of 2, 2, 2 and none; 5, 5, 5 and 3), and 4 whole stages. HSDP
// (one stage, 2 replicas of 2 shards) loads it and saves its own; saved again by whole
// stages, it loads sharded over 4 ranks likewise.
TEST(PipelineCheckpoint, ShardedStagesSaveTheirRowsAndLoadIntoAnyLayout) {
  const nn::GPTConfig config{.vocab_size = 32, .context = 8, .layers = 4, .heads = 2, .width = 6};
  const std::string dir = temp_path("pipeline_ckpt_sharded"), whole_dir = temp_path("pipeline_ckpt_unsharded");
  const std::string hsdp_dir = temp_path("pipeline_ckpt_hsdp");
  const std::string path = temp_path("pipeline_sharded_export") + ".safetensors";
  run_ranks(4, [&](int rank, std::shared_ptr<ProcessGroup> world) {
    Snapshot saved;
    std::map<std::string, Tensor> whole;
    double continued[2] = {0, 0};
    {
      DeviceMesh mesh(world, {2, 2}, {"pp", "dp"});
      Training a(mesh, 7, ScheduleKind::one_f_one_b, DType::f32, config, FSDPOptions{});
      for (int s = 0; s < 3; ++s) a.step(s);
      save_pipeline_checkpoint(dir, a.checkpoint({{"epoch", "1"}}));
      saved = snapshot(a);
      whole = whole_values(a);
      continued[0] = a.step(3);
      continued[1] = a.step(4);
    }
    world->barrier()->wait();
    if (rank == 0) {
      std::set<std::string> files;
      for (const auto& e : fs::directory_iterator(dir)) files.insert(e.path().filename().string());
      const std::set<std::string> want{"index.safetensors",
                                       "stage-g1-00000-of-00002-shard-00000-of-00002.safetensors",
                                       "stage-g1-00000-of-00002-shard-00001-of-00002.safetensors",
                                       "stage-g1-00001-of-00002-shard-00000-of-00002.safetensors",
                                       "stage-g1-00001-of-00002-shard-00001-of-00002.safetensors"};
      require(files == want, "the folder does not hold one file per rank of each stage and the index");
      require(load_safetensors_metadata(dir + "/index.safetensors").at("shards") == "2", "the index's shards");
      export_pipeline_checkpoint(dir, path);
      std::vector<std::string> names, expected;
      for (const auto& [name, t] : load_safetensors(path).tensors) names.push_back(name);
      manual_seed(1);
      for (const auto& [name, t] : nn::GPT(config).state_dict()) expected.push_back(name);
      require(names == expected, "the export's names are not nn::GPT::state_dict()'s, in its order");
    }
    world->barrier()->wait();
    std::map<std::string, Tensor> exported;
    for (auto& [name, t] : load_safetensors(path).tensors) exported.emplace(name, t);
    for (const auto& [name, t] : whole)
      require(same_bits(exported.at(name), t), "rank ", rank, ": the export's ", name, " is not the stage's");

    struct Layout {
      std::vector<int> mesh;
      ScheduleKind kind;
      bool sharded;
    };
    for (const Layout& layout : {Layout{{2, 2}, ScheduleKind::one_f_one_b, true},
                                 Layout{{2, 2}, ScheduleKind::gpipe, false}, Layout{{1, 4}, ScheduleKind::gpipe, true},
                                 Layout{{4, 1}, ScheduleKind::one_f_one_b, false}}) {
      DeviceMesh mesh(world, layout.mesh, {"pp", "dp"});
      Training b(mesh, 99, layout.kind, DType::f32, config,
                 layout.sharded ? std::optional<FSDPOptions>(FSDPOptions{}) : std::nullopt);
      const std::string what = std::string(layout.sharded ? "sharded" : "whole") + " stages on " +
                               std::to_string(layout.mesh[0]) + " x " + std::to_string(layout.mesh[1]) + ", rank " +
                               std::to_string(rank);
      require(load_pipeline_checkpoint(dir, b.checkpoint()).at("epoch") == "1", what, ": the caller's entries");
      const bool same_layout = layout.sharded && layout.mesh[0] == 2;
      if (same_layout) require_same(snapshot(b), saved, what);
      const std::map<std::string, Tensor> loaded = whole_values(b);
      require(!loaded.empty(), what, ": no stage");
      for (const auto& [name, t] : loaded)
        require(same_bits(t, exported.at(name)), what, ": ", name, " is not the saved value");
      for (int s = 0; s < 2; ++s) {
        const double loss = b.step(3 + s);
        if (same_layout)
          require(loss == continued[s], what, ": step ", 3 + s, " gives ", loss, ", the saving run ", continued[s]);
        else
          require(std::abs(loss - continued[s]) <= 1e-5 * std::abs(continued[s]), what, ": step ", 3 + s, " gives ",
                  loss, ", the saving run ", continued[s]);
      }
    }
    // HSDP: one stage sharded over 2 ranks and replicated twice loads the checkpoint, trains
    // a step and saves: the first replica alone writes, a file per shard, and whole stages on
    // 4 ranks load that save to the HSDP stage's values.
    {
      DeviceMesh mesh(world, {1, 2, 2}, {"pp", "replicate", "shard"});
      mesh.flatten({"replicate", "shard"}, "dp");
      Training h(mesh, 99, ScheduleKind::gpipe, DType::f32, config, FSDPOptions{});
      load_pipeline_checkpoint(dir, h.checkpoint());
      for (const auto& [name, t] : whole_values(h))
        require(same_bits(t, exported.at(name)), "HSDP, rank ", rank, ": ", name, " is not the saved value");
      const double loss = h.step(3);
      require(std::abs(loss - continued[0]) <= 1e-5 * std::abs(continued[0]), "HSDP: step 3 gives ", loss,
              ", the saving run ", continued[0]);
      save_pipeline_checkpoint(hsdp_dir, h.checkpoint());
      const std::map<std::string, Tensor> trained = whole_values(h);
      if (rank == 0) {
        std::set<std::string> files;
        for (const auto& e : fs::directory_iterator(hsdp_dir)) files.insert(e.path().filename().string());
        require(files == std::set<std::string>{"index.safetensors",
                                               "stage-g1-00000-of-00001-shard-00000-of-00002.safetensors",
                                               "stage-g1-00000-of-00001-shard-00001-of-00002.safetensors"},
                "HSDP's save is not one file per shard of the first replica");
      }
      DeviceMesh flat(world, {4, 1}, {"pp", "dp"});
      Training w(flat, 99, ScheduleKind::one_f_one_b, DType::f32, config);
      load_pipeline_checkpoint(hsdp_dir, w.checkpoint());
      for (const auto& [name, t] : whole_values(w))
        require(same_bits(t, trained.at(name)), "HSDP's save loaded whole, rank ", rank, ": ", name,
                " is not the HSDP stage's value");
    }
    // Whole stages saved again (a file per pipeline rank), loaded sharded over 4 ranks.
    {
      DeviceMesh mesh(world, {2, 2}, {"pp", "dp"});
      Training c(mesh, 99, ScheduleKind::one_f_one_b, DType::f32, config);
      load_pipeline_checkpoint(dir, c.checkpoint());
      save_pipeline_checkpoint(whole_dir, c.checkpoint());
    }
    require(load_safetensors_metadata(whole_dir + "/index.safetensors").at("shards") == "1", "the whole save's shards");
    DeviceMesh mesh(world, {1, 4}, {"pp", "dp"});
    Training d(mesh, 99, ScheduleKind::gpipe, DType::f32, config, FSDPOptions{});
    load_pipeline_checkpoint(whole_dir, d.checkpoint());
    for (const auto& [name, t] : whole_values(d))
      require(same_bits(t, exported.at(name)), "whole stages loaded sharded, rank ", rank, ": ", name,
              " is not the saved value");
    const double loss = d.step(3);
    require(std::abs(loss - continued[0]) <= 1e-5 * std::abs(continued[0]), "whole stages loaded sharded: step 3 "
            "gives ", loss, ", the saving run ", continued[0]);
  });
  fs::remove_all(dir);
  fs::remove_all(whole_dir);
  fs::remove_all(hsdp_dir);
  fs::remove(path);
}

// gather_state_dicts brings every stage to pp rank 0 under the whole model's names: the same
// tensors, to the bit, as the export of a checkpoint saved at that point; the other ranks get
// nothing. On 2 ranks, interleaved (rank 0 holds stages 0 and 2 of 4, the tied embedding's
// two copies on ranks 0 and 1).
TEST(PipelineGather, EveryStageReachesRankZeroAsTheExportHasIt) {
  const std::string dir = temp_path("pipeline_gather_ckpt"), path = temp_path("pipeline_gather") + ".safetensors";
  const std::string gathered = temp_path("pipeline_gathered") + ".safetensors";
  run_ranks(2, [&](int rank, std::shared_ptr<ProcessGroup> world) {
    DeviceMesh mesh(world, {2, 1}, {"pp", "dp"});
    nn::GPTConfig config = kConfig;
    config.layers = 4;
    Training a(mesh, 7, ScheduleKind::interleaved, DType::f64, config);
    a.step(0);
    save_pipeline_checkpoint(dir, a.checkpoint());
    const std::vector<std::shared_ptr<nn::Module>> stages(a.gp.modules.begin(), a.gp.modules.end());
    const nn::NamedTensors all = gather_state_dicts(*mesh.group("pp"), stages);
    require(rank == 0 || all.empty(), "rank ", rank, " got ", all.size(), " tensors");
    if (rank == 0) save_safetensors(gathered, all);
  });
  export_pipeline_checkpoint(dir, path);
  const auto want = load_safetensors(path).tensors;
  std::map<std::string, Tensor> got;
  for (auto& [name, t] : load_safetensors(gathered).tensors) got.emplace(name, t);
  ASSERT_EQ(got.size(), want.size()) << "tensors gathered against exported";
  for (const auto& [name, t] : want) {
    ASSERT_TRUE(got.count(name)) << name << " was not gathered";
    EXPECT_TRUE(same_bits(got.at(name), t)) << name << " differs from the export";
  }
  for (const std::string& p : {dir, path, gathered}) fs::remove_all(p);
}

// ---- train_gpt --pp under loomrun ---------------------------------------------------------

std::string program(const char* name) {
  const char* path = std::getenv(name);
  return path ? path : "";
}

// A small corpus of words: 27 steps an epoch at --context 16 --batch-size 8 (one pipeline).
std::string write_corpus() {
  const std::string path = temp_path("pp_corpus") + ".txt";
  const char* words[] = {"the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven"};
  std::mt19937 rng(1);
  std::ofstream out(path);
  for (int i = 0; i < 800; ++i) out << words[rng() % 11] << (i % 12 == 11 ? "\n" : " ");
  return path;
}

std::string train_gpt(const std::string& corpus, const std::string& metrics, const std::string& extra) {
  return program("LOOMRUN") + " --nproc-per-node 2 " + program("TRAIN_GPT") +
         " --device cpu --config tiny --data " + corpus +
         " --context 16 --batch-size 8 --epochs 2 --workers 1 --plot '' --metrics '" + metrics + "' " + extra;
}

// The values of `key` ("train_loss", "val_loss") in a metrics file, one per line.
std::vector<std::string> metric(const std::string& metrics, const std::string& key = "train_loss") {
  std::ifstream in(metrics);
  std::vector<std::string> out;
  std::smatch m;
  for (std::string line; std::getline(in, line);)
    if (std::regex_search(line, m, std::regex("\"" + key + "\": *([^,}]+)"))) out.push_back(m[1]);
  return out;
}

// Every tensor of a pipeline checkpoint's stage files, by file and name.
std::map<std::string, Tensor> stage_tensors(const std::string& dir) {
  std::map<std::string, Tensor> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string file = e.path().filename().string();
    if (!file.starts_with("stage-")) continue;
    for (auto& [name, t] : load_safetensors(e.path().string()).tensors) out[file + ": " + name] = t;
  }
  return out;
}

// Starts `command` (its output into `log`) as a process of its own; returns its pid.
pid_t start(const std::string& command, const std::string& log) {
  const std::string line = "exec " + command + " > '" + log + "' 2>&1";
  pid_t pid = ::fork();
  if (pid == 0) {
    ::execl("/bin/sh", "sh", "-c", line.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  return pid;
}

// Runs `command` (with --save dir) and kills it (SIGKILL to loomrun, whose ranks die with it)
// as soon as its first checkpoint is whole: while its second epoch trains.
void save_first_epoch_then_kill(const std::string& command, const std::string& dir, const std::string& log) {
  const pid_t killed = start(command, log);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!fs::exists(dir + "/index.safetensors") && std::chrono::steady_clock::now() < deadline &&
         ::waitpid(killed, nullptr, WNOHANG) == 0)
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  ::kill(killed, SIGKILL);
  ::waitpid(killed, nullptr, 0);
  ASSERT_TRUE(fs::exists(dir + "/index.safetensors")) << "no checkpoint was saved";
  const auto index = load_safetensors_metadata(dir + "/index.safetensors");
  ASSERT_EQ(index.at("user.epoch"), "1") << "the run was killed after its second epoch had been saved: too late";
}

TEST(TrainGptPipelineCheckpoint, ARunKilledAfterItsFirstSaveResumesToTheUninterruptedLosses) {
  ASSERT_FALSE(program("LOOMRUN").empty() || program("TRAIN_GPT").empty()) << "meson test sets LOOMRUN, TRAIN_GPT";
  const std::string corpus = write_corpus(), dir = temp_path("pp_train_ckpt");
  const std::string straight_dir = temp_path("pp_straight_ckpt");
  const std::string straight_metrics = temp_path("pp_straight") + ".jsonl";
  const std::string metrics = temp_path("pp_resumed") + ".jsonl";  // the killed run's, then the resumed run's
  auto straight = testing::run_command(train_gpt(corpus, straight_metrics, "--pp 2 --save " + straight_dir), 120);
  ASSERT_EQ(straight.code, 0) << straight.output;

  const std::string log = temp_path("pp_killed") + ".log";
  ASSERT_NO_FATAL_FAILURE(save_first_epoch_then_kill(train_gpt(corpus, metrics, "--pp 2 --save " + dir), dir, log));
  const auto index = load_safetensors_metadata(dir + "/index.safetensors");
  EXPECT_EQ(index.at("user.pp"), "2");
  EXPECT_EQ(index.at("user.schedule"), "1f1b");

  auto resumed = testing::run_command(train_gpt(corpus, metrics, "--pp 2 --resume " + dir + " --save " + dir), 120);
  ASSERT_EQ(resumed.code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resumed " + dir + " at epoch 2, batch 0"), std::string::npos) << resumed.output;
  const std::vector<std::string> want = metric(straight_metrics), got = metric(metrics);
  ASSERT_EQ(want.size(), 2u) << straight.output;
  EXPECT_EQ(got, want) << resumed.output;
  // Both end with generation 2's files (the epochs' two saves): the same weights and
  // optimizer state, bit for bit.
  const std::map<std::string, Tensor> final_straight = stage_tensors(straight_dir), final_resumed = stage_tensors(dir);
  ASSERT_EQ(final_straight.size(), final_resumed.size());
  ASSERT_FALSE(final_straight.empty());
  for (const auto& [key, t] : final_straight) {
    ASSERT_TRUE(final_resumed.count(key)) << key;
    EXPECT_TRUE(same_bits(final_resumed.at(key), t)) << key << " differs after the resumed run";
  }

  // Resumes of another kind: a single file given to --pp, a pipeline's folder given to a run
  // without --pp; and a single file given to --pp's --save.
  nn::GPT gpt(nn::GPTConfig::named("tiny"));
  const std::string file = temp_path("pp_file_ckpt") + ".safetensors";
  nn::save_checkpoint(file, {.model = &gpt, .user = {{"program", "train_gpt"}, {"config", "tiny"}}});
  struct Case {
    std::string args;
    std::vector<std::string> expected;
  };
  const std::vector<Case> cases = {
      {"--pp 2 --resume " + file, {"--resume " + file, "single-file training checkpoint", "--pp 2"}},
      {"--resume " + dir, {"--resume " + dir, "is a pipeline checkpoint", "--pp 2"}},
      {"--pp 2 --save " + file, {"--save " + file, "is a file", "folder"}},
      {"--fsdp --save " + dir, {"--save " + dir, "holds a checkpoint of format 'loom-pipeline-1'"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.args);
    auto r = testing::run_command(train_gpt(corpus, "", c.args), 60);
    EXPECT_NE(r.code, 0) << r.output;
    for (const std::string& part : c.expected) EXPECT_NE(r.output.find(part), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("terminate called"), std::string::npos) << r.output;
  }
  for (const std::string& path : {corpus, dir, straight_dir, straight_metrics, metrics, log, file})
    fs::remove_all(path);
}

}  // namespace
// Saved at an epoch's end by one pipeline of 2 ranks, the checkpoint resumes as two pipelines
// (--dp 2, 4 ranks): every replica reads its stage's file, and the run goes on from the next
// epoch's first step as 4 ranks count steps (13 an epoch where one pipeline took 27). At the
// end rank 0 generates text from the first pipeline's stages.
TEST(TrainGptPipelineCheckpoint, SavedAtAnEpochsEndItResumesWithAnotherDp) {
  ASSERT_FALSE(program("LOOMRUN").empty() || program("TRAIN_GPT").empty()) << "meson test sets LOOMRUN, TRAIN_GPT";
  const std::string corpus = write_corpus(), dir = temp_path("pp_dp_ckpt");
  auto command = [&](int ranks, const std::string& extra) {
    return program("LOOMRUN") + " --nproc-per-node " + std::to_string(ranks) + " " + program("TRAIN_GPT") +
           " --device cpu --config tiny --data " + corpus +
           " --context 16 --batch-size 8 --workers 1 --plot '' --metrics '' --pp 2 " + extra;
  };
  auto first = testing::run_command(command(2, "--epochs 1 --save " + dir), 120);
  ASSERT_EQ(first.code, 0) << first.output;
  auto wider = testing::run_command(command(4, "--dp 2 --epochs 2 --resume " + dir), 120);
  ASSERT_EQ(wider.code, 0) << wider.output;
  EXPECT_NE(wider.output.find("saved at --dp 1, resumed at --dp 2: an epoch is 13 steps here, so the run goes on "
                              "from step 13 (step 27 there)"),
            std::string::npos)
      << wider.output;
  EXPECT_NE(wider.output.find("resumed " + dir + " at epoch 2, batch 0"), std::string::npos) << wider.output;
  EXPECT_NE(wider.output.find("epoch 2:"), std::string::npos) << wider.output;
  // The first pipeline's stages gathered on rank 0, which generates.
  EXPECT_NE(wider.output.find("--- sample (temperature 0.80, top-k 40) ---"), std::string::npos) << wider.output;
  for (const std::string& path : {corpus, dir}) fs::remove_all(path);
}


double number(const std::string& text) { return std::stod(text); }

bool close(double a, double b) { return std::abs(a - b) <= 1e-5 * std::abs(b); }

// train_gpt --pp 2 --dp 2 --fsdp (stages sharded over their pairs) saves a checkpoint of rows
// after its first epoch; killed there and resumed with --fsdp, it ends with the uninterrupted
// run's losses (identical in the metrics' digits), and the same checkpoint resumed with whole
// stages (no --fsdp) gives them within 1e-5.
TEST(TrainGptPipelineCheckpoint, ShardedStagesResumeShardedOrWholeToTheUninterruptedLosses) {
  ASSERT_FALSE(program("LOOMRUN").empty() || program("TRAIN_GPT").empty()) << "meson test sets LOOMRUN, TRAIN_GPT";
  const std::string corpus = write_corpus(), dir = temp_path("pp_fsdp_ckpt"), log = temp_path("pp_fsdp") + ".log";
  auto command = [&](const std::string& metrics, const std::string& extra) {
    return program("LOOMRUN") + " --nproc-per-node 4 " + program("TRAIN_GPT") + " --device cpu --config tiny --data " +
           corpus + " --context 16 --batch-size 8 --epochs 2 --workers 1 --generate 0 --plot '' --metrics '" +
           metrics + "' --pp 2 --dp 2 " + extra;
  };
  const std::string straight_metrics = temp_path("pp_fsdp_straight") + ".jsonl";
  auto straight = testing::run_command(command(straight_metrics, "--fsdp"), 300);
  ASSERT_EQ(straight.code, 0) << straight.output;
  const std::vector<std::string> want = metric(straight_metrics);
  ASSERT_EQ(want.size(), 2u) << straight.output;
  ASSERT_NO_FATAL_FAILURE(save_first_epoch_then_kill(command("", "--fsdp --save " + dir), dir, log));
  std::set<std::string> shard_files;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().filename().string().find("-shard-") != std::string::npos)
      shard_files.insert(e.path().filename().string());
  EXPECT_EQ(shard_files.size(), 4u) << "one file per rank: the stages are sharded";

  for (const std::string flags : {"--fsdp", ""}) {
    SCOPED_TRACE(flags.empty() ? "whole stages" : flags);
    const std::string metrics = temp_path("pp_fsdp_resumed") + ".jsonl";
    auto resumed = testing::run_command(command(metrics, flags + " --resume " + dir), 300);
    ASSERT_EQ(resumed.code, 0) << resumed.output;
    EXPECT_NE(resumed.output.find("resumed " + dir + " at epoch 2, batch 0"), std::string::npos) << resumed.output;
    const std::vector<std::string> got = metric(metrics);
    ASSERT_EQ(got.size(), 1u) << resumed.output;
    if (flags.empty()) EXPECT_TRUE(close(number(got[0]), number(want[1]))) << got[0] << " against " << want[1];
    else EXPECT_EQ(got[0], want[1]);
    fs::remove(metrics);
  }
  for (const std::string& path : {corpus, dir, log, straight_metrics}) fs::remove_all(path);
}

// Saved at its first epoch's end by 2 ranks (1F1B, 2 stages of the guide's 6 blocks), the
// checkpoint resumes on 4 ranks (--pp 4) and on 2 ranks of two stages each (interleaved, 4
// stages): each stage reads its blocks by name from the files that hold them, and the second
// epoch's train and validation losses are the uninterrupted run's within 1e-5 (pipelines of
// any layout equal one process within that; the metrics' 6 digits are finer). Saved within
// an epoch, it resumes at another --pp; at another --dp it is refused naming --dp.
TEST(TrainGptPipelineCheckpoint, SavedByTwoRanksItResumesOnAnotherLayoutToTheUninterruptedLosses) {
  ASSERT_FALSE(program("LOOMRUN").empty() || program("TRAIN_GPT").empty()) << "meson test sets LOOMRUN, TRAIN_GPT";
  const std::string corpus = write_corpus(), dir = temp_path("pp_layout_ckpt"), log = temp_path("pp_layout") + ".log";
  auto command = [&](int ranks, const std::string& metrics, const std::string& extra) {
    return program("LOOMRUN") + " --nproc-per-node " + std::to_string(ranks) + " " + program("TRAIN_GPT") +
           " --device cpu --config guide --data " + corpus + " --context 16 --batch-size 8 --epochs 2 --workers 1 "
           "--generate 0 --plot '' --metrics '" + metrics + "' " + extra;
  };
  const std::string straight_metrics = temp_path("pp_layout_straight") + ".jsonl";
  auto straight = testing::run_command(command(2, straight_metrics, "--pp 2"), 300);
  ASSERT_EQ(straight.code, 0) << straight.output;
  const std::vector<std::string> want_train = metric(straight_metrics), want_val = metric(straight_metrics, "val_loss");
  ASSERT_EQ(want_val.size(), 2u) << straight.output;
  ASSERT_NO_FATAL_FAILURE(save_first_epoch_then_kill(command(2, "", "--pp 2 --save " + dir), dir, log));

  struct Case {
    int ranks;
    std::string flags, stages;
  };
  for (const Case& c : {Case{4, "--pp 4", "a pipeline of 4 stages on 4 x 1 ranks"},
                        Case{2, "--pp 2 --schedule interleaved", "a pipeline of 4 stages on 2 x 1 ranks"}}) {
    SCOPED_TRACE(c.flags);
    const std::string metrics = temp_path("pp_layout_resumed") + ".jsonl";
    auto resumed = testing::run_command(command(c.ranks, metrics, c.flags + " --resume " + dir), 300);
    ASSERT_EQ(resumed.code, 0) << resumed.output;
    EXPECT_NE(resumed.output.find(c.stages), std::string::npos) << resumed.output;
    EXPECT_NE(resumed.output.find("resumed " + dir + " at epoch 2, batch 0 (step 27)"), std::string::npos)
        << resumed.output;
    const std::vector<std::string> train = metric(metrics), val = metric(metrics, "val_loss");
    ASSERT_EQ(val.size(), 1u) << resumed.output;
    EXPECT_TRUE(close(number(train[0]), number(want_train[1]))) << train[0] << " against " << want_train[1];
    EXPECT_TRUE(close(number(val[0]), number(want_val[1]))) << val[0] << " against " << want_val[1];
    fs::remove(metrics);
  }

  // One step into the second epoch (--max-steps 28 ends the run there and saves): the same
  // data position at --pp 3, and refused at --dp 2.
  const std::string within = temp_path("pp_layout_within");
  auto stopped = testing::run_command(command(2, "", "--pp 2 --max-steps 28 --save " + within), 300);
  ASSERT_EQ(stopped.code, 0) << stopped.output;
  auto on_three =
      testing::run_command(command(3, "", "--pp 3 --microbatches 4 --max-steps 30 --resume " + within), 300);
  ASSERT_EQ(on_three.code, 0) << on_three.output;
  EXPECT_NE(on_three.output.find("resumed " + within + " at epoch 2, batch 1 (step 28)"), std::string::npos)
      << on_three.output;
  auto on_four = testing::run_command(command(4, "", "--pp 2 --dp 2 --resume " + within), 120);
  EXPECT_NE(on_four.code, 0) << on_four.output;
  const std::vector<std::string> refusal{"--resume " + within, "--dp 1", "this run has --dp 2", "within an epoch"};
  for (const std::string& part : refusal)
    EXPECT_NE(on_four.output.find(part), std::string::npos) << on_four.output;
  EXPECT_EQ(on_four.output.find("terminate called"), std::string::npos) << on_four.output;
  for (const std::string& path : {corpus, dir, log, straight_metrics, within}) fs::remove_all(path);
}

// train_gpt --pp 2 prints and records the validation loss one process computes on the same
// weights over the same batches (the plain run's validation: the last 10% of the text in
// windows of --context, batches of --batch-size in order, the mean of their losses, the last
// batch short and cut into uneven micro-batches): here the
// weights its checkpoint holds after the epoch, exported and loaded into a whole GPT. A
// pipelined run starts from other weights than a plain one (each rank builds its stages
// alone), so the same weights are compared, not the same seed. Within 1e-5 relative of the
// metrics' value (f32 micro-batch means against whole-batch means; 6 digits printed).
TEST(TrainGptPipeline, ItsValidationLossIsOneProcesssOnTheSameWeights) {
  ASSERT_FALSE(program("LOOMRUN").empty() || program("TRAIN_GPT").empty()) << "meson test sets LOOMRUN, TRAIN_GPT";
  const std::string corpus = write_corpus(), dir = temp_path("pp_val_ckpt"), metrics = temp_path("pp_val") + ".jsonl";
  const std::string weights = temp_path("pp_val_weights") + ".safetensors";
  auto r = testing::run_command(program("LOOMRUN") + " --nproc-per-node 2 " + program("TRAIN_GPT") +
                                    " --device cpu --config tiny --data " + corpus +
                                    " --context 16 --batch-size 14 --epochs 1 --workers 1 --generate 0 --plot '' "
                                    "--pp 2 --microbatches 7 --metrics '" + metrics + "' --save " + dir,
                                120);
  ASSERT_EQ(r.code, 0) << r.output;
  const std::vector<std::string> printed = metric(metrics, "val_loss");
  ASSERT_EQ(printed.size(), 1u) << r.output;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.output, m, std::regex("epoch 1: train loss [0-9.]+  validation loss ([0-9.]+)  ")))
      << r.output;

  export_pipeline_checkpoint(dir, weights);
  nn::GPT gpt(nn::GPTConfig::named("tiny"));
  nn::load_weights(weights, gpt);
  const data::TokenShard all = data::load_text(corpus);
  const size_t split = all.tokens.size() * 9 / 10;
  auto val_set = std::make_shared<data::TokenWindowDataset>(
      data::TokenShard{{all.tokens.begin() + int64_t(split), all.tokens.end()}}, 16);
  data::DataLoader val(val_set, std::make_shared<data::SequentialSampler>(val_set->size()),
                       {.batch_size = 14, .num_workers = 1, .drop_last = data::DropLast::no});
  NoGradGuard no_grad;
  double sum = 0;
  int64_t batches = 0;
  data::Epoch epoch = val.epoch(0);
  for (data::Batch& b : epoch) {
    sum += gpt.loss(b.inputs, b.targets).item();
    ++batches;
  }
  ASSERT_EQ(val_set->size() % 14, 10) << "the corpus should end in a batch of 10, which the pipeline cuts into 7 "
                                         "micro-batches of 2 or 1 rows";
  const double want = sum / double(batches);
  EXPECT_TRUE(close(number(printed[0]), want)) << printed[0] << " against one process's " << want;
  EXPECT_NEAR(number(m[1]), want, 0.5e-4 + 1e-5 * want) << r.output;
  for (const std::string& path : {corpus, dir, metrics, weights}) fs::remove_all(path);
}

}  // namespace loom::dist::pipeline
