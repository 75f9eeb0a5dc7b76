// What a backward keeps alive: an op saves only the tensors its gradient reads, so that
// what nothing else holds is freed as soon as the forward has moved past it.
#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <vector>

#include "engine/autograd.h"
#include "engine/ops.h"

namespace loom {
namespace {

struct Kept {
  bool input = false;
  bool output = false;
};

// Runs y = op(h) with h = x + x (whose node saves nothing), drops every handle on h and y
// but the graph's own, and reports which of the two the graph still holds.
Kept kept_by(const std::function<Tensor(const Tensor&)>& op) {
  Tensor x = from_vector(std::vector<float>{0.5f, 1.5f, 2.5f}, {3});
  x.set_requires_grad();
  Tensor h = add(x, x);
  Tensor y = op(h);
  Tensor loss = sum(y);
  std::weak_ptr<Storage> hs = h.storage(), ys = y.storage();
  h = Tensor();
  y = Tensor();
  Kept kept{!hs.expired(), !ys.expired()};
  loss.backward();
  return kept;
}

TEST(SavedTensors, ReluKeepsItsOutputAndNotItsInput) {
  Kept k = kept_by([](const Tensor& h) { return relu(h); });
  EXPECT_FALSE(k.input);
  EXPECT_TRUE(k.output);
}

TEST(SavedTensors, EachUnaryOpKeepsOnlyWhatItsGradientReads) {
  Kept gelu_kept = kept_by([](const Tensor& h) { return gelu(h); });
  EXPECT_TRUE(gelu_kept.input);
  EXPECT_FALSE(gelu_kept.output);
  Kept exp_kept = kept_by([](const Tensor& h) { return exp(h); });
  EXPECT_FALSE(exp_kept.input);
  EXPECT_TRUE(exp_kept.output);
  Kept neg_kept = kept_by([](const Tensor& h) { return neg(h); });
  EXPECT_FALSE(neg_kept.input);
  EXPECT_FALSE(neg_kept.output);
}

TEST(SavedTensors, ReluGradientFromItsOutputIsTheStepOfItsInput) {
  Tensor x = from_vector(std::vector<float>{-2.0f, -0.0f, 0.0f, 3.0f}, {4});
  x.set_requires_grad();
  sum(mul(relu(x), from_vector(std::vector<float>{1, 2, 3, 4}, {4}))).backward();
  EXPECT_EQ(x.grad().to_vector<float>(), (std::vector<float>{0, 0, 0, 4}));
}

}  // namespace
}  // namespace loom
