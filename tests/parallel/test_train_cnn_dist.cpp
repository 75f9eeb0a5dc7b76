// train_cnn data-parallel on CPU ranks, end to end: loomrun starts two ranks of train_cnn
// over Gloo on a Fashion-MNIST subset; rank 0 reports the group and the test accuracy, the
// run exits 0, and only rank 0 writes the metrics file. meson passes the programs' paths in
// LOOMRUN and TRAIN_CNN. Skips where Fashion-MNIST is not installed. train_gpt (TRAIN_GPT) the
// same way on Debian's fortunes: it learns under DDP, --fsdp prints DDP's losses, and the
// combinations --fsdp cannot run are named.
#include <gtest/gtest.h>
#include <unistd.h>

#include "run_command.h"

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

namespace loom::dist {
namespace {

using testing::RunResult;

RunResult run(const std::string& command, int seconds) { return testing::run_command(command, seconds); }

bool have_fashion_mnist() {
  return std::filesystem::exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz") ||
         std::filesystem::exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte");
}

TEST(TrainCnnDist, TwoCpuRanksOverGlooTrainAndReportOnce) {
  if (!have_fashion_mnist()) GTEST_SKIP() << "Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist)";
  const std::string metrics = (std::filesystem::path(::testing::TempDir()) / "train_cnn_dist.jsonl").string();
  std::filesystem::remove(metrics);
  RunResult r = run(std::string(std::getenv("LOOMRUN")) + " --nproc-per-node 2 " + std::getenv("TRAIN_CNN") +
                  " --device cpu --subset 1200 --test-subset 500 --epochs 1 --batch-size 50 --workers 1 --quiet"
                  " --plot '' --metrics '" + metrics + "'",
              300);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("2 ranks (gloo)"), std::string::npos) << r.output;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.output, m, std::regex("test accuracy ([0-9.]+)%"))) << r.output;
  EXPECT_GT(std::stod(m[1]), 30.0) << r.output;  // chance is 10%
  // One summary line (rank 0's), one metrics line.
  EXPECT_EQ(r.output.find("epoch 1: train loss"), r.output.rfind("epoch 1: train loss")) << r.output;
  std::ifstream in(metrics);
  std::string line;
  int lines = 0;
  while (std::getline(in, line)) ++lines;
  EXPECT_EQ(lines, 1);
}

// --channels-last lays each batch out channels-last; two ranks under DDP then train to the
// row-major run's losses (the convolutions sum in another order, so to rounding). That such a
// one-channel batch runs the network channels-last is MemoryFormat's test
// (AOneChannelBatchStartsAChannelsLastNetwork); this one checks the program end to end.
TEST(TrainCnnDist, ChannelsLastTrainsToTheLossesOfTheRowMajorRun) {
  if (!have_fashion_mnist()) GTEST_SKIP() << "Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist)";
  double losses[2][2];
  for (int layout = 0; layout < 2; ++layout) {
    RunResult r = run(std::string(std::getenv("LOOMRUN")) + " --nproc-per-node 2 " + std::getenv("TRAIN_CNN") +
                          " --device cpu --subset 1200 --test-subset 500 --epochs 1 --batch-size 50 --workers 1"
                          " --quiet --plot '' --metrics ''" + (layout ? " --channels-last" : ""),
                      300);
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find(layout ? "f32 channels-last on" : "f32 on"), std::string::npos) << r.output;
    std::smatch m;
    ASSERT_TRUE(std::regex_search(r.output, m, std::regex("train loss ([0-9.]+)  test loss ([0-9.]+)"))) << r.output;
    losses[layout][0] = std::stod(m[1]);
    losses[layout][1] = std::stod(m[2]);
  }
  EXPECT_NEAR(losses[1][0], losses[0][0], 2e-4);
  EXPECT_NEAR(losses[1][1], losses[0][1], 2e-4);
}

