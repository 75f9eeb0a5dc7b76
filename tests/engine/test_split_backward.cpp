// The split backward pass (run_backward_split, engine/autograd.h) that zero-bubble pipeline
// schedules run: the stage input's gradient is ready when it returns and no parameter has a
// gradient yet; DeferredGradients::run() then gives every parameter run_backward's gradient,
// to the bit, over small graphs of products and over two GPT blocks (plain and recomputed).
// Each weight product, recomputed ones included, runs in the weight half, and gelu_mlp's
// product through w2 runs once, in the input half. What each half asks
// of a node (gradient_wanted), and of the pass a recomputed node runs inside, hooks and
// callbacks in each half, and the weight half's life: once only, and nothing left behind when
// it is dropped unrun.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "engine/autocast.h"
#include "engine/autograd.h"
#include "engine/ops.h"
#include "engine/recompute.h"
#include "layers/models/gpt.h"

namespace loom {
namespace {

Tensor leaf(const Tensor& values) {
  Tensor t = values.detach();
  t.set_requires_grad();
  return t;
}

Tensor param(const Shape& shape, DType dtype = DType::f64) { return leaf(randn(shape, DType::f64).to(dtype)); }

void clear_grads(const TensorList& ts) {
  for (Tensor t : ts) t.zero_grad();
}

TensorList grads_of(const TensorList& ts) {
  TensorList grads;
  for (const Tensor& t : ts) grads.push_back(t.grad().defined() ? t.grad().clone() : Tensor());
  return grads;
}

TensorList ones_for(const TensorList& roots) {
  TensorList seeds;
  for (const Tensor& r : roots) seeds.push_back(ones_like(r));
  return seeds;
}

// got and want hold the same bits (both undefined counts as equal).
void expect_bitwise_equal(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.defined(), want.defined()) << what << (got.defined() ? ": unexpected gradient" : ": no gradient");
  if (!got.defined()) return;
  ASSERT_EQ(got.dtype(), want.dtype()) << what;
  ASSERT_EQ(got.shape(), want.shape()) << what;
  const std::vector<double> a = got.to_vector<double>(), b = want.to_vector<double>();
  for (size_t i = 0; i < a.size(); ++i)
    ASSERT_EQ(std::memcmp(&a[i], &b[i], sizeof(double)), 0) << what << "[" << i << "]: " << a[i] << " vs " << b[i];
}

// A stage: the roots of its backward, built from its input x (a fresh graph each call).
using Stage = std::function<TensorList(const Tensor& x)>;

// Runs the stage once unsplit and once split, from the same input values; expects x's gradient
// after B and the parameters' after W to equal run_backward's bit for bit, and the parameters
// in `deferred` to have none between the two.
void expect_split_equals_unsplit(const Stage& stage, const Tensor& x_values, const TensorList& params,
                                 const std::vector<std::string>& names, const TensorList& deferred) {
  clear_grads(params);
  Tensor x = leaf(x_values);
  TensorList roots = stage(x);
  run_backward(roots, ones_for(roots));
  const Tensor x_grad = x.grad();
  const TensorList want = grads_of(params);
  clear_grads(params);

  Tensor x_split = leaf(x_values);
  roots = stage(x_split);
  DeferredGradients rest = run_backward_split(roots, ones_for(roots), {x_split});
  expect_bitwise_equal(x_split.grad(), x_grad, "x after B");
  for (const Tensor& p : deferred) EXPECT_FALSE(p.grad().defined()) << "a parameter got its gradient in B";
  EXPECT_FALSE(rest.empty());
  roots.clear();  // the weight half must not need the graph B walked
  rest.run();
  EXPECT_TRUE(rest.empty());
  for (size_t i = 0; i < params.size(); ++i) expect_bitwise_equal(params[i].grad(), want[i], names[i]);
  expect_bitwise_equal(x_split.grad(), x_grad, "x after W");
}

Tensor square_sum(const Tensor& y) { return sum(mul(y, y)); }

// Class indices for 6 rows of 10 classes, one row ignored (ignore_index -100).
Tensor six_targets() { return from_vector(std::vector<int64_t>{3, 0, 9, -100, 5, 3}, {6}); }

// One row a graph: its input, its parameters, and its roots from both.
struct Case {
  const char* name;
  Shape x_shape;
  std::vector<Shape> param_shapes;
  std::function<TensorList(const Tensor& x, const TensorList& p)> roots;
  DType dtype;                    // of x and the parameters
  std::optional<DType> autocast;  // the forward's
};

const std::vector<Case>& cases() {
  static const std::vector<Case> table = {
      {"an MLP of linear ops with biases", {6, 8}, {{16, 8}, {16}, {16, 16}, {16}, {4, 16}, {4}},
       [](const Tensor& x, const TensorList& p) {
         Tensor h = gelu(linear(x, p[0], p[1]));
         return TensorList{square_sum(linear(tanh(linear(h, p[2], p[3])), p[4], p[5]))};
       },
       DType::f64, std::nullopt},
      {"matmuls whose b is a parameter", {2, 3, 5}, {{5, 4}, {4, 3}},
       [](const Tensor& x, const TensorList& p) { return TensorList{sum(tanh(matmul(tanh(matmul(x, p[0])), p[1])))}; },
       DType::f64, std::nullopt},
      {"gelu_mlp with its residual", {6, 8}, {{32, 8}, {32}, {8, 32}, {8}},
       [](const Tensor& x, const TensorList& p) {
         return TensorList{sum(tanh(gelu_mlp(x, p[0], p[1], p[2], p[3], x)))};
       },
       DType::f64, std::nullopt},
      // w's three gradients arrive from a product B runs, one it does not (its input is a
      // constant) and another B runs, in that order: W must sum them in it.
      {"a weight shared by three products, one of them out of x's reach", {6, 8}, {{8, 8}, {8}},
       [](const Tensor& x, const TensorList& p) {
         Tensor y = linear(x, p[0], p[1]);
         Tensor k = linear(full({6, 8}, 0.5, DType::f64), p[0]);
         return TensorList{square_sum(linear(tanh(add(y, k)), p[0], p[1]))};
       },
       DType::f64, std::nullopt},
      {"a second root that x does not reach", {6, 8}, {{8, 8}, {8}},
       [](const Tensor& x, const TensorList& p) {
         return TensorList{sum(tanh(linear(x, p[0], p[1]))), square_sum(p[0])};
       },
       DType::f64, std::nullopt},
      // matmul reaches its f32 weight through a cast node; linear takes its f32 weight straight.
      {"f32 parameters under bf16 autocast", {6, 8}, {{8, 16}, {4, 16}, {4}},
       [](const Tensor& x, const TensorList& p) {
         Tensor y = linear(gelu(matmul(x, p[0])), p[1], p[2]);
         return TensorList{square_sum(y.to(DType::f32))};
       },
       DType::f32, DType::bf16},
      // The output layer fused with its loss: x's product in B, the (classes, in) weight's in W.
      {"linear_cross_entropy after a linear op, in f64", {6, 8}, {{8, 8}, {8}, {10, 8}},
       [](const Tensor& x, const TensorList& p) {
         return TensorList{linear_cross_entropy(tanh(linear(x, p[0], p[1])), p[2], six_targets())};
       },
       DType::f64, std::nullopt},
      {"linear_cross_entropy after a linear op, in f32", {6, 8}, {{8, 8}, {8}, {10, 8}},
       [](const Tensor& x, const TensorList& p) {
         return TensorList{linear_cross_entropy(tanh(linear(x, p[0], p[1])), p[2], six_targets())};
       },
       DType::f32, std::nullopt},
      // In chunks both of its gradients come back from B, and W adds the weight's.
      {"linear_cross_entropy in chunks of 4 rows after a linear op", {6, 8}, {{8, 8}, {8}, {10, 8}},
       [](const Tensor& x, const TensorList& p) {
         return TensorList{linear_cross_entropy(tanh(linear(x, p[0], p[1])), p[2], six_targets(), -100, 0.0, 4)};
       },
       DType::f32, std::nullopt},
      // Recomputed blocks: B reruns them and asks the pass inside for x's gradient only.
      {"a recomputed MLP of linear ops", {6, 8}, {{16, 8}, {16}, {8, 16}, {8}},
       [](const Tensor& x, const TensorList& p) {
         auto block = [p](const TensorList& in) { return linear(gelu(linear(in[0], p[0], p[1])), p[2], p[3], in[0]); };
         return TensorList{square_sum(recompute(block, {x}))};
       },
       DType::f64, std::nullopt},
      // p[0] is an input of the recomputed block out of x's reach: its leaf's gradient, computed
      // by the pass inside in W, leaves along the node's edge there. The inner block is
      // recomputed within the outer one's rerun, so its pass is split inside a split pass.
      {"recompute nested in recompute, with a parameter among its inputs", {6, 8}, {{6, 8}, {8, 8}, {8}},
       [](const Tensor& x, const TensorList& p) {
         const Tensor w = p[1], b = p[2];
         auto inner = [w, b](const TensorList& in) { return tanh(linear(in[0], w, b)); };
         auto outer = [inner, w](const TensorList& in) {
           return linear(recompute(inner, {mul(in[0], in[1])}), w, Tensor(), in[0]);
         };
         return TensorList{square_sum(recompute(outer, {x, p[0]}))};
       },
       DType::f64, std::nullopt},
      // Its f32 weight's gradient comes straight out of the bf16 product, in f32.
      {"linear_cross_entropy with an f32 weight under bf16 autocast", {6, 8}, {{10, 8}},
       [](const Tensor& x, const TensorList& p) {
         return TensorList{linear_cross_entropy(tanh(x), p[0], six_targets(), -100, 0.1)};
       },
       DType::f32, DType::bf16},
  };
  return table;
}

TEST(SplitBackward, InputGradientFirstThenParametersBitwiseAsOnePass) {
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    manual_seed(7);
    TensorList params;
    std::vector<std::string> names;
    for (const Shape& s : c.param_shapes) {
      params.push_back(param(s, c.dtype));
      names.push_back("p" + std::to_string(names.size()));
    }
    const Tensor x = randn(c.x_shape, DType::f64).to(c.dtype);
    auto stage = [&](const Tensor& input) {
      AutocastGuard cast(c.autocast);
      return c.roots(input, params);
    };
    expect_split_equals_unsplit(stage, x, params, names, params);
  }
}

