// The options' defaults (engine/options.h) and OptionsGuard's scope. What each option
// changes is tested where it acts: test_options_cuda.cpp through the ops, the kernel tests
// through the kernels' arguments, tests/layers/test_weight_copies*.cpp for autocast's copies.
#include <gtest/gtest.h>

#include "engine/options.h"

namespace loom {
namespace {

TEST(Options, DefaultsAreTheFasterWays) {
  const Options o;
  EXPECT_FALSE(o.deterministic);
  EXPECT_TRUE(o.hopper_attention);
  EXPECT_TRUE(o.gemm_autotuning);
  EXPECT_TRUE(o.cudnn_graph_api);
  EXPECT_TRUE(o.conv_autotuning);
  EXPECT_TRUE(o.autocast_weight_copies);
  EXPECT_TRUE(o.autocast_gradient_copies);
  EXPECT_TRUE(o.fused_bias_sums);
}

TEST(Options, GuardsSetForTheirScopeAndRestoreWhatTheyFound) {
  const Options before = options();
  {
    Options o = before;
    o.deterministic = !before.deterministic;
    o.cudnn_graph_api = !before.cudnn_graph_api;
    o.conv_autotuning = !before.conv_autotuning;
    o.hopper_attention = !before.hopper_attention;
    OptionsGuard outer(o);
    EXPECT_EQ(options().hopper_attention, !before.hopper_attention);
    EXPECT_EQ(options().conv_autotuning, !before.conv_autotuning);
    EXPECT_EQ(options().deterministic, !before.deterministic);
    EXPECT_EQ(options().cudnn_graph_api, !before.cudnn_graph_api);
    EXPECT_EQ(options().gemm_autotuning, before.gemm_autotuning);
    {
      Options inner_options = options();
      inner_options.gemm_autotuning = !before.gemm_autotuning;
      OptionsGuard inner(inner_options);
      EXPECT_EQ(options().gemm_autotuning, !before.gemm_autotuning);
      EXPECT_EQ(options().deterministic, !before.deterministic);
    }
    EXPECT_EQ(options().gemm_autotuning, before.gemm_autotuning);
    EXPECT_EQ(options().deterministic, !before.deterministic);
  }
  const Options after = options();
  EXPECT_EQ(after.deterministic, before.deterministic);
  EXPECT_EQ(after.gemm_autotuning, before.gemm_autotuning);
  EXPECT_EQ(after.cudnn_graph_api, before.cudnn_graph_api);
  EXPECT_EQ(after.conv_autotuning, before.conv_autotuning);
  EXPECT_EQ(after.hopper_attention, before.hopper_attention);
  EXPECT_EQ(after.autocast_weight_copies, before.autocast_weight_copies);
  EXPECT_EQ(after.autocast_gradient_copies, before.autocast_gradient_copies);
  EXPECT_EQ(after.fused_bias_sums, before.fused_bias_sums);
}

TEST(Options, SetOptionsHoldsUntilChanged) {
  const Options before = options();
  Options o = before;
  o.autocast_weight_copies = !before.autocast_weight_copies;
  set_options(o);
  EXPECT_EQ(options().autocast_weight_copies, !before.autocast_weight_copies);
  set_options(before);
  EXPECT_EQ(options().autocast_weight_copies, before.autocast_weight_copies);
}

}  // namespace
}  // namespace loom
