// The pipeline through its programs, on CPU ranks under loomrun: train_gpt --pp 2 gives the
// same losses under every schedule and prints the measured bubble, and with --fsdp the
// losses of replicated stages; its pipeline flags are checked; bench_pipeline prints a row
// per schedule and micro-batch count.
#include <gtest/gtest.h>

#include <fstream>
#include <regex>
#include <string>

#include "run_command.h"

namespace loom::dist {
namespace {

using testing::run_command;

std::string program(const char* name) {
  const char* path = std::getenv(name);
  return path ? path : "";
}

TEST(TrainGptPipeline, EverySchedulePrintsTheSameLoss) {
  if (!std::filesystem::exists("/usr/share/games/fortunes"))
    GTEST_SKIP() << "Debian's fortunes are not installed (apt-get install fortunes)";
  std::string first_loss;
  for (const char* schedule : {"gpipe", "1f1b", "zb1"}) {
    SCOPED_TRACE(schedule);
    auto r = run_command(program("LOOMRUN") + " --nproc-per-node 2 " + program("TRAIN_GPT") +
                             " --device cpu --pp 2 --schedule " + schedule +
                             " --microbatches 4 --batch-size 8 --context 32 --max-steps 12 --workers 1"
                             " --trace '" + ::testing::TempDir() + "/pp_trace.json' --metrics '' --plot ''",
                         300);
    ASSERT_EQ(r.code, 0) << r.output;
    std::smatch m;
    ASSERT_TRUE(std::regex_search(r.output, m, std::regex("train loss ([0-9.]+) .*bubble: measured ([0-9.]+)%")))
        << r.output;
    if (first_loss.empty()) first_loss = m[1];
    EXPECT_EQ(m[1], first_loss) << r.output;
    EXPECT_NE(r.output.find(std::string(schedule) + ": 2 ranks, 2 stages"), std::string::npos) << r.output;
  }
}

// The losses line of a train_gpt run and the start of its sample, which runs of one seed and
// data print alike whatever their strategy; empty when the output has either missing.
std::string losses_and_sample(const std::string& output) {
  std::smatch m, sample;
  if (!std::regex_search(output, m, std::regex("train loss [0-9.]+  validation loss [0-9.]+")) ||
      !std::regex_search(output, sample, std::regex("--- sample [^\n]*\n[^\n]*")))
    return "";
  return std::string(m[0]) + "\n" + std::string(sample[0]);
}

// Runs train_gpt --device cpu --data `text` on `ranks` ranks with `flags` and then each of
// `variants` added; every run must end well and print the first one's losses and sample.
// Returns each run's output (as many as ran).
std::vector<std::string> runs_printing_the_same_losses(int ranks, const std::string& text, const std::string& flags,
                                                       const std::vector<std::string>& variants) {
  std::vector<std::string> outputs;
  std::string first;
  for (const std::string& variant : variants) {
    SCOPED_TRACE(variant);
    auto r = run_command(program("LOOMRUN") + " --nproc-per-node " + std::to_string(ranks) + " " +
                             program("TRAIN_GPT") + " --device cpu --data '" + text + "' " + flags + variant,
                         300);
    EXPECT_EQ(r.code, 0) << r.output;
    const std::string result = losses_and_sample(r.output);
    EXPECT_FALSE(result.empty()) << r.output;
    if (r.code != 0 || result.empty()) break;
    if (first.empty()) first = result;
    EXPECT_EQ(result, first);
    outputs.push_back(r.output);
  }
  return outputs;
}

// --fsdp with --pp shards each stage over its --dp pair: the same losses and sample as the
// replicated stages (2 pipelines of 2 stages on 4 ranks), and each prints its memory plan
// with the measured peak beside it.
TEST(TrainGptPipeline, ShardedStagesPrintTheLossesOfReplicatedOnes) {
  if (!std::filesystem::exists("/usr/share/games/fortunes/fortunes"))
    GTEST_SKIP() << "Debian's fortunes are not installed (apt-get install fortunes)";
  // 60 kB of it, so that validation is short.
  const std::string text = ::testing::TempDir() + "/pp_fsdp_text.txt";
  {
    std::ifstream in("/usr/share/games/fortunes/fortunes", std::ios::binary);
    std::string head(60000, '\0');
    in.read(head.data(), std::streamsize(head.size()));
    std::ofstream(text, std::ios::binary).write(head.data(), in.gcount());
  }
  const std::vector<std::string> variants = {"", " --fsdp", " --fsdp --reshard-after-forward no"};
  const std::vector<std::string> outputs = runs_printing_the_same_losses(
      4, text, "--pp 2 --dp 2 --microbatches 4 --batch-size 8 --context 32 --max-steps 12 --workers 1 --generate 16 "
      "--metrics '' --plot ''", variants);
  ASSERT_EQ(outputs.size(), variants.size());
  for (size_t i = 0; i < outputs.size(); ++i) {
    EXPECT_NE(outputs[i].find(std::string("memory plan per rank (pipeline stage 0 of 2, 1f1b") +
                              (i > 0 ? ", FSDP)" : ")")),
              std::string::npos)
        << outputs[i];
    EXPECT_TRUE(std::regex_search(outputs[i], std::regex("memory after 12 steps: peak [0-9.]+ MB on this rank, "
                                                         "[0-9]+% of the plan's [0-9.]+ MB")))
        << outputs[i];
  }
}

// --fsdp --hsdp 2 with --pp 2 --dp 4 (8 ranks): each stage sharded over 2 ranks and
// replicated twice prints the losses and sample of the replicated stages, and the mesh of
// replicas and shards.
TEST(TrainGptPipeline, HybridShardedStagesPrintTheLossesOfReplicatedOnes) {
  const std::string text = ::testing::TempDir() + "/pp_hsdp_text.txt";
  {
    std::ofstream out(text);
    for (int i = 0; i < 3000; ++i) out << "line " << i % 97 << ": the quick brown fox jumps over a lazy dog\n";
  }
  const std::vector<std::string> outputs = runs_printing_the_same_losses(
      8, text, "--pp 2 --dp 4 --microbatches 4 --batch-size 8 --context 32 --max-steps 8 --workers 1 --generate 16 "
      "--metrics '' --plot ''", {"", " --fsdp --hsdp 2"});
  ASSERT_EQ(outputs.size(), 2u);
  EXPECT_NE(outputs[1].find("HSDP inside stages: each stage's 4 data-parallel ranks are 2 replicas, each sharded "
                            "over 2"),
            std::string::npos)
      << outputs[1];
  std::filesystem::remove(text);
}

TEST(TrainGptPipeline, BadPipelineFlagsAreNamed) {
  struct Case {
    std::string args, expected;
  };
  const std::vector<Case> cases = {
      {"--pp 3 --dp 1", "--pp 3 x --dp 1 is 3 ranks, but 2 were started"},
      {"--pp 2 --batch-size 6 --microbatches 4", "--batch-size 6 does not cut into --microbatches 4"},
      {"--pp 2 --scaling 2", "--scaling is not available with --pp"},
      {"--schedule gpipe", "--schedule sets up a pipeline, and --pp is 1"},
      {"--pp 2 --schedule interleaved --stages-per-rank 2", "asks for 4 stages, but the tiny config has 2 blocks"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.args);
    auto r = run_command(program("LOOMRUN") + " --nproc-per-node 2 " + program("TRAIN_GPT") +
                             " --device cpu --config tiny --max-steps 1 --workers 1 --metrics '' --plot '' " + c.args,
                         120);
    EXPECT_NE(r.code, 0) << r.output;
    EXPECT_NE(r.output.find(c.expected), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("terminate called"), std::string::npos) << r.output;
  }
}

// bench_pipeline prints a row per schedule and micro-batch count: the bubble measured, its
// formula, the bubble simulated at the measured mean spans, and those spans; then each
// stage's own spans.
TEST(BenchPipeline, PrintsARowPerScheduleAndMicrobatchCount) {
  auto r = run_command(program("LOOMRUN") + " --nproc-per-node 2 " + program("BENCH_PIPELINE") +
                           " --width 16 --heads 2 --tokens 8 --blocks 1 --warmup 1 --steps 1 --microbatches 2,4"
                           " --schedules gpipe,1f1b,interleaved,zb1",
                       300);
  ASSERT_EQ(r.code, 0) << r.output;
  for (const char* row : {"gpipe", "1f1b", "interleaved", "zb1"})
    for (const char* m : {" 2 ", " 4 "})
      EXPECT_TRUE(std::regex_search(r.output, std::regex(std::string(row) + " +" + m + "+ *[0-9.]+%")))
          << row << m << "\n" << r.output;
  // Each row ends with the mean spans its schedule is simulated at: F and B, and zb1's W.
  EXPECT_NE(r.output.find("at costs"), std::string::npos) << r.output;
  EXPECT_TRUE(std::regex_search(r.output, std::regex("1f1b +4 .* [0-9.]+ / [0-9.]+\n"))) << r.output;
  EXPECT_TRUE(std::regex_search(r.output, std::regex("zb1 +4 .* [0-9.]+ / [0-9.]+ / [0-9.]+\n"))) << r.output;
  // And a line after each row with every stage's own spans (two stages here).
  EXPECT_TRUE(std::regex_search(
      r.output, std::regex("1f1b +4 .*\n.*per stage F / B \\(I\\) / W ms: +0: [0-9.]+ / [0-9.]+ +1: [0-9.]+ / [0-9.]+\n")))
      << r.output;
  EXPECT_TRUE(std::regex_search(r.output, std::regex("zb1 +4 .*\n.*per stage F / B \\(I\\) / W ms: +0: [0-9.]+ / "
                                                     "[0-9.]+ / [0-9.]+ +1: [0-9.]+ / [0-9.]+ / [0-9.]+\n")))
      << r.output;
}

}  // namespace
}  // namespace loom::dist