// The model's initialisation draws from the generator: seeded first, for the same model each time.
nn::GPTConfig seeded_two_block_config() {
  nn::GPTConfig c = nn::GPTConfig::named("tiny");
  c.layers = 2;
  c.context = 16;
  manual_seed(11);
  return c;
}

// Two GPT blocks, the final LayerNorm and the tied output layer with its loss, in f64, fed the
// embedding's output as a leaf: a last pipeline stage.
struct GptStage {
  explicit GptStage(bool recomputed) : model(seeded_two_block_config()), recomputed(recomputed) {
    model.to(DType::f64);
    const int64_t B = 2, T = 12;
    std::vector<int64_t> tokens(size_t(B * (T + 1)));
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = int64_t(i * 37 + 11) % 256;
    Tensor ids = from_vector(tokens, {B, T + 1});
    targets = ids.slice(1, 1, T + 1).contiguous().reshape({-1});
    NoGradGuard no_grad;
    input = token_position_embedding(model.wte->weight, model.wpe->weight, ids.slice(1, 0, T).contiguous());
  }

  TensorList roots(const Tensor& x) const {
    Tensor h = x;
    for (const auto& block : model.blocks) {
      auto rerun = [this, block](const TensorList& in) {
        Tensor y = block->forward(in[0]);
        if (on_rerun && grad_enabled()) on_rerun(y);
        return y;
      };
      h = recomputed ? recompute(rerun, {h}) : block->forward(h);
    }
    h = model.ln_f->forward_for_product(h);
    return {linear_cross_entropy(h.reshape({-1, h.size(-1)}), model.lm_head, targets)};
  }

