#include "samples/common/program.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <new>
#include <vector>

#include "engine/autograd.h"
#include "engine/ops.h"
#include "engine/serialization.h"
#include "layers/checkpoint.h"
#include "parallel/sharded_checkpoint.h"
#include "parallel/trace.h"
#include "kernels/core/error.h"

namespace loom::samples {

int run_guarded(const char* program, const std::function<int()>& body) {
  try {
    return body();
  } catch (const Error& e) {
    std::fprintf(stderr, "%s: %s\n", program, e.what());
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "%s: out of memory: a size or count asked for more memory than this machine could give; "
                 "lower it\n", program);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", program, e.what());
  } catch (...) {
    std::fprintf(stderr, "%s: stopped by an exception of unknown type\n", program);
  }
  return 1;
}

void reject_positional(const Flags& flags, const std::vector<std::string>& positional, const std::string& hint) {
  if (positional.empty()) return;
  flags.fail("unexpected argument '" + positional[0] + "': this program takes only --flags" +
             (hint.empty() ? "" : " (" + hint + ")"));
}

void check_output_paths(const Flags& flags, const std::vector<std::pair<std::string, std::string>>& paths) {
  for (const auto& [flag, path] : paths) {
    if (path.empty()) continue;
    try {
      check_output_path(path, flag);
    } catch (const Error& e) {
      flags.fail(e.what());
    }
  }
}

namespace {

// What a killed save leaves in a checkpoint folder: shard or stage files, and temporary files.
bool checkpoint_leftover(const std::string& name) {
  return name.starts_with("shard-g") || name.starts_with("stage-g") || name.find(".tmp-") != std::string::npos;
}

}  // namespace

void check_output_folders(const Flags& flags, const std::vector<std::pair<std::string, std::string>>& paths,
                          const std::string& format) {
  namespace fs = std::filesystem;
  for (const auto& [flag, path] : paths) {
    if (path.empty()) continue;
    std::error_code ec;
    const fs::file_status st = fs::status(path, ec);
    if (fs::exists(st) && !fs::is_directory(st))
      flags.fail(flag + " " + path + " is a file, and this run saves its checkpoint as a folder (one file per "
                 "rank and an index): give the path of a folder, new or holding such a checkpoint");
    if (fs::is_directory(st)) {
      if (fs::exists(fs::path(path) / "index.safetensors")) {
        std::string found;
        try {
          found = checkpoint_format(path);
        } catch (const Error& e) {
          flags.fail(flag + " " + path + ": " + e.what());
        }
        if (found != format)
          flags.fail(flag + " " + path + " holds a checkpoint of format '" + found + "', and this run saves " + format +
                     " checkpoints: give another folder, so that it is not overwritten");
      } else {
        for (const auto& entry : fs::directory_iterator(path, ec))
          if (!checkpoint_leftover(entry.path().filename().string()))
            flags.fail(flag + " " + path + " is a folder that holds other files (" +
                       entry.path().filename().string() + ") and no checkpoint: give a new or empty folder, so that "
                       "nothing in it is overwritten");
      }
    }
    // A probe file in the folder, or beside it when it is still to be made.
    const std::string probe_at = fs::is_directory(st) ? (fs::path(path) / "probe").string() : path;
    try {
      check_output_path(probe_at, flag);
    } catch (const Error& e) {
      flags.fail(e.what());
    }
  }
}

std::string checkpoint_format(const std::string& path) {
  namespace fs = std::filesystem;
  if (fs::is_directory(path)) {
    const std::string index = (fs::path(path) / "index.safetensors").string();
    if (!fs::exists(index)) return "";
    const auto meta = load_safetensors_metadata(index);
    auto it = meta.find("format");
    return it == meta.end() ? "" : it->second;
  }
  const auto meta = load_safetensors_metadata(path);
  auto it = meta.find("format");
  return it == meta.end() ? "" : it->second;
}

