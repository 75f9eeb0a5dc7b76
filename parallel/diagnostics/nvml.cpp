#include "parallel/diagnostics/nvml.h"

#include <dlfcn.h>

namespace loom::dist::diagnostics {
namespace {

template <class Fn>
void bind(void* lib, Fn& fn, const char* symbol) {
  fn = reinterpret_cast<Fn>(::dlsym(lib, symbol));
}

}  // namespace

Nvml::Nvml() {
  lib_ = ::dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib_) {
    const char* why = ::dlerror();
    error_ = why ? why : "libnvidia-ml.so.1 cannot be loaded";
    return;
  }
  bind(lib_, init_, "nvmlInit_v2");
  bind(lib_, shutdown_, "nvmlShutdown");
  bind(lib_, error_string, "nvmlErrorString");
  bind(lib_, driver_version, "nvmlSystemGetDriverVersion");
  bind(lib_, device_count, "nvmlDeviceGetCount_v2");
  bind(lib_, by_index, "nvmlDeviceGetHandleByIndex_v2");
  bind(lib_, by_pci, "nvmlDeviceGetHandleByPciBusId_v2");
  bind(lib_, name, "nvmlDeviceGetName");
  bind(lib_, uuid, "nvmlDeviceGetUUID");
  bind(lib_, memory, "nvmlDeviceGetMemoryInfo");
  bind(lib_, utilization, "nvmlDeviceGetUtilizationRates");
  bind(lib_, capability, "nvmlDeviceGetCudaComputeCapability");
  bind(lib_, max_clock, "nvmlDeviceGetMaxClockInfo");
  bind(lib_, pci_info, "nvmlDeviceGetPciInfo_v3");
  bind(lib_, nvlink_state, "nvmlDeviceGetNvLinkState");
  bind(lib_, nvlink_remote_pci, "nvmlDeviceGetNvLinkRemotePciInfo_v2");
  bind(lib_, nvlink_remote_type, "nvmlDeviceGetNvLinkRemoteDeviceType");  // drivers before R460 lack it
  bind(lib_, common_ancestor, "nvmlDeviceGetTopologyCommonAncestor");
  if (!init_ || !shutdown_ || !error_string || !driver_version || !device_count || !by_index) {
    error_ = "libnvidia-ml.so.1 lacks nvmlInit_v2 or another basic call (a driver older than R450?)";
    return;
  }
  if (nvml::Return rc = init_(); rc != nvml::kSuccess) {
    error_ = std::string("nvmlInit: ") + error_string(rc);
    return;
  }
  ready_ = true;
}

Nvml::~Nvml() {
  if (ready_) shutdown_();
  if (lib_) ::dlclose(lib_);
}

}  // namespace loom::dist::diagnostics