TEST(TrainCnnDist, ScalingReportsSpeedupAndEfficiencyForOneAndTwoRanks) {
  if (!have_fashion_mnist()) GTEST_SKIP() << "Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist)";
  const auto dir = std::filesystem::path(::testing::TempDir());
  const std::string json = (dir / "scaling.jsonl").string(), svg = (dir / "scaling.svg").string();
  std::filesystem::remove(json);
  RunResult r = run(std::string(std::getenv("TRAIN_CNN")) +
                        " --device cpu --subset 400 --test-subset 100 --epochs 1 --batch-size 50 --workers 1"
                        " --scaling 2 --metrics '" + json + "' --plot '" + svg + "'",
                    300);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("speedup"), std::string::npos) << r.output;
  std::ifstream in(json);
  std::string line;
  std::vector<std::string> lines;
  while (std::getline(in, line)) lines.push_back(line);
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_NE(lines[0].find("\"ranks\": 1"), std::string::npos) << lines[0];
  EXPECT_NE(lines[0].find("\"speedup\": 1,"), std::string::npos) << lines[0];
  EXPECT_NE(lines[1].find("\"ranks\": 2"), std::string::npos) << lines[1];
  EXPECT_TRUE(std::filesystem::exists(svg));
}

TEST(TrainGptDist, TinyGptLearnsFortunesOnTwoCpuRanks) {
  if (!std::filesystem::exists("/usr/share/games/fortunes"))
    GTEST_SKIP() << "Debian's fortunes are not installed (apt-get install fortunes)";
  RunResult r = run(std::string(std::getenv("LOOMRUN")) + " --nproc-per-node 2 " + std::getenv("TRAIN_GPT") +
                        " --device cpu --max-steps 40 --batch-size 8 --context 32 --workers 1 --generate 40"
                        " --metrics '' --plot ''",
                    300);
  ASSERT_EQ(r.code, 0) << r.output;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.output, m, std::regex("train loss ([0-9.]+)  validation loss ([0-9.]+)")))
      << r.output;
  EXPECT_LT(std::stod(m[2]), 4.5) << r.output;  // ln(256) = 5.55 before any training
  EXPECT_NE(r.output.find("--- sample"), std::string::npos) << r.output;
}

// The per-epoch summary lines ("epoch 1: train loss 3.9889  validation loss 3.1322") without
// their throughput, and the generated sample.
struct GptReport {
  std::vector<std::string> epochs;
  std::string sample;
};

GptReport gpt_report(const std::string& output) {
  GptReport report;
  const std::regex line("epoch [0-9]+: train loss [0-9.]+  validation loss [0-9.]+");
  for (auto it = std::sregex_iterator(output.begin(), output.end(), line); it != std::sregex_iterator(); ++it)
    report.epochs.push_back(it->str());
  const size_t sample = output.find("--- sample");
  if (sample != std::string::npos) report.sample = output.substr(sample);
  return report;
}

