// The whole model of a pipeline on one rank, for what needs it all (generating text after a
// pipelined run): every stage's state dict, under the whole model's names (the stage modules
// name their parameters as the whole model does, layers/models/gpt_stage.h), sent to rank 0
// of the pipeline's group. Each other rank sends a header (names, dtypes, shapes, as text)
// and then its tensors, one after the other; rank 0 takes them in rank order.
#pragma once

#include <memory>
#include <vector>

#include "../layers/module.h"
#include "process_group.h"

namespace loom::dist::pipeline {

// On rank 0 of `group`: the state dicts of every rank's `modules` (this rank's stages), in
// rank order, each tensor on rank 0's device. On the other ranks: empty, after sending theirs.
// Every rank of the group calls it.
nn::NamedTensors gather_state_dicts(ProcessGroup& group, const std::vector<std::shared_ptr<nn::Module>>& modules);
// The same from tensors this rank names itself (a sharded stage's full_state_dict()).
nn::NamedTensors gather_state_dicts(ProcessGroup& group, const nn::NamedTensors& mine);

}  // namespace loom::dist::pipeline
