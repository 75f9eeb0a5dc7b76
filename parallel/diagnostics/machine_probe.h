// The facts doctor_checks.h judges, gathered from this machine (samples/doctor.cpp runs both):
// the driver and the GPUs through the CUDA runtime and NVML (nvml.h), the links between GPUs,
// the versions of the CUDA runtime, cuDNN and NCCL that are loaded, the network interfaces.
//
// NVML is loaded with dlopen at run time, never linked, so the same binary runs on a machine
// without a driver. GPUs are listed in CUDA's order (cuda:N, as Loom numbers them) and NVML's
// view of each is found by PCI address, since NVML numbers GPUs in PCI order and ignores
// CUDA_VISIBLE_DEVICES. Nothing here throws for a missing driver or library: what cannot be
// learned stays empty, and calls that fail on a present driver are kept as notes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "doctor_checks.h"

namespace loom::dist::diagnostics {

struct Machine {
  DriverFacts driver;
  std::vector<GpuInfo> gpus;
  bool gpus_from_nvml = false;  // CUDA sees none: the list is NVML's, for information only
  LinkMatrix links;
  int built_cudart = 0, loaded_cudart = 0;
  int64_t built_cudnn = 0, loaded_cudnn = 0, cudnn_cudart = 0, cudnn_max_device = 0;
  int built_nccl = 0, loaded_nccl = 0;
  std::vector<std::string> interfaces, infiniband, addresses;
  Findings notes;  // calls that failed while gathering
};

Machine probe_machine();

// Names of the network interfaces that have an IPv4 or IPv6 address (getifaddrs), in order.
std::vector<std::string> network_interfaces();
// Those addresses as text.
std::vector<std::string> local_addresses();
// getaddrinfo on `host`: its addresses as text, or the resolver's error.
Resolved resolve_host(const std::string& host);

}  // namespace loom::dist::diagnostics