  nn::GPT model;
  bool recomputed;
  // Called on a recomputed block's output when backward runs the block again, with its graph.
  std::function<void(const Tensor&)> on_rerun;
  Tensor input;    // (B, T, C), the embedding's output
  Tensor targets;  // (B T), i64
};

void expect_gpt_split_equals_unsplit(bool recomputed) {
  GptStage stage(recomputed);
  TensorList params;
  std::vector<std::string> names;
  for (const auto& [name, p] : stage.model.named_parameters()) {
    params.push_back(p);
    names.push_back(name);
  }
  expect_split_equals_unsplit([&](const Tensor& x) { return stage.roots(x); }, stage.input, params, names, params);
}

TEST(SplitBackward, TwoGptBlocksGiveTheInputGradientFirstAndEveryParameterBitwiseAsOnePass) {
  expect_gpt_split_equals_unsplit(false);
}

TEST(SplitBackward, RecomputedGptBlocksInsideTheSplitGiveTheSameGradients) { expect_gpt_split_equals_unsplit(true); }

// Wraps the backward of each linear and gelu_mlp node of the graph that ends in `root`, to
// note for each weight (linear's input 1, gelu_mlp's 1 and 3) the half it ran in (`*half`)
// and whether it returned that weight's gradient.
void note_weight_products(const Tensor& root, const std::string* half,
                          std::vector<std::pair<std::string, bool>>* noted) {
  std::vector<Node*> stack{root.grad_fn().get()};
  std::unordered_set<Node*> seen;
  while (!stack.empty()) {
    Node* node = stack.back();
    stack.pop_back();
    if (!node || !seen.insert(node).second) continue;
    for (const Edge& e : node->next_edges) stack.push_back(e.node.get());
    const std::vector<size_t> weights = node->name == "linear"     ? std::vector<size_t>{1}
                                        : node->name == "gelu_mlp" ? std::vector<size_t>{1, 3}
                                                                   : std::vector<size_t>{};
    if (weights.empty()) continue;
    node->backward = [original = node->backward, weights, half, noted](const TensorList& g) {
      TensorList out = original(g);
      for (size_t w : weights) noted->emplace_back(*half, out[w].defined());
      return out;
    };
  }
}

