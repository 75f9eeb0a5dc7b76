// The guide's transformer (layers/models/guide_transformer.h) as a pipeline
// (parallel/pipeline.h): this rank builds only its stages (GuideTransformerStage), the blocks
// cut by `cuts`, the last stage also the output layer and the loss. Every activation between
// stages is (rows, T, width) and no parameter is shared between stages, so nothing is tied.
#pragma once

#include <memory>
#include <vector>

#include "../layers/models/guide_transformer.h"
#include "pipeline.h"

namespace loom::dist::pipeline {

using GuidePipeline = ModelPipeline<nn::GuideTransformerStage>;

// `cuts`: where each of the schedule's stages begins, stages + 1 indices from 0 to
// config.layers (an even cut when empty: stage_cuts, parallel/pipeline.h). `tokens`: the T of
// every batch. The modules are moved to options.device (their dtype, which their activations
// take, stays the caller's).
GuidePipeline make_guide_pipeline(std::shared_ptr<ProcessGroup> group, const nn::GuideTransformerConfig& config,
                                  int64_t tokens, PipelineOptions options, std::vector<int64_t> cuts = {});

}  // namespace loom::dist::pipeline
