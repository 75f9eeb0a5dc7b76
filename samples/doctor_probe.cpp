// The fact gathering behind doctor_probe.h. Every CUDA and NVML call's status is checked;
// a failing call leaves its fact empty (and a note where the driver is present).
#include "samples/doctor_probe.h"

#include <arpa/inet.h>
#include <dlfcn.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstdio>

#include "kernels/config.h"
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

#if __has_include(<nvml.h>)
#include <nvml.h>
#else
// The few NVML types used here, as nvml.h (API 12) declares them; NVML keeps them stable.
extern "C" {
typedef struct nvmlDevice_st* nvmlDevice_t;
typedef enum nvmlReturn_enum { NVML_SUCCESS = 0, NVML_ERROR_UNKNOWN = 999 } nvmlReturn_t;
typedef enum nvmlEnableState_enum { NVML_FEATURE_DISABLED = 0, NVML_FEATURE_ENABLED = 1 } nvmlEnableState_t;
typedef enum nvmlClockType_enum { NVML_CLOCK_SM = 1, NVML_CLOCK_MEM = 2 } nvmlClockType_t;
typedef enum nvmlGpuLevel_enum { NVML_TOPOLOGY_INTERNAL = 0, NVML_TOPOLOGY_SYSTEM = 50 } nvmlGpuTopologyLevel_t;
typedef enum nvmlIntNvLinkDeviceType_enum {
  NVML_NVLINK_DEVICE_TYPE_GPU = 0x00,
  NVML_NVLINK_DEVICE_TYPE_SWITCH = 0x02,
  NVML_NVLINK_DEVICE_TYPE_UNKNOWN = 0xFF
} nvmlIntNvLinkDeviceType_t;
typedef struct nvmlPciInfo_st {
  char busIdLegacy[16];
  unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
  char busId[32];
} nvmlPciInfo_t;
typedef struct nvmlMemory_st {
  unsigned long long total, free, used;
} nvmlMemory_t;
}
#define NVML_NVLINK_MAX_LINKS 18
#endif

namespace loom::samples::doctor {
namespace {

std::string pci_text(unsigned domain, unsigned bus, unsigned device) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%04x:%02x:%02x.0", domain, bus, device);
  return buf;
}

// ---- NVML, loaded at run time ----------------------------------------------------------------

class Nvml {
 public:
  Nvml() {
    lib_ = ::dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib_) {
      const char* why = ::dlerror();
      error_ = why ? why : "libnvidia-ml.so.1 cannot be loaded";
      return;
    }
    bind(init, "nvmlInit_v2");
    bind(shutdown, "nvmlShutdown");
    bind(error_string, "nvmlErrorString");
    bind(driver_version, "nvmlSystemGetDriverVersion");
    bind(device_count, "nvmlDeviceGetCount_v2");
    bind(by_index, "nvmlDeviceGetHandleByIndex_v2");
    bind(by_pci, "nvmlDeviceGetHandleByPciBusId_v2");
    bind(name, "nvmlDeviceGetName");
    bind(uuid, "nvmlDeviceGetUUID");
    bind(memory, "nvmlDeviceGetMemoryInfo");
    bind(capability, "nvmlDeviceGetCudaComputeCapability");
    bind(max_clock, "nvmlDeviceGetMaxClockInfo");
    bind(pci_info, "nvmlDeviceGetPciInfo_v3");
    bind(nvlink_state, "nvmlDeviceGetNvLinkState");
    bind(nvlink_remote_pci, "nvmlDeviceGetNvLinkRemotePciInfo_v2");
    bind(nvlink_remote_type, "nvmlDeviceGetNvLinkRemoteDeviceType");  // drivers before R460 lack it
    bind(common_ancestor, "nvmlDeviceGetTopologyCommonAncestor");
    if (!init || !shutdown || !error_string || !driver_version || !device_count || !by_index) {
      error_ = "libnvidia-ml.so.1 lacks nvmlInit_v2 or another basic call (a driver older than R450?)";
      return;
    }
    if (nvmlReturn_t rc = init(); rc != NVML_SUCCESS) {
      error_ = std::string("nvmlInit: ") + error_string(rc);
      return;
    }
    ready_ = true;
  }
  ~Nvml() {
    if (ready_) shutdown();
    if (lib_) ::dlclose(lib_);
  }
  Nvml(const Nvml&) = delete;
  Nvml& operator=(const Nvml&) = delete;

