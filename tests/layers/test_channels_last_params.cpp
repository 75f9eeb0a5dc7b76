// Module::to(MemoryFormat::channels_last): 4-d parameters laid out channels-last, the rest
// untouched, and training with them is training with row-major parameters, bit for bit, the
// optimizers updating them (and their state) as they lie.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "engine/serialization.h"
#include "tests/layers/channels_last_params.h"

namespace loom::test {
namespace {

TEST(ChannelsLastParams, ToLaysOutOnlyFourDimensionalTensors) {
  manual_seed(30);
  nn::SimpleCNN net(3, 32, 10);
  const nn::NamedTensors before = net.state_dict();
  net.to(MemoryFormat::channels_last);
  const nn::NamedTensors after = net.state_dict();
  ASSERT_EQ(before.size(), after.size());
  for (size_t i = 0; i < after.size(); ++i) {
    const Tensor& t = after[i].second;
    EXPECT_EQ(t.memory_format(), t.dim() == 4 ? MemoryFormat::channels_last : MemoryFormat::contiguous)
        << after[i].first;
    EXPECT_TRUE(t.dim() == 4 || t.is_contiguous()) << after[i].first;
    expect_same_bits(t, before[i].second, after[i].first);
  }
  net.to(MemoryFormat::contiguous);
  for (const auto& [name, t] : net.state_dict()) EXPECT_TRUE(t.is_contiguous()) << name;
}

// A checkpoint holds values in PyTorch's (row-major) order whatever the layout, and loads
// into either layout.
TEST(ChannelsLastParams, CheckpointsAreTheRowMajorOnes) {
  manual_seed(33);
  nn::SimpleCNN cl(3, 32, 10), rows(3, 32, 10);
  cl.to(MemoryFormat::channels_last);
  const std::string a = ::testing::TempDir() + "loom_cl_params_a.safetensors",
                    b = ::testing::TempDir() + "loom_cl_params_b.safetensors";
  save_safetensors(a, cl.state_dict());
  rows.load_state_dict(load_safetensors_map(a));
  save_safetensors(b, rows.state_dict());
  nn::SimpleCNN back(3, 32, 10);
  back.to(MemoryFormat::channels_last);
  back.load_state_dict(load_safetensors_map(b));
  const nn::NamedTensors want = cl.state_dict(), got = rows.state_dict(), again = back.state_dict();
  for (size_t i = 0; i < want.size(); ++i) {
    expect_same_bits(got[i].second, want[i].second, want[i].first + " into row-major");
    expect_same_bits(again[i].second, want[i].second, want[i].first + " back into channels-last");
    EXPECT_EQ(again[i].second.memory_format(), want[i].second.memory_format()) << want[i].first;
  }
  std::remove(a.c_str());
  std::remove(b.c_str());
}

TEST(ChannelsLastParams, SgdWithMomentumTrainsAsWithRowMajorParameters) {
  expect_same_training(Device::cpu(), MemoryFormat::contiguous, momentum_sgd, "SGD");
  expect_same_training(Device::cpu(), MemoryFormat::channels_last, momentum_sgd, "SGD, channels-last batch");
}

TEST(ChannelsLastParams, AdamWTrainsAsWithRowMajorParameters) {
  expect_same_training(Device::cpu(), MemoryFormat::contiguous, adamw, "AdamW");
}

TEST(ChannelsLastParams, OptimizerStateFollowsTheParameterLayout) {
  manual_seed(32);
  nn::SimpleCNN net(1, 12, 10);
  net.to(MemoryFormat::channels_last);
  optim::Adam opt(net.parameters(), optim::AdamOptions{.lr = 1e-3});
  optim::SGD sgd(net.parameters(), optim::SGDOptions{.lr = 0.01, .momentum = 0.9});
  cross_entropy(net.forward(randn({4, 1, 12, 12})), from_vector(std::vector<int64_t>{1, 2, 3, 4}, {4})).backward();
  opt.step();
  sgd.step();
  const Tensor w = net.features->named_parameters()[0].second;
  ASSERT_EQ(w.dim(), 4);
  EXPECT_EQ(w.memory_format(), MemoryFormat::channels_last);
  EXPECT_EQ(w.grad().memory_format(), MemoryFormat::channels_last);  // the gradient takes the leaf's layout
  EXPECT_EQ(opt.state(w)->buffers.at("exp_avg").memory_format(), MemoryFormat::channels_last);
  EXPECT_EQ(opt.state(w)->buffers.at("exp_avg_sq").memory_format(), MemoryFormat::channels_last);
  EXPECT_EQ(sgd.state(w)->buffers.at("momentum_buffer").memory_format(), MemoryFormat::channels_last);
}

// Adam's moments made while the parameters were row-major take their new layout at the
// next step, and the run goes on as one that never changed layout.
TEST(ChannelsLastParams, StateMadeBeforeTheLayoutChangeFollowsIt) {
  std::vector<nn::NamedTensors> results;
  std::vector<Tensor> moments;
  for (bool change : {false, true}) {
    manual_seed(34);
    nn::SimpleCNN net(3, 12, 10);
    optim::Adam opt(net.parameters(), optim::AdamOptions{.lr = 1e-2});
    for (int step = 0; step < 3; ++step) {
      if (change && step == 1) net.to(MemoryFormat::channels_last);
      manual_seed(200 + step);
      net.zero_grad();
      cross_entropy(net.forward(randn({4, 3, 12, 12})), from_vector(std::vector<int64_t>{1, 2, 3, 4}, {4})).backward();
      opt.step();
    }
    results.push_back(net.state_dict());
    moments.push_back(opt.state(net.features->named_parameters()[0].second)->buffers.at("exp_avg"));
  }
  EXPECT_EQ(moments[1].memory_format(), MemoryFormat::channels_last);
  expect_same_bits(moments[1], moments[0], "exp_avg");
  for (size_t i = 0; i < results[0].size(); ++i)
    expect_same_bits(results[1][i].second, results[0][i].second, results[0][i].first);
}

}  // namespace
}  // namespace loom::test
