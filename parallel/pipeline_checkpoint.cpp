// Pipeline checkpoints: the folder's layout and the save order are in pipeline_checkpoint.h.
// The stage modules already name their parameters as the whole model does, so a stage file
// is the stage's state dict; the optimizer's state, numbered per rank in its own state_dict,
// is filed under those names, so that it reads back whatever order the optimizer lists them.
#include "parallel/pipeline_checkpoint.h"

#include <cstdio>
#include <filesystem>
#include <set>
#include <sstream>
#include <unordered_map>

#include "engine/autograd.h"
#include "engine/ops.h"
#include "engine/serialization.h"
#include "layers/checkpoint_text.h"

namespace loom::dist::pipeline {

namespace {

// Pipeline checkpoints hold whole stages; a sharded stage's parameters exist only as shards.
void check_unsharded(const Pipeline& pipe, const std::string& dir, const char* what) {
  for (const Stage& stage : pipe.stages())
    LOOM_CHECK(!stage.sharded, what, "(", dir, "): stage ", stage.index,
               " is sharded (PipelineOptions::shard); pipeline checkpoints hold whole stages and do not take "
               "sharded ones yet");
}

namespace fs = std::filesystem;

// The same literal as samples/common/program.h's kPipelineCheckpoint (the library does not
// include the samples).
constexpr const char* kFormat = "loom-pipeline-1";
constexpr const char* kIndex = "index.safetensors";
const std::string kOptimizerPrefix = "optim.";

std::string stage_file(const std::string& dir, int64_t generation, int rank, int ranks) {
  char name[96];
  std::snprintf(name, sizeof(name), "stage-g%lld-%05d-of-%05d.safetensors", static_cast<long long>(generation), rank,
                ranks);
  return (fs::path(dir) / name).string();
}

namespace text = nn::checkpoint_text;

// The index of a saved checkpoint, checked to be one.
struct Index {
  std::string path;
  std::map<std::string, std::string> meta;
  int64_t generation = 0, ranks = 0, stages = 0;
};

Index read_index(const std::string& dir) {
  Index index;
  index.path = (fs::path(dir) / kIndex).string();
  LOOM_CHECK(fs::exists(index.path), "pipeline checkpoint: ", dir, " has no ", kIndex,
             " (not a pipeline checkpoint, or its first save never finished)");
  index.meta = load_safetensors_metadata(index.path);
  auto format = index.meta.find("format");
  LOOM_CHECK(format != index.meta.end() && format->second == kFormat, "pipeline checkpoint: ", index.path,
             " is of format '", format == index.meta.end() ? std::string() : format->second, "', expected ", kFormat);
  index.generation = text::parse<int64_t>(index.path, "generation", text::entry(index.meta, index.path, "generation"));
  index.ranks = text::parse<int64_t>(index.path, "pp", text::entry(index.meta, index.path, "pp"));
  index.stages = text::parse<int64_t>(index.path, "stages", text::entry(index.meta, index.path, "stages"));
  LOOM_CHECK(index.ranks >= 1 && index.ranks <= (int64_t(1) << 20) && index.stages >= index.ranks &&
                 index.stages % index.ranks == 0 && index.generation >= 1,
             "pipeline checkpoint: ", index.path, " says pp ", index.ranks, ", stages ", index.stages, ", generation ",
             index.generation, ": expected pp >= 1 and a whole number of stages per rank, generation >= 1");
  return index;
}

// The optimizer's parameter index (its state_dict numbering) -> the parameter's name in the
// whole model.
std::vector<std::string> optimizer_names(const optim::Optimizer& opt, const Pipeline& pipe) {
  nn::NamedTensors named;
  for (const Stage& stage : pipe.stages())
    for (auto& entry : stage.module->named_parameters()) named.push_back(entry);
  return opt.parameter_names(named, "this rank's stage parameters (the pipeline's parameters())");
}

// "state.<i>.<rest>" (an optimizer state_dict key) -> (i, rest).
std::pair<size_t, std::string> split_state_key(const std::string& key) {
  const size_t dot = key.find('.', 6);
  return {std::stoul(key.substr(6, dot - 6)), key.substr(dot + 1)};
}

Device device_of(const Pipeline& pipe) {
  for (const Stage& stage : pipe.stages())
    for (const Tensor& p : stage.module->parameters()) return p.device();
  return Device::cpu();
}

// The generation of this save: one more than the finished checkpoint's in `dir`, as world
// rank 0 reads it, sent to every rank. A folder holding another kind of checkpoint stops
// every rank (generation 0 stands for that), rank 0 naming what it found.
int64_t next_generation(const std::string& dir, ProcessGroup& world, Device device) {
  int64_t generation = 1;
  std::string refused;
  const std::string index = (fs::path(dir) / kIndex).string();
  if (world.rank() == 0 && fs::exists(index)) {
    try {
      generation = read_index(dir).generation + 1;
    } catch (const Error& e) {
      refused = e.what();
      generation = 0;
    }
  }
  Tensor g = from_vector(std::vector<int64_t>{generation}, {1}).to(device);
  world.broadcast(g, 0)->wait();
  generation = int64_t(g.item());
  LOOM_CHECK(generation > 0, "save_pipeline_checkpoint(", dir, "): its ", kIndex,
             " is not a pipeline checkpoint's, so saving there would mix two checkpoints: save into a new or empty "
             "folder", refused.empty() ? " (world rank 0 read it)" : " (" + refused + ")");
  return generation;
}

void write_stage_file(const std::string& dir, int64_t generation, const PipelineCheckpoint& state) {
  const Pipeline& pipe = *state.pipeline;
  const int ranks = pipe.schedule().ranks;
  nn::NamedTensors tensors;
  std::map<std::string, std::string> meta{{"pp_rank", std::to_string(pipe.rank())}, {"pp", std::to_string(ranks)}};
  for (const Stage& stage : pipe.stages()) {
    std::string names;
    for (const auto& [name, t] : stage.module->state_dict()) {
      LOOM_CHECK(!name.starts_with(kOptimizerPrefix), "save_pipeline_checkpoint(", dir, "): stage ", stage.index,
                 "'s entry '", name, "' starts with '", kOptimizerPrefix, "', which the files keep for the optimizer");
      tensors.emplace_back(name, t);
      names += (names.empty() ? "" : ",") + name;
    }
    meta["stage." + std::to_string(stage.index)] = names;
  }
  if (state.optimizer) {
    const optim::OptimizerState opt = state.optimizer->state_dict();
    const std::vector<std::string> names = optimizer_names(*state.optimizer, pipe);
    for (const auto& [key, t] : opt.tensors) {
      auto [i, buffer] = split_state_key(key);
      tensors.emplace_back(kOptimizerPrefix + names.at(i) + "." + buffer, t);
    }
    for (const auto& [key, v] : opt.scalars) {
      if (key.starts_with("state.")) meta["step." + names.at(split_state_key(key).first)] = text::exact(v);
      else if (key.ends_with(".size")) meta[key] = text::exact(v);  // this rank's group sizes
    }
  }
  text::write_generator(meta);
  save_safetensors(stage_file(dir, generation, pipe.rank(), ranks), tensors, meta);
}

void write_index(const std::string& dir, int64_t generation, const PipelineCheckpoint& state) {
  const Schedule& schedule = state.pipeline->schedule();
  std::map<std::string, std::string> meta{{"format", kFormat},
                                          {"generation", std::to_string(generation)},
                                          {"pp", std::to_string(schedule.ranks)},
                                          {"stages", std::to_string(schedule.stages)}};
  if (state.optimizer) {
    meta["optimizer"] = state.optimizer->type_name();
    for (const auto& [key, v] : state.optimizer->state_dict().scalars)
      if (key.starts_with("param_groups.") && !key.ends_with(".size")) meta[key] = text::exact(v);
  }
  if (state.scheduler) text::write_schedule(meta, *state.scheduler);
  text::write_generator(meta);
  for (const auto& [key, v] : state.user) meta["user." + key] = v;
  save_safetensors((fs::path(dir) / kIndex).string(), {}, meta);
}

// The stage files of every generation but `generation`: older checkpoints, and saves that
// never finished. No index names them.
void remove_other_generations(const std::string& dir, int64_t generation) {
  const std::string keep = "stage-g" + std::to_string(generation) + "-";
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string file = entry.path().filename().string();
    if (file.starts_with("stage-g") && !file.starts_with(keep)) fs::remove(entry.path());
  }
}

// Where the checkpoint's entries are: every stage file's list of names, read from the files'
// headers alone, in stage order, which is the whole model's state-dict order. A name listed
// twice is taken once, from its first file.
struct SavedNames {
  std::vector<std::string> order;
  std::map<std::string, size_t> position;  // in `order`
  std::map<std::string, int> rank_of;      // the pipeline rank whose file holds it
};

SavedNames saved_names(const std::string& dir, const Index& index) {
  SavedNames out;
  std::map<int, std::map<std::string, std::string>> headers;
  for (int64_t s = 0; s < index.stages; ++s) {
    const int rank = int(s % index.ranks);
    const std::string file = stage_file(dir, index.generation, rank, int(index.ranks));
    if (!headers.count(rank)) {
      LOOM_CHECK(fs::exists(file), "pipeline checkpoint: ", file, ", which ", index.path, " names, is missing");
      headers[rank] = load_safetensors_metadata(file);
    }
    for (const std::string& name : text::split_list(text::entry(headers[rank], file, "stage." + std::to_string(s))))
      if (out.rank_of.emplace(name, rank).second) {
        out.position[name] = out.order.size();
        out.order.push_back(name);
      }
  }
  return out;
}

// One stage's entries from the files that hold them, checked against the stage's module: every
// name there with the same shape, and the stage's names a run of the saved model's order (the
// run starting it on stage 0, ending it on the last stage), so that a model the checkpoint
// holds more of than this run does is not loaded in part.
nn::NamedTensors saved_stage(const Stage& stage, bool last, const std::string& dir, const Index& index,
                             const SavedNames& saved, const std::map<std::string, const Tensor*>& by_name) {
  const std::string layout = " (saved by " + std::to_string(index.ranks) + " pipeline ranks of " +
                             std::to_string(index.stages) + " stages in all)";
  nn::NamedTensors out;
  size_t previous = 0;
  for (const auto& [name, t] : stage.module->state_dict()) {
    auto at = saved.position.find(name);
    LOOM_CHECK(at != saved.position.end(), "pipeline checkpoint: ", dir, " holds no ", name, ", which stage ",
               stage.index, " of this run needs", layout, ": another model config?");
    const Tensor& found = *by_name.at(name);
    LOOM_CHECK(found.shape() == t.shape(), "pipeline checkpoint: ", name, " has shape ", shape_str(found.shape()),
               " in ", dir, " but ", shape_str(t.shape()), " in stage ", stage.index, " of this run (another model "
               "config?)");
    if (out.empty()) {
      LOOM_CHECK(stage.index != 0 || at->second == 0, "pipeline checkpoint: ", dir, " holds ", saved.order.front(),
                 " before ", name, ", the first entry of this run's stage 0", layout, ": another model config?");
    } else {
      LOOM_CHECK(at->second == previous + 1, "pipeline checkpoint: ", dir, " holds ",
                 saved.order[std::min(previous + 1, saved.order.size() - 1)], " after ", out.back().first,
                 ", where this run's stage ", stage.index, " goes on with ", name, layout, ": another model config?");
    }
    previous = at->second;
    out.emplace_back(name, found);
  }
  LOOM_CHECK(!last || out.empty() || previous + 1 == saved.order.size(), "pipeline checkpoint: ", dir, " holds ",
             saved.order[std::min(previous + 1, saved.order.size() - 1)], " after ",
             out.empty() ? std::string() : out.back().first, ", the last entry of this run's last stage", layout,
             ": another model config?");
  return out;
}

// This rank's optimizer state from the files that hold its parameters and the index, in the
// optimizer's own numbering, each buffer checked against its parameter's shape.
optim::OptimizerState saved_optimizer(const optim::Optimizer& opt, const Pipeline& pipe, const Index& index,
                                      const SavedNames& saved, const std::map<int, SafetensorsFile>& files,
                                      const std::string& dir, const std::map<std::string, const Tensor*>& by_name) {
  LOOM_CHECK(index.meta.count("optimizer"), "pipeline checkpoint: ", index.path,
             " holds no optimizer state, and this run steps ", opt.type_name());
  const std::string& type = index.meta.at("optimizer");
  LOOM_CHECK(type == opt.type_name(), "pipeline checkpoint: ", index.path, " holds the state of ", type,
             ", but this run uses ", opt.type_name());
  optim::OptimizerState state;
  for (const auto& [key, v] : index.meta)
    if (key.starts_with("param_groups.")) state.scalars[key] = text::parse<double>(index.path, key, v);
  // The group sizes are this rank's own: its stages hold these parameters, whichever ranks
  // held them when saved.
  for (size_t g = 0; g < opt.param_groups().size(); ++g)
    state.scalars["param_groups." + std::to_string(g) + ".size"] = double(opt.param_groups()[g].params.size());
  const std::vector<std::string> names = optimizer_names(opt, pipe);
  std::vector<Shape> shapes;
  for (const auto& group : opt.param_groups())
    for (const Tensor& p : group.params) shapes.push_back(p.shape());
  for (size_t i = 0; i < names.size(); ++i) {
    auto holder = saved.rank_of.find(names[i]);
    LOOM_CHECK(holder != saved.rank_of.end(), "pipeline checkpoint: ", dir, " holds no ", names[i],
               ", which this run's optimizer steps");
    const std::string file = stage_file(dir, index.generation, holder->second, int(index.ranks));
    const auto& metadata = files.at(holder->second).metadata;
    auto step = metadata.find("step." + names[i]);
    if (step == metadata.end()) continue;  // never stepped
    const std::string key = "state." + std::to_string(i) + ".";
    state.scalars[key + "step"] = text::parse<double>(file, step->first, step->second);
    const std::string prefix = kOptimizerPrefix + names[i] + ".";
    for (auto it = by_name.lower_bound(prefix); it != by_name.end() && it->first.starts_with(prefix); ++it) {
      const std::string buffer = it->first.substr(prefix.size());
      if (buffer.find('.') != std::string::npos) continue;  // another parameter's, whose name extends this one
      LOOM_CHECK(it->second->shape() == shapes[i], "pipeline checkpoint: ", it->first, " has shape ",
                 shape_str(it->second->shape()), " in ", file, " but its parameter has shape ",
                 shape_str(shapes[i]));
      state.tensors.emplace_back(key + buffer, *it->second);
    }
  }
  return state;
}

}  // namespace

