#include "parallel/guide_pipeline.h"

#include "layers/models/gpt_stage.h"

namespace loom::dist::pipeline {

TensorList GuidePipeline::parameters() const {
  TensorList out;
  for (const auto& m : modules)
    for (const Tensor& p : m->parameters()) out.push_back(p);
  return out;
}

GuidePipeline make_guide_pipeline(std::shared_ptr<ProcessGroup> group, const nn::GuideTransformerConfig& config,
                                  int64_t tokens, PipelineOptions options, std::vector<int64_t> cuts) {
  LOOM_CHECK(group != nullptr, "make_guide_pipeline: no process group");
  const int v = options.schedule == ScheduleKind::interleaved ? options.stages_per_rank : 1;
  const int stages = group->size() * v;
  cuts = stage_cuts(std::move(cuts), config.layers, stages);
  LOOM_CHECK(tokens >= 1, "pipeline: ", tokens, " tokens a sequence; expected 1 or more");

  GuidePipeline out;
  std::vector<Stage> built;
  for (int s = group->rank(); s < stages; s += group->size()) {
    const bool last = s == stages - 1;
    auto module = std::make_shared<nn::GuideTransformerStage>(config, cuts[size_t(s)], cuts[size_t(s) + 1], last);
    module->to(options.device);
    out.modules.push_back(module);
    Stage st;
    st.index = s;
    st.module = module;
    if (last)
      st.forward = [module](const Tensor& x, const Tensor& targets) { return module->loss(x, targets); };
    else
      st.forward = [module](const Tensor& x, const Tensor&) { return module->forward(x); };
    const int64_t T = tokens, C = config.width;
    st.input_shape = [T, C](int64_t rows) { return Shape{rows, T, C}; };
    st.output_shape = [T, C](int64_t rows) { return Shape{rows, T, C}; };
    built.push_back(std::move(st));
  }
  out.pipeline = std::make_unique<Pipeline>(group, std::move(built), options);
  return out;
}

}  // namespace loom::dist::pipeline
