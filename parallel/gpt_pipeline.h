// A GPT as a pipeline (parallel/pipeline.h): this rank builds only its stages (GPTStage,
// layers/models/gpt_stage.h), the blocks cut by `cuts`, and the token embedding of stage 0
// is tied to the output layer of the last stage without the caller doing anything.
#pragma once

#include <memory>
#include <vector>

#include "../layers/models/gpt_stage.h"
#include "pipeline.h"

namespace loom::dist::pipeline {

using GPTPipeline = ModelPipeline<nn::GPTStage>;

// `cuts`: where each of the schedule's stages begins, stages + 1 indices from 0 to
// config.layers (an even cut when empty: stage_cuts, parallel/pipeline.h). `sequence_length`:
// the T of every batch (the activations between stages are (rows, T, width)). The modules are
// moved to options.device.
GPTPipeline make_gpt_pipeline(std::shared_ptr<ProcessGroup> group, const nn::GPTConfig& config,
                              int64_t sequence_length, PipelineOptions options, std::vector<int64_t> cuts = {});

}  // namespace loom::dist::pipeline
