#include "parallel/gpt_pipeline.h"

namespace loom::dist::pipeline {

GPTPipeline make_gpt_pipeline(std::shared_ptr<ProcessGroup> group, const nn::GPTConfig& config,
                              int64_t sequence_length, PipelineOptions options, std::vector<int64_t> cuts,
                              std::function<void(nn::GPTStage&)> prepare) {
  LOOM_CHECK(sequence_length >= 1 && sequence_length <= config.context, "pipeline: sequence length ", sequence_length,
             " is outside 1..", config.context);
  // Sharded stages: the embeddings one unit, each block one, ln_f with the output layer the
  // root unit (as train_gpt --fsdp cuts the whole model).
  StageUnits<nn::GPTStage> units;
  if (options.shard && options.shard->units.empty() && options.shard->min_num_params == 0)
    units = [](nn::GPTStage& stage) {
      std::vector<std::vector<std::shared_ptr<nn::Module>>> out;
      if (stage.is_first()) out.push_back({stage.wte, stage.wpe});
      for (const auto& block : stage.blocks) out.push_back({block});
      return out;
    };
  GPTPipeline out = make_residual_pipeline<nn::GPTStage>(
      std::move(group), config.layers, sequence_length, config.width, options, std::move(cuts),
      [&](int stage, int64_t first_block, int64_t end_block, bool last) {
        auto module = std::make_shared<nn::GPTStage>(config, first_block, end_block, stage == 0, last);
        if (prepare) prepare(*module);
        return module;
      },
      units);
  // The tied embedding: stage 0's token embedding and the last stage's output layer, or
  // their shards (the same rows on both, as both are sharded over the same group).
  auto held = [](const Stage& s, const Tensor& full) { return s.sharded ? s.sharded->shard_of(full) : full; };
  Tensor first, last;
  for (const Stage& s : out.pipeline->stages()) {
    auto& m = dynamic_cast<nn::GPTStage&>(*s.module);
    if (m.is_first()) first = held(s, m.wte->weight);
    if (m.is_last()) last = held(s, m.lm_head);
  }
  out.pipeline->tie(first, last);
  return out;
}

}  // namespace loom::dist::pipeline
