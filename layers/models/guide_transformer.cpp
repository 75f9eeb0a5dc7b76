// The guide's transformer (guide_transformer.h): its blocks, the model that runs them
// through a BlockPlacement so the same forward serves the unsplit and the split model, and
// the stage that holds a range of them for a pipeline, with the same checks and loss.
#include "layers/models/guide_transformer.h"

#include <cmath>

#include "engine/autograd.h"
#include "engine/ops.h"
#include "layers/activation.h"

namespace loom::nn {
namespace {

// A module that only names its children ("blocks.0"), as PyTorch's nn.ModuleList.
class ModuleList : public Module {
 public:
  std::string type_name() const override { return "ModuleList"; }
};

void check_config(const GuideTransformerConfig& config, const char* who) {
  LOOM_CHECK(config.width > 0 && config.heads > 0 && config.layers > 0 && config.classes > 0, who, ": width (",
             config.width, "), heads (", config.heads, "), layers (", config.layers, ") and classes (", config.classes,
             ") must be positive");
  LOOM_CHECK(config.width % config.heads == 0, who, ": ", config.heads, " heads must divide the width ", config.width);
}

void check_input(const Tensor& x, int64_t width, const char* who) {
  LOOM_CHECK(x.dim() == 3 && x.size(2) == width && is_floating(x.dtype()), who, ": expected input (B, T, ", width,
             ") of floats, got ", shape_str(x.shape()), " ", dtype_name(x.dtype()));
}

// The mean cross-entropy of logits (B, T, classes) against one i64 class a position.
Tensor position_loss(const Tensor& logits, const Tensor& targets, const char* who) {
  LOOM_CHECK(targets.dim() == 2 && targets.size(0) == logits.size(0) && targets.size(1) == logits.size(1) &&
                 targets.dtype() == DType::i64,
             who, ": expected targets (", logits.size(0), ", ", logits.size(1),
             ") of i64 classes, one a position, got ", shape_str(targets.shape()), " ", dtype_name(targets.dtype()));
  return cross_entropy(logits.reshape({-1, logits.size(2)}), targets.to(logits.device()).reshape({-1}));
}

}  // namespace

GuideBlock::GuideBlock(int64_t width, int64_t heads) {
  attention = register_module("attention", std::make_shared<CausalSelfAttention>(width, heads, /*causal=*/false));
  {
    // nn.MultiheadAttention's initialisation: Xavier-uniform over the stacked (3C, C)
    // in_proj, zero in_proj and out_proj biases.
    NoGradGuard no_grad;
    const double bound = std::sqrt(6.0 / double(width + 3 * width));
    uniform_(attention->c_attn->weight, -bound, bound);
    fill_(attention->c_attn->bias, 0.0);
    fill_(attention->c_proj->bias, 0.0);
  }
  norm1 = register_module("norm1", std::make_shared<LayerNorm>(width));
  fc1 = std::make_shared<Linear>(width, 4 * width);
  fc2 = std::make_shared<Linear>(4 * width, width);
  feed_forward = register_module("feed_forward",
                                 std::make_shared<Sequential>(std::vector<std::shared_ptr<Module>>{
                                     fc1, std::make_shared<GELU>(), fc2}));
  norm2 = register_module("norm2", std::make_shared<LayerNorm>(width));
}

Tensor GuideBlock::forward(const Tensor& x) {
  // Post-norm: each residual sum is made by its branch's last product, then normalised.
  Tensor h = norm1->forward(attention->forward(x, x));
  return norm2->forward(gelu_mlp(h, fc1->weight, fc1->bias, fc2->weight, fc2->bias, h));
}

GuideTransformer::GuideTransformer(GuideTransformerConfig config) : config_(config) {
  check_config(config, "GuideTransformer");
  auto list = register_module("blocks", std::make_shared<ModuleList>());
  for (int64_t i = 0; i < config.layers; ++i)
    blocks.push_back(list->register_module(std::to_string(i), std::make_shared<GuideBlock>(config.width, config.heads)));
  output = register_module("output", std::make_shared<Linear>(config.width, config.classes));
  place({Device::cpu()}, PlacementPolicy::contiguous);
}

void GuideTransformer::place(const std::vector<Device>& devices, PlacementPolicy policy) {
  LOOM_CHECK(!devices.empty(), "GuideTransformer: no devices to place the model on");
  BlockPlacement::NamedModules named;
  for (size_t i = 0; i < blocks.size(); ++i) named.emplace_back("blocks." + std::to_string(i), blocks[i]);
  std::vector<Device> where = assign_devices(blocks.size(), devices, policy);
  named.emplace_back("output", output);
  where.push_back(devices.back());
  placement_ = BlockPlacement(std::move(named), std::move(where));
}

Tensor GuideTransformer::forward(const Tensor& x) {
  check_input(x, config_.width, "GuideTransformer");
  return placement_.forward(x);
}

Tensor GuideTransformer::loss(const Tensor& x, const Tensor& targets) {
  return position_loss(forward(x), targets, "GuideTransformer");
}

GuideTransformerStage::GuideTransformerStage(GuideTransformerConfig config, int64_t first_block, int64_t end_block,
                                             bool last)
    : config_(config), first_block_(first_block), end_block_(end_block) {
  check_config(config, "GuideTransformerStage");
  LOOM_CHECK(0 <= first_block && first_block <= end_block && end_block <= config.layers,
             "GuideTransformerStage: blocks [", first_block, ", ", end_block, ") are not a range of the model's ",
             config.layers, " blocks");
  LOOM_CHECK(first_block < end_block || last, "GuideTransformerStage: a stage that is not last holds no blocks [",
             first_block, ", ", end_block, ")");
  auto list = register_module("blocks", std::make_shared<ModuleList>());
  for (int64_t i = first_block; i < end_block; ++i)
    blocks.push_back(list->register_module(std::to_string(i), std::make_shared<GuideBlock>(config.width, config.heads)));
  if (last) output = register_module("output", std::make_shared<Linear>(config.width, config.classes));
}

Tensor GuideTransformerStage::forward(const Tensor& x) {
  check_input(x, config_.width, "GuideTransformerStage");
  Tensor h = x.to((blocks.empty() ? output->weight : blocks.front()->fc1->weight).device());
  for (const auto& block : blocks) h = block->forward(h);
  return output ? output->forward(h) : h;
}

Tensor GuideTransformerStage::loss(const Tensor& x, const Tensor& targets) {
  LOOM_CHECK(is_last(), "GuideTransformerStage: blocks [", first_block_, ", ", end_block_,
             ") are not the last stage, which alone holds the output layer and the loss");
  return position_loss(forward(x), targets, "GuideTransformerStage");
}

GuideSyntheticTask::GuideSyntheticTask(int64_t width, int64_t classes, uint64_t seed) {
  LOOM_CHECK(width > 0 && classes > 0, "GuideSyntheticTask: width (", width, ") and classes (", classes,
             ") must be positive");
  const auto saved = rng_state();
  manual_seed(seed);
  projection_ = randn({classes, width});
  set_rng_state(saved.first, saved.second);
}

GuideSyntheticTask::Batch GuideSyntheticTask::sample(int64_t batch, int64_t tokens) const {
  NoGradGuard no_grad;
  Tensor x = randn({batch, tokens, projection_.size(1)});                     // (B, T, C)
  Tensor scores = matmul(add(x, mean(x, {1}, /*keepdim=*/true)), projection_.t());  // (B, T, classes)
  return {x, argmax(scores, -1)};
}

}  // namespace loom::nn
