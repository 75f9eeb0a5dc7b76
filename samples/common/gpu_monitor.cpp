#include "samples/common/gpu_monitor.h"

#include <cstdio>

#include "kernels/config.h"
#include "parallel/diagnostics/nvml.h"
#if LOOM_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace loom::samples {

std::string gpu_monitor_line() {
#if LOOM_WITH_CUDA
  using dist::diagnostics::Nvml;
  namespace nvml = dist::diagnostics::nvml;
  static const Nvml* lib = new Nvml;  // kept for the process: NVML is not shut down
  if (!lib->ready() || !lib->by_pci || !lib->utilization || !lib->memory) return "";
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) return "";
  std::string line;
  for (int i = 0; i < count; ++i) {
    // CUDA and NVML number GPUs differently; the PCI address ties the two.
    char pci[32];
    nvml::Device dev = nullptr;
    nvml::Utilization util{};
    nvml::Memory mem{};
    if (cudaDeviceGetPCIBusId(pci, sizeof pci, i) != cudaSuccess || lib->by_pci(pci, &dev) != nvml::kSuccess ||
        lib->utilization(dev, &util) != nvml::kSuccess || lib->memory(dev, &mem) != nvml::kSuccess)
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
