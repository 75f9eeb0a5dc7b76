#include "parallel/guide_pipeline.h"

namespace loom::dist::pipeline {

GuidePipeline make_guide_pipeline(std::shared_ptr<ProcessGroup> group, const nn::GuideTransformerConfig& config,
                                  int64_t tokens, PipelineOptions options, std::vector<int64_t> cuts) {
  return make_residual_pipeline<nn::GuideTransformerStage>(
      std::move(group), config.layers, tokens, config.width, options, std::move(cuts),
      [&](int, int64_t first_block, int64_t end_block, bool last) {
        return std::make_shared<nn::GuideTransformerStage>(config, first_block, end_block, last);
      });
}

}  // namespace loom::dist::pipeline
