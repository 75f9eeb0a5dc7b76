// Sharded checkpoints: the file layout and the save order are in sharded_checkpoint.h; the
// row arithmetic is fsdp.h's (shard_rows), so a checkpoint is resharded by copying the
// overlaps of the saved ranks' row ranges with this rank's.
#include "parallel/sharded_checkpoint.h"

#include <cstdio>
#include <filesystem>
#include <functional>
#include <map>
#include <sstream>
#include <unordered_map>

#include "engine/autograd.h"
#include "engine/ops.h"
#include "engine/serialization.h"
#include "layers/checkpoint_text.h"
#include "parallel/checkpoint_files.h"

namespace loom::dist {

namespace {

namespace fs = std::filesystem;

constexpr const char* kFormat = "loom-sharded-1";
constexpr const char* kIndex = "index.safetensors";

std::string shard_file(const std::string& dir, int64_t generation, int rank, int world) {
  char name[96];
  std::snprintf(name, sizeof(name), "shard-g%lld-%05d-of-%05d.safetensors", static_cast<long long>(generation), rank,
                world);
  return (fs::path(dir) / name).string();
}

// Appends `item` to a comma-separated list.
void append(std::string& list, const std::string& item) {
  if (!list.empty()) list += ',';
  list += item;
}

namespace text = nn::checkpoint_text;


// The optimizer's parameter index (its state_dict numbering) -> the FSDP parameter name.
std::vector<std::string> optimizer_names(const optim::Optimizer& opt, const FullyShardedDataParallel& fsdp) {
  return opt.parameter_names(fsdp.named_parameters(), "the FSDP model's shards (fsdp.parameters())");
}

// A saved checkpoint: its index and the shard files, each read when first needed.
class SavedCheckpoint {
 public:
  explicit SavedCheckpoint(const std::string& dir) : dir_(dir) {
    const std::string index = (fs::path(dir) / kIndex).string();
    LOOM_CHECK(fs::exists(index), "sharded checkpoint: ", dir, " has no ", kIndex,
               " (not a sharded checkpoint, or its first save never finished)");
    meta_ = load_safetensors_metadata(index);
    LOOM_CHECK(meta_.count("format") && meta_.at("format") == kFormat, "sharded checkpoint: ", index,
               " is not an index of format ", kFormat);
    const int64_t world = text::parse<int64_t>(index, "world_size", entry("world_size"));
    generation_ = text::parse<int64_t>(index, "generation", entry("generation"));
    LOOM_CHECK(world >= 1 && world <= (int64_t(1) << 20), "sharded checkpoint: ", index, ": world_size is ", world,
               ", expected 1 to 2^20");
    world_ = int(world);
  }

  // The index's entry `key`; a missing one names the index.
  const std::string& entry(const std::string& key) const {
    auto it = meta_.find(key);
    LOOM_CHECK(it != meta_.end(), "sharded checkpoint: ", dir_, "/", kIndex, " has no entry ", key);
    return it->second;
  }
  std::string index_path() const { return (fs::path(dir_) / kIndex).string(); }
  std::string file_name(int rank) const { return shard_file(dir_, generation_, rank, world_); }

  int world() const { return world_; }
  const std::map<std::string, std::string>& meta() const { return meta_; }

  Shape shape(const std::string& name) const {
    auto it = meta_.find("shape." + name);
    LOOM_CHECK(it != meta_.end(), "sharded checkpoint: ", dir_, " holds no parameter ", name);
    return text::parse_shape(it->second, dir_ + "/" + kIndex);
  }

  const SafetensorsFile& file(int rank) {
    auto it = files_.find(rank);
    if (it == files_.end()) it = files_.emplace(rank, load_safetensors(shard_file(dir_, generation_, rank, world_))).first;
    return it->second;
  }

  const Tensor* find(int rank, const std::string& key) {
    for (const auto& [name, t] : file(rank).tensors)
      if (name == key) return &t;
    return nullptr;
  }

