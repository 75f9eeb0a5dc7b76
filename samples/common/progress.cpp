#include "samples/common/progress.h"

#include <unistd.h>

#include <cstdio>

#include "engine/allocator.h"
#include "samples/common/gpu_monitor.h"

namespace loom::samples {

std::string device_note(Device device, double data_wait_seconds) {
  char buf[96];
  std::snprintf(buf, sizeof buf, "data wait %.0f ms", data_wait_seconds * 1000);
  std::string note = buf;
  if (device.is_cuda()) {
    std::snprintf(buf, sizeof buf, "  peak %.0f MiB", double(memory::stats(device).peak_allocated) / (1 << 20));
    note += buf;
    if (std::string gpus = gpu_monitor_line(); !gpus.empty()) note += "  " + gpus;
  }
  return note;
}

std::string format_duration(double seconds) {
  if (!(seconds >= 0) || seconds > 1e8) return "?";
  long s = long(seconds + 0.5);
  char buf[32];
  if (s >= 3600)
    std::snprintf(buf, sizeof buf, "%ld:%02ld:%02ld", s / 3600, s / 60 % 60, s % 60);
  else
    std::snprintf(buf, sizeof buf, "%ld:%02ld", s / 60, s % 60);
  return buf;
}

Progress::Progress(std::string label, int64_t total_steps, std::string unit)
    : label_(std::move(label)), unit_(std::move(unit)), total_(total_steps), tty_(isatty(fileno(stdout)) != 0) {
  start_ = last_draw_ = std::chrono::steady_clock::now();
}

std::string Progress::line(int64_t step, int64_t items, double loss, const std::string& extra) const {
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  // Throughput from the first update on, so start-up (the first step's allocations and
  // algorithm choices) does not drag the rate down.
  const double rate = last_rate_;
  const double eta = step > 0 && step < total_ ? elapsed / double(step) * double(total_ - step) : 0;
  constexpr int kWidth = 24;
  const int filled = total_ > 0 ? int(kWidth * step / total_) : kWidth;
  std::string bar(size_t(filled), '=');
  if (filled < kWidth) bar += '>' + std::string(size_t(kWidth - filled - 1), ' ');
  char buf[512];
  char rate_text[32] = "-";
  if (rate > 0) std::snprintf(rate_text, sizeof rate_text, "%.0f", rate);
  std::snprintf(buf, sizeof buf, "%s [%s] %lld/%lld  %s %s/s  loss %.4f  %s %s%s%s", label_.c_str(), bar.c_str(),
                (long long)step, (long long)total_, rate_text, unit_.c_str(), loss, step < total_ ? "ETA" : "took",
                format_duration(step < total_ ? eta : elapsed).c_str(), extra.empty() ? "" : "  ", extra.c_str());
  (void)items;
  return buf;
}

void Progress::update(int64_t step, int64_t items, double loss, const std::string& extra) {
  auto now = std::chrono::steady_clock::now();
  if (start_step_ < 0) {
    start_step_ = step;
    start_items_ = items;
    start_ = now;
  }
  const double since = std::chrono::duration<double>(now - start_).count();
  if (since > 0 && items > start_items_) last_rate_ = double(items - start_items_) / since;
  last_items_ = items;
  if (tty_) {
    if (step < total_ && std::chrono::duration<double>(now - last_draw_).count() < 0.1) return;
    last_draw_ = now;
    std::printf("\r%s\033[K", line(step, items, loss, extra).c_str());
  } else {
    const int64_t every = total_ >= 10 ? total_ / 10 : 1;
    if (step != total_ && step / every == last_printed_step_ / every) return;
    std::printf("%s\n", line(step, items, loss, extra).c_str());
  }
  last_printed_step_ = step;
  std::fflush(stdout);
}

double Progress::finish() {
  if (tty_) std::printf("\n");
  std::fflush(stdout);
  return last_rate_;
}

}  // namespace loom::samples
