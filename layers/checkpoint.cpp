// Training checkpoints: one safetensors file, model tensors under their own names, the
// optimizer's under "optimizer.", every scalar in the metadata as exact decimal text.
#include "layers/checkpoint.h"


#include "engine/ops.h"
#include "engine/serialization.h"
#include "layers/checkpoint_text.h"

namespace loom::nn {
namespace {

constexpr const char* kFormat = "loom-training-checkpoint";
const std::string kOptimizerPrefix = "optimizer.";

using checkpoint_text::exact;
using checkpoint_text::under;

}  // namespace

void save_checkpoint(const std::string& path, const TrainingCheckpoint& state) {
  LOOM_CHECK(state.model != nullptr, "save_checkpoint(", path, "): no model given");
  NamedTensors tensors = state.model->state_dict();
  for (const auto& [name, _] : tensors)
    LOOM_CHECK(!name.starts_with(kOptimizerPrefix), "save_checkpoint(", path, "): the model's entry '", name,
               "' starts with '", kOptimizerPrefix, "', which checkpoints reserve for the optimizer");
  std::map<std::string, std::string> meta{{"format", kFormat}};
  if (state.optimizer) {
    optim::OptimizerState o = state.optimizer->state_dict();
    for (auto& [name, t] : o.tensors) tensors.emplace_back(kOptimizerPrefix + name, t);
    for (const auto& [key, v] : o.scalars) meta["optimizer." + key] = exact(v);
    meta["optimizer"] = state.optimizer->type_name();
  }
  if (state.scheduler) checkpoint_text::write_schedule(meta, *state.scheduler);
  checkpoint_text::write_generator(meta);
  for (const auto& [key, v] : state.user) meta["user." + key] = v;
  save_safetensors(path, tensors, meta);
}

std::map<std::string, std::string> load_checkpoint(const std::string& path, const TrainingCheckpoint& state) {
  LOOM_CHECK(state.model != nullptr, "load_checkpoint(", path, "): no model given");
  SafetensorsFile file = load_safetensors(path);
  const auto& meta = file.metadata;
  auto format = meta.find("format");
  LOOM_CHECK(format != meta.end() && format->second == kFormat, path,
             ": not a Loom training checkpoint (its metadata has no format = ", kFormat,
             "); to start from a model's weights alone use them as initial weights instead");

  NamedTensors model_tensors;
  optim::OptimizerState optimizer_state;
  for (auto& [name, t] : file.tensors) {
    if (name.starts_with(kOptimizerPrefix))
      optimizer_state.tensors.emplace_back(name.substr(kOptimizerPrefix.size()), t);
    else
      model_tensors.emplace_back(name, t);
  }
  for (const auto& [key, v] : under(meta, "optimizer."))
    optimizer_state.scalars[key] = checkpoint_text::parse<double>(path, "optimizer." + key, v);
  const std::map<std::string, double> scheduler_state = checkpoint_text::read_schedule(meta, path);
  const auto generator = checkpoint_text::read_generator(meta, path);
  LOOM_CHECK(generator.has_value(), path, ": the checkpoint has no random generator state (rng.seed, rng.offset)");
  const auto [seed, offset] = *generator;
  if (state.optimizer) {
    auto type = meta.find("optimizer");
    LOOM_CHECK(type != meta.end(), path, ": the checkpoint holds no optimizer state, but this run uses ",
               state.optimizer->type_name());
    LOOM_CHECK(type->second == state.optimizer->type_name(), path, ": the checkpoint's optimizer is ", type->second,
               " but this run uses ", state.optimizer->type_name(), "; resume with the same --optimizer");
  }

  // The loads below check before they change anything; the model goes first because its
  // check (keys and shapes) is the one most likely to fail for a wrong file.
  try {
    state.model->load_state_dict(model_tensors, Strict::yes);
    if (state.optimizer) state.optimizer->load_state_dict(optimizer_state);
    if (state.scheduler) state.scheduler->load_state_dict(scheduler_state);
  } catch (const Error& e) {
    LOOM_FAIL(path, ": ", e.what());
  }
  set_rng_state(seed, offset);
  return under(meta, "user.");
}

void load_weights(const std::string& path, Module& model) {
  SafetensorsFile file = load_safetensors(path);
  NamedTensors weights;
  for (auto& [name, t] : file.tensors)
    if (!name.starts_with(kOptimizerPrefix)) weights.emplace_back(name, t);
  try {
    model.load_state_dict(weights, Strict::yes);
  } catch (const Error& e) {
    LOOM_FAIL(path, ": ", e.what());
  }
}

}  // namespace loom::nn
