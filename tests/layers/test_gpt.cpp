// GPT: nanoGPT's module names and GPT-2's parameter count, the tied output layer, shapes, the
// attention layer against a composite softmax(QK^T / sqrt(D)) V, and a tiny byte-level GPT
// that learns a short text on the CPU (its loss falls four-fold); recomputing the blocks'
// activations (GPTConfig::recompute) leaves the loss and every gradient unchanged.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <string>

#include "engine/allocator.h"
#include "engine/autograd.h"
#include "engine/ops.h"
#include "layers/attention.h"
#include "layers/models/gpt.h"
#include "layers/optim/adam.h"

namespace loom::nn {
namespace {

TEST(Gpt, Gpt2SmallHasNanoGptNamesAndItsParameterCount) {
  GPTConfig c = GPTConfig::named("gpt2-124m");
  c.layers = 1;  // the count per block is checked below; one block keeps the test quick
  GPT model(c);
  auto sd = model.state_dict();
  std::vector<std::string> keys;
  for (const auto& [k, _] : sd) keys.push_back(k);
  for (const char* k : {"transformer.wte.weight", "transformer.wpe.weight", "transformer.h.0.ln_1.weight",
                        "transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_proj.bias",
                        "transformer.h.0.mlp.c_fc.weight", "transformer.h.0.mlp.c_proj.weight",
                        "transformer.ln_f.bias", "lm_head.weight"})
    EXPECT_NE(std::find(keys.begin(), keys.end(), k), keys.end()) << k;
  // GPT-2 124M with the padded vocabulary: embeddings 50304*768 + 1024*768, 12 blocks of
  // 7,087,872, the final LayerNorm 1,536; the tied head adds nothing.
  const int64_t block = 7087872, embeddings = 50304 * 768 + 1024 * 768;
  EXPECT_EQ(model.num_parameters(), embeddings + block + 1536);
  EXPECT_EQ(embeddings + 12 * block + 1536, 124475904);  // nanoGPT's figure for vocab 50304
  EXPECT_EQ(model.lm_head.impl(), model.wte->weight.impl());
}

TEST(Gpt, Gpt2MediumHasItsParameterCount) {
  GPTConfig c = GPTConfig::named("gpt2-350m");
  EXPECT_EQ(c.layers, 24);
  EXPECT_EQ(c.heads, 16);
  c.layers = 1;
  GPT model(c);
  // 12 d^2 + 13 d a block at d = 1024; embeddings 50304*1024 + 1024*1024; ln_f 2,048.
  const int64_t block = 12596224, embeddings = 50304 * 1024 + 1024 * 1024;
  EXPECT_EQ(model.num_parameters(), embeddings + block + 2048);
  EXPECT_EQ(embeddings + 24 * block + 2048, 354871296);
}

TEST(Gpt, AttentionLayerMatchesTheCompositeFormula) {
  manual_seed(1);
  CausalSelfAttention attn(8, 2);
  Tensor x = randn({2, 5, 8});
  Tensor y = attn.forward(x);
  // Composite: q, k, v from c_attn, per head softmax(q k^T / sqrt(4) + causal mask) v.
  Tensor qkv = attn.c_attn->forward(x).view({2, 5, 3, 2, 4}).permute({2, 0, 3, 1, 4});
  Tensor q = qkv.select(0, 0), k = qkv.select(0, 1), v = qkv.select(0, 2);
  Tensor scores = mul(matmul(q, k.transpose(-2, -1)), 0.5);
  std::vector<float> mask_values(25);
  for (int i = 0; i < 5; ++i)
    for (int j = 0; j < 5; ++j) mask_values[size_t(i * 5 + j)] = j <= i ? 0.f : -1e9f;
  scores = add(scores, from_vector(mask_values, {5, 5}));
  Tensor ref = attn.c_proj->forward(matmul(softmax(scores, -1), v).transpose(1, 2).reshape({2, 5, 8}));
  auto a = y.to_vector<float>(), b = ref.to_vector<float>();
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-5) << i;
}

TEST(Gpt, TinyByteModelLearnsAShortTextOnTheCpu) {
  manual_seed(0);
  GPT model(GPTConfig::named("tiny"));
  const std::string text = "the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the lazy dog.";
  const int64_t T = 32, B = 4;
  std::vector<int64_t> in, out;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      in.push_back(static_cast<unsigned char>(text[size_t(b * 7 + t)]));
      out.push_back(static_cast<unsigned char>(text[size_t(b * 7 + t + 1)]));
    }
  Tensor ids = from_vector(in, {B, T}), targets = from_vector(out, {B, T});
  optim::AdamW opt(model.parameters(), {.lr = 3e-3, .weight_decay = 0.0});
  double first = 0, last = 0;
  for (int step = 0; step < 60; ++step) {
    opt.zero_grad();
    Tensor loss = model.loss(ids, targets);
    loss.backward();
    opt.step();
    (step == 0 ? first : last) = loss.item();
  }
  EXPECT_NEAR(first, std::log(256.0), 0.5);  // near uniform over bytes at the start
  EXPECT_LT(last, first / 4) << "loss " << first << " -> " << last;
}

