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

Tensor CausalSelfAttention::forward(const Tensor& x) {
  LOOM_CHECK(x.dim() == 3 && x.size(2) == embed_dim_, "CausalSelfAttention(", embed_dim_,
             "): expected input (B, T, ", embed_dim_, "), got ", shape_str(x.shape()));
  const int64_t B = x.size(0), T = x.size(1), H = num_heads_, D = embed_dim_ / num_heads_;
  // (B, T, 3C) -> (3, B, H, T, D): one view and one copy for q, k and v together.
  Tensor qkv = c_attn->forward(x).view({B, T, 3, H, D}).permute({2, 0, 3, 1, 4}).contiguous();
  TensorList q_k_v = unbind(qkv, 0);
  Tensor y = scaled_dot_product_attention(q_k_v[0], q_k_v[1], q_k_v[2], causal_);
  return c_proj->forward(y.transpose(1, 2).reshape({B, T, embed_dim_}));
}

}  // namespace loom::nn
