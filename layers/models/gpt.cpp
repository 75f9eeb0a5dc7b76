#include "layers/models/gpt.h"

#include <cmath>

#include "engine/autograd.h"
#include "engine/ops.h"
#include "engine/recompute.h"
#include "layers/activation.h"

namespace loom::nn {
namespace {

// A module that only names its children, for nanoGPT's "transformer.h.0" paths.
class Container : public Module {
 public:
  std::string type_name() const override { return "ModuleDict"; }
};

// A Linear with GPT-2's initialisation: N(0, std) weight, zero bias.
std::shared_ptr<Linear> gpt_linear(int64_t in, int64_t out, double std) {
  auto l = std::make_shared<Linear>(in, out);
  NoGradGuard no_grad;
  normal_(l->weight, 0.0, std);
  fill_(l->bias, 0.0);
  return l;
}


}  // namespace

GPTMlp::GPTMlp(int64_t width, double proj_std) {
  c_fc = register_module("c_fc", gpt_linear(width, 4 * width, 0.02));
  c_proj = register_module("c_proj", gpt_linear(4 * width, width, proj_std));
}

Tensor GPTMlp::forward(const Tensor& x, const Tensor& residual) {
  return gelu_mlp(x, c_fc->weight, c_fc->bias, c_proj->weight, c_proj->bias, residual);
}

GPTConfig GPTConfig::named(const std::string& name) {
  if (name == "gpt2-124m") return {};
  if (name == "gpt2-350m") return {.layers = 24, .heads = 16, .width = 1024};
  if (name == "guide") return {.vocab_size = 256, .context = 256, .layers = 6, .heads = 8, .width = 256};
  if (name == "tiny") return {.vocab_size = 256, .context = 256, .layers = 2, .heads = 4, .width = 64};
  LOOM_FAIL("unknown GPT config '", name, "': expected gpt2-124m, gpt2-350m, guide or tiny");
}

GPTBlock::GPTBlock(int64_t width, int64_t heads, int64_t layers) {
  const double proj_std = 0.02 / std::sqrt(2.0 * double(layers));
  ln_1 = register_module("ln_1", std::make_shared<LayerNorm>(width));
  attn = register_module("attn", std::make_shared<CausalSelfAttention>(width, heads));
  {
    NoGradGuard no_grad;
    normal_(attn->c_attn->weight, 0.0, 0.02);
    fill_(attn->c_attn->bias, 0.0);
    normal_(attn->c_proj->weight, 0.0, proj_std);
    fill_(attn->c_proj->bias, 0.0);
  }
  ln_2 = register_module("ln_2", std::make_shared<LayerNorm>(width));
  mlp = register_module("mlp", std::make_shared<GPTMlp>(width, proj_std));
}

Tensor GPTBlock::forward(const Tensor& x) {
  // Each LayerNorm feeds a product: under autocast it writes bf16 itself (no separate cast).
  // Each residual sum is made by the branch's last product, in f32 beside bf16 products,
  // and the residual's gradient is added to the LayerNorm's inside its backward kernel.
  TensorList x_n = ln_1->tee_for_product(x);
  Tensor h = attn->forward(x_n[1], x_n[0]);
  TensorList h_n = ln_2->tee_for_product(h);
  return mlp->forward(h_n[1], h_n[0]);
}

GPT::GPT(GPTConfig config) : config_(config) {
  LOOM_CHECK(config.vocab_size > 0 && config.context > 0 && config.layers > 0, "GPT: vocabulary (",
             config.vocab_size, "), context (", config.context, ") and layers (", config.layers,
             ") must be positive");
  auto transformer = register_module("transformer", std::make_shared<Container>());
  wte = transformer->register_module("wte", std::make_shared<Embedding>(config.vocab_size, config.width));
  wpe = transformer->register_module("wpe", std::make_shared<Embedding>(config.context, config.width));
  {
    NoGradGuard no_grad;
    normal_(wte->weight, 0.0, 0.02);
    normal_(wpe->weight, 0.0, 0.02);
  }
  auto h = transformer->register_module("h", std::make_shared<Container>());
  for (int64_t i = 0; i < config.layers; ++i)
    blocks.push_back(h->register_module(std::to_string(i),
                                        std::make_shared<GPTBlock>(config.width, config.heads, config.layers)));
  ln_f = transformer->register_module("ln_f", std::make_shared<LayerNorm>(config.width));
  // Weight tying: the output layer is the token embedding, registered a second time (one
  // parameter, listed once by parameters(), under both names in the state dict).
  lm_head = wte->weight;
  register_module("lm_head", std::make_shared<Container>())->register_parameter("weight", lm_head);
}

Tensor GPT::hidden(const Tensor& ids) {
  LOOM_CHECK(ids.dim() == 2 && ids.dtype() == DType::i64, "GPT: expected token ids (B, T) of i64, got ",
             shape_str(ids.shape()), " ", dtype_name(ids.dtype()));
  const int64_t T = ids.size(1);
  LOOM_CHECK(T <= config_.context, "GPT: a sequence of ", T, " tokens is longer than the context of ",
             config_.context);
  Tensor x = token_position_embedding(wte->weight, wpe->weight, ids);  // wte[ids] + wpe[:T], one pass
  const bool recomputing = config_.recompute && grad_enabled() && is_training();
  for (const auto& block : blocks)
    x = recomputing ? recompute([block](const TensorList& in) { return block->forward(in[0]); }, {x})
                    : block->forward(x);
  return ln_f->forward_for_product(x);
}

Tensor GPT::forward(const Tensor& ids) { return matmul(hidden(ids), lm_head.t()); }

Tensor GPT::loss(const Tensor& ids, const Tensor& targets) {
  Tensor h = hidden(ids);
  LOOM_CHECK(targets.numel() == ids.numel(), "GPT: targets of shape ", shape_str(targets.shape()),
             " do not match token ids of shape ", shape_str(ids.shape()), " (one target a token)");
  // The output layer and the loss as one op: under autocast the bf16 logits are read once,
  // accumulating in f32, and their gradient is written over them (no f32 copy, no second
  // buffer), a chunk of rows at a time (config_.loss_chunk_rows).
  return linear_cross_entropy(h.reshape({-1, h.size(-1)}), lm_head, targets.reshape({-1}), -100, 0.0,
                              config_.loss_chunk_rows);
}

}  // namespace loom::nn