// train_gpt --fsdp on two CPU ranks trains the run DDP trains: every epoch's train and
// validation loss, to the printed digits, and the text generated from the gathered weights.
// The averaged gradients are the same sums (two ranks' sum commutes, the mean halves it
// exactly); only the clipping norm is summed in another order (shard by shard), which stays
// far below the fourth decimal. Two epochs of Debian's 24 KB "fortunes" file, 43 steps each.
TEST(TrainGptDist, FsdpOnTwoCpuRanksPrintsTheLossesOfDdp) {
  const std::string corpus = "/usr/share/games/fortunes/fortunes";
  if (!std::filesystem::exists(corpus)) GTEST_SKIP() << "Debian's fortunes are not installed (apt-get install fortunes)";
  const std::string command = std::string(std::getenv("LOOMRUN")) + " --nproc-per-node 2 " + std::getenv("TRAIN_GPT") +
                              " --device cpu --data " + corpus +
                              " --epochs 2 --batch-size 8 --context 32 --workers 1 --generate 40 --metrics '' --plot ''";
  RunResult ddp = run(command, 300);
  ASSERT_EQ(ddp.code, 0) << ddp.output;
  const GptReport want = gpt_report(ddp.output);
  ASSERT_EQ(want.epochs.size(), 2u) << ddp.output;
  ASSERT_FALSE(want.sample.empty()) << ddp.output;
  // Each run prints its memory plan, and the measured peak beside it after the first epoch.
  const std::regex measured("memory after [0-9]+ steps: peak [0-9.]+ MB on this rank, [0-9]+% of the plan's");
  EXPECT_NE(ddp.output.find("memory plan per rank (DDP):\n[rank 0]   parameters    0.531 MB"), std::string::npos)
      << ddp.output;
  EXPECT_TRUE(std::regex_search(ddp.output, measured)) << ddp.output;
  struct Case {
    std::string flags, units, peak, plan;
  };
  // ZeRO-3 holds two units and a third arriving (prefetch), here all three; ZeRO-2 everything
  // at the turn.
  const std::vector<Case> cases = {
      {"--fsdp", "FSDP (ZeRO-3): 3 units; parameters 0.531 MB in all, 0.266 MB of shards on rank 0",
       "FSDP: at most 0.531 MB of full parameters held at once on rank 0",
       "memory plan per rank (FSDP ZeRO-3 over 2 ranks):\n[rank 0]   parameters    0.266 MB"},
      {"--fsdp --reshard-after-forward no --min-params 20000", "FSDP (ZeRO-2): 4 units;",
       "FSDP: at most 0.531 MB of full parameters held at once on rank 0",
       "memory plan per rank (FSDP ZeRO-2 over 2 ranks):\n[rank 0]   parameters    0.266 MB"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.flags);
    RunResult fsdp = run(command + " " + c.flags, 300);
    ASSERT_EQ(fsdp.code, 0) << fsdp.output;
    const GptReport got = gpt_report(fsdp.output);
    EXPECT_EQ(got.epochs, want.epochs) << fsdp.output;
    EXPECT_EQ(got.sample, want.sample) << fsdp.output;
    EXPECT_NE(fsdp.output.find(c.units), std::string::npos) << fsdp.output;
    EXPECT_NE(fsdp.output.find(c.peak), std::string::npos) << fsdp.output;
    EXPECT_NE(fsdp.output.find(c.plan), std::string::npos) << fsdp.output;
    EXPECT_TRUE(std::regex_search(fsdp.output, measured)) << fsdp.output;
  }
}

// train_gpt --trace without --pp: every rank's steps (forward, backward, optimizer) beside its
// collectives, in one file: DDP's bucket all-reduces, or FSDP's gathers (some prefetched) and
// reduce-scatters per unit.
TEST(TrainGptDist, TraceShowsEachRanksStepsBesideItsCollectives) {
  struct Case {
    std::string flags;
    std::vector<std::string> spans;
  };
  const std::vector<Case> cases = {
      {"", {"\"name\":\"all_reduce bucket 0\",\"cat\":\"allreduce\""}},
      {"--fsdp", {"\"name\":\"all_gather transformer.h.1\",\"cat\":\"allgather\"",
                  "\"name\":\"all_gather transformer.h.1 (prefetch)\",\"cat\":\"allgather\"",
                  "\"name\":\"reduce_scatter transformer.h.0\",\"cat\":\"reduce-scatter\""}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.flags.empty() ? "DDP" : c.flags);
    const std::string path = ::testing::TempDir() + "/train_gpt_trace.json";
    std::filesystem::remove(path);
    RunResult r = run(std::string(std::getenv("LOOMRUN")) + " --nproc-per-node 2 " + std::getenv("TRAIN_GPT") +
                          " --device cpu --config tiny --max-steps 3 --workers 1 --generate 0 --metrics '' --plot '' "
                          "--trace " + path + " " + c.flags,
                      120);
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("wrote the step timeline of 2 rank(s) to " + path), std::string::npos) << r.output;
    std::ifstream in(path);
    std::stringstream text;
    text << in.rdbuf();
    const std::string json = text.str();
    std::vector<std::string> want = c.spans;
    for (const char* name : {"forward", "backward", "optimizer"})
      want.push_back(std::string("\"name\":\"") + name + "\"");
    want.push_back("\"args\":{\"name\":\"rank 1\"}");
    for (const std::string& span : want) EXPECT_NE(json.find(span), std::string::npos) << span;
    for (int rank : {0, 1}) {
      // Each rank's collectives: the spans on its communication lane (tid 1).
      const std::regex lane("\"cat\":\"(allreduce|allgather|reduce-scatter)\",\"ph\":\"X\",\"pid\":" +
                            std::to_string(rank) + ",\"tid\":1");
      EXPECT_TRUE(std::regex_search(json, lane)) << "rank " << rank << " has no collective on its communication lane";
    }
    std::filesystem::remove(path);
  }
}