  bool ready() const { return ready_; }
  const std::string& error() const { return error_; }

  nvmlReturn_t (*init)() = nullptr;
  nvmlReturn_t (*shutdown)() = nullptr;
  const char* (*error_string)(nvmlReturn_t) = nullptr;
  nvmlReturn_t (*driver_version)(char*, unsigned) = nullptr;
  nvmlReturn_t (*device_count)(unsigned*) = nullptr;
  nvmlReturn_t (*by_index)(unsigned, nvmlDevice_t*) = nullptr;
  nvmlReturn_t (*by_pci)(const char*, nvmlDevice_t*) = nullptr;
  nvmlReturn_t (*name)(nvmlDevice_t, char*, unsigned) = nullptr;
  nvmlReturn_t (*uuid)(nvmlDevice_t, char*, unsigned) = nullptr;
  nvmlReturn_t (*memory)(nvmlDevice_t, nvmlMemory_t*) = nullptr;
  nvmlReturn_t (*capability)(nvmlDevice_t, int*, int*) = nullptr;
  nvmlReturn_t (*max_clock)(nvmlDevice_t, nvmlClockType_t, unsigned*) = nullptr;
  nvmlReturn_t (*pci_info)(nvmlDevice_t, nvmlPciInfo_t*) = nullptr;
  nvmlReturn_t (*nvlink_state)(nvmlDevice_t, unsigned, nvmlEnableState_t*) = nullptr;
  nvmlReturn_t (*nvlink_remote_pci)(nvmlDevice_t, unsigned, nvmlPciInfo_t*) = nullptr;
  nvmlReturn_t (*nvlink_remote_type)(nvmlDevice_t, unsigned, nvmlIntNvLinkDeviceType_t*) = nullptr;
  nvmlReturn_t (*common_ancestor)(nvmlDevice_t, nvmlDevice_t, nvmlGpuTopologyLevel_t*) = nullptr;

 private:
  template <class Fn>
  void bind(Fn& fn, const char* symbol) {
    fn = reinterpret_cast<Fn>(::dlsym(lib_, symbol));
  }

  void* lib_ = nullptr;
  bool ready_ = false;
  std::string error_;
};

// ---- the facts -------------------------------------------------------------------------------

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
void nvml_details(Nvml& nvml, nvmlDevice_t d, GpuInfo& g) {
  char text[96] = {};
  if (nvml.name && nvml.name(d, text, sizeof text) == NVML_SUCCESS && g.name.empty()) g.name = text;
  if (nvml.uuid && nvml.uuid(d, text, sizeof text) == NVML_SUCCESS) g.uuid = text;
  nvmlMemory_t mem{};
  if (nvml.memory && nvml.memory(d, &mem) == NVML_SUCCESS) {
    g.memory_total = mem.total;
    g.memory_used = mem.used;
  }
  int major = 0, minor = 0;
  if (g.cc_major == 0 && nvml.capability && nvml.capability(d, &major, &minor) == NVML_SUCCESS) {
    g.cc_major = major;
    g.cc_minor = minor;
  }
  unsigned mhz = 0;
  if (nvml.max_clock && nvml.max_clock(d, NVML_CLOCK_SM, &mhz) == NVML_SUCCESS) g.sm_clock_mhz = int(mhz);
  if (nvml.max_clock && nvml.max_clock(d, NVML_CLOCK_MEM, &mhz) == NVML_SUCCESS) g.memory_clock_mhz = int(mhz);
  nvmlPciInfo_t pci{};
  if (g.pci.empty() && nvml.pci_info && nvml.pci_info(d, &pci) == NVML_SUCCESS)
    g.pci = pci_text(pci.domain, pci.bus, pci.device);
}

