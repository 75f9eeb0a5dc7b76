#include "parallel/gpt_pipeline.h"

namespace loom::dist::pipeline {

GPTPipeline make_gpt_pipeline(std::shared_ptr<ProcessGroup> group, const nn::GPTConfig& config,
                              int64_t sequence_length, PipelineOptions options, std::vector<int64_t> cuts) {
  LOOM_CHECK(sequence_length >= 1 && sequence_length <= config.context, "pipeline: sequence length ", sequence_length,
             " is outside 1..", config.context);
  GPTPipeline out = make_residual_pipeline<nn::GPTStage>(
      std::move(group), config.layers, sequence_length, config.width, options, std::move(cuts),
      [&](int stage, int64_t first_block, int64_t end_block, bool last) {
        return std::make_shared<nn::GPTStage>(config, first_block, end_block, stage == 0, last);
      });
  Tensor first, last;
  for (const auto& m : out.modules) {
    if (m->is_first()) first = m->wte->weight;
    if (m->is_last()) last = m->lm_head;
  }
  out.pipeline->tie(first, last);
  return out;
}

}  // namespace loom::dist::pipeline
