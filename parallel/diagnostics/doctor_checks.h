// The verdicts behind `doctor` (samples/doctor.cpp), which checks whether a machine is fit
// to train: its GPUs and the links between them, the chain driver -> CUDA runtime -> cuDNN
// and NCCL, the GPU code in the build, the NCCL settings in the environment, the rendezvous
// address and port, and one all-reduce.
//
// machine_probe.h gathers the facts (NVML, the CUDA runtime, getifaddrs) and these
// functions judge them. They take plain numbers, lists and an EnvLookup rather than probing the machine
// themselves, so tests can feed them any machine: a driver too old for the runtime, a
// GPU newer than the build, NCCL_SOCKET_IFNAME naming an absent interface.
//
// Every finding is OK (a fact that is fine), INFO (worth knowing, changes nothing), WARN
// (works, but slower or fragile) or FAIL (training will not work); WARN and FAIL carry the
// fix. A machine is fit to train when no finding is FAIL.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "../rendezvous.h"
#include "json.h"

namespace loom::dist::diagnostics {

enum class Level { ok, info, warn, fail };
// "OK  ", "INFO", "WARN", "FAIL": the column each line of the report starts with.
const char* level_tag(Level level);
// "ok", "info", "warn", "fail": the JSON report's words.
const char* level_name(Level level);

struct Finding {
  Level level = Level::ok;
  std::string check;    // a stable name for the JSON report: "driver", "arch.gpu1", "nccl.ifname"
  std::string message;  // what was found, in plain words
  std::string fix;      // what to do about it (WARN and FAIL; a hint for some INFO)
};
using Findings = std::vector<Finding>;

// 1 when any finding is FAIL, else 0: the program's exit code.
int exit_code(const Findings& findings);

// ---- versions ------------------------------------------------------------------------------

struct Version {
  int major = 0, minor = 0, patch = -1;  // patch -1: not part of the version (CUDA's)
  std::string str() const;               // "12.8", "9.19.0"
  auto operator<=>(const Version&) const = default;
};
// CUDA's encoding (cudaDriverGetVersion, CUDART_VERSION): 12080 -> 12.8.
Version cuda_version(int code);
// cuDNN's: 9.x is major*10000 + minor*100 + patch (91900 -> 9.19.0), 8.x major*1000 + ... (8907 -> 8.9.7).
Version cudnn_version(int64_t code);
// NCCL's: from 2.9 major*10000 + minor*100 + patch (22809 -> 2.28.9), before that *1000 (2708 -> 2.7.8).
Version nccl_version(int code);
// The oldest Linux driver for a CUDA major version ("580.65.06" for 13), or "" when unknown.
std::string minimum_driver(int cuda_major);

// The driver's CUDA (cudaDriverGetVersion; 0 when there is no driver) against the runtime Loom
// was built with (CUDART_VERSION) and the one it loaded (cudaRuntimeGetVersion).
Findings check_cuda_chain(int driver_cuda, int built_cudart, int loaded_cudart);
// cuDNN as built (CUDNN_VERSION; 0 when Loom was built without it) and as loaded
// (cudnnGetVersion), the CUDA it was built for (cudnnGetCudartVersion) against Loom's runtime
// and the driver.
Findings check_cudnn(int64_t built, int64_t loaded, int64_t cudnn_cudart, int runtime_cuda, int driver_cuda);
// NCCL as built (NCCL_VERSION_CODE; 0 without NCCL) and as loaded (ncclGetVersion).
Findings check_nccl_version(int built, int loaded, int gpus);

// ---- GPU code in the build -------------------------------------------------------------------

// One entry of LOOM_CUDA_ARCHS: 90, or 90 with variant 'a' (arch-specific: that GPU only) or
// 'f' (family-specific: that major version).
struct Arch {
  int sm = 0;
  char variant = 0;
  std::string str() const;  // "90", "90a"
  bool operator==(const Arch&) const = default;
};
// "80;90" -> {80, 90}; also accepts "8.0", "sm_90", "compute_90a", commas and spaces. Entries
// that are not architectures are skipped.
std::vector<Arch> parse_cuda_archs(std::string_view list);
// Whether a GPU of compute capability major.minor runs the build: SASS for a listed
// architecture of its major version at or below it (OK), else the PTX of the last entry when
// the GPU is newer (WARN: JIT at start-up), else nothing (FAIL), each with the -Dcuda-arch to
// build instead.
Finding check_arch(int gpu, int major, int minor, std::string_view archs);
// cudnnGetMaxDeviceVersion (major*100 + minor*10: 1210 is 12.1) against the GPU: a WARN when
// cuDNN predates the GPU, else nothing.
std::vector<Finding> check_cudnn_arch(int gpu, int major, int minor, int64_t cudnn_max_device);

// ---- the driver and the GPUs -----------------------------------------------------------------

struct DriverFacts {
  bool built_with_cuda = false;
  int built_cudart = 0;        // CUDART_VERSION, for the driver a fix asks for
  std::string nvml_error;      // why NVML could not be used; "" when it was
  std::string driver_version;  // "580.95.05"; "" when unknown
  int driver_cuda = 0;         // cudaDriverGetVersion; 0: no driver
  int nvml_gpus = -1;          // GPUs NVML sees on the host; -1 unknown
  int cuda_gpus = 0;           // GPUs the CUDA runtime sees
  std::string cuda_error;      // "cudaErrorNoDevice: ..." when cudaGetDeviceCount failed
  std::optional<std::string> cuda_visible_devices;
  std::vector<std::string> pci_gpus;  // NVIDIA display/3D controllers on the PCI bus
};
// Whether there is a driver, whether CUDA sees the GPUs, and what to do when it does not.
Findings check_driver(const DriverFacts& facts);

struct GpuInfo {
  int index = 0;                               // cuda:N (NVML's index when CUDA sees none)
  std::string name, uuid, pci;                 // pci: "0000:18:00.0"
  uint64_t memory_total = 0, memory_used = 0;  // bytes; used 0 when unknown
  int cc_major = 0, cc_minor = 0;
  int sms = 0;
  int sm_clock_mhz = 0, memory_clock_mhz = 0;  // the maximum clocks; 0 when unknown
};
// One line per GPU, and a WARN for a GPU other processes already fill.
Findings check_gpus(const std::vector<GpuInfo>& gpus);

// ---- links between GPUs ----------------------------------------------------------------------

// One active NVLink of a GPU: where it leads.
struct NvLinkEnd {
  enum class Remote { gpu, nvswitch, other };
  Remote remote = Remote::other;
  std::string remote_pci;  // the GPU at the other end ("0000:18:00.0"), for Remote::gpu
};
// NVLinks joining GPU a to GPU b (b's PCI address b_pci): a's links that lead to b, or, when both
// reach NVSwitches, the links the fewer-linked of the two has into the switches (nvidia-smi
// shows NV18 between any two H100/H200 of an HGX board).
int nvlinks_between(const std::vector<NvLinkEnd>& a, const std::string& b_pci, const std::vector<NvLinkEnd>& b);
// nvmlDeviceGetTopologyCommonAncestor's levels as nvidia-smi names them: 10 PIX, 20 PXB,
// 30 PHB, 40 NODE, 50 SYS; 0 (same board) is "PIX" too; "" otherwise.
std::string pcie_path_name(int nvml_level);

struct Link {
  int nvlinks = 0;
  std::string path;      // PIX, PXB, PHB, NODE or SYS; "" when unknown
  int peer_access = -1;  // cudaDeviceCanAccessPeer: 1, 0, -1 unknown
};
using LinkMatrix = std::vector<std::vector<Link>>;  // (gpus, gpus); the diagonal is unused
// "NV18", "PHB", "?"; "X" on the diagonal (i == j).
std::string link_label(const Link& link, bool self = false);
// The matrix as `nvidia-smi topo -m` prints it, one line per GPU.
std::string link_table(const LinkMatrix& links);
// A WARN naming GPU pairs without peer access, an OK when every pair has NVLink, an INFO
// naming pairs joined over PCIe only.
Findings check_links(const LinkMatrix& links);

// ---- NCCL settings ---------------------------------------------------------------------------

// Every NCCL_* variable of an environment block (environ), in order.
std::vector<std::pair<std::string, std::string>> nccl_variables(char** envp);
// NCCL_SOCKET_IFNAME's syntax: a comma-separated list of name prefixes; a leading '^' excludes
// the listed interfaces instead, and a leading '=' (after any '^') compares whole names.
// A ":port" after a name is dropped.
struct IfnameFilter {
  bool exclude = false, exact = false;
  std::vector<std::string> names;
};
IfnameFilter parse_ifname_filter(std::string_view value);
// The interfaces (in the given order) that the filter lets NCCL use.
std::vector<std::string> matching_interfaces(const IfnameFilter& filter, const std::vector<std::string>& interfaces);

struct NetFacts {
  int gpus = 0;                         // GPUs CUDA sees
  bool nccl = false;                    // Loom was built with NCCL: GPU ranks use it
  bool nvlink = false;                  // some pair of GPUs shares NVLink
  bool peer_access = false;             // some pair has P2P (NVLink or PCIe)
  std::vector<std::string> interfaces;  // network interfaces with an address
  std::vector<std::string> infiniband;  // /sys/class/infiniband entries
};
// The NCCL_* (and GLOO_SOCKET_IFNAME) settings against the machine: the known traps.
Findings check_nccl_env(const dist::EnvLookup& env, const NetFacts& facts);
// One INFO listing the NCCL_* variables in effect (or saying there are none).
Finding nccl_settings(const std::vector<std::pair<std::string, std::string>>& vars);

// ---- rendezvous ------------------------------------------------------------------------------

// What a name lookup of MASTER_ADDR gave (machine_probe.h: resolve_host).
struct Resolved {
  std::vector<std::string> addresses;
  std::string error;  // "" when the name resolved
};
// MASTER_ADDR resolves; MASTER_PORT (default 29500) is a port and free on this host when
// MASTER_ADDR is this host (an address in `local_addresses`, or a loopback one).
Findings check_rendezvous(const dist::EnvLookup& env, const std::function<Resolved(const std::string&)>& resolve,
                          const std::function<bool(int)>& port_free, const std::vector<std::string>& local_addresses);

// ---- facts read from sysfs (a folder argument, so tests can point them at a made-up tree) ------

// The entries of a directory, sorted; none when it does not exist.
std::vector<std::string> directory_entries(const std::string& dir);
// NVIDIA VGA/3D controllers under a sysfs PCI device folder: their addresses.
std::vector<std::string> nvidia_pci_devices(const std::string& sysfs_pci = "/sys/bus/pci/devices");

// ---- the smoke test --------------------------------------------------------------------------

struct SmokeResult {
  std::string backend;      // "nccl" or "gloo"; "" when not run
  std::string skipped;      // why it did not run; "" when it ran
  std::string skipped_fix;  // when not running it is a problem: what to do (a WARN)
  int ranks = 0;
  int64_t bytes = 0;         // per rank
  int exit_code = 0;         // the launcher's
  double startup_s = 0;      // from launch to exit, all ranks
  double allreduce_ms = -1;  // the slowest rank's timed all-reduce; -1 when none reported it
  std::string wrong;         // a rank's report of a wrong sum
};
Finding check_smoke(const SmokeResult& result);

// ---- the JSON report -------------------------------------------------------------------------

// The findings as a JSON array of {level, check, message, fix} objects.
Json to_json(const Findings& findings);

}  // namespace loom::dist::diagnostics
