// The engine's convolution and pooling ops beyond what the gradient table checks: shape
// rules and the messages users see when they get them wrong, the bias, which gradients
// are computed, and the composites (adaptive pooling) against their definitions.
#include <gtest/gtest.h>

#include <string>

#include "engine/autograd.h"
#include "engine/ops.h"

namespace loom {
namespace {

// Runs f, expecting a loom::Error whose message contains `needle`.
template <class F>
void expect_error(F&& f, const std::string& needle) {
  try {
    f();
    FAIL() << "expected a loom::Error mentioning '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

void expect_all_close(const Tensor& a, const Tensor& b, double tol) {
  ASSERT_EQ(a.shape(), b.shape());
  auto va = a.to_vector<double>(), vb = b.to_vector<double>();
  for (size_t i = 0; i < va.size(); ++i) ASSERT_NEAR(va[i], vb[i], tol) << "element " << i;
}

TEST(ConvOps, ChannelsLastInputGetsAHint) {
  expect_error([] { conv2d(zeros({64, 32, 32, 3}), zeros({32, 3, 3, 3})); }, "channels-last");
  expect_error([] { conv2d(zeros({64, 32, 32, 3}), zeros({32, 3, 3, 3})); }, "(64, 32, 32, 3)");
}

TEST(ConvOps, ShapeErrorsNameWhatToChange) {
  expect_error([] { conv2d(zeros({3, 8, 8}), zeros({4, 3, 3, 3})); }, "unsqueeze(0)");
  expect_error([] { conv2d(zeros({1, 4, 8, 8}), zeros({6, 2, 3, 3}), Tensor(), {1, 1}, {0, 0}, {1, 1}, 4); },
               "groups = 4");
  expect_error([] { conv2d(zeros({1, 3, 2, 2}), zeros({4, 3, 3, 3})); }, "padded input is only 2");
  expect_error([] { conv2d(zeros({1, 3, 8, 8}), zeros({4, 3, 3, 3}), zeros({5})); }, "bias (4)");
  expect_error([] { conv2d(zeros({1, 3, 8, 8}), zeros({4, 3, 3, 3}), Tensor(), {0, 1}); }, "stride");
  expect_error([] { max_pool2d(zeros({1, 1, 4, 4}), {2, 2}, {2, 2}, {2, 2}); }, "at most half the kernel");
  expect_error([] { max_pool2d(zeros({1, 1, 0, 4}), {2, 2}, {2, 2}, {1, 1}); }, "H and W at least 1");
  expect_error([] { avg_pool2d(zeros({1, 1, 4, 0}), {2, 2}, {2, 2}, {1, 1}); }, "got (1, 1, 4, 0)");
  expect_error([] { adaptive_avg_pool2d(zeros({1, 1, 5, 5}), {2, 2}); }, "does not divide");
  expect_error([] { max_pool2d_bias(zeros({1, 3, 4, 4}), zeros({4}), {2, 2}, {2, 2}); }, "bias (C) = (3)");
  expect_error([] { max_pool2d_bias(zeros({1, 3, 4, 4}), zeros({3}, DType::f64), {2, 2}, {2, 2}); },
               "bias is f64 and x f32");
  expect_error([] { max_pool2d_bias(zeros({1, 3, 4, 4}), Tensor(), {2, 2}, {2, 2}); }, "max_pool2d_bias");
}

TEST(ConvOps, SimpleCnnShapes) {
  manual_seed(1);
  Tensor x = randn({2, 3, 32, 32});
  Tensor h = max_pool2d(relu(conv2d(x, randn({32, 3, 3, 3}), randn({32}), {1, 1}, {1, 1})), {2, 2});
  EXPECT_EQ(h.shape(), (Shape{2, 32, 16, 16}));
  h = max_pool2d(relu(conv2d(h, randn({64, 32, 3, 3}), randn({64}), {1, 1}, {1, 1})), {2, 2});
  EXPECT_EQ(h.shape(), (Shape{2, 64, 8, 8}));
  EXPECT_EQ(conv2d(x, randn({16, 3, 3, 3}), Tensor(), {2, 2}, {1, 1}).shape(), (Shape{2, 16, 16, 16}));
  EXPECT_EQ(adaptive_avg_pool2d(h, {1, 1}).shape(), (Shape{2, 64, 1, 1}));
}

TEST(ConvOps, BiasIsAddedPerOutputChannel) {
  manual_seed(2);
  Tensor x = randn({2, 3, 6, 6}), w = randn({4, 3, 3, 3}), b = randn({4});
  Tensor with = conv2d(x, w, b, {1, 1}, {1, 1});
  Tensor without = conv2d(x, w, Tensor(), {1, 1}, {1, 1});
  expect_all_close(with, add(without, b.reshape({1, 4, 1, 1})), 1e-6);
}

TEST(ConvOps, OnlyTheGradientsNeededAreComputed) {
  manual_seed(3);
  Tensor x = randn({2, 3, 5, 5}), w = randn({4, 3, 3, 3}), b = randn({4});
  w.set_requires_grad();
  b.set_requires_grad();
  sum(conv2d(x, w, b, {1, 1}, {1, 1})).backward();
  EXPECT_FALSE(x.grad().defined());
  ASSERT_TRUE(w.grad().defined());
  // d sum(y) / db = N * OH * OW for every channel.
  expect_all_close(b.grad(), full({4}, 2 * 5 * 5), 1e-4);
}

TEST(ConvOps, AdaptiveAvgPoolIsTheMeanOfEqualWindows) {
  manual_seed(4);
  Tensor x = randn({2, 3, 4, 6});
  expect_all_close(adaptive_avg_pool2d(x, {1, 1}), mean(x, {2, 3}, true), 1e-6);
  expect_all_close(adaptive_avg_pool2d(x, {2, 3}), avg_pool2d(x, {2, 2}), 1e-6);
  expect_all_close(adaptive_avg_pool2d(x, {4, 6}), x, 1e-6);
}

TEST(ConvOps, MaxPoolDefaultsStrideToTheKernel) {
  Tensor x = arange(0, 16, 1, DType::f32).reshape({1, 1, 4, 4});
  expect_all_close(max_pool2d(x, {2, 2}), from_vector(std::vector<float>{5, 7, 13, 15}, {1, 1, 2, 2}), 0);
  expect_all_close(avg_pool2d(x, {2, 2}), from_vector(std::vector<float>{2.5, 4.5, 10.5, 12.5}, {1, 1, 2, 2}), 0);
}

}  // namespace
}  // namespace loom
