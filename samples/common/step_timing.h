// Timing training steps for the benchmarks: on a GPU each step bracketed by CUDA events
// recorded back to back (the host never waits between steps), on the CPU by the host's
// clock; medians, and the alternating rounds that compare two ways of stepping one model
// within one run.
#pragma once

#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "engine/device.h"

namespace loom::samples {

// The median of v (the mean of the middle two for an even count); v must not be empty.
double median(std::vector<double> v);

// Runs `steps` steps back to back on `device`'s compute stream, an event between each two
// (on the CPU, where every op has finished when it returns, a clock reading), and returns
// each step's milliseconds.
std::vector<double> timed_steps(const std::function<void()>& step, int64_t steps, Device device);

// Times `a` and `b` in `rounds` alternating rounds (a b, b a, a b, ...) of `per_round` steps
// each, so clock drift and thermal state hit both alike; returns each one's step times.
std::pair<std::vector<double>, std::vector<double>> alternating_steps(const std::function<void()>& a,
                                                                      const std::function<void()>& b,
                                                                      int64_t rounds, int64_t per_round,
                                                                      Device device);

// Runs `step` once on `device` (a GPU) between cudaProfilerStart and cudaProfilerStop, the
// device idle before and after, so that `ncu --profile-from-start off` sees that step alone.
void profiled_step(const std::function<void()>& step, Device device);

}  // namespace loom::samples
