#include "layers/models/gpt_stage.h"

#include "engine/autograd.h"
#include "engine/ops.h"
#include "engine/recompute.h"

namespace loom::nn {
namespace {

// A module that only names its children, for GPT's "transformer.h.0" paths.
class Names : public Module {
 public:
  std::string type_name() const override { return "ModuleDict"; }
};

}  // namespace

GPTStage::GPTStage(GPTConfig config, int64_t first_block, int64_t end_block, bool first, bool last)
    : config_(config), first_block_(first_block), end_block_(end_block), first_(first), last_(last) {
  LOOM_CHECK(0 <= first_block && first_block <= end_block && end_block <= config.layers, "GPTStage: blocks [",
             first_block, ", ", end_block, ") are not a range of the model's ", config.layers, " blocks");
  LOOM_CHECK(first_block < end_block || first || last, "GPTStage: a middle stage with no blocks [", first_block, ", ",
             end_block, ")");
  auto transformer = register_module("transformer", std::make_shared<Names>());
  if (first) {
    wte = transformer->register_module("wte", std::make_shared<Embedding>(config.vocab_size, config.width));
    wpe = transformer->register_module("wpe", std::make_shared<Embedding>(config.context, config.width));
    NoGradGuard no_grad;
    normal_(wte->weight, 0.0, 0.02);
    normal_(wpe->weight, 0.0, 0.02);
  }
  auto h = transformer->register_module("h", std::make_shared<Names>());
  for (int64_t i = first_block; i < end_block; ++i)
    blocks.push_back(h->register_module(std::to_string(i),
                                        std::make_shared<GPTBlock>(config.width, config.heads, config.layers)));
  if (last) {
    ln_f = transformer->register_module("ln_f", std::make_shared<LayerNorm>(config.width));
    if (first) {
      lm_head = wte->weight;
    } else {
      lm_head = Tensor::empty({config.vocab_size, config.width});
      NoGradGuard no_grad;
      normal_(lm_head, 0.0, 0.02);
    }
    register_module("lm_head", std::make_shared<Names>())->register_parameter("weight", lm_head);
  }
}

Tensor GPTStage::run_blocks(Tensor x) {
  const bool recomputing = config_.recompute && grad_enabled() && is_training();
  for (const auto& block : blocks)
    x = recomputing ? recompute([block](const TensorList& in) { return block->forward(in[0]); }, {x})
                    : block->forward(x);
  return x;
}

Tensor GPTStage::forward(const Tensor& x) {
  LOOM_CHECK(!last_, "GPTStage: the last stage gives the loss; call loss(x, targets)");
  if (first_) {
    LOOM_CHECK(x.dim() == 2 && x.dtype() == DType::i64, "GPTStage: the first stage expects token ids (B, T) of i64, got ",
               shape_str(x.shape()), " ", dtype_name(x.dtype()));
    LOOM_CHECK(x.size(1) <= config_.context, "GPTStage: a sequence of ", x.size(1), " tokens is longer than the context of ",
               config_.context);
    return run_blocks(token_position_embedding(wte->weight, wpe->weight, x));
  }
  LOOM_CHECK(x.dim() == 3 && x.size(2) == config_.width, "GPTStage: expected the residual stream (B, T, ", config_.width,
             "), got ", shape_str(x.shape()));
  return run_blocks(x);
}

Tensor GPTStage::loss(const Tensor& x, const Tensor& targets) {
  LOOM_CHECK(last_, "GPTStage: only the last stage computes the loss");
  Tensor h = first_ ? run_blocks(token_position_embedding(wte->weight, wpe->weight, x)) : run_blocks(x);
  h = ln_f->forward_for_product(h);
  LOOM_CHECK(targets.numel() == h.numel() / h.size(-1), "GPTStage: targets of shape ", shape_str(targets.shape()),
             " do not match the stage's ", shape_str(h.shape()), " (one target a token)");
  return linear_cross_entropy(h.reshape({-1, h.size(-1)}), lm_head, targets.reshape({-1}), -100, 0.0,
                              config_.loss_chunk_rows);
}

}  // namespace loom::nn
