#include "parallel/gpt_pipeline.h"

#include <set>

namespace loom::dist::pipeline {

TensorList GPTPipeline::parameters() const {
  TensorList out;
  std::set<const void*> seen;
  for (const auto& m : modules)
    for (const Tensor& p : m->parameters())
      if (seen.insert(p.impl()).second) out.push_back(p);
  return out;
}

GPTPipeline make_gpt_pipeline(std::shared_ptr<ProcessGroup> group, const nn::GPTConfig& config,
                              int64_t sequence_length, PipelineOptions options, std::vector<int64_t> cuts) {
  LOOM_CHECK(group != nullptr, "make_gpt_pipeline: no process group");
  const int v = options.schedule == ScheduleKind::interleaved ? options.stages_per_rank : 1;
  const int stages = group->size() * v;
  cuts = stage_cuts(std::move(cuts), config.layers, stages);
  LOOM_CHECK(sequence_length >= 1 && sequence_length <= config.context, "pipeline: sequence length ", sequence_length,
             " is outside 1..", config.context);

  GPTPipeline out;
  std::vector<Stage> built;
  for (int s = group->rank(); s < stages; s += group->size()) {
    auto module = std::make_shared<nn::GPTStage>(config, cuts[size_t(s)], cuts[size_t(s) + 1], s == 0,
                                                 s == stages - 1);
    module->to(options.device);
    out.modules.push_back(module);
    Stage st;
    st.index = s;
    st.module = module;
    const int64_t T = sequence_length, C = config.width;
    if (module->is_last())
      st.forward = [module](const Tensor& x, const Tensor& targets) { return module->loss(x, targets); };
    else
      st.forward = [module](const Tensor& x, const Tensor&) { return module->forward(x); };
    st.input_shape = [T, C](int64_t rows) { return Shape{rows, T, C}; };
    st.output_shape = [T, C](int64_t rows) { return Shape{rows, T, C}; };
    built.push_back(std::move(st));
  }
  out.pipeline = std::make_unique<Pipeline>(group, std::move(built), options);
  Tensor first, last;
  for (const auto& m : out.modules) {
    if (m->is_first()) first = m->wte->weight;
    if (m->is_last()) last = m->lm_head;
  }
  out.pipeline->tie(first, last);
  return out;
}

}  // namespace loom::dist::pipeline
