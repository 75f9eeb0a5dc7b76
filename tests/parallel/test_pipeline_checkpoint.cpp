// Pipeline checkpoints (parallel/pipeline_checkpoint.h) on forked CPU ranks over Gloo: a
// checkpoint loaded into pipelines built from another seed gives back every parameter,
// optimizer buffer, schedule and generator bit for bit, and the next step's loss is the
// continued run's (2 ranks with two stages each, and 2 x 2 pipelines times replicas); a save
// that never wrote its index leaves the previous checkpoint loadable and its files go at the
// next save; the export is a plain GPT's state dict giving the pipeline's loss. Then
// train_gpt --pp under loomrun: a run killed after its first epoch's save and resumed ends
// with the uninterrupted run's losses, and resumes of another layout are refused by name.
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

#include "engine/autograd.h"
#include "engine/ops.h"
#include "engine/serialization.h"
#include "layers/checkpoint.h"
#include "layers/models/gpt.h"
#include "layers/optim/adam.h"
#include "parallel/device_mesh.h"
#include "parallel/gpt_pipeline.h"
#include "parallel/pipeline_checkpoint.h"
#include "parallel/pipeline_gather.h"
#include "ranks.h"
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
std::pair<Tensor, Tensor> batch(int step) {
  std::mt19937 rng(1234 + step);
  Tensor ids = Tensor::empty({kRows, kT}, DType::i64), targets = Tensor::empty({kRows, kT}, DType::i64);
  for (int64_t i = 0; i < kRows * kT; ++i) {
    ids.data<int64_t>()[i] = int64_t(rng() % 32);
    targets.data<int64_t>()[i] = int64_t(rng() % 32);
  }
  return {ids, targets};
}

// One rank's part of a pipelined training: the GPT's stages on the mesh's "pp" group (its
// replicas on "dp"), AdamW and a cosine schedule, the replicas seeded alike.
struct Training {
  const DeviceMesh& mesh;
  GPTPipeline gp;
  std::unique_ptr<optim::AdamW> opt;
  std::unique_ptr<optim::LRScheduler> sched;

