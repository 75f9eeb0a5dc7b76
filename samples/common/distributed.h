// Data parallelism for Loom's training programs, set up the way torchrun users expect.
//
// A program started by loomrun, `torchrun --no-python`, mpirun or srun finds RANK and the
// other env:// variables (parallel/rendezvous.h): it meets the other ranks at MASTER_ADDR:
// MASTER_PORT, takes the GPU of its LOCAL_RANK (or stays on the CPU), and opens an NCCL
// group on a GPU or a Gloo group on the CPU. A program started alone with `--gpus N` (N > 1)
// starts those N ranks itself, through the same launcher loomrun uses, and waits for them.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "engine/device.h"
#include "parallel/process_group.h"
#include "parallel/store.h"

namespace loom::samples {

struct DistContext {
  bool active = false;  // more than this one process takes part
  int rank = 0, size = 1, local_rank = 0;
  Device device = Device::cpu();
  std::shared_ptr<dist::Store> store;
  std::shared_ptr<dist::ProcessGroup> group;  // null when not active
  bool is_main() const { return rank == 0; }
};

// `device_flag` is the program's --device value ("auto", "cpu", "cuda", "cuda:N"). Without a
// launcher's variables: one process on that device. With them: the rank's device is
// cuda:LOCAL_RANK ("auto" or "cuda" with GPUs) or the CPU ("cpu", or no GPU), and a group
// of the matching backend is opened. Errors name the variable or the flag.
DistContext init_distributed(const std::string& device_flag, dist::Duration timeout);

// This program's command line for starting it again: its own executable, then argv[1..] with
// each flag of `drop_flags` (as --name value or --name=value) removed.
std::vector<std::string> command_without(int argc, char** argv, const std::vector<std::string>& drop_flags);

// Runs argv[0] again as `ranks` processes on this node (a free port, the env:// variables,
// output prefixed by rank, the group stopped when one fails), with `drop_flag` and its value
// removed from the arguments. Returns the exit code the program should end with.
int relaunch(int argc, char** argv, int ranks, const std::string& drop_flag);

// The mean over ranks of a host value (every rank must call it; identity when not active).
double mean_over_ranks(const DistContext& ctx, double value);

}  // namespace loom::samples
