// The fact gathering behind machine_probe.h. Every CUDA and NVML call's status is checked;
// a failing call leaves its fact empty (and a note where the driver is present).
#include "parallel/diagnostics/machine_probe.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstdio>

#include "kernels/config.h"
#include "parallel/diagnostics/nvml.h"
#include "parallel/rendezvous.h"

#if LOOM_WITH_CUDA
#include <cuda_runtime.h>
#endif
#if LOOM_WITH_CUDNN
#include <cudnn.h>
#endif
#if LOOM_WITH_NCCL
#include <nccl.h>
#endif

namespace loom::dist::diagnostics {
namespace {

std::string pci_text(unsigned domain, unsigned bus, unsigned device) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%04x:%02x:%02x.0", domain, bus, device);
  return buf;
}

void note(Machine& m, std::string check, std::string what) {
  m.notes.push_back({Level::warn, std::move(check), std::move(what), "check `nvidia-smi` and dmesg for driver errors"});
}

#if LOOM_WITH_CUDA
std::string cuda_error_text(cudaError_t rc) {
  return std::string(cudaGetErrorName(rc)) + ": " + cudaGetErrorString(rc);
}

std::string uuid_text(const cudaUUID_t& id) {
  const auto* b = reinterpret_cast<const unsigned char*>(id.bytes);
  char buf[48];
  std::snprintf(buf, sizeof buf, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1],
                b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
  return buf;
}

void probe_cuda(Machine& m) {
  m.built_cudart = CUDART_VERSION;
  int v = 0;
  if (cudaDriverGetVersion(&v) == cudaSuccess) m.driver.driver_cuda = v;
  if (cudaRuntimeGetVersion(&v) == cudaSuccess) m.loaded_cudart = v;
  int n = 0;
  if (cudaError_t rc = cudaGetDeviceCount(&n); rc != cudaSuccess) {
    m.driver.cuda_error = cuda_error_text(rc);
    cudaGetLastError();
    return;
  }
  m.driver.cuda_gpus = n;
  for (int i = 0; i < n; ++i) {
    GpuInfo g;
    g.index = i;
    cudaDeviceProp p{};
    if (cudaError_t rc = cudaGetDeviceProperties(&p, i); rc != cudaSuccess) {
      cudaGetLastError();
      note(m, "gpu" + std::to_string(i),
           "cudaGetDeviceProperties(" + std::to_string(i) + ") failed: " + cuda_error_text(rc));
      g.name = "(unknown)";
      m.gpus.push_back(g);
      continue;
    }
    g.name = p.name;
    g.memory_total = p.totalGlobalMem;
    g.cc_major = p.major;
    g.cc_minor = p.minor;
    g.sms = p.multiProcessorCount;
    g.pci = pci_text(unsigned(p.pciDomainID), unsigned(p.pciBusID), unsigned(p.pciDeviceID));
    g.uuid = uuid_text(p.uuid);
    int khz = 0;
    if (cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, i) == cudaSuccess) g.sm_clock_mhz = khz / 1000;
    if (cudaDeviceGetAttribute(&khz, cudaDevAttrMemoryClockRate, i) == cudaSuccess) g.memory_clock_mhz = khz / 1000;
    cudaGetLastError();
    m.gpus.push_back(g);
  }
  m.links.assign(size_t(n), std::vector<Link>(size_t(n)));
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j) {
      if (i == j) continue;
      int can = 0;
      if (cudaError_t rc = cudaDeviceCanAccessPeer(&can, i, j); rc == cudaSuccess) {
        m.links[i][j].peer_access = can ? 1 : 0;
      } else {
        cudaGetLastError();
        note(m, "links",
             "cudaDeviceCanAccessPeer(" + std::to_string(i) + ", " + std::to_string(j) +
                 ") failed: " + cuda_error_text(rc));
      }
    }
}
#endif

