#include "layers/attention.h"

#include "engine/ops.h"

namespace loom::nn {

CausalSelfAttention::CausalSelfAttention(int64_t embed_dim, int64_t num_heads, bool causal)
    : embed_dim_(embed_dim), num_heads_(num_heads), causal_(causal) {
  LOOM_CHECK(num_heads > 0 && embed_dim > 0 && embed_dim % num_heads == 0, "CausalSelfAttention: ", num_heads,
             " heads must divide the width ", embed_dim);
  c_attn = register_module("c_attn", std::make_shared<Linear>(embed_dim, 3 * embed_dim));
  c_proj = register_module("c_proj", std::make_shared<Linear>(embed_dim, embed_dim));
}

Tensor CausalSelfAttention::forward(const Tensor& x) { return forward(x, Tensor()); }

Tensor CausalSelfAttention::forward(const Tensor& x, const Tensor& residual) {
  LOOM_CHECK(x.dim() == 3 && x.size(2) == embed_dim_, "CausalSelfAttention(", embed_dim_,
             "): expected input (B, T, ", embed_dim_, "), got ", shape_str(x.shape()));
  // (B, T, 3C) -> (B, T, C): the kernels read the heads of q, k and v inside the projection's
  // output and write theirs side by side, so neither direction copies to change layout.
  return c_proj->forward(packed_self_attention(c_attn->forward(x), num_heads_, causal_), residual);
}

}  // namespace loom::nn
