#include "engine/device.h"

#include <charconv>

#include "kernels/config.h"
#include "kernels/core/error.h"

#if LOOM_WITH_CUDA
#include <cuda_runtime.h>

#include <mutex>
#include <vector>

#include "kernels/cuda/check.h"
#endif

namespace loom {

Device Device::parse(std::string_view text) {
  if (text == "cpu") return cpu();
  if (text == "cuda") return cuda(0);
  if (text.starts_with("cuda:")) {
    std::string_view num = text.substr(5);
    int index = -1;
    auto [ptr, ec] = std::from_chars(num.data(), num.data() + num.size(), index);
    if (ec == std::errc() && ptr == num.data() + num.size() && index >= 0) return cuda(index);
  }
  LOOM_FAIL("unknown device '", text, "': expected cpu, cuda or cuda:N");
}

std::string Device::str() const { return is_cpu() ? "cpu" : "cuda:" + std::to_string(index); }

Device default_device() { return cuda_available() ? Device::cuda(0) : Device::cpu(); }
bool cuda_available() { return cuda_device_count() > 0; }

#if LOOM_WITH_CUDA

int cuda_device_count() {
  static const int count = [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      cudaGetLastError();  // no driver or no GPU: clear the sticky error, report none
      return 0;
    }
    return n;
  }();
  return count;
}

namespace {
void check_index(Device device) {
  int n = cuda_device_count();
  LOOM_CHECK(device.index < n, "device ", device.str(), " does not exist: ",
             n == 0 ? std::string("no CUDA GPU is visible") : "this machine shows " + std::to_string(n) + " GPU(s)");
}
}  // namespace

void set_current_device(Device device) {
  if (device.is_cpu()) return;
  check_index(device);
  thread_local int current = -1;
  if (current != device.index) {
    LOOM_CUDA(cudaSetDevice(device.index));
    current = device.index;
  }
}

StreamHandle compute_stream(Device device) {
  if (device.is_cpu()) return nullptr;
  set_current_device(device);
  static std::mutex mu;
  static std::vector<cudaStream_t> streams;
  std::lock_guard lock(mu);
  if (streams.empty()) streams.resize(cuda_device_count(), nullptr);
  cudaStream_t& s = streams[device.index];
  if (!s) LOOM_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  return s;
}

void synchronize(Device device) {
  if (device.is_cpu()) return;
  LOOM_CHECK(!capturing(device), "synchronize(", device.str(), ") inside a captured step: a CUDA graph cannot "
             "wait for the host; read results after the step (engine/cuda_graph.h)");
  LOOM_CUDA(cudaStreamSynchronize(static_cast<cudaStream_t>(compute_stream(device))));
}

bool capturing(Device device) {
  if (device.is_cpu()) return false;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  LOOM_CUDA(cudaStreamIsCapturing(static_cast<cudaStream_t>(compute_stream(device)), &status));
  return status != cudaStreamCaptureStatusNone;
}

Event::Event() { LOOM_CUDA(cudaEventCreate(reinterpret_cast<cudaEvent_t*>(&event_))); }
Event::~Event() { cudaEventDestroy(static_cast<cudaEvent_t>(event_)); }
void Event::record(StreamHandle stream) {
  LOOM_CUDA(cudaEventRecord(static_cast<cudaEvent_t>(event_), static_cast<cudaStream_t>(stream)));
}
void Event::wait_on(StreamHandle stream) const {
  LOOM_CUDA(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(event_), 0));
}
void Event::synchronize() const { LOOM_CUDA(cudaEventSynchronize(static_cast<cudaEvent_t>(event_))); }
bool Event::query() const {
  cudaError_t status = cudaEventQuery(static_cast<cudaEvent_t>(event_));
  if (status == cudaErrorNotReady) {
    cudaGetLastError();  // "not ready" is an answer, not an error to leave behind
    return false;
  }
  LOOM_CUDA(status);
  return true;
}
float Event::elapsed_ms_since(const Event& start) const {
  float ms = 0;
  LOOM_CUDA(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start.event_), static_cast<cudaEvent_t>(event_)));
  return ms;
}

Stream::Stream(Device device) {
  LOOM_CHECK(device.is_cuda(), "a Stream needs a CUDA device, got ", device.str());
  set_current_device(device);
  cudaStream_t s;
  LOOM_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  stream_ = s;
}
Stream::~Stream() { cudaStreamDestroy(static_cast<cudaStream_t>(stream_)); }

#else  // built without CUDA

int cuda_device_count() { return 0; }
void set_current_device(Device device) {
  LOOM_CHECK(device.is_cpu(), "device ", device.str(), " needs CUDA, but this build of Loom has none");
}
StreamHandle compute_stream(Device device) {
  set_current_device(device);
  return nullptr;
}
void synchronize(Device) {}
bool capturing(Device) { return false; }
Event::Event() { LOOM_FAIL("CUDA events need a build of Loom with CUDA"); }
Event::~Event() {}
void Event::record(StreamHandle) {}
void Event::wait_on(StreamHandle) const {}
void Event::synchronize() const {}
bool Event::query() const { return true; }
float Event::elapsed_ms_since(const Event&) const { return 0; }
Stream::Stream(Device) { LOOM_FAIL("CUDA streams need a build of Loom with CUDA"); }
Stream::~Stream() {}

#endif

}  // namespace loom