// The products inside a recomputed block are made in B, when B runs it again; B asks of them
// only x's gradient, so each block's four weight products run in W.
TEST(SplitBackward, TheWeightProductsOfRecomputedGptBlocksRunInTheWeightHalf) {
  GptStage stage(true);
  std::string half = "B";
  std::vector<std::pair<std::string, bool>> noted;  // (half, returned the weight's gradient)
  stage.on_rerun = [&](const Tensor& y) { note_weight_products(y, &half, &noted); };
  Tensor x = leaf(stage.input);
  TensorList roots = stage.roots(x);
  DeferredGradients rest = run_backward_split(roots, ones_for(roots), {x});
  EXPECT_TRUE(x.grad().defined());
  half = "W";
  rest.run();
  using Noted = std::pair<std::string, bool>;
  const int64_t blocks = std::ssize(stage.model.blocks);
  EXPECT_EQ(std::count(noted.begin(), noted.end(), Noted{"B", true}), 0) << "a weight product ran in B";
  EXPECT_EQ(std::count(noted.begin(), noted.end(), Noted{"B", false}), 4 * blocks);
  EXPECT_EQ(std::count(noted.begin(), noted.end(), Noted{"W", true}), 4 * blocks);
  EXPECT_EQ(std::ssize(noted), 8 * blocks);
}

