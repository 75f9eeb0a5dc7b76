// The autograd contract the layers above depend on: accumulation into leaves, explicit
// upstream gradients (pipeline stages), no-grad and detach, diamond graphs, saved tensors
// freed once their node has run (kept with RetainGraph::yes), the post-accumulate hooks DDP
// launches its all-reduces from (once per leaf, when final, last layer first) and the
// end-of-pass callbacks it finishes in, parameters whose storage is swapped in place (as a
// sharded-parameter scheme would swap it), the refusal of in-place updates that would corrupt a
// graph, and dtype handling across the graph.
#include <gtest/gtest.h>

#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "engine/autograd.h"
#include "engine/ops.h"

namespace loom {
namespace {

std::vector<double> values(const Tensor& t) { return t.to_vector<double>(); }

// A leaf requiring a gradient.
Tensor param(const std::vector<float>& v, const Shape& shape) {
  Tensor t = from_vector(v, shape);
  t.set_requires_grad();
  return t;
}
Tensor param(const std::vector<float>& v) { return param(v, {int64_t(v.size())}); }
Tensor constant(const std::vector<float>& v) { return from_vector(v, {int64_t(v.size())}); }

// Expects `fn` to throw a loom::Error whose message holds every one of `parts`.
void expect_error(const std::function<void()>& fn, std::initializer_list<std::string> parts) {
  try {
    fn();
    ADD_FAILURE() << "expected a loom::Error";
  } catch (const Error& e) {
    std::string msg = e.what();
    for (const std::string& p : parts)
      EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' missing from: " << msg;
  }
}

TEST(AutogradBackward, GradientsAccumulateAcrossBackwardCalls) {
  Tensor w = param({1, 2, 3});
  sum(mul(w, w)).backward();
  EXPECT_EQ(values(w.grad()), (std::vector<double>{2, 4, 6}));
  sum(mul(w, w)).backward();
  EXPECT_EQ(values(w.grad()), (std::vector<double>{4, 8, 12}));
  EXPECT_FALSE(w.grad().requires_grad()) << "backward runs under no-grad";
  w.zero_grad();
  EXPECT_FALSE(w.grad().defined());
  sum(mul(w, 3.0)).backward();
  EXPECT_EQ(values(w.grad()), (std::vector<double>{3, 3, 3}));
}

TEST(AutogradBackward, LeafGradientsAreContiguousAndLeafShaped) {
  // Gradients that arrive as transposed or broadcast views are made dense: DDP and the
  // fused optimizers treat .grad as one contiguous block of the parameter's shape.
  Tensor x = param({1, 2, 3, 4, 5, 6}, {2, 3});
  sum(mul(x.t(), from_vector(std::vector<float>{1, 2, 3, 4, 5, 6}, {3, 2}))).backward();
  EXPECT_EQ(x.grad().shape(), (Shape{2, 3}));
  EXPECT_TRUE(x.grad().is_contiguous());
  EXPECT_EQ(values(x.grad()), (std::vector<double>{1, 3, 5, 2, 4, 6}));
  Tensor b = param({1, 2, 3}, {1, 3});
  sum(b.expand({4, 3})).backward();
  EXPECT_EQ(b.grad().shape(), (Shape{1, 3}));
  EXPECT_TRUE(b.grad().is_contiguous());
  EXPECT_EQ(values(b.grad()), (std::vector<double>{4, 4, 4}));
}

TEST(AutogradBackward, ExplicitUpstreamGradientOnNonScalarOutput) {
  Tensor x = param({1, 2, 3, 4, 5, 6}, {2, 3});
  Tensor b = param({10, 20, 30});
  Tensor y = add(mul(x, 3.0), b);  // (2, 3), b broadcast over rows
  Tensor g = from_vector(std::vector<float>{1, -1, 2, 0.5f, 0, -2}, {2, 3});
  y.backward(g);
  EXPECT_EQ(values(x.grad()), (std::vector<double>{3, -3, 6, 1.5, 0, -6}));
  EXPECT_EQ(values(b.grad()), (std::vector<double>{1.5, -1, 0}));
  EXPECT_EQ(values(g), (std::vector<double>{1, -1, 2, 0.5, 0, -2})) << "the upstream gradient is not modified";
}

TEST(AutogradBackward, LeafGradientNeverAliasesTheUpstreamGradient) {
  struct Case {
    const char* name;
    std::function<Tensor(const Tensor&)> f;
  };
  const std::vector<Case> cases = {{"clone", [](const Tensor& x) { return x.clone(); }},
                                   {"view", [](const Tensor& x) { return x.view({2, 2}); }},
                                   {"view_chain", [](const Tensor& x) { return x.view({2, 2}).reshape({4}); }}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    Tensor x = param({1, 2, 3, 4});
    Tensor y = c.f(x);
    Tensor g = ones(y.shape());
    y.backward(g, RetainGraph::yes);
    y.backward(g);  // accumulates into x.grad in place
    EXPECT_EQ(values(g), std::vector<double>(4, 1)) << "accumulation wrote into the caller's gradient";
    EXPECT_EQ(values(x.grad()), std::vector<double>(4, 2));
  }
  Tensor leaf = param({1, 2});
  Tensor g = from_vector(std::vector<float>{5, 6}, {2});
  leaf.backward(g);
  leaf.backward(g);
  EXPECT_EQ(values(leaf.grad()), (std::vector<double>{10, 12}));
  EXPECT_EQ(values(g), (std::vector<double>{5, 6}));
}

TEST(AutogradBackward, NonScalarWithoutGradientExplainsWhatToPass) {
  Tensor y = mul(param({1, 2, 3, 4, 5, 6}, {2, 3}), 2.0);
  expect_error([&] { y.backward(); }, {"(2, 3)", "backward(grad)"});
  expect_error([&] { y.backward(zeros({3, 2})); }, {"(3, 2)", "(2, 3)"});
}

TEST(AutogradBackward, TensorNotRequiringGradientRefuses) {
  Tensor x = ones({1});
  expect_error([&] { mul(x, 2.0).backward(); }, {"does not require a gradient"});
}

TEST(AutogradBackward, DiamondGraphSumsBothPaths) {
  Tensor x = param({1, 2, 3});
  Tensor a = mul(x, 2.0);
  sum(add(mul(a, 3.0), mul(a, 4.0))).backward();  // d/dx = 2 * (3 + 4)
  EXPECT_EQ(values(x.grad()), (std::vector<double>{14, 14, 14}));
  Tensor z = param({1, 2, 3});
  sum(add(mul(z, z), z)).backward();  // z used three times: 2z + 1
  EXPECT_EQ(values(z.grad()), (std::vector<double>{3, 5, 7}));
}

TEST(AutogradSavedTensors, FreedAsSoonAsTheirNodeHasRunThoughTheLossLives) {
  // h is held by nothing but what mul(h, h) saved; the probe runs after that node.
  Tensor x = param({1, 2, 3});
  Tensor probed = x.detach().clone();
  std::weak_ptr<Storage> saved;
  bool freed_when_probe_ran = false;
  record("Probe", {x}, {probed}, [&](const TensorList& g) {
    freed_when_probe_ran = saved.expired();
    return TensorList{g[0]};
  });
  Tensor loss;
  {
    Tensor h = mul(probed, 2.0);
    saved = h.storage();
    loss = sum(mul(h, h));
  }
  EXPECT_FALSE(saved.expired()) << "mul's node holds h for its gradient";
  loss.backward();
  EXPECT_TRUE(freed_when_probe_ran) << "h outlived its node's backward";
  EXPECT_TRUE(saved.expired());
  EXPECT_EQ(values(x.grad()), (std::vector<double>{8, 16, 24}));  // d/dx sum((2x)^2)
}

TEST(AutogradSavedTensors, ASecondBackwardThroughARunNodeIsRefusedNamingIt) {
  Tensor x = param({1, 2, 3});
  Tensor h = mul(x, x);
  sum(h).backward();
  expect_error([&] { sum(mul(h, 3.0)).backward(); },
               {"backward through mul a second time", "freed", "RetainGraph::yes"});
  EXPECT_EQ(values(x.grad()), (std::vector<double>{2, 4, 6})) << "the refused pass added nothing";
}

TEST(AutogradSavedTensors, RetainGraphKeepsThemForASecondBackward) {
  Tensor x = param({1, 2, 3});
  Tensor loss = sum(mul(x, x));
  loss.backward({}, RetainGraph::yes);
  loss.backward();
  EXPECT_EQ(values(x.grad()), (std::vector<double>{4, 8, 12}));
  // The second pass did not retain the graph.
  expect_error([&] { loss.backward(); }, {"backward through sum a second time"});
}

TEST(AutogradModes, NoGradGuardStopsRecordingAndRestores) {
  Tensor x = param({1, 2});
  ASSERT_TRUE(grad_enabled());
  {
    NoGradGuard outer;
    EXPECT_FALSE(grad_enabled());
    Tensor y = mul(x, 2.0);
    EXPECT_FALSE(y.requires_grad());
    EXPECT_EQ(y.grad_fn(), nullptr);
    {
      NoGradGuard inner;
      EXPECT_FALSE(grad_enabled());
    }
    EXPECT_FALSE(grad_enabled()) << "an inner guard restores the outer mode, not 'on'";
  }
  EXPECT_TRUE(grad_enabled());
  set_grad_enabled(false);
  { NoGradGuard guard; }
  EXPECT_FALSE(grad_enabled()) << "a guard restores the mode it found";
  bool other_thread = false;
  std::thread([&] { other_thread = grad_enabled(); }).join();
  EXPECT_TRUE(other_thread) << "grad mode is per thread";
  set_grad_enabled(true);
  Tensor y = mul(x, 2.0);
  EXPECT_TRUE(y.requires_grad());
  EXPECT_NE(y.grad_fn(), nullptr);
}

TEST(AutogradModes, DetachCutsTheGraph) {
  Tensor x = param({1, 2, 3});
  Tensor d = x.detach();
  EXPECT_EQ(d.storage(), x.storage());
  EXPECT_TRUE(d.is_leaf());
  EXPECT_FALSE(d.requires_grad());
  sum(mul(x, d)).backward();  // only the x path counts: the gradient is d, not 2x
  EXPECT_EQ(values(x.grad()), (std::vector<double>{1, 2, 3}));
  Tensor h = mul(x, 5.0).detach();
  EXPECT_FALSE(h.requires_grad());
  EXPECT_EQ(h.grad_fn(), nullptr);
}

TEST(AutogradHooks, FireOncePerBackwardWithTheFinalGradient) {
  Tensor w = param({1, 2});
  Tensor x1 = constant({3, 4}), x2 = constant({5, 6});
  int calls = 0;
  std::vector<double> seen;
  w.register_post_accumulate_grad_hook([&](Tensor& p) {
    ++calls;
    EXPECT_TRUE(p.same(w)) << "the hook receives the parameter itself";
    seen = values(p.grad());
  });
  auto loss = [&] { return add(add(sum(mul(w, x1)), sum(mul(w, x2))), sum(mul(w, w))); };
  loss().backward();  // d/dw = x1 + x2 + 2w
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(seen, (std::vector<double>{10, 14}));
  loss().backward();
  EXPECT_EQ(calls, 2);
  EXPECT_EQ(seen, (std::vector<double>{20, 28})) << "the hook sees the accumulated gradient";
}

TEST(AutogradHooks, FireInReverseOrderOfUse) {
  Tensor w1 = param({1, 2, 3}), w2 = param({2, 2, 2}), w3 = param({-1, 1, 0.5f});
  Tensor x = from_vector(std::vector<float>{1, 2, 3, 4, 5, 6}, {2, 3});
  std::vector<std::string> order;
  std::vector<std::pair<Tensor, std::string>> named = {{w1, "w1"}, {w2, "w2"}, {w3, "w3"}};
  for (auto& [w, name] : named)
    w.register_post_accumulate_grad_hook([&order, n = name](Tensor&) { order.push_back(n); });
  Tensor h = mul(mul(mul(x, w1), w2), w3);  // three "layers", w broadcast over the batch
  sum(h).backward();
  EXPECT_EQ(order, (std::vector<std::string>{"w3", "w2", "w1"}));
  // A parameter used by the first and the last layer is final only after the first.
  order.clear();
  Tensor h2 = mul(mul(mul(x, w1), w2), w1);
  sum(h2).backward();
  EXPECT_EQ(order, (std::vector<std::string>{"w2", "w1"}));
}

TEST(AutogradHooks, FireBeforeEarlierLayersRunTheirBackward) {
  // A probe node between two layers logs when its backward runs: w2's hook must come
  // first, so DDP's all-reduce of w2 overlaps the rest of backward.
  Tensor w1 = param({1, 2}), w2 = param({3, 4});
  std::vector<std::string> order;
  w1.register_post_accumulate_grad_hook([&](Tensor&) { order.push_back("w1"); });
  w2.register_post_accumulate_grad_hook([&](Tensor&) { order.push_back("w2"); });
  Tensor h1 = mul(constant({1, 1}), w1);
  Tensor probed = h1.detach().clone();
  record("Probe", {h1}, {probed}, [&](const TensorList& g) {
    order.push_back("layer1 backward");
    return TensorList{g[0]};
  });
  sum(mul(probed, w2)).backward();
  EXPECT_EQ(order, (std::vector<std::string>{"w2", "layer1 backward", "w1"}));
  EXPECT_EQ(values(w1.grad()), (std::vector<double>{3, 4}));
}

TEST(AutogradHooks, AThrowingHookLeavesGradModeOn) {
  Tensor w = param({1});
  w.register_post_accumulate_grad_hook([](Tensor&) { throw Error("hook failed"); });
  EXPECT_THROW(sum(mul(w, 2.0)).backward(), Error);
  EXPECT_TRUE(grad_enabled()) << "backward's no-grad mode must not leak out with the exception";
}

TEST(AutogradHooks, OnlyOnLeavesRequiringGradient) {
  Tensor y = mul(param({1}), 2.0);
  expect_error([&] { y.register_post_accumulate_grad_hook([](Tensor&) {}); }, {"leaves"});
  Tensor c = ones({1});
  expect_error([&] { c.register_post_accumulate_grad_hook([](Tensor&) {}); }, {"leaves"});
}

TEST(AutogradCallbacks, QueuedFromAHookRunOnceAfterTheWholePass) {
  // w2's hook fires first (last layer), w1's later: the callback queued from w2's hook
  // must run after both, once, and see every gradient final.
  Tensor w1 = param({1, 2}), w2 = param({3, 4});
  std::vector<std::string> order;
  w1.register_post_accumulate_grad_hook([&](Tensor&) { order.push_back("w1"); });
  w2.register_post_accumulate_grad_hook([&](Tensor&) {
    order.push_back("w2");
    queue_callback([&] {
      order.push_back("callback");
      EXPECT_EQ(values(w1.grad()), (std::vector<double>{3, 4}));
      queue_callback([&] { order.push_back("queued by the callback"); });
    });
  });
  sum(mul(mul(constant({1, 1}), w1), w2)).backward();
  EXPECT_EQ(order, (std::vector<std::string>{"w2", "w1", "callback", "queued by the callback"}));
  order.clear();
  w1.zero_grad();
  w2.zero_grad();
  sum(mul(mul(constant({1, 1}), w1), w2)).backward();
  EXPECT_EQ(order, (std::vector<std::string>{"w2", "w1", "callback", "queued by the callback"}))
      << "callbacks belong to one pass: the next pass starts with none";
}

TEST(AutogradCallbacks, AThrowingCallbackReachesTheCallerOfBackward) {
  Tensor w = param({1});
  w.register_post_accumulate_grad_hook([](Tensor&) { queue_callback([] { throw Error("callback failed"); }); });
  expect_error([&] { sum(mul(w, 2.0)).backward(); }, {"callback failed"});
  EXPECT_TRUE(grad_enabled());
  EXPECT_EQ(values(w.grad()), (std::vector<double>{2})) << "the gradients were accumulated before the callback";
}

TEST(AutogradCallbacks, QueueingOutsideABackwardPassIsRefused) {
  expect_error([] { queue_callback([] {}); }, {"no backward pass is running", "gradient hook"});
}

TEST(AutogradParams, SetDataIsSeenByEveryHandleAndGradientsStillFlow) {
  Tensor p = param({1, 2});
  Tensor module_ref = p;  // a second handle, as a Module holds its parameters
  int hook_calls = 0;
  p.register_post_accumulate_grad_hook([&](Tensor&) { ++hook_calls; });
  Tensor full_data = from_vector(std::vector<float>{5, 6, 7}, {3});
  p.set_data(full_data);
  EXPECT_EQ(module_ref.shape(), (Shape{3}));
  EXPECT_EQ(values(module_ref), (std::vector<double>{5, 6, 7}));
  EXPECT_EQ(module_ref.storage(), full_data.storage());
  EXPECT_TRUE(module_ref.requires_grad());
  EXPECT_TRUE(module_ref.is_leaf());
  sum(mul(module_ref, module_ref)).backward();
  EXPECT_EQ(values(p.grad()), (std::vector<double>{10, 12, 14}));
  EXPECT_EQ(hook_calls, 1);
  fill_(full_data, 1);
  EXPECT_EQ(values(p), (std::vector<double>{1, 1, 1})) << "p views full_data's storage";
}

TEST(AutogradParams, FsdpStyleSwapAroundForwardAndBackward) {
  Tensor p = param({0, 0});  // the shard
  Tensor shard = p.detach();
  Tensor x = constant({1, 2, 3, 4});
  p.set_data(from_vector(std::vector<float>{1, 1, 1, 1}, {4}));  // gather
  Tensor y = sum(mul(p, x));
  p.set_data(shard);                                              // free after forward
  p.set_data(from_vector(std::vector<float>{1, 1, 1, 1}, {4}));  // gather again for backward
  y.backward();
  EXPECT_EQ(values(p.grad()), (std::vector<double>{1, 2, 3, 4}));
  expect_error([&] { p.set_data(arange(0, 4)); }, {"set_data", "i64"});
}

struct InPlaceCase {
  const char* name;
  std::function<void(const Tensor&)> update;
  std::vector<double> after;  // starting from {1, 2}
};

TEST(AutogradInPlace, RefusedOnLeafRequiringGradOutsideNoGrad) {
  const std::vector<InPlaceCase> cases = {
      {"add_", [](const Tensor& t) { add_(t, ones({2}), 2.0); }, {3, 4}},
      {"mul_", [](const Tensor& t) { mul_(t, 3.0); }, {3, 6}},
      {"fill_", [](const Tensor& t) { fill_(t, 7); }, {7, 7}},
      {"zero_", [](const Tensor& t) { zero_(t); }, {0, 0}},
      {"copy_", [](const Tensor& t) { copy_(t, full({2}, 4)); }, {4, 4}},
      {"uniform_", [](const Tensor& t) { uniform_(t, 5, 5); }, {5, 5}},
  };
  for (const InPlaceCase& c : cases) {
    SCOPED_TRACE(c.name);
    Tensor p = param({1, 2});
    expect_error([&] { c.update(p); }, {"NoGradGuard"});
    EXPECT_EQ(values(p), (std::vector<double>{1, 2})) << "a refused update must not have happened";
    {
      NoGradGuard no_grad;
      c.update(p);
    }
    EXPECT_EQ(values(p), c.after);
    EXPECT_TRUE(p.requires_grad() && p.is_leaf());
  }
  Tensor y = mul(param({1, 2}), 2.0);  // a non-leaf in the graph is refused too
  expect_error([&] { mul_(y, 2.0); }, {"NoGradGuard"});
}

struct PromoteCase {
  DType a, b, out;
};

TEST(AutogradDtype, MixedBinaryOpsPromoteAndGradientsKeepInputDtypes) {
  const std::vector<PromoteCase> cases = {
      {DType::f32, DType::bf16, DType::f32},   {DType::bf16, DType::f32, DType::f32},
      {DType::f64, DType::f32, DType::f64},    {DType::f16, DType::bf16, DType::f32},
      {DType::bf16, DType::bf16, DType::bf16}, {DType::f16, DType::f64, DType::f64}};
  for (const PromoteCase& c : cases) {
    SCOPED_TRACE(std::string(dtype_name(c.a)) + " * " + std::string(dtype_name(c.b)));
    Tensor a = constant({1.5f, -2, 0.25f}).to(c.a), b = constant({3, 0.5f, -4}).to(c.b);
    a.set_requires_grad();
    b.set_requires_grad();
    Tensor y = mul(a, b);
    EXPECT_EQ(y.dtype(), c.out);
    sum(y).backward();
    ASSERT_TRUE(a.grad().defined() && b.grad().defined());
    EXPECT_EQ(a.grad().dtype(), c.a);
    EXPECT_EQ(b.grad().dtype(), c.b);
    EXPECT_EQ(values(a.grad()), (std::vector<double>{3, 0.5, -4}));
    EXPECT_EQ(values(b.grad()), (std::vector<double>{1.5, -2, 0.25}));
  }
  Tensor w = param({1, 2});
  Tensor y = mul(w, from_vector(std::vector<int64_t>{3, 4}, {2}));  // an integer operand
  EXPECT_EQ(y.dtype(), DType::f32);
  sum(y).backward();
  EXPECT_EQ(values(w.grad()), (std::vector<double>{3, 4}));
}

TEST(AutogradDtype, ToDtypeAndCloneAreDifferentiable) {
  for (DType dt : {DType::f64, DType::bf16, DType::f16}) {
    SCOPED_TRACE(std::string(dtype_name(dt)));
    Tensor x = param({1, 2, 3});
    Tensor y = x.to(dt);
    EXPECT_TRUE(y.requires_grad());
    sum(mul(y, y)).backward();
    EXPECT_EQ(x.grad().dtype(), DType::f32);
    EXPECT_EQ(values(x.grad()), (std::vector<double>{2, 4, 6}));
  }
  Tensor x = param({1, 2, 3});
  EXPECT_FALSE(x.to(DType::i64).requires_grad()) << "an integer copy carries no gradient";
  Tensor c = x.clone();
  EXPECT_NE(c.storage(), x.storage());
  EXPECT_FALSE(c.is_leaf());
  sum(mul(c, 4.0)).backward();
  EXPECT_EQ(values(x.grad()), (std::vector<double>{4, 4, 4}));
}

TEST(AutogradParams, SetRequiresGradOnlyOnFloatingLeaves) {
  Tensor y = mul(param({1}), 2.0);
  expect_error([&] { y.set_requires_grad(); }, {"only leaves"});
  Tensor i = arange(0, 3);
  expect_error([&] { i.set_requires_grad(); }, {"floating-point", "i64"});
  i.set_requires_grad(false);  // turning it off is always fine
  EXPECT_FALSE(i.requires_grad());
  Tensor f = zeros({2});
  f.set_requires_grad();
  EXPECT_TRUE(f.requires_grad());
  f.set_requires_grad(false);
  EXPECT_FALSE(f.requires_grad());
}

// y = 3 * x through a record_accumulating node that notes what it was offered and adds its
// gradient into it when it can.
Tensor triple_accumulating(const Tensor& x, std::vector<bool>* offered) {
  Tensor y = mul(x.detach(), 3.0);
  record_accumulating("Triple", {x}, {y}, [offered](const TensorList& g, const TensorList& into) {
    offered->push_back(into[0].defined());
    if (!into[0].defined()) return TensorList{mul(g[0], 3.0)};
    add_(into[0], g[0], 3.0);
    return TensorList{Tensor()};
  });
  return y;
}

TEST(AutogradAccumulating, AddsIntoTheGradientOtherOpsSentWhenThePassAloneHoldsIt) {
  Tensor x = param({1, 2, 3});
  std::vector<bool> offered;
  // The product runs first in backward (recorded last): its gradient for x (2 x) is there.
  Tensor tripled = triple_accumulating(x, &offered);
  Tensor squared = mul(x, x);
  sum(add(tripled, squared)).backward();
  EXPECT_EQ(offered, std::vector<bool>{true});
  EXPECT_EQ(values(x.grad()), (std::vector<double>{3 + 2, 3 + 4, 3 + 6}));
}

TEST(AutogradAccumulating, OffersNothingWhenItRunsFirstOrTheGradientIsShared) {
  {
    SCOPED_TRACE("first to reach x");
    Tensor x = param({1, 2});
    std::vector<bool> offered;
    Tensor z = mul(x, 2.0);  // recorded before the accumulating node: its backward runs after
    Tensor tripled = triple_accumulating(x, &offered);
    sum(add(z, tripled)).backward();
    EXPECT_EQ(offered, std::vector<bool>{false});
    EXPECT_EQ(values(x.grad()), (std::vector<double>{5, 5}));
  }
  // A node that runs first in backward sends x the upstream gradient and keeps a handle on
  // it (the same tensor, or another on its storage): not the pass's to write into.
  for (bool same_tensor : {true, false}) {
    SCOPED_TRACE(same_tensor ? "a gradient someone else holds" : "a gradient sharing its storage with one held");
    Tensor x = param({1, 2});
    std::vector<bool> offered;
    Tensor kept;
    Tensor tripled = triple_accumulating(x, &offered);
    Tensor y = mul(x.detach(), 1.0);
    record("Keep", {x}, {y}, [&kept, same_tensor](const TensorList& g) {
      kept = g[0].clone();
      return TensorList{same_tensor ? kept : kept.detach()};
    });
    sum(add(tripled, y)).backward();
    EXPECT_EQ(offered, std::vector<bool>{false});
    EXPECT_EQ(values(x.grad()), (std::vector<double>{4, 4}));
    EXPECT_EQ(values(kept), (std::vector<double>{1, 1})) << "the kept gradient was written";
  }
}

}  // namespace
}  // namespace loom