// Fills what NVML knows about one GPU into `g`; CUDA's values stay where NVML has none.
void nvml_details(Nvml& lib, nvml::Device d, GpuInfo& g) {
  char text[96] = {};
  if (lib.name && lib.name(d, text, sizeof text) == nvml::kSuccess && g.name.empty()) g.name = text;
  if (lib.uuid && lib.uuid(d, text, sizeof text) == nvml::kSuccess) g.uuid = text;
  nvml::Memory mem{};
  if (lib.memory && lib.memory(d, &mem) == nvml::kSuccess) {
    g.memory_total = mem.total;
    g.memory_used = mem.used;
  }
  int major = 0, minor = 0;
  if (g.cc_major == 0 && lib.capability && lib.capability(d, &major, &minor) == nvml::kSuccess) {
    g.cc_major = major;
    g.cc_minor = minor;
  }
  unsigned mhz = 0;
  if (lib.max_clock && lib.max_clock(d, nvml::kClockSm, &mhz) == nvml::kSuccess) g.sm_clock_mhz = int(mhz);
  if (lib.max_clock && lib.max_clock(d, nvml::kClockMemory, &mhz) == nvml::kSuccess) g.memory_clock_mhz = int(mhz);
  nvml::PciInfo pci{};
  if (g.pci.empty() && lib.pci_info && lib.pci_info(d, &pci) == nvml::kSuccess)
    g.pci = pci_text(pci.domain, pci.bus, pci.device);
}

std::vector<NvLinkEnd> nvlink_ends(Nvml& lib, nvml::Device d) {
  std::vector<NvLinkEnd> ends;
  if (!lib.nvlink_state) return ends;
  for (unsigned link = 0; link < nvml::kMaxNvLinks; ++link) {
    nvml::EnableState active = 0;
    // Past the GPU's own link count, or on a GPU without NVLink, the call fails: not a link.
    if (lib.nvlink_state(d, link, &active) != nvml::kSuccess || active != nvml::kEnabled) continue;
    NvLinkEnd end;
    nvml::PciInfo pci{};
    const bool have_pci = lib.nvlink_remote_pci && lib.nvlink_remote_pci(d, link, &pci) == nvml::kSuccess;
    if (have_pci) end.remote_pci = pci_text(pci.domain, pci.bus, pci.device);
    nvml::NvLinkDeviceType type = nvml::kNvLinkUnknown;
    if (lib.nvlink_remote_type && lib.nvlink_remote_type(d, link, &type) == nvml::kSuccess)
      end.remote = type == nvml::kNvLinkGpu      ? NvLinkEnd::Remote::gpu
                   : type == nvml::kNvLinkSwitch ? NvLinkEnd::Remote::nvswitch
                                                            : NvLinkEnd::Remote::other;
    else if (have_pci)
      end.remote = NvLinkEnd::Remote::gpu;  // counted only if the address is one of the GPUs
    ends.push_back(end);
  }
  return ends;
}

void probe_nvml(Nvml& lib, Machine& m) {
  if (!lib.ready()) {
    m.driver.nvml_error = lib.error();
    return;
  }
  char version[96] = {};
  if (lib.driver_version(version, sizeof version) == nvml::kSuccess) m.driver.driver_version = version;
  unsigned count = 0;
  if (nvml::Return rc = lib.device_count(&count); rc != nvml::kSuccess) {
    note(m, "nvml", std::string("nvmlDeviceGetCount failed: ") + lib.error_string(rc));
    return;
  }
  m.driver.nvml_gpus = int(count);
  std::vector<nvml::Device> handles;
  if (m.gpus.empty()) {  // CUDA sees no GPU (or Loom has no CUDA): list NVML's, in its order
    for (unsigned i = 0; i < count; ++i) {
      nvml::Device d = nullptr;
      if (lib.by_index(i, &d) != nvml::kSuccess) continue;
      GpuInfo g;
      g.index = int(i);
      nvml_details(lib, d, g);
      m.gpus.push_back(g);
      handles.push_back(d);
    }
    m.gpus_from_nvml = !m.gpus.empty();
    m.links.assign(m.gpus.size(), std::vector<Link>(m.gpus.size()));
  } else {
    for (GpuInfo& g : m.gpus) {
      nvml::Device d = nullptr;
      if (!lib.by_pci || g.pci.empty() || lib.by_pci(g.pci.c_str(), &d) != nvml::kSuccess) d = nullptr;
      if (d) nvml_details(lib, d, g);
      handles.push_back(d);
    }
  }
  std::vector<std::vector<NvLinkEnd>> ends;
  for (nvml::Device d : handles) ends.push_back(d ? nvlink_ends(lib, d) : std::vector<NvLinkEnd>{});
  for (size_t i = 0; i < handles.size(); ++i)
    for (size_t j = 0; j < handles.size(); ++j) {
      if (i == j || !handles[i] || !handles[j]) continue;
      Link& link = m.links[i][j];
      link.nvlinks = nvlinks_between(ends[i], m.gpus[j].pci, ends[j]);
      nvml::TopologyLevel level = 0;
      if (lib.common_ancestor && lib.common_ancestor(handles[i], handles[j], &level) == nvml::kSuccess)
        link.path = pcie_path_name(int(level));
    }
}

