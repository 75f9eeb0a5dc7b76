// Threads over the outer loop, for the CPU kernels. A fixed pool sized to the CPUs the
// process may run on (its affinity mask; LOOM_NUM_THREADS overrides) runs `body(begin,
// end)` over contiguous chunks of [0, n); small ranges run inline so tiny tensors pay no
// thread hand-off.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

namespace loom::cpu {

// Runs body over [0, n) split into chunks of at least `grain` iterations; returns when
// every chunk is done. Exceptions thrown by body are rethrown on the calling thread.
void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& body);

int num_threads();

// The ids of the CPUs this process may run on (its affinity mask, read with a mask sized
// up until the kernel's fits, so hosts with more than CPU_SETSIZE CPUs are read whole), in
// number order; empty where the mask cannot be read.
std::vector<int> affinity_cpus();

}  // namespace loom::cpu