std::vector<NvLinkEnd> nvlink_ends(Nvml& nvml, nvmlDevice_t d) {
  std::vector<NvLinkEnd> ends;
  if (!nvml.nvlink_state) return ends;
  for (unsigned link = 0; link < NVML_NVLINK_MAX_LINKS; ++link) {
    nvmlEnableState_t active = NVML_FEATURE_DISABLED;
    // Past the GPU's own link count, or on a GPU without NVLink, the call fails: not a link.
    if (nvml.nvlink_state(d, link, &active) != NVML_SUCCESS || active != NVML_FEATURE_ENABLED) continue;
    NvLinkEnd end;
    nvmlPciInfo_t pci{};
    const bool have_pci = nvml.nvlink_remote_pci && nvml.nvlink_remote_pci(d, link, &pci) == NVML_SUCCESS;
    if (have_pci) end.remote_pci = pci_text(pci.domain, pci.bus, pci.device);
    nvmlIntNvLinkDeviceType_t type = NVML_NVLINK_DEVICE_TYPE_UNKNOWN;
    if (nvml.nvlink_remote_type && nvml.nvlink_remote_type(d, link, &type) == NVML_SUCCESS)
      end.remote = type == NVML_NVLINK_DEVICE_TYPE_GPU      ? NvLinkEnd::Remote::gpu
                   : type == NVML_NVLINK_DEVICE_TYPE_SWITCH ? NvLinkEnd::Remote::nvswitch
                                                            : NvLinkEnd::Remote::other;
    else if (have_pci)
      end.remote = NvLinkEnd::Remote::gpu;  // counted only if the address is one of the GPUs
    ends.push_back(end);
  }
  return ends;
}

void probe_nvml(Nvml& nvml, Machine& m) {
  if (!nvml.ready()) {
    m.driver.nvml_error = nvml.error();
    return;
  }
  char version[96] = {};
  if (nvml.driver_version(version, sizeof version) == NVML_SUCCESS) m.driver.driver_version = version;
  unsigned count = 0;
  if (nvmlReturn_t rc = nvml.device_count(&count); rc != NVML_SUCCESS) {
    note(m, "nvml", std::string("nvmlDeviceGetCount failed: ") + nvml.error_string(rc));
    return;
  }
  m.driver.nvml_gpus = int(count);
  std::vector<nvmlDevice_t> handles;
  if (m.gpus.empty()) {  // CUDA sees no GPU (or Loom has no CUDA): list NVML's, in its order
    for (unsigned i = 0; i < count; ++i) {
      nvmlDevice_t d = nullptr;
      if (nvml.by_index(i, &d) != NVML_SUCCESS) continue;
      GpuInfo g;
      g.index = int(i);
      nvml_details(nvml, d, g);
      m.gpus.push_back(g);
      handles.push_back(d);
    }
    m.gpus_from_nvml = !m.gpus.empty();
    m.links.assign(m.gpus.size(), std::vector<Link>(m.gpus.size()));
  } else {
    for (GpuInfo& g : m.gpus) {
      nvmlDevice_t d = nullptr;
      if (!nvml.by_pci || g.pci.empty() || nvml.by_pci(g.pci.c_str(), &d) != NVML_SUCCESS) d = nullptr;
      if (d) nvml_details(nvml, d, g);
      handles.push_back(d);
    }
  }
  std::vector<std::vector<NvLinkEnd>> ends;
  for (nvmlDevice_t d : handles) ends.push_back(d ? nvlink_ends(nvml, d) : std::vector<NvLinkEnd>{});
  for (size_t i = 0; i < handles.size(); ++i)
    for (size_t j = 0; j < handles.size(); ++j) {
      if (i == j || !handles[i] || !handles[j]) continue;
      Link& link = m.links[i][j];
      link.nvlinks = nvlinks_between(ends[i], m.gpus[j].pci, ends[j]);
      nvmlGpuTopologyLevel_t level{};
      if (nvml.common_ancestor && nvml.common_ancestor(handles[i], handles[j], &level) == NVML_SUCCESS)
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

Machine probe() {
  Machine m;
  m.driver.built_with_cuda = LOOM_WITH_CUDA;
  m.driver.cuda_visible_devices = dist::process_env("CUDA_VISIBLE_DEVICES");
#if LOOM_WITH_CUDA
  probe_cuda(m);
  m.driver.built_cudart = m.built_cudart;
#endif
  Nvml nvml;
  probe_nvml(nvml, m);
  if (!nvml.ready() && m.driver.cuda_gpus == 0) m.driver.pci_gpus = nvidia_pci_devices();
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

}  // namespace loom::samples::doctor
