// train_cnn data-parallel on CPU ranks, end to end: loomrun starts two ranks of train_cnn
// over Gloo on a Fashion-MNIST subset; rank 0 reports the group and the test accuracy, the
// run exits 0, and only rank 0 writes the metrics file. meson passes the programs' paths in
// LOOMRUN and TRAIN_CNN. Skips where Fashion-MNIST is not installed.
#include <gtest/gtest.h>

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
