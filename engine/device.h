// Devices and streams. A Device is cpu or cuda:N. Each CUDA device has one compute
// stream that all of Loom's ops on that device use; copies and communication create
// their own streams and order themselves against it with events.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "../kernels/core/strided.h"

namespace loom {

enum class DeviceKind : uint8_t { cpu, cuda };

struct Device {
  DeviceKind kind = DeviceKind::cpu;
  int index = 0;

  static Device cpu() { return {}; }
  static Device cuda(int index = 0) { return {DeviceKind::cuda, index}; }
  // "cpu", "cuda", "cuda:1"; throws loom::Error naming the text otherwise.
  static Device parse(std::string_view text);

  bool is_cpu() const { return kind == DeviceKind::cpu; }
  bool is_cuda() const { return kind == DeviceKind::cuda; }
  std::string str() const;
  bool operator==(const Device&) const = default;
};

// Number of visible CUDA devices: 0 when built without CUDA or when no driver/GPU is present.
int cuda_device_count();
bool cuda_available();
// The best device available: cuda:0 where a GPU is visible, else the CPU.
Device default_device();

// The compute stream of a device (nullptr for the CPU). Makes `device` current on this thread.
StreamHandle compute_stream(Device device);
// Makes device current on this thread (cudaSetDevice); a no-op for the CPU.
void set_current_device(Device device);
// Waits until all work on the device's compute stream is done (no-op on the CPU).
void synchronize(Device device);
// Whether the device's compute stream is being captured into a CUDA graph
// (engine/cuda_graph.h); false for the CPU.
bool capturing(Device device);

// An event recorded on one stream and waited on by another, for ordering without
// device-wide synchronisation.
class Event {
 public:
  Event();
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  void record(StreamHandle stream);
  void wait_on(StreamHandle stream) const;  // `stream` waits for this event
  void synchronize() const;
  bool query() const;
  // Milliseconds between `start` and this event, both recorded and complete.
  float elapsed_ms_since(const Event& start) const;

 private:
  void* event_ = nullptr;
};

// A stream of one's own (copies, communication), destroyed with the object.
class Stream {
 public:
  explicit Stream(Device device);
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  StreamHandle handle() const { return stream_; }

 private:
  StreamHandle stream_ = nullptr;
};

}  // namespace loom