// A weight's gradient is a product of dy and the op's input, which the op saved by reference:
// overwritten between the halves, that input zeroes the weight's gradient if, and only if,
// the product runs in W.
TEST(SplitBackward, TheWeightProductsOfLinearMatmulGeluMlpLinearCrossEntropyAndRecomputeRunInTheWeightHalf) {
  struct Row {
    const char* op;
    std::vector<Shape> param_shapes;
    std::function<Tensor(const Tensor& x, const TensorList& p)> forward;
  };
  const std::vector<Row> rows = {
      {"linear", {{5, 4}, {5}}, [](const Tensor& x, const TensorList& p) { return linear(x, p[0], p[1]); }},
      {"matmul", {{4, 5}}, [](const Tensor& x, const TensorList& p) { return matmul(x, p[0]); }},
      {"gelu_mlp", {{8, 4}, {8}, {4, 8}, {4}},
       [](const Tensor& x, const TensorList& p) { return gelu_mlp(x, p[0], p[1], p[2], p[3]); }},
      {"linear_cross_entropy", {{6, 4}}, [](const Tensor& x, const TensorList& p) {
         return linear_cross_entropy(x, p[0], from_vector(std::vector<int64_t>{5, 0, 2}, {3}));
       }},
      // The block's input is saved by reference too, and rerun in B: its leaf is x's data.
      {"recomputed linear", {{5, 4}, {5}}, [](const Tensor& x, const TensorList& p) {
         return recompute([p](const TensorList& in) { return linear(in[0], p[0], p[1]); }, {x});
       }},
  };
  for (const Row& row : rows) {
    SCOPED_TRACE(row.op);
    TensorList p;
    for (const Shape& s : row.param_shapes) p.push_back(param(s));
    Tensor x = param({3, 4});
    Tensor loss = square_sum(row.forward(x, p));
    DeferredGradients rest = run_backward_split({loss}, {ones_like(loss)}, {x});
    EXPECT_TRUE(x.grad().defined());
    {
      NoGradGuard no_grad;
      zero_(x);
    }
    rest.run();
    ASSERT_TRUE(p[0].grad().defined());
    const std::vector<double> dw = p[0].grad().to_vector<double>();
    EXPECT_EQ(std::count(dw.begin(), dw.end(), 0.0), std::ssize(dw)) << row.op << ": the weight's product ran in B";
  }
}

// y = a * b, recorded with a backward that notes which inputs the pass wants ("a-": a only)
// and computes only those when `honour`, else both.
Tensor probe_mul(const Tensor& a, const Tensor& b, std::vector<std::string>* calls, bool honour) {
  Tensor y;
  {
    NoGradGuard no_grad;
    y = mul(a, b);
  }
  Tensor sa = a.detach(), sb = b.detach();
  record("probe", {a, b}, {y}, [sa, sb, calls, honour](const TensorList& g) {
    const bool want_a = gradient_wanted(0), want_b = gradient_wanted(1);
    calls->push_back(std::string(want_a ? "a" : "-") + (want_b ? "b" : "-"));
    return TensorList{want_a || !honour ? mul(g[0], sb) : Tensor(), want_b || !honour ? mul(g[0], sa) : Tensor()};
  });
  return y;
}

TEST(SplitBackward, EachHalfAsksANodeForItsOwnInputsAndAWholePassForAll) {
  EXPECT_TRUE(gradient_wanted(0)) << "outside a pass every input is wanted";
  Tensor x = param({3}), w = param({3});
  std::vector<std::string> calls;
  Tensor loss = sum(probe_mul(x, w, &calls, true));
  run_backward({loss}, {ones_like(loss)});
  EXPECT_EQ(calls, (std::vector<std::string>{"ab"}));
  const TensorList want = grads_of({x, w});
  clear_grads({x, w});

  calls.clear();
  loss = sum(probe_mul(x, w, &calls, true));
  DeferredGradients rest = run_backward_split({loss}, {ones_like(loss)}, {x});
  EXPECT_EQ(calls, (std::vector<std::string>{"a-"}));
  expect_bitwise_equal(x.grad(), want[0], "x");
  EXPECT_FALSE(w.grad().defined());
  rest.run();
  EXPECT_EQ(calls, (std::vector<std::string>{"a-", "-b"})) << "W asks again for what B declined";
  expect_bitwise_equal(w.grad(), want[1], "w");
}

TEST(SplitBackward, AGradientComputedThoughNotWantedIsKeptForTheWeightHalf) {
  Tensor x = param({3}), w = param({3});
  std::vector<std::string> calls;
  Tensor loss = sum(probe_mul(x, w, &calls, false));
  run_backward({loss}, {ones_like(loss)});
  const TensorList want = grads_of({x, w});
  clear_grads({x, w});

  calls.clear();
  loss = sum(probe_mul(x, w, &calls, false));
  DeferredGradients rest = run_backward_split({loss}, {ones_like(loss)}, {x});
  EXPECT_FALSE(w.grad().defined()) << "computed in B, accumulated in W";
  rest.run();
  EXPECT_EQ(calls, (std::vector<std::string>{"a-"})) << "the node is not called again";
  expect_bitwise_equal(w.grad(), want[1], "w");
}

