// Layer-wise model parallelism in one process (layers/placement.h) and the guide's transformer
// (layers/models/guide_transformer.h): the two placement policies, the device-list parser's
// errors, the model's names and shapes, a float64 gradient check of a block, a split over
// cpu,cpu that trains bitwise like the unsplit model under either policy, and the synthetic
// task that the model learns. tests/layers/test_model_parallel_cuda.cpp splits over cuda:0,cpu.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "engine/autograd.h"
#include "engine/ops.h"
#include "layers/models/guide_transformer.h"
#include "layers/optim/adam.h"
#include "layers/placement.h"
#include "tests/common/tensor_checks.h"
#include "tests/layers/gradcheck.h"

namespace loom::nn {
namespace {

std::vector<std::string> names(const std::vector<Device>& devices) {
  std::vector<std::string> out;
  for (const Device& d : devices) out.push_back(d.str());
  return out;
}

TEST(ModelParallel, RoundRobinDealsBlocksInTurnAndContiguousCutsRanges) {
  const std::vector<Device> two = {Device::cuda(0), Device::cuda(1)};
  const std::vector<Device> four = {Device::cuda(0), Device::cuda(1), Device::cuda(2), Device::cpu()};
  using V = std::vector<std::string>;
  EXPECT_EQ(names(assign_devices(6, two, PlacementPolicy::round_robin)),
            (V{"cuda:0", "cuda:1", "cuda:0", "cuda:1", "cuda:0", "cuda:1"}));
  EXPECT_EQ(names(assign_devices(6, two, PlacementPolicy::contiguous)),
            (V{"cuda:0", "cuda:0", "cuda:0", "cuda:1", "cuda:1", "cuda:1"}));
  EXPECT_EQ(names(assign_devices(6, four, PlacementPolicy::contiguous)),
            (V{"cuda:0", "cuda:0", "cuda:1", "cuda:1", "cuda:2", "cpu"}));
  EXPECT_EQ(names(assign_devices(2, four, PlacementPolicy::contiguous)), (V{"cuda:0", "cuda:1"}));
  EXPECT_EQ(names(assign_devices(5, four, PlacementPolicy::round_robin)),
            (V{"cuda:0", "cuda:1", "cuda:2", "cpu", "cuda:0"}));
}

TEST(ModelParallel, DeviceListAndPolicyErrorsNameTheValueAndWhatWasExpected) {
  EXPECT_EQ(names(parse_device_list("cuda:0,cpu,cuda:1")), (std::vector<std::string>{"cuda:0", "cpu", "cuda:1"}));
  test::expect_error([] { parse_device_list("cuda:0,gpu1"); }, "'gpu1' is not a device; expected cpu, cuda or cuda:N");
  test::expect_error([] { parse_device_list("cpu,,cpu"); }, "'cpu,,cpu' has an empty entry");
  test::expect_error([] { parse_device_list(""); }, "empty device list");
  test::expect_error([] { parse_placement_policy("striped"); }, "unknown placement 'striped': expected round-robin or contiguous");
  EXPECT_EQ(parse_placement_policy("contiguous"), PlacementPolicy::contiguous);
}

TEST(ModelParallel, GuideTransformerHasTheGuideNamesShapesAndParameterCount) {
  manual_seed(0);
  const int64_t C = 32;
  GuideTransformer model({.width = C, .heads = 4, .layers = 6, .classes = 10});
  std::vector<std::string> keys;
  for (const auto& [k, _] : model.state_dict()) keys.push_back(k);
  for (const char* k : {"blocks.0.attention.c_attn.weight", "blocks.0.attention.c_proj.bias", "blocks.0.norm1.weight",
                        "blocks.0.feed_forward.0.weight", "blocks.0.feed_forward.2.bias", "blocks.5.norm2.bias",
                        "output.weight", "output.bias"})
    EXPECT_NE(std::find(keys.begin(), keys.end(), k), keys.end()) << k;
  // A block: in_proj 3C^2 + 3C, out_proj C^2 + C, two norms 4C, the MLP 8C^2 + 5C.
  EXPECT_EQ(model.num_parameters(), 6 * (12 * C * C + 13 * C) + C * 10 + 10);
  Tensor y = model.forward(randn({3, 5, C}));
  EXPECT_EQ(y.shape(), (Shape{3, 5, 10}));
  test::expect_error([&] { model.forward(randn({3, 5, C + 1})); }, "expected input (B, T, 32)");
}

TEST(ModelParallel, GuideBlockGradientsMatchFiniteDifferencesInFloat64) {
  manual_seed(3);
  GuideBlock block(8, 2);
  block.to(DType::f64);
  Tensor x = randn({2, 3, 8}, DType::f64).set_requires_grad();
  TensorList leaves = {x};
  std::vector<std::string> leaf_names = {"x"};
  for (const auto& [name, p] : block.named_parameters()) {
    leaves.push_back(p);
    leaf_names.push_back(name);
  }
  test::expect_gradients_match_finite_differences([&] { return block.forward(x); }, leaves, leaf_names);
}

TEST(ModelParallel, TablePrintsEachBlocksDeviceAndTheParametersPerDevice) {
  manual_seed(0);
  GuideTransformer model({.width = 16, .heads = 2, .layers = 3, .classes = 10});
  model.place({Device::cpu(), Device::cpu()}, PlacementPolicy::round_robin);
  const std::string table = model.placement().table();
  EXPECT_NE(table.find("blocks.2"), std::string::npos) << table;
  EXPECT_NE(table.find("output"), std::string::npos) << table;
  // Every block and the output layer on the CPU: one summary row with all the parameters.
  ASSERT_EQ(model.num_parameters(), 10010);
  EXPECT_NE(table.find("cpu: 4 modules, 10,010 parameters"), std::string::npos) << table;
}

struct Trained {
  std::vector<double> losses;
  NamedTensors grads, weights;
};

// `steps` AdamW steps of a fresh model (seed 0) on fixed batches, placed on `devices` (none:
// left unsplit).
Trained train(const std::vector<Device>& devices, PlacementPolicy policy, int steps) {
  manual_seed(0);
  GuideTransformer model({.width = 32, .heads = 4, .layers = 6, .classes = 10});
  if (!devices.empty()) model.place(devices, policy);
  optim::AdamW opt(model.parameters(), {.lr = 1e-3});
  GuideSyntheticTask task(32, 10);
  Trained out;
  for (int step = 0; step < steps; ++step) {
    auto batch = task.sample(4, 6);
    opt.zero_grad();
    Tensor loss = model.loss(batch.inputs, batch.targets);
    loss.backward();
    out.losses.push_back(loss.item());
    if (step + 1 == steps)
      for (const auto& [name, p] : model.named_parameters()) out.grads.emplace_back(name, p.grad().clone());
    opt.step();
  }
  for (const auto& [name, p] : model.named_parameters()) out.weights.emplace_back(name, p.detach().clone());
  return out;
}

void expect_bitwise_equal(const NamedTensors& a, const NamedTensors& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].first, b[i].first);
    EXPECT_EQ(a[i].second.to_vector<float>(), b[i].second.to_vector<float>()) << what << " of " << a[i].first;
  }
}