  Training(const DeviceMesh& mesh, uint64_t seed, ScheduleKind kind, DType dtype = DType::f32,
           const nn::GPTConfig& config = kConfig)
      : mesh(mesh) {
    manual_seed(seed + uint64_t(mesh.coordinate("pp")));
    PipelineOptions options{.schedule = kind, .microbatches = 2,
                            .stages_per_rank = kind == ScheduleKind::interleaved ? 2 : 1, .activation_dtype = dtype,
                            .data_parallel = mesh.size("dp") > 1 ? mesh.group("dp") : nullptr};
    gp = make_gpt_pipeline(mesh.group("pp"), config, kT, options);
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
  for (const auto& m : t.gp.modules)
    for (const auto& [name, p] : m->state_dict()) s.tensors[name] = p.clone();
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
    world->barrier()->wait();

    Training b(mesh, 99, ScheduleKind::one_f_one_b);
    load_pipeline_checkpoint(dir, b.checkpoint());
    require_same(snapshot(b), first, "loaded past the unfinished save");

    // The next save is generation 2 over the leftovers; generation 1's files are removed.
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

TEST(PipelineCheckpoint, AnotherPipelineOrModelIsRefusedNamingBothAndChangesNothing) {
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
    Training four_stages(mesh, 9, ScheduleKind::interleaved);
    refused(four_stages, {dir, "holds 2 stages", "this pipeline has 4"});
    const nn::GPTConfig wider{.vocab_size = 32, .context = 8, .layers = 4, .heads = 2, .width = 16};
    Training wide(mesh, 9, ScheduleKind::one_f_one_b, DType::f32, wider);
    const std::string first = rank == 0 ? "transformer.wte.weight" : "transformer.h.2.ln_1.weight";
    const Shape saved_shape = rank == 0 ? Shape{32, 8} : Shape{8}, wide_shape = rank == 0 ? Shape{32, 16} : Shape{16};
    refused(wide, {dir, first, shape_str(saved_shape), shape_str(wide_shape)});
    DeviceMesh one_rank_pipelines(world, {1, 2}, {"pp", "dp"});
    Training whole(one_rank_pipelines, 9, ScheduleKind::one_f_one_b);
    refused(whole, {dir, "pipeline of 2 ranks", "this one has 1"});
  });
  fs::remove_all(dir);
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

// The train_loss values of a metrics file, one per line.
std::vector<std::string> train_losses(const std::string& metrics) {
  std::ifstream in(metrics);
  std::vector<std::string> out;
  std::smatch m;
  for (std::string line; std::getline(in, line);)
    if (std::regex_search(line, m, std::regex("\"train_loss\": *([^,}]+)"))) out.push_back(m[1]);
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

TEST(TrainGptPipelineCheckpoint, ARunKilledAfterItsFirstSaveResumesToTheUninterruptedLosses) {
  ASSERT_FALSE(program("LOOMRUN").empty() || program("TRAIN_GPT").empty()) << "meson test sets LOOMRUN, TRAIN_GPT";
  const std::string corpus = write_corpus(), dir = temp_path("pp_train_ckpt");
  const std::string straight_dir = temp_path("pp_straight_ckpt");
  const std::string straight_metrics = temp_path("pp_straight") + ".jsonl";
  const std::string metrics = temp_path("pp_resumed") + ".jsonl";  // the killed run's, then the resumed run's
  auto straight = testing::run_command(train_gpt(corpus, straight_metrics, "--pp 2 --save " + straight_dir), 120);
  ASSERT_EQ(straight.code, 0) << straight.output;

  // The same run with --save, killed (SIGKILL to loomrun, whose ranks die with it) as soon as
  // its first checkpoint is whole: while its second epoch trains.
  const std::string log = temp_path("pp_killed") + ".log";
  const pid_t killed = start(train_gpt(corpus, metrics, "--pp 2 --save " + dir), log);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!fs::exists(dir + "/index.safetensors") && std::chrono::steady_clock::now() < deadline &&
         ::waitpid(killed, nullptr, WNOHANG) == 0)
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  ::kill(killed, SIGKILL);
  ::waitpid(killed, nullptr, 0);
  ASSERT_TRUE(fs::exists(dir + "/index.safetensors")) << "no checkpoint was saved";
  const auto index = load_safetensors_metadata(dir + "/index.safetensors");
  ASSERT_EQ(index.at("user.epoch"), "1") << "the run was killed after its second epoch had been saved: too late";
  EXPECT_EQ(index.at("user.pp"), "2");
  EXPECT_EQ(index.at("user.schedule"), "1f1b");

  auto resumed = testing::run_command(train_gpt(corpus, metrics, "--pp 2 --resume " + dir + " --save " + dir), 120);
  ASSERT_EQ(resumed.code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resumed " + dir + " at epoch 2, batch 0"), std::string::npos) << resumed.output;
  const std::vector<std::string> want = train_losses(straight_metrics), got = train_losses(metrics);
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

  // Resumes of another layout: another --pp, a single file given to --pp, a pipeline's folder
  // given to a run without --pp; and a single file given to --pp's --save.
  nn::GPT gpt(nn::GPTConfig::named("tiny"));
  const std::string file = temp_path("pp_file_ckpt") + ".safetensors";
  nn::save_checkpoint(file, {.model = &gpt, .user = {{"program", "train_gpt"}, {"config", "tiny"}}});
  struct Case {
    std::string args;
    std::vector<std::string> expected;
  };
  const std::vector<Case> cases = {
      {"--pp 3 --resume " + dir, {"--resume " + dir, "--pp 2", "this run is --pp 3"}},
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
  EXPECT_NE(wider.output.find("saved on 2 ranks, resumed on 4: an epoch is 13 steps here, so the run goes on from "
                              "step 13 (step 27 there)"),
            std::string::npos)
      << wider.output;
  EXPECT_NE(wider.output.find("resumed " + dir + " at epoch 2, batch 0"), std::string::npos) << wider.output;
  EXPECT_NE(wider.output.find("epoch 2:"), std::string::npos) << wider.output;
  // The first pipeline's stages gathered on rank 0, which generates.
  EXPECT_NE(wider.output.find("--- sample (temperature 0.80, top-k 40) ---"), std::string::npos) << wider.output;
  for (const std::string& path : {corpus, dir}) fs::remove_all(path);
}

}  // namespace loom::dist::pipeline
