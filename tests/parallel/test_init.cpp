// parallel/init.h without a launcher: the command line a program restarts itself with, and
// start-up and the mean over ranks as one process. The launched case (a Gloo group from the
// env:// variables) runs through train_cnn and train_gpt in test_train_cnn_dist.cpp.
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <vector>

#include "parallel/init.h"
#include "parallel/rendezvous.h"

namespace loom::dist {
namespace {

std::vector<std::string> without(std::vector<std::string> args, const std::vector<std::string>& drop) {
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  std::vector<std::string> command = command_without(int(argv.size()), argv.data(), drop);
  command.erase(command.begin());  // this test binary's own path
  return command;
}

TEST(CommandWithout, DropsEachFlagInBothSpellingsWithItsValue) {
  using Args = std::vector<std::string>;
  EXPECT_EQ(without({"prog", "--gpus", "4", "--epochs", "2"}, {"gpus"}), (Args{"--epochs", "2"}));
  EXPECT_EQ(without({"prog", "--gpus=4", "--epochs", "2"}, {"gpus"}), (Args{"--epochs", "2"}));
  EXPECT_EQ(without({"prog", "--scaling", "4", "--metrics=m.jsonl", "--plot", "", "--quiet"},
                    {"scaling", "metrics", "plot"}),
            (Args{"--quiet"}));
  // A flag that only starts with a dropped name stays.
  EXPECT_EQ(without({"prog", "--gpus-per-node", "8"}, {"gpus"}), (Args{"--gpus-per-node", "8"}));
}

TEST(CommandWithout, StartsWithThisProgramsOwnPath) {
  std::string name = "not-this-name";
  char* argv[] = {name.data()};
  const std::vector<std::string> command = command_without(1, argv, {});
  ASSERT_EQ(command.size(), 1u);
  EXPECT_NE(command[0], name);
  EXPECT_NE(command[0].find("loom_tests_parallel"), std::string::npos) << command[0];
}

TEST(InitDistributed, AloneIsOneInactiveProcessOnTheNamedDevice) {
  if (launched_with_rank()) GTEST_SKIP() << "this test runs without a launcher's variables";
  const DistContext ctx = init_distributed("cpu", std::chrono::seconds(5));
  EXPECT_FALSE(ctx.active);
  EXPECT_TRUE(ctx.is_main());
  EXPECT_EQ(ctx.size, 1);
  EXPECT_TRUE(ctx.device.is_cpu());
  EXPECT_EQ(ctx.group, nullptr);
  EXPECT_EQ(mean_over_ranks(ctx, 2.5), 2.5);
}

}  // namespace
}  // namespace loom::dist
