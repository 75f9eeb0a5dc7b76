// Sharded checkpoints of an FSDP model (fsdp.h) and its optimizer, the role of PyTorch's
// distributed checkpoint (DCP). Every rank writes what it holds, so no rank ever gathers the
// whole model; an index written last says what a finished checkpoint is made of; a
// checkpoint loads at any world size, and exports to one safetensors file.
//
// A checkpoint is a folder:
//
//   shard-g<G>-<r>-of-<W>.safetensors   rank r's rows of every parameter ("param.<name>") and of
//                                       its optimizer buffers ("optim.<name>.<buffer>"), rank 0's
//                                       buffers ("buffer.<name>"); metadata: each parameter's
//                                       optimizer step ("step.<name>")
//   index.safetensors                   no tensors; metadata: the generation G, W, each parameter's
//                                       full shape ("shape.<name>"), tied names ("tied.<alias>"),
//                                       the optimizer's type and group hyper-parameters, the
//                                       learning-rate schedule's state ("scheduler.<key>"), rank
//                                       0's random generator ("rng.seed", "rng.offset") and the
//                                       caller's entries ("user.<key>": epoch, data position, ...)
//
// Under HSDP (fsdp.h, step 8) the first replica writes and the others wait for it. Buffers
// (BatchNorm's running statistics) are rank 0's: with FSDPOptions::average_buffers every rank
// holds those; without it each rank's own differ, and a resumed run starts all ranks from
// rank 0's, so its evaluation can differ from a run that never stopped.
//
// Saving: every rank writes its shard file (atomically, engine/serialization.h), a barrier
// waits for all of them, then rank 0 writes the index (atomically, hence last and whole) and
// removes the shard files of older generations. G counts the saves into the folder, so a
// save killed at any point leaves the previous index pointing at the previous files, which
// are still there: the previous checkpoint stays loadable, and a half-written one is never
// found, as no index names it.
//
// Loading at world size W': rank r' needs rows shard_rows(n, W', r') of each parameter; they
// come from the saved ranks whose rows overlap (shard_rows(n, W, r)), copied row range by row
// range, for the parameters and the optimizer buffers alike. Each rank reads only the shard
// files that hold its rows.
#pragma once

#include <map>
#include <string>

#include "../layers/optim/optimizer.h"
#include "../layers/optim/schedule.h"
#include "fsdp.h"

namespace loom::dist {

// What a training run keeps beside the model and the optimizer, as nn::TrainingCheckpoint
// does in one file: the schedule's state and the caller's own entries. The random
// generator's state is always saved (rank 0's) and restored on load.
struct ShardedCheckpointExtras {
  const optim::LRScheduler* scheduler = nullptr;
  std::map<std::string, std::string> user;
};

// Writes `fsdp`'s shards (and `optimizer`'s state, when given) into the folder `dir` (created
// if missing), with `extras` in the index. Every rank of the group calls it.
void save_sharded_checkpoint(const std::string& dir, FullyShardedDataParallel& fsdp,
                             const optim::Optimizer* optimizer = nullptr, const ShardedCheckpointExtras& extras = {});

// Loads a checkpoint saved at any world size into `fsdp`'s shards (and `optimizer`, which must
// be built on fsdp.parameters(), and `scheduler`, when given), sets the random generator to
// the saved state and returns the caller's entries. Every rank of the group calls it; no
// communication.
std::map<std::string, std::string> load_sharded_checkpoint(const std::string& dir, FullyShardedDataParallel& fsdp,
                                                           optim::Optimizer* optimizer = nullptr,
                                                           optim::LRScheduler* scheduler = nullptr);

// Loads a single-file training checkpoint (nn::save_checkpoint's: a plain or DDP run's) into
// `fsdp`: each rank takes its rows of every parameter and of the optimizer's buffers (the
// optimizer must list the parameters in the model's order, as one built on fsdp.parameters()
// and the saving run's built on model.parameters() do), the schedule, the generator and the
// caller's entries, which it returns. Every rank calls it; no communication.
std::map<std::string, std::string> load_checkpoint_into_shards(const std::string& path, FullyShardedDataParallel& fsdp,
                                                               optim::Optimizer* optimizer = nullptr,
                                                               optim::LRScheduler* scheduler = nullptr);

// Writes the full parameters (tied ones under every name) and buffers of the checkpoint in
// `dir` to one safetensors file, as a plain model's state_dict() would be saved: PyTorch loads
// it as a state dict. One process, no group.
void export_consolidated_safetensors(const std::string& dir, const std::string& path);

}  // namespace loom::dist
