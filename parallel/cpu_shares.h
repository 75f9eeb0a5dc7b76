// The CPUs a node's ranks run on. Several ranks on one machine each make a pool of
// threads for the CPU kernels (kernels/cpu/parallel_for.h), sized by default to every CPU
// the process may use: four CPU ranks on 16 CPUs would run 64 threads on 16 CPUs, each
// rank's threads preempting the others' mid-product. So loomrun gives each rank a share:
// LOOM_NUM_THREADS set to its share of the CPUs (unless the user set it), and with
// --cpu-bind the rank is also pinned to its own CPUs, so the operating system cannot move
// its threads onto another rank's cores and every rank of a pipeline runs at one speed.
//
// A share is a run of CPUs in core order (by package, then core, from sysfs): on a machine
// with two hardware threads a core, a share of 4 holds two whole cores, not four halves.
#pragma once

#include <string>
#include <vector>

namespace loom::dist {

// The CPUs this process may run on (its affinity mask), in core order: the CPUs of one
// core side by side, cores of one package side by side; in number order where sysfs does
// not say. Never empty.
std::vector<int> usable_cpus();

// `cpus` cut into `ranks` contiguous shares whose sizes differ by at most one (the first
// ones get the extra CPU). Needs 1 <= ranks <= cpus.size().
std::vector<std::vector<int>> cpu_shares(const std::vector<int>& cpus, int ranks);

// "0-3,8,10-11": a CPU list as taskset and /proc print it (sorted).
std::string cpu_list_text(std::vector<int> cpus);

}  // namespace loom::dist
