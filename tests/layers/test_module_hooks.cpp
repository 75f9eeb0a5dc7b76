// Module hooks and child replacement: pre-hooks run before forward and hooks after it, with
// the input and output, when the module is called through operator(); removal by handle;
// replace_module keeps the name and the place in traversal and state_dict.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "engine/ops.h"
#include "layers/layers.h"

namespace loom::nn {
namespace {

TEST(ModuleHooks, PreHooksRunBeforeForwardAndHooksAfterWithTheOutput) {
  auto lin = std::make_shared<Linear>(2, 2);
  std::vector<std::string> events;
  Tensor seen_input, seen_output;
  lin->register_forward_pre_hook([&](Module& m, const Tensor& in) {
    events.push_back("pre " + m.type_name());
    seen_input = in;
  });
  lin->register_forward_hook([&](Module&, const Tensor& in, const Tensor& out) {
    events.push_back("post");
    EXPECT_TRUE(in.same(seen_input));
    seen_output = out;
  });
  Tensor x = ones({3, 2});
  Tensor y = (*lin)(x);
  EXPECT_EQ(events, (std::vector<std::string>{"pre Linear", "post"}));
  EXPECT_TRUE(seen_input.same(x));
  EXPECT_TRUE(seen_output.same(y));
  lin->forward(x);  // a direct call skips the hooks
  EXPECT_EQ(events.size(), 2u);
}

TEST(ModuleHooks, RemovedHooksNoLongerRunAndUnknownHandlesAreRefused) {
  auto relu = std::make_shared<ReLU>();
  int pre = 0, post = 0;
  int a = relu->register_forward_pre_hook([&](Module&, const Tensor&) { ++pre; });
  int b = relu->register_forward_hook([&](Module&, const Tensor&, const Tensor&) { ++post; });
  (*relu)(ones({2}));
  relu->remove_hook(a);
  (*relu)(ones({2}));
  relu->remove_hook(b);
  (*relu)(ones({2}));
  EXPECT_EQ(pre, 1);
  EXPECT_EQ(post, 2);
  EXPECT_THROW(relu->remove_hook(b), Error);
}

TEST(ModuleReplace, TheNewChildTakesTheOldOnesNameAndPlace) {
  auto seq = std::make_shared<Sequential>(
      std::vector<std::shared_ptr<Module>>{std::make_shared<Linear>(2, 3), std::make_shared<ReLU>(),
                                           std::make_shared<Linear>(3, 1)});
  auto replacement = std::make_shared<Linear>(3, 1, Bias::no);
  auto old = seq->replace_module("2", replacement);
  EXPECT_EQ(old->type_name(), "Linear");
  EXPECT_EQ((*seq)[2].get(), replacement.get());
  std::vector<std::string> names;
  for (const auto& [name, _] : seq->state_dict()) names.push_back(name);
  EXPECT_EQ(names, (std::vector<std::string>{"0.weight", "0.bias", "2.weight"}));
  EXPECT_EQ(seq->forward(ones({4, 2})).shape(), (Shape{4, 1}));
  EXPECT_THROW(seq->replace_module("7", replacement), Error);
  EXPECT_THROW(seq->replace_module("1", nullptr), Error);
}

}  // namespace
}  // namespace loom::nn
