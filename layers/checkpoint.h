// Training checkpoints: everything a run needs to continue exactly where it stopped, in one
// safetensors file (engine/serialization.h: written to a temporary name, fsynced, renamed).
//
//   tensors   the model's state dict under its own names ("features.0.weight", ...), so
//             safetensors.torch.load_file gives PyTorch the weights directly; the
//             optimizer's buffers under "optimizer.state.<i>.<buffer>"
//   metadata  "format" = "loom-training-checkpoint", the optimizer's type and scalars
//             ("optimizer.<key>"), the schedule's ("scheduler.<key>"), the random
//             generator's state ("rng.seed", "rng.offset"), and the caller's own entries
//             (epoch, batch, data order, ...) under "user.<key>"
//
// Numbers are written as decimal text that reads back to the same double (or, for the
// generator, the same 64-bit integer), so a resumed run follows the same losses bit for bit
// on the same device.
#pragma once

#include <map>
#include <string>

#include "module.h"
#include "optim/optimizer.h"
#include "optim/schedule.h"

namespace loom::nn {

// What save_checkpoint stores; optimizer and scheduler may be null.
struct TrainingCheckpoint {
  Module* model = nullptr;
  optim::Optimizer* optimizer = nullptr;
  optim::LRScheduler* scheduler = nullptr;
  std::map<std::string, std::string> user;  // the caller's own entries
};

void save_checkpoint(const std::string& path, const TrainingCheckpoint& state);

// Restores model, optimizer, scheduler and the random generator from `path` and returns
// the caller's entries. Everything is checked (format, optimizer type, keys, shapes) before
// anything changes; failures name the file and what disagreed.
std::map<std::string, std::string> load_checkpoint(const std::string& path, const TrainingCheckpoint& state);

// Loads model weights from a safetensors file: a plain state dict (from PyTorch or
// Module::state_dict) or a training checkpoint, whose optimizer entries are ignored.
// Strict: missing or unexpected weights are named in the error.
void load_weights(const std::string& path, Module& model);

}  // namespace loom::nn