std::map<std::string, std::string> checkpoint_entries(const Flags& flags, const std::string& path,
                                                      const std::string& program) {
  namespace fs = std::filesystem;
  const bool folder = fs::is_directory(path);
  const std::string header = folder ? (fs::path(path) / "index.safetensors").string() : path;
  if (folder && !fs::exists(header))
    flags.fail("--resume " + path + " is a folder with no index.safetensors: not a checkpoint, or its first save "
               "never finished");
  const std::map<std::string, std::string> meta = load_safetensors_metadata(header);
  auto format = meta.find("format");
  const std::string kind = format == meta.end() ? "" : format->second;
  if (kind != kFileCheckpoint && kind != kShardedCheckpoint && kind != kPipelineCheckpoint)
    flags.fail("--resume " + path + " is not a Loom training checkpoint (" + header + " has no format = " +
               kFileCheckpoint + ", " + kShardedCheckpoint + " or " + kPipelineCheckpoint + "): " + program +
               " resumes the checkpoints it writes with --save");
  std::map<std::string, std::string> out;
  for (const auto& [key, value] : meta)
    if (key.starts_with("user.")) out.emplace(key.substr(5), value);
  return out;
}

int64_t checkpoint_integer(const std::string& path, const std::map<std::string, std::string>& entries,
                           const std::string& key, const std::string& program) {
  auto it = entries.find(key);
  LOOM_CHECK(it != entries.end(), path, ": the checkpoint has no user.", key, " entry; was it written by ", program,
             "?");
  const std::string& text = it->second;
  int64_t v = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  LOOM_CHECK(!text.empty() && ec == std::errc() && end == text.data() + text.size() && v >= 0, path,
             ": checkpoint entry user.", key, " = '", text, "' is not a whole number >= 0, as ", program,
             " writes it: the file was changed after it was saved");
  return v;
}

namespace {

struct CheckpointKind {
  std::string format, what, plural, run, resumed_by;
};

const CheckpointKind& checkpoint_kind(const std::string& format) {
  static const std::vector<CheckpointKind> kinds{
      {kFileCheckpoint, "a single-file checkpoint (written by a run without --fsdp or --pp)", "single-file checkpoints",
       "this run, without --fsdp or --pp,", "without --fsdp and --pp"},
      {kShardedCheckpoint, "a sharded checkpoint (a folder written by a run with --fsdp)",
       "sharded checkpoints (and single files)",
       "this run, with --fsdp,", "with --fsdp"},
      {kPipelineCheckpoint, "a pipeline checkpoint (a folder written by a run with --pp)", "pipeline checkpoints",
       "this run, with --pp,", "with the same --pp"}};
  for (const CheckpointKind& k : kinds)
    if (k.format == format) return k;
  static const CheckpointKind unknown{"", "not a training checkpoint", "", "", ""};
  return unknown;
}

}  // namespace

void check_resume_format(const Flags& flags, const std::string& path, const std::vector<std::string>& accepted) {
  const std::string format = checkpoint_format(path);
  if (std::find(accepted.begin(), accepted.end(), format) != accepted.end()) return;
  const CheckpointKind& got = checkpoint_kind(format);
  const CheckpointKind& want = checkpoint_kind(accepted.front());
  flags.fail("--resume " + path + " is " + got.what + ", and " + want.run + " resumes " + want.plural +
             (got.resumed_by.empty() ? "" : ": resume it " + got.resumed_by));
}

SavedSetting saved_rank_count(int ranks) {
  return {"world_size", "the rank count", std::to_string(ranks),
          "it was saved within an epoch, and its data position is a place in each rank's shard of the data "
          "(a checkpoint saved at an epoch's end resumes on any rank count)",
          true};
}

int64_t resumed_step(const std::map<std::string, std::string>& entries, int ranks, int64_t epoch, int64_t step,
                     int64_t steps_per_epoch, optim::LRScheduler& schedule, bool main_rank) {
  auto saved = entries.find("world_size");
  if (saved == entries.end() || saved->second == std::to_string(ranks)) return step;
  const int64_t moved = epoch * steps_per_epoch;
  std::map<std::string, double> state = schedule.state_dict();
  state["last_step"] = double(moved);
  schedule.load_state_dict(state);
  if (main_rank)
    std::printf("saved on %s ranks, resumed on %d: an epoch is %lld steps here, so the run goes on from step %lld "
                "(step %lld there)\n",
                saved->second.c_str(), ranks, (long long)steps_per_epoch, (long long)moved, (long long)step);
  return moved;
}