// What --fsdp cannot run stops before training, exits non-zero and names the flags.
TEST(TrainGptDist, FsdpCombinationsItCannotRunStopNamingTheFlags) {
  struct Case {
    std::string launcher, flags, expected;
  };
  const std::string loomrun = std::string(std::getenv("LOOMRUN")) + " --nproc-per-node 2 ";
  const std::vector<Case> cases = {
      {loomrun, "--fsdp --pp 2 --schedule zb1", "--schedule zb1 splits backward into halves FSDP does not follow"},
      {loomrun, "--fsdp --pp 2 --hsdp 2", "--hsdp 2 with --pp: the 1 data-parallel ranks of a stage (--dp) do not "
                                          "divide into that many replicas"},
      {loomrun, "--fsdp --hsdp 3", "--hsdp 3: the 2 rank(s) started do not divide into that many replicas"},
      {loomrun, "--hsdp 2", "--hsdp is FSDP's: add --fsdp"},
      {"", "--fsdp --scaling 2", "--fsdp with --scaling is not available"},
      {"", "--fsdp", "--fsdp shards over several ranks, and no launcher started this one"},
      {loomrun, "--min-params 1000", "--min-params is FSDP's: add --fsdp"},
      {loomrun, "--reshard-after-forward no", "--reshard-after-forward is FSDP's: add --fsdp"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.flags);
    RunResult r = run(c.launcher + std::getenv("TRAIN_GPT") +
                          " --device cpu --config tiny --max-steps 1 --workers 1 --metrics '' --plot '' " + c.flags,
                      120);
    EXPECT_NE(r.code, 0) << r.output;
    EXPECT_NE(r.output.find(c.expected), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("epoch 1"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("terminate called"), std::string::npos) << r.output;
  }
}

// train_gpt --fsdp --save writes a folder of shards (every rank its own file, an index last);
// --resume continues it from the next epoch, on the same rank count or, as it was saved at an
// epoch's end, on another: here 4 ranks as 2 replicas of 2 shards (--hsdp 2), whose first
// row alone writes the next save. The exactness of a resumed run is train_cnn's test
// (tests/parallel/test_fsdp.cpp); train_gpt's schedule spans the run, so a shorter first run
// would not be the same run.
TEST(TrainGptDist, FsdpSavesShardsAndResumesThemOnAnotherRankCount) {
  const std::string dir = ::testing::TempDir() + "gpt_fsdp_ckpt_" + std::to_string(::getpid());
  const std::string next = dir + "_next", corpus = dir + ".txt";
  {
    std::ofstream out(corpus);
    for (int i = 0; i < 300; ++i) out << "a quick brown fox jumps over the lazy dog " << i % 7 << "\n";
  }
  const std::string train_gpt = std::string(std::getenv("TRAIN_GPT")) + " --device cpu --config tiny --data " + corpus +
                                " --batch-size 8 --context 32 --workers 1 --generate 0 --metrics '' --plot '' --fsdp ";
  auto ranks = [](int n) { return std::string(std::getenv("LOOMRUN")) + " --nproc-per-node " + std::to_string(n) + " "; };
  RunResult first = run(ranks(2) + train_gpt + "--epochs 1 --save " + dir, 300);
  ASSERT_EQ(first.code, 0) << first.output;
  for (const char* file : {"index.safetensors", "shard-g1-00000-of-00002.safetensors", "shard-g1-00001-of-00002.safetensors"})
    EXPECT_TRUE(std::filesystem::exists(std::filesystem::path(dir) / file)) << file << "\n" << first.output;

  RunResult same = run(ranks(2) + train_gpt + "--epochs 2 --resume " + dir, 300);
  ASSERT_EQ(same.code, 0) << same.output;
  EXPECT_NE(same.output.find("resumed " + dir + " at epoch 2, batch 0"), std::string::npos) << same.output;
  EXPECT_EQ(gpt_report(same.output).epochs.size(), 1u) << same.output;

  RunResult hybrid = run(ranks(4) + train_gpt + "--hsdp 2 --epochs 2 --resume " + dir + " --save " + next, 300);
  ASSERT_EQ(hybrid.code, 0) << hybrid.output;
  EXPECT_NE(hybrid.output.find("HSDP: 2 replicas, each sharded over 2 ranks"), std::string::npos) << hybrid.output;
  EXPECT_NE(hybrid.output.find("resumed " + dir + " at epoch 2, batch 0"), std::string::npos) << hybrid.output;
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(next)) files += e.is_regular_file();
  EXPECT_EQ(files, 3) << "an index and the first row's two shards";

  // The folder given to a run without --fsdp: named, with the flag that resumes it.
  RunResult plain = run(std::string(std::getenv("TRAIN_GPT")) + " --device cpu --config tiny --data " + corpus +
                            " --context 32 --metrics '' --plot '' --resume " + dir,
                        60);
  EXPECT_EQ(plain.code, 2) << plain.output;
  EXPECT_NE(plain.output.find("--resume " + dir + " is a sharded checkpoint"), std::string::npos) << plain.output;
  EXPECT_NE(plain.output.find("resume it with --fsdp"), std::string::npos) << plain.output;
  std::filesystem::remove_all(dir);
  std::filesystem::remove_all(next);
  std::filesystem::remove(corpus);
}

