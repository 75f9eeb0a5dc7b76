// CausalSelfAttention: GPT-2's attention layer with nanoGPT's module names. One Linear makes
// queries, keys and values together (c_attn: C -> 3C), the heads attend through the engine's
// fused packed_self_attention, reading that (B, T, 3C) output in place (nothing of size
// T x T is kept, and no layout copy is made), and c_proj (C -> C) mixes the heads back.
#pragma once

#include <memory>

#include "linear.h"

namespace loom::nn {

class CausalSelfAttention : public Module {
 public:
  // `causal` false gives plain (bidirectional) self-attention.
  CausalSelfAttention(int64_t embed_dim, int64_t num_heads, bool causal = true);

  // (B, T, C) -> (B, T, C)
  Tensor forward(const Tensor& x) override;
  // residual + forward(x), the sum made by the output projection's product (linear's
  // residual): a transformer block's residual stream without an add of its own.
  Tensor forward(const Tensor& x, const Tensor& residual);
  std::string type_name() const override { return "CausalSelfAttention"; }

  std::shared_ptr<Linear> c_attn, c_proj;

 private:
  int64_t embed_dim_, num_heads_;
  bool causal_;
};

}  // namespace loom::nn
