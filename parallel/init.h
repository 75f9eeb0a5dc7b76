// Starting a training program's process group from its environment, the counterpart of
// PyTorch's init_process_group(init_method="env://") with the device choice folded in, so a
// program takes one call to run alone, under loomrun, `torchrun --no-python`, mpirun or srun.
//
// init_distributed, in the order it runs:
//
// 1. Launcher or not. Without RANK (or mpirun's or Slurm's rank variable, rendezvous.h) the
//    program is one process on the device its flag names; nothing else happens.
// 2. The rendezvous. The env:// variables are read and checked (rendezvous_from_env).
// 3. The device. A rank takes the GPU of its LOCAL_RANK (one process per GPU, as NCCL wants),
//    or the CPU when asked to or when no GPU is visible. This comes before any other CUDA
//    call, so each rank's context lands on its own GPU.
// 4. The store and the group. Every rank meets at MASTER_ADDR:MASTER_PORT (connect_store),
//    then opens an NCCL group on a GPU or a Gloo group on the CPU, with the given timeout for
//    the store and every collective.
//
// A program started alone with `--gpus N` (N > 1) can start its N ranks itself: relaunch runs
// it again through the launcher behind loomrun (launcher.h) and waits for them.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "../engine/device.h"
#include "process_group.h"
#include "store.h"

namespace loom::dist {

struct DistContext {
  bool active = false;  // more than this one process takes part
  int rank = 0, size = 1, local_rank = 0;
  Device device = Device::cpu();
  std::shared_ptr<Store> store;         // null when no launcher started this process
  std::shared_ptr<ProcessGroup> group;  // null when no launcher started this process
  bool is_main() const { return rank == 0; }
};

// `device_flag` is the program's --device value ("auto", "cpu", "cuda", "cuda:N"). Without a
// launcher's variables: one process on that device. With them: steps 2 to 4 above; a device
// the rank cannot take is an error naming --device or LOCAL_RANK and what to do instead.
DistContext init_distributed(const std::string& device_flag, Duration timeout);

// This program's command line for starting it again: its own executable (/proc/self/exe, so
// a PATH lookup cannot find another one), then argv[1..] with each flag of `drop_flags` (as
// --name value or --name=value) removed.
std::vector<std::string> command_without(int argc, char** argv, const std::vector<std::string>& drop_flags);

// Runs this program again as `ranks` processes on this node (a free port on 127.0.0.1, the
// env:// variables, output prefixed by rank, the group stopped when one fails), with
// `drop_flag` and its value removed from the arguments so the ranks do not relaunch in turn.
// Returns the exit code the program should end with: the first failing rank's, else 0.
int relaunch(int argc, char** argv, int ranks, const std::string& drop_flag);

// A value every rank must share, such as the number of steps per epoch.
struct SharedValue {
  std::string name;  // "steps per epoch"
  int64_t value = 0;
};

// Checks, before the first step, that every rank holds the same `values` (one all_gather of
// as many int64s): ranks that disagree on the dataset's size or the steps per epoch would
// call a different number of collectives, and the first one left over would hang or abort
// deep inside the backend. Throws loom::Error naming the first rank that differs from rank
// 0, each value that differs with both ranks' numbers, and `hint` (what the user should make
// the same on every rank). Every rank must call it; nothing happens when ctx is not active.
void check_same_on_every_rank(const DistContext& ctx, const std::vector<SharedValue>& values, const std::string& hint);

// Runs `check` on every rank and ends every rank alike: a rank whose check throws rethrows
// its own error; the others throw one naming that rank and `what` (what was checked), so
// that a fault found on one rank (a NaN in its shard) does not leave the others waiting in
// their next collective. Every rank must call it; without an active context it runs `check`.
void check_on_every_rank(const DistContext& ctx, const std::function<void()>& check, const std::string& what);

// The mean over ranks of a host value, such as each rank's loss (every rank must call it;
// the value itself when the context is not active).
double mean_over_ranks(const DistContext& ctx, double value);

}  // namespace loom::dist