// Whether the graph behind `t` holds a node named `name`.
bool graph_has(const Tensor& t, const std::string& name) {
  std::vector<Node*> stack = {t.grad_fn().get()};
  std::set<Node*> seen;
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    if (!n || !seen.insert(n).second) continue;
    if (n->name == name) return true;
    for (const Edge& e : n->next_edges) stack.push_back(e.node.get());
  }
  return false;
}

TEST(Gpt, RecomputedBlocksGiveTheSameLossAndGradientsInF64) {
  GPTConfig c = GPTConfig::named("tiny");
  c.context = 16;
  GPTConfig rc = c;
  rc.recompute = true;
  manual_seed(2);
  GPT plain(c);
  GPT recomputed(rc);
  recomputed.load_state_dict(plain.state_dict());
  plain.to(DType::f64);
  recomputed.to(DType::f64);
  const int64_t B = 3, T = 16;
  std::vector<int64_t> tokens(size_t(B * T));
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = int64_t(i * 37 + 11) % 256;
  Tensor ids = from_vector(tokens, {B, T});
  Tensor targets = ids.slice(1, 1, T).contiguous();
  Tensor inputs = ids.slice(1, 0, T - 1).contiguous();

  Tensor loss = plain.loss(inputs, targets);
  EXPECT_FALSE(graph_has(loss, "Recompute"));
  loss.backward();
  Tensor loss_rc = recomputed.loss(inputs, targets);
  EXPECT_TRUE(graph_has(loss_rc, "Recompute")) << "config.recompute must route the blocks through recompute()";
  loss_rc.backward();
  EXPECT_EQ(loss_rc.item(), loss.item());

  const NamedTensors p = plain.named_parameters(), r = recomputed.named_parameters();
  ASSERT_EQ(p.size(), r.size());
  for (size_t i = 0; i < p.size(); ++i) {
    ASSERT_TRUE(r[i].second.grad().defined()) << r[i].first << " got no gradient with recompute";
    ASSERT_EQ(r[i].second.grad().dtype(), DType::f64) << r[i].first;
    const std::vector<double> a = r[i].second.grad().to_vector<double>(), b = p[i].second.grad().to_vector<double>();
    for (size_t j = 0; j < a.size(); ++j) ASSERT_NEAR(a[j], b[j], 1e-12) << r[i].first << "[" << j << "]";
  }

  // In evaluation (or without grad mode) the blocks run plainly.
  recomputed.eval();
  EXPECT_FALSE(graph_has(recomputed.loss(inputs, targets), "Recompute"));
}

TEST(Gpt, RecomputedBlocksLowerThePeakMemoryOfAStepOnTheCpu) {
  // Four blocks over (8, 64) tokens; the CUDA suite checks the same on a larger model.
  auto peak_of_step = [](bool recompute) {
    GPTConfig c = GPTConfig::named("tiny");
    c.layers = 4;
    c.context = 64;
    c.recompute = recompute;
    manual_seed(0);
    GPT model(c);
    std::vector<int64_t> tokens(8 * 65);
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = int64_t(i * 37 + 11) % 256;
    Tensor ids = from_vector(tokens, {8, 65});
    Tensor inputs = ids.slice(1, 0, 64).contiguous(), targets = ids.slice(1, 1, 65).contiguous();
    const size_t base = memory::stats(Device::cpu()).allocated;
    memory::reset_peak(Device::cpu());
    model.loss(inputs, targets).backward();
    return memory::stats(Device::cpu()).peak_allocated - base;
  };
  const size_t plain = peak_of_step(false), recomputed = peak_of_step(true);
  EXPECT_LT(double(recomputed), 0.6 * double(plain)) << recomputed << " vs " << plain << " bytes";
}

}  // namespace
}  // namespace loom::nn
