#include "samples/common/gpu_monitor.h"

#include <dlfcn.h>

#include <cstdio>
#include <mutex>

#include "kernels/config.h"
#if LOOM_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace loom::samples {
namespace {

// The few NVML types used here, as NVML declares them (nvml.h is not needed).
using nvmlDevice_t = struct nvmlDevice_st*;
using nvmlReturn_t = int;  // 0 = NVML_SUCCESS
struct nvmlUtilization_t {
  unsigned int gpu, memory;
};
struct nvmlMemory_t {
  unsigned long long total, free, used;
};

struct Nvml {
  bool ok = false;
  nvmlReturn_t (*by_pci)(const char*, nvmlDevice_t*) = nullptr;
  nvmlReturn_t (*utilization)(nvmlDevice_t, nvmlUtilization_t*) = nullptr;
  nvmlReturn_t (*memory)(nvmlDevice_t, nvmlMemory_t*) = nullptr;

  Nvml() {
    void* lib = ::dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) return;
    auto init = reinterpret_cast<nvmlReturn_t (*)()>(::dlsym(lib, "nvmlInit_v2"));
    by_pci = reinterpret_cast<decltype(by_pci)>(::dlsym(lib, "nvmlDeviceGetHandleByPciBusId_v2"));
    utilization = reinterpret_cast<decltype(utilization)>(::dlsym(lib, "nvmlDeviceGetUtilizationRates"));
    memory = reinterpret_cast<decltype(memory)>(::dlsym(lib, "nvmlDeviceGetMemoryInfo"));
    ok = init && by_pci && utilization && memory && init() == 0;
  }
};

const Nvml& nvml() {
  static const Nvml* instance = new Nvml;  // kept for the process: NVML is not shut down
  return *instance;
}

}  // namespace

std::string gpu_monitor_line() {
#if LOOM_WITH_CUDA
  const Nvml& n = nvml();
  if (!n.ok) return "";
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) return "";
  std::string line;
  for (int i = 0; i < count; ++i) {
    // CUDA and NVML number GPUs differently; the PCI address ties the two.
    char pci[32];
    nvmlDevice_t dev = nullptr;
    nvmlUtilization_t util{};
    nvmlMemory_t mem{};
    if (cudaDeviceGetPCIBusId(pci, sizeof pci, i) != cudaSuccess || n.by_pci(pci, &dev) != 0 ||
        n.utilization(dev, &util) != 0 || n.memory(dev, &mem) != 0)
      continue;
    char part[96];
    std::snprintf(part, sizeof part, "%sgpu%d %u%% %.1f/%.1fG", line.empty() ? "" : "  ", i, util.gpu,
                  double(mem.used) / double(1ull << 30), double(mem.total) / double(1ull << 30));
    line += part;
  }
  return line;
#else
  return "";
#endif
}

}  // namespace loom::samples