void probe_libraries(Machine& m) {
#if LOOM_WITH_CUDNN
  m.built_cudnn = CUDNN_VERSION;
  m.loaded_cudnn = int64_t(cudnnGetVersion());
  m.cudnn_cudart = int64_t(cudnnGetCudartVersion());
#if CUDNN_MAJOR >= 9
  m.cudnn_max_device = int64_t(cudnnGetMaxDeviceVersion());
#endif
#endif
#if LOOM_WITH_NCCL
  m.built_nccl = NCCL_VERSION_CODE;
  int v = 0;
  if (ncclGetVersion(&v) == ncclSuccess) m.loaded_nccl = v;
#endif
}

}  // namespace

Machine probe_machine() {
  Machine m;
  m.driver.built_with_cuda = LOOM_WITH_CUDA;
  m.driver.cuda_visible_devices = dist::process_env("CUDA_VISIBLE_DEVICES");
#if LOOM_WITH_CUDA
  probe_cuda(m);
  m.driver.built_cudart = m.built_cudart;
#endif
  Nvml lib;
  probe_nvml(lib, m);
  if (!lib.ready() && m.driver.cuda_gpus == 0) m.driver.pci_gpus = nvidia_pci_devices();
  probe_libraries(m);
  m.interfaces = network_interfaces();
  m.addresses = local_addresses();
  m.infiniband = directory_entries("/sys/class/infiniband");
  return m;
}

namespace {
template <class Fn>
void for_each_address(Fn&& fn) {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return;
  for (ifaddrs* a = list; a; a = a->ifa_next) {
    if (!a->ifa_addr || (a->ifa_addr->sa_family != AF_INET && a->ifa_addr->sa_family != AF_INET6)) continue;
    char text[INET6_ADDRSTRLEN] = {};
    const void* ip = a->ifa_addr->sa_family == AF_INET6
                         ? static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(a->ifa_addr)->sin6_addr)
                         : static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr);
    if (::inet_ntop(a->ifa_addr->sa_family, ip, text, sizeof text)) fn(std::string(a->ifa_name), std::string(text));
  }
  ::freeifaddrs(list);
}
}  // namespace

std::vector<std::string> network_interfaces() {
  std::vector<std::string> out;
  for_each_address([&](const std::string& name, const std::string&) {
    if (std::find(out.begin(), out.end(), name) == out.end()) out.push_back(name);
  });
  return out;
}

std::vector<std::string> local_addresses() {
  std::vector<std::string> out;
  for_each_address([&](const std::string&, const std::string& address) { out.push_back(address); });
  return out;
}

Resolved resolve_host(const std::string& host) {
  Resolved r;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &found); rc != 0) {
    r.error = ::gai_strerror(rc);
    return r;
  }
  for (addrinfo* a = found; a; a = a->ai_next) {
    char text[INET6_ADDRSTRLEN] = {};
    const void* ip = a->ai_family == AF_INET6
                         ? static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr)
                         : static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr);
    if (::inet_ntop(a->ai_family, ip, text, sizeof text) &&
        std::find(r.addresses.begin(), r.addresses.end(), text) == r.addresses.end())
      r.addresses.push_back(text);
  }
  ::freeaddrinfo(found);
  return r;
}

}  // namespace loom::dist::diagnostics
