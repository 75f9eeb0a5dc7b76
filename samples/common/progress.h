// A progress line for training loops: position in the epoch, throughput, loss, time left,
// and whatever else the caller adds (GPU memory, data-loader stalls). On a terminal it is
// redrawn in place at most ten times a second; into a file or a pipe it is printed as a
// plain line about every tenth of the epoch, so logs stay readable.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "engine/device.h"

namespace loom::samples {

class Progress {
 public:
  // `label` ("epoch 3/10"), the epoch's steps, and what one item is called ("img", "tok").
  Progress(std::string label, int64_t total_steps, std::string unit);
  // After step `step` (1-based) of the epoch: items processed in this epoch so far, the
  // latest loss, and an extra text shown at the end of the line.
  void update(int64_t step, int64_t items, double loss, const std::string& extra = "");
  // Ends the line and returns the items per second over the epoch.
  double finish();

 private:
  std::string line(int64_t step, int64_t items, double loss, const std::string& extra) const;

  std::string label_, unit_;
  int64_t total_, start_step_ = -1, start_items_ = 0, last_printed_step_ = 0, last_items_ = 0;
  bool tty_;
  std::chrono::steady_clock::time_point start_, last_draw_;
  double last_rate_ = 0;
};

// What a training program's progress line adds: the time this epoch waited for data (a
// starved GPU shows here) and, on a GPU, Loom's peak memory on the device and every GPU's
// utilization and memory as NVML sees it: "data wait 3 ms  peak 812 MiB  gpu0 97% 3.1/139.8G".
std::string device_note(Device device, double data_wait_seconds);

// "1:02:03" or "2:03".
std::string format_duration(double seconds);

}  // namespace loom::samples
