// recompute (engine/recompute.h): the gradients of a recomputed function equal those of the
// function run plainly — for its inputs and for the parameters it uses inside — with
// dropout's random masks and autocast's dtype reproduced in the second run; the nested
// backward it runs fires hooks as usual but leaves queued callbacks to the end of the whole
// pass; and its edges (an identity function, no grad mode, no input requiring a gradient).
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "engine/autocast.h"
#include "engine/autograd.h"
#include "engine/ops.h"
#include "engine/recompute.h"

namespace loom {
namespace {

std::vector<double> values(const Tensor& t) { return t.to(DType::f64).to_vector<double>(); }

// An f64 leaf requiring a gradient, filled from N(0, 1).
Tensor param(const Shape& shape) {
  Tensor t = randn(shape, DType::f64);
  t.set_requires_grad();
  return t;
}

void expect_close(const Tensor& got, const Tensor& want, double tol, const std::string& what) {
  ASSERT_TRUE(got.defined()) << what << ": no gradient";
  ASSERT_TRUE(want.defined()) << what << ": no reference gradient";
  ASSERT_EQ(got.shape(), want.shape()) << what;
  const std::vector<double> a = values(got), b = values(want);
  for (size_t i = 0; i < a.size(); ++i) ASSERT_NEAR(a[i], b[i], tol) << what << " [" << i << "]";
}

void clear_grads(const TensorList& ts) {
  for (Tensor t : ts) t.zero_grad();
}

// Runs `loss` (which builds a scalar from the leaves) and returns each leaf's gradient.
TensorList gradients(const std::function<Tensor()>& loss, const TensorList& leaves) {
  clear_grads(leaves);
  loss().backward();
  TensorList grads;
  for (const Tensor& l : leaves) grads.push_back(l.grad());
  clear_grads(leaves);
  return grads;
}

TEST(Recompute, GradientsMatchThePlainFunctionForInputsAndParametersInside) {
  manual_seed(3);
  Tensor x = param({4, 5});               // input
  Tensor c = randn({4, 5}, DType::f64);   // input needing no gradient
  Tensor w1 = param({5, 6}), b1 = param({6}), w2 = param({6, 5});  // used inside only
  Tensor w_out = param({5});              // used after the recomputed part
  // A small MLP block with a residual: x + gelu((x * c) w1 + b1) w2.
  auto block = [&](const TensorList& in) {
    return add(in[0], matmul(gelu(add(matmul(mul(in[0], in[1]), w1), b1)), w2));
  };
  auto loss = [&](bool recomputed) {
    Tensor h = recomputed ? recompute(block, {x, c}) : block({x, c});
    return sum(mul(tanh(add(h, x)), w_out));  // x also used outside: two paths into it
  };
  const TensorList leaves = {x, w1, b1, w2, w_out};
  const TensorList plain = gradients([&] { return loss(false); }, leaves);
  const TensorList again = gradients([&] { return loss(true); }, leaves);
  const char* names[] = {"x", "w1", "b1", "w2", "w_out"};
  for (size_t i = 0; i < leaves.size(); ++i) expect_close(again[i], plain[i], 1e-12, names[i]);
  EXPECT_FALSE(c.grad().defined()) << "an input that needs no gradient gets none";
}

TEST(Recompute, ForwardKeepsNoGraphInsideAndRecordsOneNode) {
  Tensor x = param({3});
  Tensor w = param({3});
  Tensor inner;
  Tensor y = recompute(
      [&](const TensorList& in) {
        inner = mul(in[0], w);
        return exp(inner);
      },
      {x});
  EXPECT_FALSE(inner.requires_grad()) << "the forward runs under no-grad: its intermediates hold no graph";
  ASSERT_NE(y.grad_fn(), nullptr);
  EXPECT_EQ(y.grad_fn()->name, "Recompute");
  EXPECT_EQ(y.grad_fn()->next_edges.size(), 1u);
}

TEST(Recompute, ParametersInsideGetGradientsWhenNoInputNeedsOne) {
  Tensor x = randn({3}, DType::f64);
  Tensor w = param({3});
  Tensor y = recompute([&](const TensorList& in) { return mul(in[0], w); }, {x});
  ASSERT_TRUE(y.requires_grad()) << "fn may use parameters, so the node is recorded under grad mode";
  sum(y).backward();
  expect_close(w.grad(), x, 0, "w");
  EXPECT_FALSE(x.grad().defined());
}

TEST(Recompute, NothingToDifferentiateGivesNoGradients) {
  Tensor x = randn({3}, DType::f64);
  Tensor w = param({3});
  Tensor y = recompute([](const TensorList& in) { return exp(in[0]); }, {x});
  sum(mul(y, w)).backward();  // the recomputed part needs no gradient: only w gets one
  EXPECT_FALSE(x.grad().defined());
  expect_close(w.grad(), exp(x), 0, "w");
}

TEST(Recompute, IdentityFunctionLeavesTheInputALeaf) {
  Tensor x = param({3});
  Tensor y = recompute([](const TensorList& in) { return in[0]; }, {x});
  EXPECT_FALSE(y.same(x));
  EXPECT_TRUE(x.is_leaf());
  sum(mul(y, 2.0)).backward();
  EXPECT_EQ(values(x.grad()), (std::vector<double>{2, 2, 2}));
}

TEST(Recompute, WithoutGradModeIsThePlainFunction) {
  Tensor x = param({3});
  NoGradGuard no_grad;
  Tensor y = recompute([](const TensorList& in) { return mul(in[0], 2.0); }, {x});
  EXPECT_FALSE(y.requires_grad());
  EXPECT_EQ(y.grad_fn(), nullptr);
}

TEST(Recompute, DropoutMasksAreDrawnAgainIdentically) {
  // Dropout inside the recomputed function and after it: by backward the generator has
  // moved past both masks, so the second run must be put back on the first mask's draws.
  auto dropout = [](const Tensor& t) { return mul(t, mul(lt(rand(t.shape(), DType::f64), 0.5).to(DType::f64), 2.0)); };
  manual_seed(11);
  Tensor x = param({64}), w = param({64}), v = param({64});
  auto block = [&](const TensorList& in) { return dropout(tanh(mul(in[0], w))); };
  auto run = [&](bool recomputed, std::pair<uint64_t, uint64_t>* after) {
    set_rng_state(123, 0);
    Tensor h = recomputed ? recompute(block, {x}) : block({x});
    Tensor loss = sum(mul(dropout(h), v));
    loss.backward();
    *after = rng_state();
  };
  const TensorList leaves = {x, w, v};
  std::pair<uint64_t, uint64_t> after_plain, after_recomputed;
  clear_grads(leaves);
  run(false, &after_plain);
  const TensorList plain = {x.grad(), w.grad(), v.grad()};
  clear_grads(leaves);
  run(true, &after_recomputed);
  const char* names[] = {"x", "w", "v"};
  for (size_t i = 0; i < leaves.size(); ++i) expect_close(leaves[i].grad(), plain[i], 0, names[i]);
  int dropped = 0;
  for (double g : values(plain[0])) dropped += g == 0;
  EXPECT_GT(dropped, 0) << "the mask must drop something, or the test proves nothing";
  EXPECT_EQ(after_recomputed, after_plain) << "recomputation must leave the generator where backward found it";
}

TEST(Recompute, RunsAgainUnderTheForwardsAutocast) {
  // The forward runs under bf16 autocast, backward outside it: an f32 rerun would give
  // other (more exact) gradients than the bf16 products the loss was computed from.
  manual_seed(5);
  Tensor x = randn({8, 16});
  x.set_requires_grad();
  Tensor w = randn({16, 16});
  w.set_requires_grad();
  auto block = [&](const TensorList& in) { return tanh(matmul(in[0], w)); };
  auto grads = [&](bool recomputed) {
    x.zero_grad();
    w.zero_grad();
    Tensor loss;
    {
      AutocastGuard bf16(DType::bf16);
      Tensor h = recomputed ? recompute(block, {x}) : block({x});
      loss = sum(mul(h, h));
    }
    loss.backward();
    return TensorList{x.grad(), w.grad()};
  };
  const TensorList plain = grads(false), again = grads(true);
  expect_close(again[0], plain[0], 0, "x");
  expect_close(again[1], plain[1], 0, "w");
}

TEST(Recompute, NestedBackwardFiresHooksButLeavesCallbacksToTheEndOfThePass) {
  // Graph: first (w_first) -> recomputed block (w_in) -> last (w_last). Backward order:
  // w_last's hook, then the block's nested pass (w_in's hook), then w_first's hook. The
  // callback queued before the nested pass must not run in it, and the one queued inside
  // it must wait for the end of the whole pass, after w_first.
  Tensor w_first = param({4}), w_in = param({4}), w_last = param({4});
  std::vector<std::string> order;
  w_last.register_post_accumulate_grad_hook([&](Tensor&) {
    order.push_back("w_last");
    queue_callback([&] { order.push_back("callback from w_last"); });
  });
  w_in.register_post_accumulate_grad_hook([&](Tensor&) {
    order.push_back("w_in");
    queue_callback([&] {
      order.push_back("callback from w_in");
      EXPECT_TRUE(w_first.grad().defined()) << "the whole pass is done when callbacks run";
    });
  });
  w_first.register_post_accumulate_grad_hook([&](Tensor&) { order.push_back("w_first"); });
  Tensor h = mul(randn({4}, DType::f64), w_first);
  h = recompute([&](const TensorList& in) { return tanh(mul(in[0], w_in)); }, {h});
  sum(mul(h, w_last)).backward();
  EXPECT_EQ(order, (std::vector<std::string>{"w_last", "w_in", "w_first", "callback from w_last",
                                             "callback from w_in"}));
}

TEST(Recompute, SeparateNestedPassRunsItsOwnCallbacksOnly) {
  // The default nesting (a backward run from a hook) keeps its callbacks to itself and
  // leaves the enclosing pass's queued ones alone.
  Tensor w = param({2}), u = param({2});
  std::vector<std::string> order;
  u.register_post_accumulate_grad_hook([&](Tensor&) {
    queue_callback([&] { order.push_back("inner callback"); });
  });
  w.register_post_accumulate_grad_hook([&](Tensor&) {
    queue_callback([&] { order.push_back("outer callback"); });
    set_grad_enabled(true);  // hooks run under the pass's no-grad
    Tensor s = sum(u);
    set_grad_enabled(false);
    run_backward({s}, {ones_like(s)});
    order.push_back("inner pass returned");
  });
  sum(mul(w, 3.0)).backward();
  EXPECT_EQ(order, (std::vector<std::string>{"inner callback", "inner pass returned", "outer callback"}));
}

}  // namespace
}  // namespace loom
