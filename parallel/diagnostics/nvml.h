// NVML, NVIDIA's management library, loaded with dlopen at run time and never linked: the
// same binary then runs on a machine without the driver (the library is missing and ready()
// says why) and on one with it. NVML has no header where the driver is not installed, so the
// few types used here are declared below, laid out as nvml.h (API 12) lays them out; NVML
// keeps them stable, and a call through dlsym needs only their layout.
//
// NVML numbers GPUs in PCI order and ignores CUDA_VISIBLE_DEVICES: find the GPU a CUDA index
// means by its PCI address (cudaDeviceGetPCIBusId, then by_pci), never by index.
#pragma once

#include <string>

namespace loom::dist::diagnostics {

namespace nvml {
using Device = struct nvmlDevice_st*;
using Return = int;  // nvmlReturn_t
inline constexpr Return kSuccess = 0;
using EnableState = int;  // nvmlEnableState_t
inline constexpr EnableState kEnabled = 1;
using ClockType = int;  // nvmlClockType_t
inline constexpr ClockType kClockSm = 1, kClockMemory = 2;
using TopologyLevel = int;  // nvmlGpuTopologyLevel_t: 0 same board, 10 PIX ... 50 SYS
using NvLinkDeviceType = int;  // nvmlIntNvLinkDeviceType_t
inline constexpr NvLinkDeviceType kNvLinkGpu = 0x00, kNvLinkSwitch = 0x02, kNvLinkUnknown = 0xFF;
inline constexpr unsigned kMaxNvLinks = 18;  // NVML_NVLINK_MAX_LINKS
struct PciInfo {                             // nvmlPciInfo_t
  char bus_id_legacy[16];
  unsigned int domain, bus, device, pci_device_id, pci_subsystem_id;
  char bus_id[32];
};
struct Memory {  // nvmlMemory_t, bytes
  unsigned long long total, free, used;
};
struct Utilization {  // nvmlUtilization_t, percent over the driver's last sample period
  unsigned int gpu, memory;
};
}  // namespace nvml

// One loaded and initialised NVML. NVML counts its initialisations, so instances may overlap;
// each shuts down its own on destruction. Calls the driver lacks stay null: check a call
// before use, except those ready() guarantees.
class Nvml {
 public:
  Nvml();
  ~Nvml();
  Nvml(const Nvml&) = delete;
  Nvml& operator=(const Nvml&) = delete;

  // Loaded and initialised; then error_string, driver_version, device_count and by_index are set.
  bool ready() const { return ready_; }
  // Why not ready: dlopen's message, a missing basic call, or nvmlInit's error.
  const std::string& error() const { return error_; }

  const char* (*error_string)(nvml::Return) = nullptr;
  nvml::Return (*driver_version)(char*, unsigned) = nullptr;
  nvml::Return (*device_count)(unsigned*) = nullptr;
  nvml::Return (*by_index)(unsigned, nvml::Device*) = nullptr;
  nvml::Return (*by_pci)(const char*, nvml::Device*) = nullptr;
  nvml::Return (*name)(nvml::Device, char*, unsigned) = nullptr;
  nvml::Return (*uuid)(nvml::Device, char*, unsigned) = nullptr;
  nvml::Return (*memory)(nvml::Device, nvml::Memory*) = nullptr;
  nvml::Return (*utilization)(nvml::Device, nvml::Utilization*) = nullptr;
  nvml::Return (*capability)(nvml::Device, int*, int*) = nullptr;
  nvml::Return (*max_clock)(nvml::Device, nvml::ClockType, unsigned*) = nullptr;
  nvml::Return (*pci_info)(nvml::Device, nvml::PciInfo*) = nullptr;
  nvml::Return (*nvlink_state)(nvml::Device, unsigned, nvml::EnableState*) = nullptr;
  nvml::Return (*nvlink_remote_pci)(nvml::Device, unsigned, nvml::PciInfo*) = nullptr;
  nvml::Return (*nvlink_remote_type)(nvml::Device, unsigned, nvml::NvLinkDeviceType*) = nullptr;
  nvml::Return (*common_ancestor)(nvml::Device, nvml::Device, nvml::TopologyLevel*) = nullptr;

 private:
  nvml::Return (*init_)() = nullptr;
  nvml::Return (*shutdown_)() = nullptr;
  void* lib_ = nullptr;
  bool ready_ = false;
  std::string error_;
};

}  // namespace loom::dist::diagnostics