void check_saved_settings(const Flags& flags, const std::string& path, const std::map<std::string, std::string>& entries,
                          const std::vector<SavedSetting>& settings) {
  auto batch = entries.find("batch");
  const bool at_epoch_end = batch != entries.end() && batch->second == "0";
  for (const SavedSetting& s : settings) {
    auto it = entries.find(s.key);
    if (it == entries.end() || it->second == s.value || (s.within_epoch_only && at_epoch_end)) continue;
    flags.fail("--resume " + path + " was saved with " + s.flag + " " + it->second + ", this run has " + s.flag + " " +
               s.value + ": " + s.why + "; resume with " + s.flag + " " + it->second);
  }
}

ResumedAt resume_data_parallel(const std::string& path, const std::string& program, nn::Module& model,
                               dist::FullyShardedDataParallel* fsdp, optim::Optimizer& opt,
                               optim::LRScheduler& schedule, const dist::DistContext& ctx, int64_t steps_per_epoch,
                               bool allow_nonfinite) {
  const bool one_file = checkpoint_format(path) == kFileCheckpoint;
  const std::map<std::string, std::string> entries =
      !fsdp      ? nn::load_checkpoint(path, {.model = &model, .optimizer = &opt, .scheduler = &schedule})
      : one_file ? dist::load_checkpoint_into_shards(path, *fsdp, &opt, &schedule)
                 : dist::load_sharded_checkpoint(path, *fsdp, &opt, &schedule);
  ResumedAt at;
  at.epoch = checkpoint_integer(path, entries, "epoch", program);
  at.batch = checkpoint_integer(path, entries, "batch", program);
  at.step = checkpoint_integer(path, entries, "step", program);
  at.step = resumed_step(entries, ctx.size, at.epoch, at.step, steps_per_epoch, schedule, ctx.is_main());
  // Under FSDP each rank checks its own shards, and all stop if one finds a fault.
  if (!allow_nonfinite)
    dist::check_on_every_rank(
        ctx,
        [&] { check_finite_parameters(fsdp ? fsdp->named_parameters() : model.named_parameters(), "--resume " + path); },
        "the check of the resumed weights");
  if (ctx.is_main())
    std::printf("resumed %s at epoch %lld, batch %lld (step %lld)\n", path.c_str(), (long long)at.epoch + 1,
                (long long)at.batch, (long long)at.step);
  return at;
}

void check_finite_parameters(const nn::Module& model, const std::string& source) {
  check_finite_parameters(model.named_parameters(), source);
}

void check_finite_parameters(const nn::NamedTensors& parameters, const std::string& source) {
  NoGradGuard no_grad;
  for (const auto& [name, p] : parameters) {
    // x * 0 is 0 for a finite x and NaN for a NaN or an infinity: one reduction per tensor.
    if (std::isfinite(sum(mul(p.detach(), 0.0)).item())) continue;
    const std::vector<double> values = p.detach().to(Device::cpu()).to(DType::f64).contiguous().to_vector<double>();
    size_t i = 0;
    while (i < values.size() && std::isfinite(values[i])) ++i;
    LOOM_FAIL(source, ": parameter '", name, "' holds ", i < values.size() ? std::to_string(values[i]) : "a non-finite value",
              " at element ", i, " of ", values.size(), ", the first value that is not finite: a run from it trains on ",
              "NaN; start from other weights, or pass ", kAllowNonfiniteFlag, " to train anyway");
  }
}

void check_finite_loss(double loss, int64_t step, bool exact) {
  if (std::isfinite(loss)) return;
  LOOM_FAIL("the loss is ", loss, " at step ", step,
            exact ? "" : " (the first step at which it was read: on a GPU it is read every few steps)",
            ": training stopped (a learning rate too high for this model? lower --lr, or add --clip); pass ",
            kAllowNonfiniteFlag, " to go on regardless");
}

void start_step_trace(const std::string& path, const dist::DistContext& ctx, Device device) {
  if (path.empty()) return;
  if (ctx.is_main()) dist::trace::write_chrome_trace(path, {});  // fails now, not after training
  dist::trace::set_enabled(true, device);
}

void write_step_trace(const std::string& path, const dist::DistContext& ctx, Device device) {
  if (path.empty()) return;
  dist::trace::set_enabled(false);  // what follows (a sample, the last report) is not a step
  dist::trace::write_merged_trace(ctx.active ? ctx.group.get() : nullptr, device, path);
  if (ctx.is_main()) std::printf("wrote the step timeline of %d rank(s) to %s\n", ctx.size, path.c_str());
}

}  // namespace loom::samples
