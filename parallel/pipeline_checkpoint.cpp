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
#include <unordered_set>
#include <utility>

#include "engine/autograd.h"
#include "engine/ops.h"
#include "engine/serialization.h"
#include "layers/checkpoint_text.h"
#include "parallel/checkpoint_files.h"

namespace loom::dist::pipeline {

namespace {

namespace fs = std::filesystem;

// The same literal as samples/common/program.h's kPipelineCheckpoint (the library does not
// include the samples).
constexpr const char* kFormat = "loom-pipeline-1";
constexpr const char* kIndex = "index.safetensors";
const std::string kOptimizerPrefix = "optim.";

// Pipeline rank `rank`'s file; a sharded stage's data-parallel rank `shard` of `shards` writes
// its own rows ("...-of-00002-shard-00001-of-00004.safetensors"), an unsharded one the whole.
std::string stage_file(const std::string& dir, int64_t generation, int rank, int ranks, int shard = 0,
                       int shards = 1) {
  char name[128];
  if (shards == 1)
    std::snprintf(name, sizeof(name), "stage-g%lld-%05d-of-%05d.safetensors", static_cast<long long>(generation), rank,
                  ranks);
  else
    std::snprintf(name, sizeof(name), "stage-g%lld-%05d-of-%05d-shard-%05d-of-%05d.safetensors",
                  static_cast<long long>(generation), rank, ranks, shard, shards);
  return (fs::path(dir) / name).string();
}

// How this rank's stages are written: unsharded, whole (shards 1); sharded (fsdp.h), as its
// rows among the stage's data-parallel group's.
struct ShardPlace {
  int shard = 0, shards = 1;
};
ShardPlace shard_place(const Pipeline& pipe) {
  for (const Stage& stage : pipe.stages())
    if (stage.sharded) return {stage.sharded->group().rank(), stage.sharded->group().size()};
  return {};
}

// Of whole stages the first replica (data-parallel coordinate 0) writes the file; of sharded
// ones every rank of the first replica's shard group (HSDP's other replicas hold the same rows).
bool writes_stage_file(const PipelineCheckpoint& state) {
  for (const Stage& stage : state.pipeline->stages())
    if (stage.sharded && stage.sharded->group().size() > 1)
      return !stage.sharded->replicate_group() || stage.sharded->replicate_group()->rank() == 0;
  return state.replica == 0;
}


namespace text = nn::checkpoint_text;

// The index of a saved checkpoint, checked to be one.
struct Index {
  std::string path;
  std::map<std::string, std::string> meta;
  int64_t generation = 0, ranks = 0, stages = 0;
  int shards = 1;  // the files each pipeline rank's stages are cut into (sharded stages)
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
  if (auto shards = index.meta.find("shards"); shards != index.meta.end()) {
    const int64_t n = text::parse<int64_t>(index.path, "shards", shards->second);
    LOOM_CHECK(n >= 1 && n <= (int64_t(1) << 20), "pipeline checkpoint: ", index.path, " says shards ", n,
               ": expected 1 to 2^20");
    index.shards = int(n);
  }
  return index;
}

// The optimizer's parameter index (its state_dict numbering) -> the parameter's name in the
// whole model.
std::vector<std::string> optimizer_names(const optim::Optimizer& opt, const Pipeline& pipe) {
  nn::NamedTensors named;
  for (const Stage& stage : pipe.stages())
    for (auto& entry : stage.sharded ? stage.sharded->named_parameters() : stage.module->named_parameters())
      named.push_back(entry);
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
// every rank, rank 0 naming what it found.
int64_t next_generation(const std::string& dir, ProcessGroup& world, Device device) {
  return agree_on_generation(
      dir, (fs::path(dir) / kIndex).string(), world, device,
      [&](const std::string&) {
        try {
          return read_index(dir).generation;
        } catch (const Error& e) {
          LOOM_FAIL(e.what(), "; saving into ", dir, " would mix two checkpoints: save into a new or empty folder");
        }
      },
      "save_pipeline_checkpoint(" + dir + ")");
}

// A sharded stage's shards by the storage of the module's parameter, so that a state-dict
// entry (a tied name included) finds its shard; empty for a whole stage.
std::unordered_map<const Storage*, Tensor> shards_by_storage(const Stage& stage) {
  std::unordered_map<const Storage*, Tensor> out;
  if (stage.sharded)
    for (const auto& [name, p] : stage.module->named_parameters())
      out.emplace(p.storage().get(), stage.sharded->shard_of(p));
  return out;
}

void write_stage_file(const std::string& dir, int64_t generation, const PipelineCheckpoint& state) {
  const Pipeline& pipe = *state.pipeline;
  const int ranks = pipe.schedule().ranks;
  const ShardPlace place = shard_place(pipe);
  nn::NamedTensors tensors;
  std::map<std::string, std::string> meta{{"pp_rank", std::to_string(pipe.rank())},
                                          {"pp", std::to_string(ranks)},
                                          {"shard", std::to_string(place.shard)},
                                          {"shards", std::to_string(place.shards)}};
  for (const Stage& stage : pipe.stages()) {
    // A sharded stage's parameters go in as this rank's rows, each with its whole shape; its
    // buffers, which every rank holds, whole.
    const std::unordered_map<const Storage*, Tensor> rows = shards_by_storage(stage);
    // A parameter the state dict lists under a second name (a stage holding both ends of
    // GPT's tied embedding: "lm_head.weight") is "tied.<alias>" = its parameter name, under
    // which the optimizer's state is filed.
    std::unordered_map<const Storage*, std::string> parameter_name;
    for (const auto& [name, p] : stage.module->named_parameters()) parameter_name.emplace(p.storage().get(), name);
    std::string names;
    for (const auto& [name, t] : stage.module->state_dict()) {
      if (auto it = parameter_name.find(t.storage().get()); it != parameter_name.end() && it->second != name)
        meta["tied." + name] = it->second;
      LOOM_CHECK(!name.starts_with(kOptimizerPrefix), "save_pipeline_checkpoint(", dir, "): stage ", stage.index,
                 "'s entry '", name, "' starts with '", kOptimizerPrefix, "', which the files keep for the optimizer");
      if (auto shard = rows.find(t.storage().get()); shard != rows.end()) {
        tensors.emplace_back(name, shard->second);
        meta["shape." + name] = text::shape_text(t.shape());
      } else {
        tensors.emplace_back(name, t);
      }
      names += (names.empty() ? "" : ",") + name;
    }
    meta["stage." + std::to_string(stage.index)] = names;
  }
  if (state.optimizer) {
    // A shard's optimizer buffers have the shard's shape: they are the same rows of the
    // parameter's whole buffers.
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
  save_safetensors(stage_file(dir, generation, pipe.rank(), ranks, place.shard, place.shards), tensors, meta);
}

void write_index(const std::string& dir, int64_t generation, const PipelineCheckpoint& state) {
  const Schedule& schedule = state.pipeline->schedule();
  std::map<std::string, std::string> meta{{"format", kFormat},
                                          {"generation", std::to_string(generation)},
                                          {"pp", std::to_string(schedule.ranks)},
                                          {"stages", std::to_string(schedule.stages)},
                                          {"shards", std::to_string(shard_place(*state.pipeline).shards)}};
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

// Every stage file but this save's (generation, pipeline ranks, shards): older checkpoints,
// and saves that never finished, of this generation too (a save killed before its index was
// retried with another layout). No index names them.
void remove_other_files(const std::string& dir, int64_t generation, int ranks, int shards) {
  std::set<std::string> keep;
  for (int r = 0; r < ranks; ++r)
    for (int d = 0; d < shards; ++d)
      keep.insert(fs::path(stage_file(dir, generation, r, ranks, d, shards)).filename().string());
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string file = entry.path().filename().string();
    if (file.starts_with("stage-g") && !keep.count(file)) fs::remove(entry.path());
  }
}

// The saved stage files, each read when first needed. Pipeline rank r's entries are in its
// file, or, when its stages were sharded, spread over its shard files: each sharded parameter
// (and its optimizer buffers) as that shard's rows, with "shape.<name>" giving the whole
// shape; anything else whole in every one of them.
class SavedFiles {
 public:
  SavedFiles(std::string dir, const Index& index) : dir_(std::move(dir)), index_(index) {}

  std::string name(int rank, int shard = 0) const {
    return stage_file(dir_, index_.generation, rank, int(index_.ranks), shard, index_.shards);
  }
  // A file's metadata, from its header alone (the tensors are read when first asked for),
  // checked to be the file of that pipeline rank and shard.
  const text::Metadata& meta(int rank, int shard = 0) {
    auto it = meta_.find({rank, shard});
    if (it != meta_.end()) return it->second;
    const std::string path = name(rank, shard);
    LOOM_CHECK(fs::exists(path), "pipeline checkpoint: ", path, ", which ", index_.path, " names, is missing");
    text::Metadata m = load_safetensors_metadata(path);
    auto says = [&](const char* key, const std::string& want) {
      auto found = m.find(key);
      LOOM_CHECK(found == m.end() || found->second == want, "pipeline checkpoint: ", path, " says ", key, " ",
                 found->second, ", where ", index_.path, " puts it at ", key, " ", want);
    };
    says("pp_rank", std::to_string(rank));
    says("shard", std::to_string(shard));
    says("shards", std::to_string(index_.shards));
    return meta_.emplace(std::make_pair(rank, shard), std::move(m)).first->second;
  }
  const SafetensorsFile& file(int rank, int shard = 0) {
    auto it = files_.find({rank, shard});
    if (it != files_.end()) return it->second;
    (void)meta(rank, shard);  // checked first
    return files_.emplace(std::make_pair(rank, shard), load_safetensors(name(rank, shard))).first->second;
  }
  const Tensor* find(int rank, int shard, const std::string& key) {
    for (const auto& [name, t] : file(rank, shard).tensors)
      if (name == key) return &t;
    return nullptr;
  }

  // The whole shape of entry `name` as pipeline rank `rank` saved it, and whether its rows are
  // spread over the rank's shard files.
  std::pair<Shape, bool> shape(const std::string& name, int rank) {
    const text::Metadata& first = meta(rank);
    if (auto it = first.find("shape." + name); it != first.end())
      return {text::parse_shape(it->second, this->name(rank)), true};
    const Tensor* t = find(rank, 0, name);
    LOOM_CHECK(t != nullptr, "pipeline checkpoint: ", this->name(rank), " lists ", name, " but holds no such tensor");
    return {t->shape(), false};
  }

  // Rows `range` of entry `key` held by pipeline rank `rank`: a state-dict entry, or an
  // optimizer buffer ("optim.<name>.<buffer>") of a parameter of whole shape `full`, whose
  // rows are spread over the rank's shard files when `spread`. All rows are the whole tensor.
  Tensor rows(const std::string& key, int rank, const Shape& full, bool spread, RowRange range) {
    const Tensor* first = find(rank, 0, key);
    LOOM_CHECK(first != nullptr, "pipeline checkpoint: ", name(rank), " has no ", key);
    const bool whole = range.start == 0 && range.count == rows_of(full);
    Shape shape = full;  // the rows' shape: a shard's is (count, ...), a scalar's (count)
    if (!whole) {
      if (shape.empty()) shape = {range.count};
      else shape[0] = range.count;
    }
    if (!spread) {
      LOOM_CHECK(first->shape() == full, "pipeline checkpoint: ", key, " has shape ", shape_str(first->shape()), " in ",
                 name(rank), ", expected ", shape_str(full));
      if (whole) return *first;
      return first->reshape({rows_of(full), shape_numel(full) / rows_of(full)})
          .slice(0, range.start, range.start + range.count)
          .contiguous()
          .reshape(shape);
    }
    Tensor out = Tensor::empty(shape, first->dtype());
    copy_saved_rows(
        key, full, range, index_.shards, [&](int shard) { return find(rank, shard, key); },
        [&](int shard) { return name(rank, shard); }, out);
    return out;
  }

 private:
  std::string dir_;
  const Index& index_;
  std::map<std::pair<int, int>, text::Metadata> meta_;
  std::map<std::pair<int, int>, SafetensorsFile> files_;
};

// Where the checkpoint's entries are: every stage file's list of names, read from the header
// of the first file of each pipeline rank, in stage order, which is the whole model's state-dict order. A
// name listed twice is taken once, from its first pipeline rank.
struct SavedNames {
  std::vector<std::string> order;
  std::map<std::string, size_t> position;  // in `order`
  std::map<std::string, int> rank_of;      // the pipeline rank whose files hold it
};

SavedNames saved_names(const Index& index, SavedFiles& files) {
  SavedNames out;
  for (int64_t s = 0; s < index.stages; ++s) {
    const int rank = int(s % index.ranks);
    for (const std::string& name :
         text::split_list(text::entry(files.meta(rank), files.name(rank), "stage." + std::to_string(s))))
      if (out.rank_of.emplace(name, rank).second) {
        out.position[name] = out.order.size();
        out.order.push_back(name);
      }
  }
  return out;
}

// The rows of a parameter of `rows` rows this rank's stage holds: its shard's when the stage
// is sharded, all of them when not.
RowRange wanted_rows(const ShardPlace& place, bool sharded, int64_t rows) {
  return sharded ? shard_rows(rows, place.shards, place.shard) : RowRange{0, rows};
}

// One stage's entries from the files that hold them, checked against the stage's module: every
// name there with the same whole shape, and the stage's names a run of the saved model's order
// (the run starting it on stage 0, ending it on the last stage), so that a model the checkpoint
// holds more of than this run does is not loaded in part. A sharded stage gets its shard's
// rows of each parameter.
nn::NamedTensors saved_stage(const Stage& stage, bool last, const std::string& dir, const Index& index,
                             const SavedNames& saved, SavedFiles& files, const ShardPlace& place) {
  const std::string layout = " (saved by " + std::to_string(index.ranks) + " pipeline ranks of " +
                             std::to_string(index.stages) + " stages in all)";
  const std::unordered_map<const Storage*, Tensor> shards = shards_by_storage(stage);
  nn::NamedTensors out;
  std::string previous_name;
  size_t previous = 0;
  for (const auto& [name, t] : stage.module->state_dict()) {
    auto at = saved.position.find(name);
    LOOM_CHECK(at != saved.position.end(), "pipeline checkpoint: ", dir, " holds no ", name, ", which stage ",
               stage.index, " of this run needs", layout, ": another model config?");
    const int holder = saved.rank_of.at(name);
    const auto [full, spread] = files.shape(name, holder);
    LOOM_CHECK(full == t.shape(), "pipeline checkpoint: ", name, " has shape ", shape_str(full), " in ", dir, " but ",
               shape_str(t.shape()), " in stage ", stage.index, " of this run (another model config?)");
    if (out.empty()) {
      LOOM_CHECK(stage.index != 0 || at->second == 0, "pipeline checkpoint: ", dir, " holds ", saved.order.front(),
                 " before ", name, ", the first entry of this run's stage 0", layout, ": another model config?");
    } else {
      LOOM_CHECK(at->second == previous + 1, "pipeline checkpoint: ", dir, " holds ",
                 saved.order[std::min(previous + 1, saved.order.size() - 1)], " after ", previous_name,
                 ", where this run's stage ", stage.index, " goes on with ", name, layout, ": another model config?");
    }
    previous = at->second;
    previous_name = name;
    const bool shard = shards.count(t.storage().get()) > 0;
    out.emplace_back(name, files.rows(name, holder, full, spread, wanted_rows(place, shard, rows_of(full))));
  }
  LOOM_CHECK(!last || out.empty() || previous + 1 == saved.order.size(), "pipeline checkpoint: ", dir, " holds ",
             saved.order[std::min(previous + 1, saved.order.size() - 1)], " after ", previous_name,
             ", the last entry of this run's last stage", layout, ": another model config?");
  return out;
}

// Puts a stage's checked entries in: a whole stage through its state dict, a sharded one's
// parameters into their shards and its buffers as they are.
void restore_stage(const Stage& stage, const nn::NamedTensors& entries) {
  if (!stage.sharded) {
    stage.module->load_state_dict(entries, nn::Strict::yes);
    return;
  }
  const std::unordered_map<const Storage*, Tensor> shards = shards_by_storage(stage);
  const nn::NamedTensors mine = stage.module->state_dict();
  for (size_t i = 0; i < mine.size(); ++i) {
    const Tensor& t = mine[i].second;
    auto shard = shards.find(t.storage().get());
    const Tensor into = shard != shards.end() ? shard->second : t;
    copy_(into, entries[i].second.reshape(into.shape()).to(into.device()));
  }
}

// This rank's optimizer state from the files that hold its parameters and the index, in the
// optimizer's own numbering, each buffer checked against its parameter's shape (a shard's, for
// a sharded stage).
optim::OptimizerState saved_optimizer(const optim::Optimizer& opt, const Pipeline& pipe, const Index& index,
                                      const SavedNames& saved, SavedFiles& files, const std::string& dir,
                                      const ShardPlace& place) {
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
  std::unordered_set<std::string> sharded;
  for (const Stage& stage : pipe.stages())
    if (stage.sharded)
      for (const auto& [name, p] : stage.sharded->named_parameters()) sharded.insert(name);
  std::vector<Shape> shapes;
  for (const auto& group : opt.param_groups())
    for (const Tensor& p : group.params) shapes.push_back(p.shape());
  for (size_t i = 0; i < names.size(); ++i) {
    auto holder = saved.rank_of.find(names[i]);
    LOOM_CHECK(holder != saved.rank_of.end(), "pipeline checkpoint: ", dir, " holds no ", names[i],
               ", which this run's optimizer steps");
    const text::Metadata& header = files.meta(holder->second);
    // A name the saving stage held as a second name of another parameter (tied) has its
    // state under that parameter's name, in the same file.
    auto tied = header.find("tied." + names[i]);
    const std::string& filed = tied == header.end() ? names[i] : tied->second;
    auto step = header.find("step." + filed);
    if (step == header.end()) continue;  // never stepped
    const SafetensorsFile& file = files.file(holder->second);
    const std::string key = "state." + std::to_string(i) + ".";
    state.scalars[key + "step"] = text::parse<double>(files.name(holder->second), step->first, step->second);
    const auto [full, spread] = files.shape(filed, holder->second);
    const RowRange wanted = wanted_rows(place, sharded.count(names[i]) > 0, rows_of(full));
    const std::string prefix = kOptimizerPrefix + filed + ".";
    for (const auto& [saved_key, t] : file.tensors) {
      if (!saved_key.starts_with(prefix)) continue;
      const std::string buffer = saved_key.substr(prefix.size());
      if (buffer.find('.') != std::string::npos) continue;  // another parameter's, whose name extends this one
      // A shard's buffer has the shard's shape ((rows, ...), a scalar's (rows)).
      Tensor rows = files.rows(saved_key, holder->second, full, spread, wanted);
      LOOM_CHECK(rows.numel() == shape_numel(shapes[i]), "pipeline checkpoint: ", saved_key, " gives shape ",
                 shape_str(rows.shape()), " from ", files.name(holder->second), " but its parameter has shape ",
                 shape_str(shapes[i]), " here");
      state.tensors.emplace_back(key + buffer, rows.reshape(shapes[i]));
    }
  }
  return state;
}

}  // namespace

void save_pipeline_checkpoint(const std::string& dir, const PipelineCheckpoint& state) {
  LOOM_CHECK(state.pipeline != nullptr && state.world != nullptr, "save_pipeline_checkpoint(", dir,
             "): give the pipeline and the world group (every rank of every pipeline)");
  ProcessGroup& world = *state.world;
  fs::create_directories(dir);
  const int64_t generation = next_generation(dir, world, device_of(*state.pipeline));
  if (writes_stage_file(state)) write_stage_file(dir, generation, state);
  world.barrier()->wait();
  if (world.rank() == 0) {
    write_index(dir, generation, state);
    remove_other_files(dir, generation, state.pipeline->schedule().ranks, shard_place(*state.pipeline).shards);
  }
  world.barrier()->wait();
}

std::map<std::string, std::string> load_pipeline_checkpoint(const std::string& dir, const PipelineCheckpoint& state) {
  LOOM_CHECK(state.pipeline != nullptr, "load_pipeline_checkpoint(", dir, "): no pipeline given");
  NoGradGuard no_grad;
  const Pipeline& pipe = *state.pipeline;
  const Index index = read_index(dir);
  SavedFiles files(dir, index);
  const SavedNames saved = saved_names(index, files);
  const ShardPlace place = shard_place(pipe);
  // This pipeline rank's generator is the one its rank saved, or, for a rank the saving
  // pipeline did not have, world rank 0's (the index's), as a single-file checkpoint gives it.
  const bool saved_rank = pipe.rank() < index.ranks;

  // Everything is read and checked first; nothing changes until all of it passed.
  std::vector<nn::NamedTensors> stages;
  for (const Stage& stage : pipe.stages())
    stages.push_back(saved_stage(stage, stage.index == pipe.schedule().stages - 1, dir, index, saved, files, place));
  optim::OptimizerState opt_state;
  if (state.optimizer) opt_state = saved_optimizer(*state.optimizer, pipe, index, saved, files, dir, place);
  const std::map<std::string, double> schedule_state = text::read_schedule(index.meta, index.path);
  LOOM_CHECK(!state.scheduler || !schedule_state.empty(), "pipeline checkpoint: ", index.path,
             " holds no learning-rate schedule, and this run has one");
  const std::string generator_file = saved_rank ? files.name(pipe.rank()) : index.path;
  const auto generator = text::read_generator(saved_rank ? files.meta(pipe.rank()) : index.meta, generator_file);
  LOOM_CHECK(generator.has_value(), "pipeline checkpoint: ", generator_file, " has no random generator state");

  // The optimizer and the schedule check their own state before they change; the stages'
  // entries were checked above.
  try {
    if (state.optimizer) state.optimizer->load_state_dict(opt_state);
    if (state.scheduler) state.scheduler->load_state_dict(schedule_state);
    for (size_t i = 0; i < stages.size(); ++i) restore_stage(pipe.stages()[i], stages[i]);
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
  SavedFiles files(dir, index);
  // Stage s is on rank s % pp (pipeline_schedule.h); its names in the order it listed them,
  // so the stages in order give the whole model's state-dict order. A sharded stage's
  // entries are put together from its shard files.
  nn::NamedTensors out;
  std::set<std::string> seen;
  for (int64_t s = 0; s < index.stages; ++s) {
    const int rank = int(s % index.ranks);
    for (const std::string& name :
         text::split_list(text::entry(files.meta(rank), files.name(rank), "stage." + std::to_string(s)))) {
      LOOM_CHECK(seen.insert(name).second, "pipeline checkpoint: ", name, " is held by two stages of ", dir);
      const auto [full, spread] = files.shape(name, rank);
      out.emplace_back(name, files.rows(name, rank, full, spread, {0, rows_of(full)}));
    }
  }
  save_safetensors(path, out);
}

}  // namespace loom::dist::pipeline