// matmul's input h, which its weight's gradient needs, lives until W has run the product and
// no longer, though the loss does; tanh, which also saved h, is done with it in B.
TEST(SplitBackward, WhatANodeSavedIsFreedOnceTheLastHalfThatCallsItHasRun) {
  Tensor x = param({3, 4}), w = param({4, 5});
  std::weak_ptr<Storage> saved;
  Tensor loss;
  {
    Tensor h = tanh(x);
    saved = h.storage();
    loss = sum(matmul(h, w));
  }
  DeferredGradients rest = run_backward_split({loss}, {ones_like(loss)}, {x});
  EXPECT_TRUE(x.grad().defined());
  EXPECT_FALSE(saved.expired()) << "W needs h for w's gradient";
  rest.run();
  EXPECT_TRUE(w.grad().defined());
  EXPECT_TRUE(saved.expired());
}

// gelu_mlp's input half computes dz (the product through w2 with GELU's derivative) for x and
// keeps it for the weight half, which computes w1's gradient from it instead of computing it
// again: w2 changed between the halves leaves w1's and b1's gradients those of one pass (a
// weight half that recomputed dz would read the changed w2), and w2's own is the product of dy
// and the hidden values, which w2 does not enter either.
TEST(SplitBackward, GeluMlpsWeightHalfReusesTheInputHalfsProductThroughW2) {
  Tensor x = param({6, 4}), w1 = param({8, 4}), b1 = param({8}), w2 = param({4, 8}), b2 = param({4});
  auto loss_of = [&] { return sum(tanh(gelu_mlp(x, w1, b1, w2, b2))); };
  Tensor loss = loss_of();
  run_backward({loss}, {ones_like(loss)});
  const TensorList want = grads_of({x, w1, b1, w2, b2});
  clear_grads({x, w1, b1, w2, b2});

  loss = loss_of();
  DeferredGradients rest = run_backward_split({loss}, {ones_like(loss)}, {x});
  expect_bitwise_equal(x.grad(), want[0], "x");
  {
    NoGradGuard no_grad;
    mul_(w2, 3.0);  // the weight half must not read it
  }
  rest.run();
  expect_bitwise_equal(w1.grad(), want[1], "w1");
  expect_bitwise_equal(b1.grad(), want[2], "b1");
  expect_bitwise_equal(w2.grad(), want[3], "w2");
  expect_bitwise_equal(b2.grad(), want[4], "b2");
}

TEST(SplitBackward, APassInsideANodesBackwardIsSplitAsTheNodeIsAsked) {
  // The recompute node has inputs x (live) and v (not): B calls it asking for x only, so the pass
  // it runs inside asks its nodes only for what leads to x's leaf. The weight w inside and v get
  // theirs in W, where no question is asked: a hook there sees every input wanted.
  Tensor x = param({3}), v = param({3}), w = param({3});
  std::vector<std::string> inner;
  std::vector<bool> hook_saw;
  w.register_post_accumulate_grad_hook([&](Tensor&) { hook_saw = {gradient_wanted(0), gradient_wanted(1)}; });
  auto loss_of = [&] {
    return sum(recompute([&](const TensorList& in) { return probe_mul(mul(in[0], in[1]), w, &inner, true); }, {x, v}));
  };
  Tensor loss = loss_of();
  run_backward({loss}, {ones_like(loss)});
  EXPECT_EQ(inner, (std::vector<std::string>{"ab"})) << "a whole pass asks for every input";
  const TensorList want = grads_of({x, v, w});
  clear_grads({x, v, w});
  inner.clear();
  hook_saw.clear();

  loss = loss_of();
  DeferredGradients rest = run_backward_split({loss}, {ones_like(loss)}, {x});
  EXPECT_EQ(inner, (std::vector<std::string>{"a-"}));
  expect_bitwise_equal(x.grad(), want[0], "x");
  EXPECT_FALSE(v.grad().defined());
  EXPECT_FALSE(w.grad().defined()) << "the weight inside got its gradient in B";
  EXPECT_TRUE(hook_saw.empty());
  EXPECT_TRUE(gradient_wanted(1)) << "the question ends with the node";
  loss = Tensor();
  rest.run();
  EXPECT_EQ(inner, (std::vector<std::string>{"a-", "-b"})) << "W asks the node inside for what B declined";
  EXPECT_EQ(hook_saw, (std::vector<bool>{true, true}));
  expect_bitwise_equal(v.grad(), want[1], "v");
  expect_bitwise_equal(w.grad(), want[2], "w");
}