void save_pipeline_checkpoint(const std::string& dir, const PipelineCheckpoint& state) {
  LOOM_CHECK(state.pipeline != nullptr && state.world != nullptr, "save_pipeline_checkpoint(", dir,
             "): give the pipeline and the world group (every rank of every pipeline)");
  check_unsharded(*state.pipeline, dir, "save_pipeline_checkpoint");
  ProcessGroup& world = *state.world;
  fs::create_directories(dir);
  const int64_t generation = next_generation(dir, world, device_of(*state.pipeline));
  if (state.replica == 0) write_stage_file(dir, generation, state);
  world.barrier()->wait();
  if (world.rank() == 0) {
    write_index(dir, generation, state);
    remove_other_generations(dir, generation);
  }
  world.barrier()->wait();
}

std::map<std::string, std::string> load_pipeline_checkpoint(const std::string& dir, const PipelineCheckpoint& state) {
  LOOM_CHECK(state.pipeline != nullptr, "load_pipeline_checkpoint(", dir, "): no pipeline given");
  check_unsharded(*state.pipeline, dir, "load_pipeline_checkpoint");
  NoGradGuard no_grad;
  const Pipeline& pipe = *state.pipeline;
  const Index index = read_index(dir);
  const SavedNames saved = saved_names(dir, index);
  // The files holding what this rank's stages and optimizer need, each read once; a name is
  // taken from the first file that lists it (by_name keeps the first).
  std::map<int, SafetensorsFile> files;
  auto read = [&](int rank) {
    if (!files.count(rank))
      files.emplace(rank, load_safetensors(stage_file(dir, index.generation, rank, int(index.ranks))));
  };
  for (const Stage& stage : pipe.stages())
    for (const auto& [name, t] : stage.module->state_dict())
      if (auto holder = saved.rank_of.find(name); holder != saved.rank_of.end()) read(holder->second);
  // This pipeline rank's generator is the one its rank saved, or, for a rank the saving
  // pipeline did not have, world rank 0's (the index's), as a single-file checkpoint gives it.
  const bool saved_rank = pipe.rank() < index.ranks;
  if (saved_rank) read(pipe.rank());
  // Each entry from its holder's file: a parameter's optimizer buffers
  // ("optim.<name>.<buffer>") come with the parameter.
  auto held_by = [&](const std::string& entry, int rank) {
    std::string name = entry;
    if (name.starts_with(kOptimizerPrefix))
      name = name.substr(kOptimizerPrefix.size(), name.rfind('.') - kOptimizerPrefix.size());
    auto holder = saved.rank_of.find(name);
    return holder != saved.rank_of.end() && holder->second == rank;
  };
  std::map<std::string, const Tensor*> by_name;
  for (const auto& [rank, file] : files)
    for (const auto& [name, t] : file.tensors)
      if (held_by(name, rank)) by_name.emplace(name, &t);

  // Everything is read and checked first; nothing changes until all of it passed.
  std::vector<nn::NamedTensors> stages;
  for (const Stage& stage : pipe.stages())
    stages.push_back(saved_stage(stage, stage.index == pipe.schedule().stages - 1, dir, index, saved, by_name));
  optim::OptimizerState opt_state;
  if (state.optimizer) opt_state = saved_optimizer(*state.optimizer, pipe, index, saved, files, dir, by_name);
  const std::map<std::string, double> schedule_state = text::read_schedule(index.meta, index.path);
  LOOM_CHECK(!state.scheduler || !schedule_state.empty(), "pipeline checkpoint: ", index.path,
             " holds no learning-rate schedule, and this run has one");
  const std::string generator_file =
      saved_rank ? stage_file(dir, index.generation, pipe.rank(), int(index.ranks)) : index.path;
  const auto generator = text::read_generator(saved_rank ? files.at(pipe.rank()).metadata : index.meta, generator_file);
  LOOM_CHECK(generator.has_value(), "pipeline checkpoint: ", generator_file, " has no random generator state");

  // The optimizer and the schedule check their own state before they change; the stages'
  // entries were checked above.
  try {
    if (state.optimizer) state.optimizer->load_state_dict(opt_state);
    if (state.scheduler) state.scheduler->load_state_dict(schedule_state);
    for (size_t i = 0; i < stages.size(); ++i) pipe.stages()[i].module->load_state_dict(stages[i], nn::Strict::yes);
  } catch (const Error& e) {
    LOOM_FAIL("pipeline checkpoint: ", dir, ": ", e.what());
  }
  set_rng_state(generator->first, generator->second);
  return text::under(index.meta, "user.");
}