// The most common distributed bug: ranks that would run different numbers of steps (here
// another --subset on rank 1, as another copy of the data would give). They stop before
// the first step, naming both ranks and values, instead of aborting inside Gloo.
TEST(TrainCnnDist, RanksThatDisagreeOnTheirStepsStopBeforeTheFirstNamingBoth) {
  if (!have_fashion_mnist()) GTEST_SKIP() << "Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist)";
  for (const char* differing : {"--subset", "--batch-size"}) {
    SCOPED_TRACE(differing);
    const std::string script = (std::filesystem::path(::testing::TempDir()) / "disagreeing_rank.sh").string();
    const bool subset = std::string(differing) == "--subset";
    std::ofstream(script) << "#!/bin/sh\nif [ \"$RANK\" = 1 ]; then A=" << (subset ? "'--subset 600'" : "'--batch-size 40'")
                          << "; else A=''; fi\nexec '" << std::getenv("TRAIN_CNN")
                          << "' --device cpu --subset 1200 --test-subset 100 --batch-size 50 --epochs 1 --workers 1 "
                             "--quiet --metrics '' --plot '' --timeout-s 60 $A\n";
    std::filesystem::permissions(script, std::filesystem::perms::owner_all);
    RunResult r = run(std::string(std::getenv("LOOMRUN")) + " --nproc-per-node 2 " + script, 120);
    EXPECT_NE(r.code, 0) << r.output;
    EXPECT_NE(r.code, 134) << r.output;
    EXPECT_NE(r.output.find("ranks 1 and 0 disagree before the first step"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(subset ? "training images: rank 1 has 600, rank 0 has 1200"
                                   : "batch size: rank 1 has 40, rank 0 has 50"),
              std::string::npos)
        << r.output;
    EXPECT_EQ(r.output.find("preamble"), std::string::npos) << r.output;
  }
}

TEST(TrainCnnDist, AskingForMoreGpusThanVisibleSaysSo) {
  RunResult r = run("env CUDA_VISIBLE_DEVICES= " + std::string(std::getenv("TRAIN_CNN")) + " --gpus 2", 60);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("--gpus 2: only 0 GPU(s) are visible"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace loom::dist
