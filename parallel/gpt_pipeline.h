// A GPT as a pipeline (parallel/pipeline.h): this rank builds only its stages (GPTStage,
// layers/models/gpt_stage.h), the blocks cut by `cuts`, and the token embedding of stage 0
// is tied to the output layer of the last stage without the caller doing anything.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "../layers/models/gpt_stage.h"
#include "pipeline.h"

namespace loom::dist::pipeline {

using GPTPipeline = ModelPipeline<nn::GPTStage>;

// `cuts`: where each of the schedule's stages begins, stages + 1 indices from 0 to
// config.layers (an even cut when empty: stage_cuts, parallel/pipeline.h). `sequence_length`:
// the T of every batch (the activations between stages are (rows, T, width)). The modules are
// moved to options.device. `prepare`, when given, runs on each stage module as it is built,
// before it moves and before options.shard shards it: where to set a dtype or load weights
// that the shards must start from.
GPTPipeline make_gpt_pipeline(std::shared_ptr<ProcessGroup> group, const nn::GPTConfig& config,
                              int64_t sequence_length, PipelineOptions options, std::vector<int64_t> cuts = {},
                              std::function<void(nn::GPTStage&)> prepare = {});

}  // namespace loom::dist::pipeline