  // Rows [range.start, range.start + range.count) of the saved tensor `key` (a parameter of
  // full shape `full`, or one of its optimizer buffers), copied into dst, (range.count, ...).
  void read_rows(const std::string& key, const Shape& full, RowRange range, const Tensor& dst) {
    copy_saved_rows(
        key, full, range, world_, [&](int r) { return find(r, key); },
        [&](int r) { return shard_file(dir_, generation_, r, world_); }, dst);
  }

 private:
  std::string dir_;
  std::map<std::string, std::string> meta_;
  int world_ = 0;
  int64_t generation_ = 0;
  std::map<int, SafetensorsFile> files_;
};

// The shards of one replica (all of them without HSDP), written as the header comment says.
void save_sharded_checkpoint_of_one_replica(const std::string& dir, FullyShardedDataParallel& fsdp,
                                            const optim::Optimizer* optimizer, const ShardedCheckpointExtras& extras) {
  ProcessGroup& group = fsdp.group();
  const int rank = group.rank(), world = group.size();
  nn::NamedTensors shards = fsdp.named_parameters();
  const Device device = shards.empty() ? Device::cpu() : shards.front().second.device();
  fs::create_directories(dir);

  // The generation: one more than the finished checkpoint's, as rank 0 reads it. An index of
  // another kind (a pipeline's checkpoint) or one that cannot be read stops every rank, so
  // that nothing in the folder is overwritten and no rank waits for the others.
  const std::string index = (fs::path(dir) / kIndex).string();
  const int64_t generation = agree_on_generation(
      dir, index, group, device,
      [](const std::string& path) {
        auto meta = load_safetensors_metadata(path);
        auto format = meta.find("format");
        LOOM_CHECK(format != meta.end() && format->second == kFormat, path,
                   " is the index of a checkpoint of format '", format == meta.end() ? std::string() : format->second,
                   "', not a sharded one (", kFormat, "): save into another folder, so that it is not overwritten");
        return text::parse<int64_t>(path, "generation", text::entry(meta, path, "generation"));
      },
      "sharded checkpoint");

  nn::NamedTensors tensors;
  std::map<std::string, std::string> meta{{"rank", std::to_string(rank)}, {"world_size", std::to_string(world)}};
  for (const auto& [name, t] : shards) tensors.emplace_back("param." + name, t);
  optim::OptimizerState opt_state;
  if (optimizer) {
    opt_state = optimizer->state_dict();
    const std::vector<std::string> names = optimizer_names(*optimizer, fsdp);
    // "state.<i>.<buffer>" and "state.<i>.step" under the parameter's name instead of i.
    auto split = [&](const std::string& key) {
      const size_t dot = key.find('.', 6);
      return std::make_pair(names.at(std::stoul(key.substr(6, dot - 6))), key.substr(dot + 1));
    };
    for (const auto& [key, t] : opt_state.tensors) {
      auto [name, buffer] = split(key);
      tensors.emplace_back("optim." + name + "." + buffer, t);
    }
    for (const auto& [key, v] : opt_state.scalars)
      if (key.starts_with("state.")) meta["step." + split(key).first] = text::exact(v);
  }
  if (rank == 0)
    for (const auto& [name, b] : fsdp.module()->named_buffers()) tensors.emplace_back("buffer." + name, b);
  save_safetensors(shard_file(dir, generation, rank, world), tensors, meta);
  group.barrier()->wait();

  if (rank == 0) {
    std::map<std::string, std::string> index_meta{{"format", kFormat},
                                                  {"generation", std::to_string(generation)},
                                                  {"world_size", std::to_string(world)}};
    std::string order;
    std::unordered_map<const Storage*, std::string> by_storage;
    for (const auto& [name, p] : fsdp.module()->named_parameters()) {
      index_meta["shape." + name] = text::shape_text(p.shape());
      append(order, name);
      by_storage.emplace(p.storage().get(), name);
    }
    index_meta["params"] = order;
    std::string buffers;
    for (const auto& [name, b] : fsdp.module()->named_buffers()) append(buffers, name);
    index_meta["buffers"] = buffers;
    // Names under which state_dict() lists a parameter a second time (GPT's lm_head.weight).
    for (const auto& [name, t] : fsdp.module()->state_dict()) {
      auto it = by_storage.find(t.storage().get());
      if (it != by_storage.end() && it->second != name) index_meta["tied." + name] = it->second;
    }
    if (optimizer) {
      index_meta["optimizer"] = optimizer->type_name();
      for (const auto& [key, v] : opt_state.scalars)
        if (key.starts_with("param_groups.")) index_meta[key] = text::exact(v);
    }
    if (extras.scheduler) text::write_schedule(index_meta, *extras.scheduler);
    text::write_generator(index_meta);
    for (const auto& [key, v] : extras.user) index_meta["user." + key] = v;
    save_safetensors(index, {}, index_meta);
    // The previous generations' files: no index names them any more.
    const std::string keep = "shard-g" + std::to_string(generation) + "-";
    for (const auto& entry : fs::directory_iterator(dir)) {
      const std::string file = entry.path().filename().string();
      if (file.starts_with("shard-g") && !file.starts_with(keep) && file.ends_with(".safetensors"))
        fs::remove(entry.path());
    }
  }
  group.barrier()->wait();
}

}  // namespace

void save_sharded_checkpoint(const std::string& dir, FullyShardedDataParallel& fsdp,
                             const optim::Optimizer* optimizer, const ShardedCheckpointExtras& extras) {
  // HSDP: the first replica writes the shards, the others wait until it has finished.
  if (ProcessGroup* replicas = fsdp.replicate_group()) {
    if (replicas->rank() == 0) save_sharded_checkpoint_of_one_replica(dir, fsdp, optimizer, extras);
    replicas->barrier()->wait();
  } else {
    save_sharded_checkpoint_of_one_replica(dir, fsdp, optimizer, extras);
  }
}

std::map<std::string, std::string> load_sharded_checkpoint(const std::string& dir, FullyShardedDataParallel& fsdp,
                                                           optim::Optimizer* optimizer, optim::LRScheduler* scheduler) {
  NoGradGuard no_grad;
  SavedCheckpoint saved(dir);
  const std::string index = saved.index_path();
  // The schedule and the generator are read (and checked) before anything changes.
  const std::map<std::string, double> scheduler_state = text::read_schedule(saved.meta(), index);
  const text::Metadata user = text::under(saved.meta(), "user.");
  LOOM_CHECK(!scheduler || !scheduler_state.empty(), "sharded checkpoint: ", index,
             " holds no learning-rate schedule state (saved without one)");
  // The generator, where the index has it (checkpoints saved before it was kept have not).
  const auto generator = text::read_generator(saved.meta(), index);
  const int rank = fsdp.group().rank(), world = fsdp.group().size();
  nn::NamedTensors full = fsdp.module()->named_parameters();  // shapes only: their storages stay released
  nn::NamedTensors shards = fsdp.named_parameters();
  std::map<std::string, Shape> full_shape;
  for (size_t i = 0; i < full.size(); ++i) {
    const auto& [name, p] = full[i];
    Shape shape = saved.shape(name);
    LOOM_CHECK(shape == p.shape(), "sharded checkpoint: ", name, " has shape ", shape_str(shape), " in ", dir,
               " but ", shape_str(p.shape()), " in the model");
    full_shape[name] = shape;
    saved.read_rows("param." + name, shape, shard_rows(rows_of(shape), world, rank), shards[i].second);
  }
  for (const auto& [name, b] : fsdp.module()->named_buffers()) {
    const Tensor* t = saved.find(0, "buffer." + name);
    LOOM_CHECK(t != nullptr, "sharded checkpoint: ", dir, " holds no buffer ", name);
    copy_(b, *t);
  }
  auto finish = [&] {
    if (scheduler) scheduler->load_state_dict(scheduler_state);
    if (generator) set_rng_state(generator->first, generator->second);
    return user;
  };
  if (!optimizer) return finish();
  const auto& meta = saved.meta();
  LOOM_CHECK(meta.count("optimizer"), "sharded checkpoint: ", dir, " holds no optimizer state");
  LOOM_CHECK(meta.at("optimizer") == optimizer->type_name(), "sharded checkpoint: ", dir, " holds the state of ",
             meta.at("optimizer"), ", not of ", optimizer->type_name());
  optim::OptimizerState state;
  for (const auto& [key, v] : meta)
    if (key.starts_with("param_groups.")) state.scalars[key] = text::parse<double>(index, key, v);
  const std::vector<std::string> names = optimizer_names(*optimizer, fsdp);
  const SafetensorsFile& first = saved.file(0);
  for (size_t i = 0; i < names.size(); ++i) {
    const std::string& name = names[i];
    auto step = first.metadata.find("step." + name);
    if (step == first.metadata.end()) continue;  // never stepped
    const std::string key = "state." + std::to_string(i) + ".";
    state.scalars[key + "step"] = text::parse<double>(saved.file_name(0), "step." + name, step->second);
    const std::string prefix = "optim." + name + ".";
    const Shape& shape = full_shape.at(name);
    const RowRange mine = shard_rows(rows_of(shape), world, rank);
    for (const auto& [saved_key, t] : first.tensors) {
      if (!saved_key.starts_with(prefix) || saved_key.find('.', prefix.size()) != std::string::npos) continue;
      Shape shard_shape = shape.empty() ? Shape{mine.count} : shape;
      shard_shape[0] = mine.count;
      Tensor buffer = Tensor::empty(shard_shape, t.dtype());
      saved.read_rows(saved_key, shape, mine, buffer);
      state.tensors.emplace_back(key + saved_key.substr(prefix.size()), buffer);
    }
  }
  optimizer->load_state_dict(state);
  return finish();
}

std::map<std::string, std::string> load_checkpoint_into_shards(const std::string& path, FullyShardedDataParallel& fsdp,
                                                               optim::Optimizer* optimizer, optim::LRScheduler* scheduler) {
  NoGradGuard no_grad;
  SafetensorsFile file = load_safetensors(path);
  const auto& meta = file.metadata;
  auto format = meta.find("format");
  LOOM_CHECK(format != meta.end() && format->second == "loom-training-checkpoint", path,
             ": not a Loom training checkpoint (its metadata has no format = loom-training-checkpoint)");
  const int rank = fsdp.group().rank(), world = fsdp.group().size();
  // The file is read and its entries checked before anything changes; the weights' names and
  // shapes are checked as they are copied in.
  nn::NamedTensors model_state;
  std::map<std::string, Tensor> optimizer_tensors;
  for (auto& [name, t] : file.tensors) {
    if (name.starts_with("optimizer.")) optimizer_tensors.emplace(name.substr(10), t);
    else model_state.emplace_back(name, t);
  }
  const std::map<std::string, double> scheduler_state = text::read_schedule(meta, path);
  const text::Metadata user = text::under(meta, "user.");
  optim::OptimizerState state;
  for (const auto& [key, v] : text::under(meta, "optimizer."))
    state.scalars[key] = text::parse<double>(path, "optimizer." + key, v);
  const auto generator = text::read_generator(meta, path);
  LOOM_CHECK(generator.has_value(), path, ": the checkpoint has no random generator state (rng.seed, rng.offset)");
  LOOM_CHECK(!scheduler || !scheduler_state.empty(), path, ": the checkpoint holds no learning-rate schedule state");
  if (optimizer) {
    const std::string type = text::entry(meta, path, "optimizer");
    LOOM_CHECK(type == optimizer->type_name(), path, ": the checkpoint's optimizer is ", type, " but this run uses ",
               optimizer->type_name(), "; resume with the same optimizer");
    // "state.<i>.<buffer>": parameter i's buffer at full size, cut to this rank's rows.
    const std::vector<std::string> names = optimizer_names(*optimizer, fsdp);
    std::map<std::string, Shape> full_shape;
    for (const auto& [name, p] : fsdp.module()->named_parameters()) full_shape.emplace(name, p.shape());
    for (const auto& [key, t] : optimizer_tensors) {
      LOOM_CHECK(key.starts_with("state."), path, ": unexpected optimizer entry optimizer.", key);
      const size_t dot = key.find('.', 6);
      const std::string index = key.substr(6, dot == std::string::npos ? std::string::npos : dot - 6);
      const int64_t i = text::parse<int64_t>(path, "optimizer." + key, index);
      LOOM_CHECK(dot != std::string::npos && i < int64_t(names.size()), path, ": optimizer.", key,
                 " belongs to parameter ", i, ", and this run's optimizer has ", names.size());
      const Shape& shape = full_shape.at(names[size_t(i)]);
      LOOM_CHECK(t.shape() == shape, path, ": optimizer.", key, " has shape ", shape_str(t.shape()), ", but parameter ",
                 names[size_t(i)], " (the optimizer's parameter ", i, ") has ", shape_str(shape),
                 ": the checkpoint's optimizer listed its parameters in another order");
      const RowRange mine = shard_rows(rows_of(shape), world, rank);
      Shape shard_shape = shape.empty() ? Shape{mine.count} : shape;
      shard_shape[0] = mine.count;
      const int64_t row_numel = rows_of(shape) == 0 ? 0 : shape_numel(shape) / rows_of(shape);
      state.tensors.emplace_back(
          key, t.reshape({rows_of(shape), row_numel}).slice(0, mine.start, mine.start + mine.count).contiguous()
                   .reshape(shard_shape));
    }
  }
  try {
    fsdp.load_full_state_dict(model_state);
    if (optimizer) optimizer->load_state_dict(state);
    if (scheduler) scheduler->load_state_dict(scheduler_state);
  } catch (const Error& e) {
    LOOM_FAIL(path, ": ", e.what());
  }
  set_rng_state(generator->first, generator->second);
  return user;
}

void export_consolidated_safetensors(const std::string& dir, const std::string& path) {
  NoGradGuard no_grad;
  SavedCheckpoint saved(dir);
  const auto& meta = saved.meta();
  nn::NamedTensors out;
  std::map<std::string, Tensor> by_name;
  for (const std::string& name : text::split_list(saved.entry("params"))) {
    const Shape shape = saved.shape(name);
    const Tensor* first = saved.find(0, "param." + name);
    LOOM_CHECK(first != nullptr, "sharded checkpoint: ", dir, " has no param.", name, " in rank 0's file");
    Tensor t = Tensor::empty(shape, first->dtype());
    saved.read_rows("param." + name, shape, {0, rows_of(shape)}, t);
    out.emplace_back(name, t);
    by_name.emplace(name, t);
  }
  for (const auto& [key, target] : meta)
    if (key.starts_with("tied.")) {
      LOOM_CHECK(by_name.count(target), "sharded checkpoint: ", saved.index_path(), " ties ", key.substr(5), " to ",
                 target, ", which it does not hold");
      out.emplace_back(key.substr(5), by_name.at(target));
    }
  for (const std::string& name : text::split_list(saved.entry("buffers"))) {
    const Tensor* t = saved.find(0, "buffer." + name);
    LOOM_CHECK(t != nullptr, "sharded checkpoint: ", dir, " has no buffer ", name);
    out.emplace_back(name, *t);
  }
  save_safetensors(path, out);
}

}  // namespace loom::dist