TEST(ModelParallel, SplitOverCpuCpuTrainsExactlyLikeTheUnsplitModel) {
  const Trained whole = train({}, PlacementPolicy::round_robin, 4);
  for (PlacementPolicy policy : {PlacementPolicy::round_robin, PlacementPolicy::contiguous}) {
    SCOPED_TRACE(placement_policy_name(policy));
    const Trained split = train({Device::cpu(), Device::cpu()}, policy, 4);
    EXPECT_EQ(split.losses, whole.losses);
    expect_bitwise_equal(split.grads, whole.grads, "gradient");
    expect_bitwise_equal(split.weights, whole.weights, "weight");
  }
}

TEST(ModelParallel, GuideTransformerLearnsTheSyntheticTask) {
  manual_seed(0);
  GuideTransformer model({.width = 32, .heads = 4, .layers = 2, .classes = 10});
  model.place({Device::cpu(), Device::cpu()}, PlacementPolicy::contiguous);
  optim::AdamW opt(model.parameters(), {.lr = 3e-3, .weight_decay = 0.0});
  GuideSyntheticTask task(32, 10);
  const auto held_out = task.sample(16, 8);
  auto held_out_loss = [&] {
    NoGradGuard no_grad;
    return model.loss(held_out.inputs, held_out.targets).item();
  };
  const double before = held_out_loss();
  for (int step = 0; step < 60; ++step) {
    auto batch = task.sample(16, 8);
    opt.zero_grad();
    model.loss(batch.inputs, batch.targets).backward();
    opt.step();
  }
  const double after = held_out_loss();
  EXPECT_NEAR(before, std::log(10.0), 0.5);
  EXPECT_LT(after, 0.6 * before) << "before " << before << ", after " << after;
}

}  // namespace
}  // namespace loom::nn
