// GPT: nanoGPT's module names and GPT-2's parameter count, the tied output layer, shapes, the
// attention layer against a composite softmax(QK^T / sqrt(D)) V, and a tiny byte-level GPT
// that learns a short text on the CPU (its loss falls four-fold).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>

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

}  // namespace
}  // namespace loom::nn
