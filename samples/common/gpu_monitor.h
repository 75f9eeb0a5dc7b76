// A gpustat-like reading of the GPUs while training runs: utilization and memory in use of
// every visible GPU, from NVML (parallel/diagnostics/nvml.h), which is loaded at first use and
// never linked, so a program on a machine without the NVIDIA driver simply reports nothing.
#pragma once

#include <string>

namespace loom::samples {

// "gpu0 97% 3.1/139.8G  gpu1 95% 3.0/139.8G", or "" where NVML or a GPU is missing. Each call
// reads NVML afresh (microseconds); utilization is the driver's figure over its last sample
// period (about 1/6 s to 1 s).
std::string gpu_monitor_line();

}  // namespace loom::samples