int64_t resumed_pipeline_step(int64_t saved_pipelines, int64_t pipelines, int64_t epoch, int64_t batch, int64_t step,
                              int64_t steps_per_epoch, optim::LRScheduler& schedule) {
  if (saved_pipelines == pipelines) return step;
  LOOM_CHECK(batch == 0, "pipeline checkpoint: saved by ", saved_pipelines, " data-parallel pipelines within epoch ",
             epoch + 1, " (at batch ", batch, "), resumed by ", pipelines, ": within an epoch the data position is a "
             "place in each pipeline's shard of the data; resume with ", saved_pipelines, " pipelines");
  const int64_t moved = epoch * steps_per_epoch;
  std::map<std::string, double> state = schedule.state_dict();
  state["last_step"] = double(moved);
  schedule.load_state_dict(state);
  return moved;
}

void export_pipeline_checkpoint(const std::string& dir, const std::string& path) {
  const Index index = read_index(dir);
  std::vector<SafetensorsFile> files;
  std::vector<std::map<std::string, const Tensor*>> by_name(size_t(index.ranks));
  for (int r = 0; r < index.ranks; ++r) {
    const std::string file = stage_file(dir, index.generation, r, int(index.ranks));
    LOOM_CHECK(fs::exists(file), "pipeline checkpoint: ", file, ", which ", index.path, " names, is missing");
    files.push_back(load_safetensors(file));
  }
  for (int r = 0; r < index.ranks; ++r)
    for (const auto& [name, t] : files[size_t(r)].tensors) by_name[size_t(r)].emplace(name, &t);
  // Stage s is on rank s % pp (pipeline_schedule.h); its names in the order it listed them,
  // so the stages in order give the whole model's state-dict order.
  nn::NamedTensors out;
  std::set<std::string> seen;
  for (int64_t s = 0; s < index.stages; ++s) {
    const int rank = int(s % index.ranks);
    const std::string file = stage_file(dir, index.generation, rank, int(index.ranks));
    const SafetensorsFile& saved = files[size_t(rank)];
    for (const std::string& name : text::split_list(text::entry(saved.metadata, file, "stage." + std::to_string(s)))) {
      LOOM_CHECK(seen.insert(name).second, "pipeline checkpoint: ", name, " is held by two stages of ", dir);
      auto found = by_name[size_t(rank)].find(name);
      LOOM_CHECK(found != by_name[size_t(rank)].end(), "pipeline checkpoint: ", file, " lists ", name, " in stage ",
                 s, " but holds no such tensor");
      out.emplace_back(name, *found->second);
    }
  }
  save_safetensors(path, out);
}

}  // namespace loom::dist::pipeline
