// GPT: GPT-2's architecture with nanoGPT's module names, so a nanoGPT or Hugging Face GPT-2
// state dict maps one to one ("transformer.h.0.attn.c_attn.weight", ...; Loom's Linear keeps
// PyTorch's (out, in) weight layout, so the Conv1D weights of Hugging Face checkpoints need a
// transpose). Token and position embeddings, pre-LayerNorm blocks (attention, then a GELU
// MLP four times wider), a final LayerNorm and an output layer tied to the token embedding.
// Initialisation follows GPT-2: N(0, 0.02) weights, zero biases, and the residual
// projections scaled by 1/sqrt(2 * layers).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "../attention.h"
#include "../embedding.h"
#include "../layer_norm.h"

namespace loom::nn {

struct GPTConfig {
  int64_t vocab_size = 50304;  // GPT-2's 50257, padded to a multiple of 64
  int64_t context = 1024;      // longest sequence (position embeddings)
  int64_t layers = 12, heads = 12, width = 768;
  // Activation recomputation (engine/recompute.h): in training with grad mode on, each
  // block's activations are dropped after its forward and recomputed in backward, so the
  // memory a block holds for backward drops to its input (B, T, C), for a second forward of
  // every block. Gradients are unchanged.
  bool recompute = false;
  // Rows of logits the loss makes at a time (linear_cross_entropy's chunk_rows): 0 lets it
  // choose (4096 rows at GPT-2's vocabulary, where a batch of 16 x 1024 tokens would hold
  // 1.6 GB of bf16 logits at once), a number at least B T keeps the batch in one chunk.
  int64_t loss_chunk_rows = 0;

  // "gpt2-124m" (12 x 768, 12 heads), "gpt2-350m" (24 x 1024, 16 heads: GPT-2 medium), "guide"
  // (the guide's six-block transformer: width 256, 8 heads), "tiny" (2 x 64, 4 heads, context
  // 256, byte vocabulary); unknown names throw.
  static GPTConfig named(const std::string& name);
};

// GELU's MLP with nanoGPT's names: c_fc, then gelu, then c_proj, run as one op (gelu_mlp)
// so the GELU and the bias gradients ride in the products' epilogues.
class GPTMlp : public Module {
 public:
  GPTMlp(int64_t width, double proj_std);
  Tensor forward(const Tensor& x) override { return forward(x, Tensor()); }
  // residual + forward(x), the sum made by c_proj's product.
  Tensor forward(const Tensor& x, const Tensor& residual);
  std::string type_name() const override { return "MLP"; }
  std::shared_ptr<Linear> c_fc, c_proj;
};

class GPTBlock : public Module {
 public:
  GPTBlock(int64_t width, int64_t heads, int64_t layers);
  Tensor forward(const Tensor& x) override;  // (B, T, C) -> (B, T, C)
  std::string type_name() const override { return "GPTBlock"; }

  std::shared_ptr<LayerNorm> ln_1, ln_2;
  std::shared_ptr<CausalSelfAttention> attn;
  std::shared_ptr<GPTMlp> mlp;
};

class GPT : public Module {
 public:
  explicit GPT(GPTConfig config);
  // Token ids (B, T), i64, T <= context -> logits (B, T, vocab).
  Tensor forward(const Tensor& ids) override;
  // Mean next-token cross-entropy of forward(ids) against targets (B, T).
  Tensor loss(const Tensor& ids, const Tensor& targets);
  std::string type_name() const override { return "GPT"; }
  const GPTConfig& config() const { return config_; }

  std::shared_ptr<Embedding> wte, wpe;
  std::vector<std::shared_ptr<GPTBlock>> blocks;
  std::shared_ptr<LayerNorm> ln_f;
  Tensor lm_head;  // the token embedding's weight, tied

 private:
  // The final LayerNorm's output (B, T, width) for token ids (B, T), in the dtype the output
  // layer's product reads.
  Tensor hidden(const Tensor& ids);
  GPTConfig config_;
};

}  // namespace loom::nn
