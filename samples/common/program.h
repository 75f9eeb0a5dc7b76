// What the programs share around their training loop: main's exception guard, and the
// checks a training program makes before its first step (output paths, checkpoints it
// resumes, weights it loads) and during its run (the loss), so that a mistake costs seconds
// and a message naming the flag, file or value, never an epoch or an abort.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "layers/module.h"
#include "layers/optim/schedule.h"
#include "parallel/fsdp.h"
#include "parallel/init.h"
#include "samples/common/flags.h"

namespace loom::samples {

// Runs `body` and returns its exit status; anything it throws becomes one line on stderr
// ("<program>: <what>") and status 1, so no program ends in std::terminate (exit 134).
int run_guarded(const char* program, const std::function<int()>& body);

// Positional arguments are mistakes in programs that take only flags: the first is named,
// with `hint` ("did you mean --data FILE?").
void reject_positional(const Flags& flags, const std::vector<std::string>& positional, const std::string& hint);

// Each (flag, path) with a non-empty path must be writable now (engine/serialization.h's
// check_output_path): a missing or read-only directory, or a path that is a directory or a
// device, fails before any work with the flag and the path named.
void check_output_paths(const Flags& flags, const std::vector<std::pair<std::string, std::string>>& paths);

// The formats of the checkpoints the programs write: one file (nn::save_checkpoint), or a
// folder whose index.safetensors says what it is.
inline constexpr const char* kFileCheckpoint = "loom-training-checkpoint";
inline constexpr const char* kShardedCheckpoint = "loom-sharded-1";
inline constexpr const char* kPipelineCheckpoint = "loom-pipeline-1";

// Checkpoints saved as folders (FSDP's sharded checkpoints, parallel/sharded_checkpoint.h; a
// pipeline's per-stage files), checked before any work: each (flag, path) with a non-empty
// path must be a new folder in an existing directory, or a folder that is empty, holds a
// checkpoint of `format` (its index.safetensors says so), or holds only what a killed first
// save left (shard and stage files, no index); and a probe file must be creatable in it (or
// beside it).
void check_output_folders(const Flags& flags, const std::vector<std::pair<std::string, std::string>>& paths,
                          const std::string& format);

// The format of the checkpoint at `path` (a file's "format" metadata, or a folder's
// index.safetensors's), "" when it has none. Throws naming the file when it cannot be read.
std::string checkpoint_format(const std::string& path);

// A checkpoint's own entries (the "user." metadata the programs store), read from its header
// (a folder's: its index.safetensors) without loading any tensor. A path that is no training
// checkpoint of `program`'s kinds fails here, naming --resume and `program`.
std::map<std::string, std::string> checkpoint_entries(const Flags& flags, const std::string& path,
                                                      const std::string& program);

// Entry `key` of a checkpoint as an integer >= 0; a missing or malformed one is a loom::Error
// naming the file, the key and the value (so a hand-edited file is not a std::stoll abort).
int64_t checkpoint_integer(const std::string& path, const std::map<std::string, std::string>& entries,
                           const std::string& key, const std::string& program);

// The checkpoint at --resume `path` must be of one of the formats `accepted` (this run's
// kinds, its own first: one file, FSDP's shards or a pipeline's stages); another fails naming
// both kinds and the flag that resumes it.
void check_resume_format(const Flags& flags, const std::string& path, const std::vector<std::string>& accepted);

// One setting a resumed run must share with the run that saved the checkpoint.
struct SavedSetting {
  std::string key;    // the checkpoint entry, "batch_size"
  std::string flag;   // "--batch-size"
  std::string value;  // this run's
  std::string why;    // what a different value would break
  // Compared only for a checkpoint saved within an epoch (entry "batch" not 0): one saved at
  // an epoch's end starts the next epoch, whose order is drawn afresh for the ranks there are.
  bool within_epoch_only = false;
};
// The rank count, as a setting: a checkpoint saved within an epoch resumes on as many ranks
// (its data position is a place in each rank's shard), one saved at an epoch's end on any.
SavedSetting saved_rank_count(int ranks);

// Where a resumed run goes on from (its step count): the saved `step`, or, for a checkpoint
// saved at an epoch's end on another rank count, where an epoch is another number of steps,
// the first step of epoch `epoch` as this run counts them (`steps_per_epoch`), the schedule
// moved there too. `entries` are the checkpoint's own; prints what changed on the main rank.
int64_t resumed_step(const std::map<std::string, std::string>& entries, int ranks, int64_t epoch, int64_t step,
                     int64_t steps_per_epoch, optim::LRScheduler& schedule, bool main_rank);
// Fails naming the flag, the saved value and this run's for the first setting that differs;
// entries the checkpoint lacks (older files) are not compared.
void check_saved_settings(const Flags& flags, const std::string& path, const std::map<std::string, std::string>& entries,
                          const std::vector<SavedSetting>& settings);

// Where a resumed run goes on from.
struct ResumedAt {
  int64_t epoch = 0, batch = 0, step = 0;
};

// Resumes a plain, DDP or FSDP run from --resume `path`: a single-file checkpoint into `model`
// (or, under FSDP, into `fsdp`'s shards), or a folder of shards into `fsdp`; the optimizer, the
// schedule and the generator with it. Reads the data position (resumed_step moves it for
// another rank count), checks the weights are finite on every rank unless `allow_nonfinite`,
// and prints where the run goes on from on the main rank. `program` names the checkpoints'
// writer in the messages.
ResumedAt resume_data_parallel(const std::string& path, const std::string& program, nn::Module& model,
                               dist::FullyShardedDataParallel* fsdp, optim::Optimizer& opt,
                               optim::LRScheduler& schedule, const dist::DistContext& ctx, int64_t steps_per_epoch,
                               bool allow_nonfinite);

// Throws a loom::Error naming `source` (the flag and file the weights came from), the first
// parameter holding a NaN or an infinity, and the element, unless every value is finite.
void check_finite_parameters(const nn::Module& model, const std::string& source);
// The same for named tensors (an FSDP model's shards, parallel/fsdp.h).
void check_finite_parameters(const nn::NamedTensors& parameters, const std::string& source);

// --trace FILE (parallel/trace.h): start_step_trace checks now that rank 0 can write FILE, not
// after training, and starts recording every rank's spans (on a GPU, synchronized with its
// compute stream); write_step_trace merges them into FILE on rank 0 and says so. Every rank
// calls both; nothing happens when FILE is "".
void start_step_trace(const std::string& path, const dist::DistContext& ctx, Device device);
void write_step_trace(const std::string& path, const dist::DistContext& ctx, Device device);

// Stops a run whose loss is no longer finite, naming the step. On the CPU each step's loss
// is read anyway; on a GPU reading it waits for the device, so it is checked where the
// program reads it (`exact` false: the message says the step it was seen at).
void check_finite_loss(double loss, int64_t step, bool exact);

// The flag that lets a run go on through non-finite weights and losses, for the messages.
inline constexpr const char* kAllowNonfiniteFlag = "--allow-nonfinite";

}  // namespace loom::samples
