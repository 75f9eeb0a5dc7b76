#include "samples/common/step_timing.h"

#include <algorithm>
#include <chrono>
#include <memory>

#include "kernels/config.h"
#include "kernels/core/error.h"

#if LOOM_WITH_CUDA
#include <cuda_profiler_api.h>
#endif

namespace loom::samples {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::vector<double> timed_steps(const std::function<void()>& step, int64_t steps, Device device) {
  if (device.is_cpu()) {
    using Clock = std::chrono::steady_clock;
    std::vector<double> ms;
    for (int64_t i = 0; i < steps; ++i) {
      const Clock::time_point start = Clock::now();
      step();
      ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count());
    }
    return ms;
  }
  StreamHandle s = compute_stream(device);
  std::vector<std::unique_ptr<Event>> events;
  events.push_back(std::make_unique<Event>());
  events.back()->record(s);
  for (int64_t i = 0; i < steps; ++i) {
    step();
    events.push_back(std::make_unique<Event>());
    events.back()->record(s);
  }
  events.back()->synchronize();
  std::vector<double> ms;
  for (size_t i = 1; i < events.size(); ++i) ms.push_back(events[i]->elapsed_ms_since(*events[i - 1]));
  return ms;
}

std::pair<std::vector<double>, std::vector<double>> alternating_steps(const std::function<void()>& a,
                                                                      const std::function<void()>& b,
                                                                      int64_t rounds, int64_t per_round,
                                                                      Device device) {
  std::vector<double> a_ms, b_ms;
  for (int64_t r = 0; r < rounds; ++r) {
    for (int half = 0; half < 2; ++half) {
      const bool run_a = (r + half) % 2 == 0;
      auto ms = timed_steps(run_a ? a : b, per_round, device);
      auto& into = run_a ? a_ms : b_ms;
      into.insert(into.end(), ms.begin(), ms.end());
    }
  }
  return {a_ms, b_ms};
}

void profiled_step(const std::function<void()>& step, Device device) {
  LOOM_CHECK(!device.is_cpu(), "a profiled step runs on a GPU, not on ", device.str());
#if LOOM_WITH_CUDA
  synchronize(device);
  cudaProfilerStart();
  step();
  synchronize(device);
  cudaProfilerStop();
#else
  LOOM_FAIL("a profiled step needs a build with CUDA");
#endif
}

}  // namespace loom::samples