TEST(SplitBackward, HooksAndCallbacksBelongToTheHalfThatAccumulates) {
  Tensor x = param({4, 3}), w1 = param({5, 3}), b1 = param({5}), w2 = param({5, 2});
  std::vector<std::string> events;
  x.register_post_accumulate_grad_hook([&](Tensor&) {
    events.push_back("x");
    queue_callback([&] { events.push_back("end of B"); });
  });
  bool queued = false;
  const std::vector<std::pair<std::string, Tensor>> params = {{"w1", w1}, {"b1", b1}, {"w2", w2}};
  for (const auto& [name, p] : params) {
    Tensor t = p;
    t.register_post_accumulate_grad_hook([&events, &queued, name](Tensor& grad_leaf) {
      events.push_back(name + (grad_leaf.grad().defined() ? "" : " without a gradient"));
      if (!queued) queue_callback([&events] { events.push_back("end of W"); });
      queued = true;
    });
  }
  Tensor loss = sum(matmul(tanh(linear(x, w1, b1)), w2));
  DeferredGradients rest = run_backward_split({loss}, {ones_like(loss)}, {x});
  EXPECT_EQ(events, (std::vector<std::string>{"x", "end of B"}));
  events.clear();
  rest.run();
  ASSERT_EQ(events.size(), 4u);
  EXPECT_EQ(events.back(), "end of W");
  for (const char* name : {"w1", "b1", "w2"})
    EXPECT_EQ(std::count(events.begin(), events.end(), name), 1) << name;
}

TEST(SplitBackward, TheWeightHalfRunsOnceAndMovesWhole) {
  Tensor x = param({4, 3}), w = param({2, 3}), b = param({2});
  Tensor loss = square_sum(linear(x, w, b));
  DeferredGradients rest = run_backward_split({loss}, {ones_like(loss)}, {x});
  DeferredGradients moved = std::move(rest);
  EXPECT_TRUE(rest.empty());  // NOLINT(bugprone-use-after-move): a moved-from half is empty
  EXPECT_FALSE(moved.empty());
  moved.run();
  const TensorList once = grads_of({w, b});
  moved.run();
  rest.run();
  EXPECT_TRUE(moved.empty());
  expect_bitwise_equal(w.grad(), once[0], "w after a second run()");
  expect_bitwise_equal(b.grad(), once[1], "b after a second run()");
  DeferredGradients none;
  EXPECT_TRUE(none.empty());
  none.run();
}

TEST(SplitBackward, AnUnrunWeightHalfHoldsOnlyWhatItNeedsAndFreesItWhenDropped) {
  Tensor x = param({4, 3}), w = param({2, 3}), b = param({2});
  std::weak_ptr<Node> below, above, accumulator;
  {
    Tensor h = tanh(x);
    Tensor loss = square_sum(linear(h, w, b));
    below = h.grad_fn();  // the linear node's input edge leads there: W must not keep it
    above = loss.grad_fn();
    accumulator = w.impl()->grad_accumulator;
    std::optional<DeferredGradients> rest = run_backward_split({loss}, {ones_like(loss)}, {x});
    h = loss = Tensor();
    EXPECT_TRUE(below.expired() && above.expired()) << "the weight half keeps the graph B walked alive";
    EXPECT_FALSE(accumulator.expired());
    EXPECT_NO_THROW(rest.reset());
    EXPECT_TRUE(accumulator.expired());
  }
  EXPECT_TRUE(x.grad().defined());
  EXPECT_FALSE(w.grad().defined());
  EXPECT_FALSE(b.grad().defined());
}

TEST(SplitBackward, NowMustHoldLeavesRequiringAGradient) {
  Tensor x = param({3});
  Tensor h = mul(x, 2.0);
  Tensor loss = sum(mul(h, h));
  EXPECT_THROW(run_backward_split({loss}, {ones_like(loss)}, {h}), Error);
  EXPECT_THROW(run_backward_split({loss}, {ones_like(loss)}, {ones({3})}), Error);
}

}  // namespace
}  // namespace loom
