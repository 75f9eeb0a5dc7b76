// The CPUs a node's ranks run on under loomrun --cpu-bind: each rank is pinned to a share
// of its own, so the operating system cannot move its threads onto another rank's cores,
// and its CPU kernels' pool (kernels/cpu/parallel_for.h, sized by default to the CPUs the
// process may use) makes a thread per CPU of the share.
//
// Shares are runs of whole cores (the hardware threads of one core, by package, die and
// core id from sysfs) when there are at least as many cores as ranks, their core counts
// differing by at most one; with fewer cores than ranks, runs of CPUs in core order whose
// sizes differ by at most one.
#pragma once

#include <string>
#include <vector>

namespace loom::dist {

// A CPU and the core it belongs to (-1 where sysfs does not say).
struct Cpu {
  int id;
  int package = -1, die = -1, core = -1;
};

// The CPUs this process may run on (its affinity mask), in core order: the CPUs of one
// core side by side, cores of one die and package side by side; in number order where
// sysfs does not say. Never empty.
std::vector<Cpu> usable_cpus();

// The ids of `cpus` (in core order, as usable_cpus() gives them) cut into `ranks` shares as
// the header says. Needs 1 <= ranks <= cpus.size().
std::vector<std::vector<int>> cpu_shares(const std::vector<Cpu>& cpus, int ranks);

// The ids of `cpus`.
std::vector<int> cpu_ids(const std::vector<Cpu>& cpus);

// Why `ranks` ranks cannot each be pinned to CPUs of their own (fewer usable CPUs than
// ranks), naming the counts and the CPUs; empty when they can.
std::string cpu_bind_problem(int ranks);

// "0-3,8,10-11": a CPU list as taskset and /proc print it (sorted).
std::string cpu_list_text(std::vector<int> cpus);

}  // namespace loom::dist
