// The verdicts of doctor_checks.h. The words of every message, the thresholds and the
// version rules live here; machine_probe.cpp gathers the facts.
#include "parallel/diagnostics/doctor_checks.h"

#include <dirent.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdio>
#include <fstream>
#include <map>

#include "parallel/diagnostics/collective_bench.h"
#include "parallel/socket.h"

namespace loom::dist::diagnostics {
namespace {

Finding make(Level level, std::string check, std::string message, std::string fix = "") {
  return {level, std::move(check), std::move(message), std::move(fix)};
}

std::string join(const std::vector<std::string>& items, const char* sep = ", ") {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) out += (i ? sep : "") + items[i];
  return out;
}

std::string format(const char* fmt, double value) {
  char buf[64];
  std::snprintf(buf, sizeof buf, fmt, value);
  return buf;
}

std::string gib(uint64_t bytes) { return format("%.1f GiB", double(bytes) / (1 << 30)); }

std::string capability(int major, int minor) { return std::to_string(major) + "." + std::to_string(minor); }

// What to install when the driver is too old for CUDA `cudart`.
std::string driver_fix(int cudart) {
  const Version v = cuda_version(cudart);
  const std::string min = minimum_driver(v.major);
  return "install an NVIDIA driver that supports CUDA " + v.str() +
         (min.empty() ? "" : " (" + min + " or newer for CUDA " + std::to_string(v.major) + ".x)") +
         "; `nvidia-smi` shows the CUDA version a driver supports";
}

bool nonzero(const std::optional<std::string>& value) {
  if (!value) return false;
  auto n = dist::parse_integer(*value);
  return n && *n != 0;
}

bool is_loopback(const std::string& address) { return address.starts_with("127.") || address == "::1"; }

std::string read_line(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

}  // namespace

const char* level_tag(Level level) { return std::array{"OK  ", "INFO", "WARN", "FAIL"}[size_t(level)]; }
const char* level_name(Level level) { return std::array{"ok", "info", "warn", "fail"}[size_t(level)]; }

int exit_code(const Findings& findings) {
  return std::any_of(findings.begin(), findings.end(), [](const Finding& f) { return f.level == Level::fail; }) ? 1 : 0;
}

// ---- versions ------------------------------------------------------------------------------

std::string Version::str() const {
  std::string s = std::to_string(major) + "." + std::to_string(minor);
  if (patch >= 0) s += "." + std::to_string(patch);
  return s;
}

Version cuda_version(int code) { return {code / 1000, code % 1000 / 10, -1}; }

Version cudnn_version(int64_t code) {
  if (code >= 90000) return {int(code / 10000), int(code % 10000 / 100), int(code % 100)};
  return {int(code / 1000), int(code % 1000 / 100), int(code % 100)};
}

Version nccl_version(int code) {
  if (code >= 10000) return {code / 10000, code % 10000 / 100, code % 100};
  return {code / 1000, code % 1000 / 100, code % 100};
}

std::string minimum_driver(int cuda_major) {
  static const std::map<int, std::string> oldest = {{11, "450.80.02"}, {12, "525.60.13"}, {13, "580.65.06"}};
  auto it = oldest.find(cuda_major);
  return it == oldest.end() ? "" : it->second;
}

Findings check_cuda_chain(int driver_cuda, int built_cudart, int loaded_cudart) {
  Findings out;
  if (built_cudart <= 0) return out;
  const Version built = cuda_version(built_cudart);
  const int runtime = loaded_cudart > 0 ? loaded_cudart : built_cudart;
  const Version loaded = cuda_version(runtime);
  if (loaded_cudart > 0) {
    if (loaded.major != built.major) {
      out.push_back(
          make(Level::fail, "cuda.runtime",
               "Loom was built with CUDA " + built.str() + " but loaded the CUDA " + loaded.str() + " runtime library",
               "put CUDA " + std::to_string(built.major) + "'s libcudart.so." + std::to_string(built.major) +
                   " first on the library path (LD_LIBRARY_PATH=/usr/local/cuda/lib64), or rebuild Loom"));
    } else if (loaded < built) {
      out.push_back(make(Level::warn, "cuda.runtime",
                         "the CUDA runtime loaded (" + loaded.str() + ") is older than the " + built.str() +
                             " Loom was built with: calls new in " + built.str() + " fail",
                         "put the CUDA " + built.str() + " runtime first on LD_LIBRARY_PATH, or rebuild Loom"));
    } else {
      out.push_back(make(Level::ok, "cuda.runtime",
                         "CUDA runtime " + loaded.str() + " (Loom was built with " + built.str() + ")"));
    }
  }
  if (driver_cuda <= 0) return out;  // no driver: check_driver says so
  const Version driver = cuda_version(driver_cuda);
  if (driver_cuda >= runtime) {
    out.push_back(
        make(Level::ok, "cuda.driver",
             "the driver supports CUDA " + driver.str() + ", enough for the CUDA " + loaded.str() + " runtime"));
  } else if (driver.major == loaded.major) {
    out.push_back(make(Level::warn, "cuda.driver",
                       "the driver supports CUDA " + driver.str() + ", older than the CUDA " + loaded.str() +
                           " runtime: Loom runs under CUDA's minor-version compatibility, but this driver cannot "
                           "JIT-compile PTX made by CUDA " +
                           loaded.str() + ", and features new since " + driver.str() + " fail",
                       driver_fix(runtime)));
  } else {
    out.push_back(make(Level::fail, "cuda.driver",
                       "the driver supports CUDA " + driver.str() + " but Loom uses the CUDA " + loaded.str() +
                           " runtime: every CUDA call fails (cudaErrorInsufficientDriver)",
                       driver_fix(runtime) + "; or rebuild Loom with CUDA " + std::to_string(driver.major)));
  }
  return out;
}

Findings check_cudnn(int64_t built, int64_t loaded, int64_t cudnn_cudart, int runtime_cuda, int driver_cuda) {
  Findings out;
  if (built <= 0) {
    out.push_back(make(Level::warn, "cudnn", "Loom was built without cuDNN: convolutions on the GPU throw",
                       "install cuDNN 9 (the library and its headers) and rebuild Loom"));
    return out;
  }
  const Version b = cudnn_version(built), l = cudnn_version(loaded);
  const std::string for_cuda = cudnn_cudart > 0 ? " for CUDA " + cuda_version(int(cudnn_cudart)).str() : "";
  if (loaded <= 0) {
    out.push_back(
        make(Level::fail, "cudnn", "cudnnGetVersion reported no cuDNN version", "reinstall cuDNN " + b.str()));
  } else if (l.major != b.major) {
    out.push_back(make(Level::fail, "cudnn", "Loom was built with cuDNN " + b.str() + " but loaded cuDNN " + l.str(),
                       "install cuDNN " + std::to_string(b.major) + ".x, or rebuild Loom against cuDNN " + l.str()));
  } else if (l < b) {
    out.push_back(make(Level::warn, "cudnn",
                       "cuDNN " + l.str() + for_cuda + " is older than the " + b.str() +
                           " Loom was built with: cuDNN is compatible only with newer minor versions",
                       "install cuDNN " + b.str() + " or newer, or rebuild Loom against cuDNN " + l.str()));
  } else {
    out.push_back(make(Level::ok, "cudnn", "cuDNN " + l.str() + for_cuda + " (Loom was built with " + b.str() + ")"));
  }
  if (cudnn_cudart <= 0) return out;
  const Version c = cuda_version(int(cudnn_cudart));
  if (driver_cuda > 0 && cuda_version(driver_cuda).major < c.major) {
    out.push_back(make(Level::fail, "cudnn.cuda",
                       "cuDNN was built for CUDA " + c.str() + ", which this driver (CUDA " +
                           cuda_version(driver_cuda).str() + ") cannot run",
                       driver_fix(int(cudnn_cudart))));
  } else if (runtime_cuda > 0 && c.major != cuda_version(runtime_cuda).major) {
    const std::string r = std::to_string(cuda_version(runtime_cuda).major);
    out.push_back(make(Level::warn, "cudnn.cuda",
                       "cuDNN was built for CUDA " + c.str() + " but Loom runs the CUDA " +
                           cuda_version(runtime_cuda).str() + " runtime",
                       "install cuDNN's build for CUDA " + r + " (the cudnn9-cuda-" + r + " package)"));
  }
  return out;
}

Findings check_nccl_version(int built, int loaded, int gpus) {
  Findings out;
  if (built <= 0) {
    if (gpus > 0)
      out.push_back(make(Level::warn, "nccl",
                         "Loom was built without NCCL: one process can train on one GPU, but multi-GPU training "
                         "(DDP, one process per GPU) cannot start",
                         "install NCCL 2 (library and nccl.h) and rebuild Loom"));
    return out;
  }
  const Version b = nccl_version(built), l = nccl_version(loaded);
  if (loaded <= 0) {
    out.push_back(make(Level::fail, "nccl", "ncclGetVersion reported no NCCL version", "reinstall NCCL " + b.str()));
  } else if (l.major != b.major) {
    out.push_back(make(Level::fail, "nccl", "Loom was built with NCCL " + b.str() + " but loaded NCCL " + l.str(),
                       "install NCCL " + b.str() + " or newer 2.x, or rebuild Loom against NCCL " + l.str()));
  } else if (l < b) {
    out.push_back(make(Level::warn, "nccl",
                       "NCCL " + l.str() + " is older than the " + b.str() +
                           " Loom was built with: functions new since " + l.str() + " are missing",
                       "install NCCL " + b.str() + " or newer, or rebuild Loom against NCCL " + l.str()));
  } else {
    out.push_back(make(Level::ok, "nccl", "NCCL " + l.str() + " (Loom was built with " + b.str() + ")"));
  }
  return out;
}

// ---- GPU code in the build -------------------------------------------------------------------

std::string Arch::str() const { return std::to_string(sm) + (variant ? std::string(1, variant) : ""); }

std::vector<Arch> parse_cuda_archs(std::string_view list) {
  std::vector<Arch> out;
  size_t i = 0;
  while (i < list.size()) {
    size_t end = list.find_first_of(";, \t", i);
    if (end == std::string_view::npos) end = list.size();
    std::string token(list.substr(i, end - i));
    i = end + 1;
    for (const char* prefix : {"sm_", "compute_"})
      if (token.starts_with(prefix)) token.erase(0, std::string_view(prefix).size());
    Arch arch;
    if (!token.empty() && (token.back() == 'a' || token.back() == 'f')) {
      arch.variant = token.back();
      token.pop_back();
    }
    std::string digits;
    for (char c : token)
      if (c != '.') digits += c;
    auto n = dist::parse_integer(digits);
    if (digits.empty() || !n || *n < 10 || *n > 999) continue;
    arch.sm = int(*n);
    out.push_back(arch);
  }
  return out;
}

Finding check_arch(int gpu, int major, int minor, std::string_view archs) {
  const std::vector<Arch> list = parse_cuda_archs(archs);
  const std::string check = "arch.gpu" + std::to_string(gpu);
  const std::string who = "GPU " + std::to_string(gpu);
  const std::string cc = capability(major, minor);
  if (list.empty())
    return make(Level::fail, check, "the build lists no GPU architecture ('" + std::string(archs) + "')",
                "rebuild with -Dcuda-arch=" + std::to_string(major * 10 + minor));
  const int sm = major * 10 + minor;
  auto runs_sass = [&](const Arch& a) { return a.variant == 'a' ? a.sm == sm : a.sm / 10 == major && a.sm <= sm; };
  for (const Arch& a : list)
    if (runs_sass(a))
      return make(Level::ok, check, who + " (compute capability " + cc + ") runs the build's sm_" + a.str() + " code");

  std::vector<Arch> wanted = list;
  wanted.push_back(Arch{sm, 0});
  std::sort(wanted.begin(), wanted.end(), [](const Arch& x, const Arch& y) { return x.sm < y.sm; });
  std::vector<std::string> names;
  for (const Arch& a : wanted) names.push_back(a.str());
  const std::string fix =
      "rebuild with -Dcuda-arch=\"" + join(names, ";") + "\" (meson configure BUILD_DIR -Dcuda-arch=...)";
  std::vector<std::string> built;
  for (const Arch& a : list) built.push_back(a.str());

  const Arch& last = list.back();
  const bool runs_ptx = last.variant == 'a' ? last.sm == sm : last.variant == 'f' ? runs_sass(last) : last.sm <= sm;
  if (runs_ptx)
    return make(Level::warn, check,
                who + " has compute capability " + cc + ", newer than the build's newest architecture (" + last.str() +
                    "): its kernels are JIT-compiled from the compute_" + last.str() +
                    " PTX when a program starts (a slow first start, and code not tuned for this GPU)",
                fix);
  return make(Level::fail, check,
              who + " has compute capability " + cc + " but the build has GPU code only for " + join(built, ";") +
                  ": no Loom kernel can run on it (cudaErrorNoKernelImageForDevice)",
              fix);
}

std::vector<Finding> check_cudnn_arch(int gpu, int major, int minor, int64_t cudnn_max_device) {
  if (cudnn_max_device <= 0 || major * 100 + minor * 10 <= cudnn_max_device) return {};
  const int known_major = int(cudnn_max_device / 100), known_minor = int(cudnn_max_device % 100 / 10);
  return {make(Level::warn, "cudnn.gpu" + std::to_string(gpu),
               "this cuDNN knows GPUs up to compute capability " + capability(known_major, known_minor) + "; GPU " +
                   std::to_string(gpu) + " (" + capability(major, minor) +
                   ") is newer: convolutions may fail or run without tuned kernels",
               "install a cuDNN release that supports compute capability " + capability(major, minor))};
}

// ---- the driver and the GPUs -----------------------------------------------------------------

Findings check_driver(const DriverFacts& f) {
  Findings out;
  // NVML answering proves a working driver; so does CUDA finding GPUs where NVML is missing.
  // libcuda alone (a container without the GPUs mounted) is not one.
  const bool driver = f.nvml_error.empty() || (f.driver_cuda > 0 && f.cuda_gpus > 0);
  if (!driver) {
    out.push_back(make(Level::info, "driver", "no NVIDIA driver found: GPU checks skipped; training runs on the CPU"));
    if (!f.pci_gpus.empty()) {
      const std::string min = f.built_cudart > 0 ? minimum_driver(cuda_version(f.built_cudart).major) : "";
      out.push_back(make(Level::warn, "driver.pci",
                         "NVIDIA GPU(s) on the PCI bus (" + join(f.pci_gpus) + ") but no working driver (" +
                             f.nvml_error + "): they go unused",
                         "install the NVIDIA driver" + (min.empty() ? "" : " (" + min + " or newer)") +
                             " and reboot (a reboot also cures 'Driver/library version mismatch' after an update); "
                             "`nvidia-smi` must then list the GPUs"));
    }
    return out;
  }
  std::string about = "NVIDIA driver";
  if (!f.driver_version.empty()) about += " " + f.driver_version;
  if (f.driver_cuda > 0) about += ", supporting CUDA " + cuda_version(f.driver_cuda).str();
  out.push_back(make(Level::ok, "driver", about));
  if (!f.nvml_error.empty())
    out.push_back(
        make(Level::info, "driver.nvml",
             "NVML is unavailable (" + f.nvml_error + "): GPU names and clocks come from CUDA, links are unknown"));
  if (!f.built_with_cuda) {
    out.push_back(make(Level::warn, "cuda.build",
                       "Loom was built without CUDA: the GPUs go unused and training runs on the CPU",
                       "rebuild Loom with the CUDA toolkit: meson setup BUILD_DIR -Dcuda=enabled"));
    return out;
  }
  if (f.cuda_error.empty() && f.cuda_gpus > 0) {
    out.push_back(make(Level::ok, "cuda.devices", std::to_string(f.cuda_gpus) + " GPU(s) visible to CUDA"));
    if (f.nvml_gpus > f.cuda_gpus && f.cuda_visible_devices)
      out.push_back(make(Level::info, "cuda.visible",
                         "CUDA_VISIBLE_DEVICES='" + *f.cuda_visible_devices + "' shows " + std::to_string(f.cuda_gpus) +
                             " of the " + std::to_string(f.nvml_gpus) + " GPUs on this host"));
    return out;
  }
  if (f.nvml_gpus == 0) {
    out.push_back(
        make(Level::info, "cuda.devices", "the NVIDIA driver is installed but finds no GPU: training runs on the CPU"));
  } else if (f.cuda_visible_devices && f.cuda_error.find("NoDevice") != std::string::npos) {
    out.push_back(
        make(Level::warn, "cuda.visible",
             "CUDA_VISIBLE_DEVICES='" + *f.cuda_visible_devices + "' hides every GPU" +
                 (f.nvml_gpus > 0 ? " of the " + std::to_string(f.nvml_gpus) + " on this host" : "") +
                 ": training runs on the CPU",
             "unset CUDA_VISIBLE_DEVICES, or list the GPUs to use by index or UUID (CUDA_VISIBLE_DEVICES=0,1)"));
  } else {
    std::string fix = "check `nvidia-smi`, and the kernel log (dmesg) for the driver's errors";
    if (f.cuda_error.find("InsufficientDriver") != std::string::npos) fix = driver_fix(f.built_cudart);
    if (f.cuda_error.find("SystemDriverMismatch") != std::string::npos)
      fix =
          "the kernel module and the driver's libraries differ in version (updated without a reboot?): reboot, or "
          "reinstall the driver";
    if (f.cuda_error.find("NoDevice") != std::string::npos)
      fix =
          "the driver sees no usable GPU: check `nvidia-smi`; in a container, pass the GPUs in (docker run --gpus all)";
    out.push_back(
        make(Level::fail, "cuda.devices",
             "the CUDA runtime cannot use the GPUs: " + (f.cuda_error.empty() ? "it finds none" : f.cuda_error), fix));
  }
  return out;
}

Findings check_gpus(const std::vector<GpuInfo>& gpus) {
  Findings out;
  for (const GpuInfo& g : gpus) {
    const std::string id = "gpu" + std::to_string(g.index);
    std::string line = "GPU " + std::to_string(g.index) + ": " + g.name + ", " + gib(g.memory_total) +
                       ", compute capability " + capability(g.cc_major, g.cc_minor);
    if (g.sms > 0) line += ", " + std::to_string(g.sms) + " SMs";
    if (g.sm_clock_mhz > 0)
      line += ", max clocks " + std::to_string(g.sm_clock_mhz) + " MHz (SM) / " + std::to_string(g.memory_clock_mhz) +
              " MHz (memory)";
    if (!g.pci.empty()) line += ", PCI " + g.pci;
    if (!g.uuid.empty()) line += ", " + g.uuid;
    out.push_back(make(Level::ok, id, line));
    if (g.memory_total > 0 && g.memory_used > g.memory_total / 4)
      out.push_back(make(Level::warn, id + ".memory",
                         "GPU " + std::to_string(g.index) + " already has " + gib(g.memory_used) + " of " +
                             gib(g.memory_total) + " in use by other processes: training gets the rest",
                         "`nvidia-smi` names the processes; end them, or pick another GPU with CUDA_VISIBLE_DEVICES"));
  }
  return out;
}

// ---- links between GPUs ----------------------------------------------------------------------

int nvlinks_between(const std::vector<NvLinkEnd>& a, const std::string& b_pci, const std::vector<NvLinkEnd>& b) {
  auto same_pci = [](const std::string& x, const std::string& y) {
    return std::equal(x.begin(), x.end(), y.begin(), y.end(), [](char p, char q) {
      return std::tolower(static_cast<unsigned char>(p)) == std::tolower(static_cast<unsigned char>(q));
    });
  };
  auto switches = [](const std::vector<NvLinkEnd>& links) {
    return int(std::count_if(links.begin(), links.end(),
                             [](const NvLinkEnd& e) { return e.remote == NvLinkEnd::Remote::nvswitch; }));
  };
  int direct = int(std::count_if(a.begin(), a.end(), [&](const NvLinkEnd& e) {
    return e.remote == NvLinkEnd::Remote::gpu && same_pci(e.remote_pci, b_pci);
  }));
  return direct + std::min(switches(a), switches(b));
}

std::string pcie_path_name(int nvml_level) {
  switch (nvml_level) {
    case 0:
    case 10:
      return "PIX";
    case 20:
      return "PXB";
    case 30:
      return "PHB";
    case 40:
      return "NODE";
    case 50:
      return "SYS";
  }
  return "";
}

std::string link_label(const Link& link, bool self) {
  if (self) return "X";
  if (link.nvlinks > 0) return "NV" + std::to_string(link.nvlinks);
  return link.path.empty() ? "?" : link.path;
}

std::string link_table(const LinkMatrix& links) {
  auto cell = [](const std::string& text) { return text + std::string(text.size() < 7 ? 7 - text.size() : 1, ' '); };
  std::string out = cell("");
  for (size_t j = 0; j < links.size(); ++j) out += cell("GPU" + std::to_string(j));
  out += "\n";
  for (size_t i = 0; i < links.size(); ++i) {
    out += cell("GPU" + std::to_string(i));
    for (size_t j = 0; j < links.size(); ++j) out += cell(link_label(links[i][j], i == j));
    out += "\n";
  }
  return out;
}

Findings check_links(const LinkMatrix& links) {
  Findings out;
  const size_t n = links.size();
  if (n < 2) return out;
  std::vector<std::string> no_peer, pcie_only, unknown;
  for (size_t i = 0; i < n; ++i)
    for (size_t j = i + 1; j < n; ++j) {
      const Link& l = links[i][j];
      const std::string pair = std::to_string(i) + "-" + std::to_string(j);
      const std::string label = link_label(l);
      if (l.peer_access == 0 || links[j][i].peer_access == 0) no_peer.push_back(pair + " (" + label + ")");
      if (l.nvlinks > 0) continue;
      (l.path.empty() ? unknown : pcie_only).push_back(pair + (l.path.empty() ? "" : " (" + l.path + ")"));
    }
  if (!no_peer.empty())
    out.push_back(make(Level::warn, "links.p2p",
                       "GPU pairs without peer-to-peer access: " + join(no_peer) +
                           ": NCCL passes their traffic through host memory, which slows every all-reduce",
                       "on bare metal, check the BIOS settings for IOMMU and PCIe ACS; in a VM or container, ask for "
                       "GPUs with P2P; `nvidia-smi topo -p2p r` shows the matrix"));
  if (pcie_only.empty() && unknown.empty())
    out.push_back(make(Level::ok, "links", "every pair of the " + std::to_string(n) + " GPUs is joined by NVLink"));
  if (!pcie_only.empty())
    out.push_back(make(Level::info, "links",
                       "GPU pairs joined over PCIe only: " + join(pcie_only) +
                           ": all-reduce between them runs at PCIe speed (NVLink is several times faster)"));
  if (!unknown.empty())
    out.push_back(make(Level::info, "links.unknown",
                       "the link type of GPU pairs " + join(unknown) + " is unknown (NVML did not say)"));
  return out;
}

// ---- NCCL settings ---------------------------------------------------------------------------

std::vector<std::pair<std::string, std::string>> nccl_variables(char** envp) {
  std::vector<std::pair<std::string, std::string>> out;
  for (char** e = envp; e && *e; ++e) {
    std::string_view entry(*e);
    size_t eq = entry.find('=');
    if (!entry.starts_with("NCCL_") || eq == std::string_view::npos) continue;
    out.emplace_back(std::string(entry.substr(0, eq)), std::string(entry.substr(eq + 1)));
  }
  return out;
}

IfnameFilter parse_ifname_filter(std::string_view value) {
  IfnameFilter f;
  if (value.starts_with('^')) {
    f.exclude = true;
    value.remove_prefix(1);
  }
  if (value.starts_with('=')) {
    f.exact = true;
    value.remove_prefix(1);
  }
  while (!value.empty()) {
    size_t comma = value.find(',');
    std::string_view name = value.substr(0, comma);
    if (size_t colon = name.find(':'); colon != std::string_view::npos) name = name.substr(0, colon);
    if (!name.empty()) f.names.emplace_back(name);
    if (comma == std::string_view::npos) break;
    value.remove_prefix(comma + 1);
  }
  return f;
}

std::vector<std::string> matching_interfaces(const IfnameFilter& filter, const std::vector<std::string>& interfaces) {
  std::vector<std::string> out;
  for (const std::string& iface : interfaces) {
    bool listed = std::any_of(filter.names.begin(), filter.names.end(), [&](const std::string& name) {
      return filter.exact ? iface == name : iface.starts_with(name);
    });
    if (listed != filter.exclude) out.push_back(iface);
  }
  return out;
}

Findings check_nccl_env(const dist::EnvLookup& env, const NetFacts& facts) {
  Findings out;
  const bool nccl_trains = facts.nccl && facts.gpus > 0;
  const std::string present = facts.interfaces.empty() ? "none" : join(facts.interfaces);

  if (auto v = env("NCCL_P2P_DISABLE"); nonzero(v)) {
    if (facts.nvlink || facts.peer_access)
      out.push_back(make(Level::warn, "nccl.p2p",
                         "NCCL_P2P_DISABLE=" + *v + " turns off the direct " +
                             (facts.nvlink ? "NVLink" : "PCIe peer-to-peer") +
                             " path these GPUs have: NCCL copies through host memory instead, several times slower",
                         "unset NCCL_P2P_DISABLE (P2P is on by default)"));
    else
      out.push_back(
          make(Level::info, "nccl.p2p", "NCCL_P2P_DISABLE=" + *v + ": no effect here (no GPU pair has peer access)"));
  }
  if (auto v = env("NCCL_IB_DISABLE"); nonzero(v) && !facts.infiniband.empty())
    out.push_back(make(Level::info, "nccl.ib",
                       "NCCL_IB_DISABLE=" + *v + " although this host has InfiniBand devices (" +
                           join(facts.infiniband) +
                           "): multi-node traffic goes over TCP sockets instead; one-node runs are unaffected",
                       "unset NCCL_IB_DISABLE for multi-node runs"));
  if (auto v = env("NCCL_SOCKET_IFNAME"); v && !v->empty()) {
    const IfnameFilter filter = parse_ifname_filter(*v);
    const std::vector<std::string> chosen = matching_interfaces(filter, facts.interfaces);
    if (chosen.empty())
      out.push_back(make(nccl_trains ? Level::fail : Level::warn, "nccl.ifname",
                         "NCCL_SOCKET_IFNAME='" + *v + "' " +
                             (filter.exclude ? "excludes every network interface" : "matches no network interface") +
                             " of this host (it has: " + present +
                             "): NCCL cannot start ('no socket interface found')" +
                             (nccl_trains ? "" : "; this matters once GPUs train here"),
                         "set it to one of them (name prefixes; '=' compares whole names, '^' excludes), or unset "
                         "it and let NCCL choose"));
    else
      out.push_back(make(Level::ok, "nccl.ifname", "NCCL_SOCKET_IFNAME='" + *v + "' selects " + join(chosen)));
  }
  if (auto v = env("GLOO_SOCKET_IFNAME"); v && !v->empty()) {
    if (std::find(facts.interfaces.begin(), facts.interfaces.end(), *v) == facts.interfaces.end())
      out.push_back(make(facts.gpus == 0 ? Level::fail : Level::warn, "gloo.ifname",
                         "GLOO_SOCKET_IFNAME='" + *v + "' names no network interface of this host (it has: " + present +
                             "): CPU ranks (Gloo) cannot start",
                         "set it to one of them (a whole name), or unset it"));
    else
      out.push_back(make(Level::ok, "gloo.ifname", "GLOO_SOCKET_IFNAME='" + *v + "' is an interface of this host"));
  }
  if (facts.nccl && facts.gpus >= 2) {
    auto v = env("NCCL_NVLS_ENABLE");
    auto n = v ? dist::parse_integer(*v) : std::nullopt;
    if (n && *n == 0)
      out.push_back(make(Level::ok, "nccl.nvls", "NCCL_NVLS_ENABLE=0: NVLink multicast (NVLS) is off"));
    else
      out.push_back(make(Level::warn, "nccl.nvls",
                         (v ? "NCCL_NVLS_ENABLE=" + *v : std::string("NCCL_NVLS_ENABLE is unset")) +
                             ": NCCL may use NVLink multicast (NVLS) on NVSwitch systems, which on a shared host "
                             "(GPUs lent out per job, VMs, containers) can fail or hang at start-up",
                         "export NCCL_NVLS_ENABLE=0"));
  }
  if (nccl_trains && !env("NCCL_DEBUG"))
    out.push_back(make(Level::info, "nccl.debug", "NCCL_DEBUG is unset: NCCL explains nothing when it fails",
                       "when NCCL fails or hangs, rerun with NCCL_DEBUG=INFO (NCCL_DEBUG_SUBSYS=INIT,NET narrows it) "
                       "to see the transports and interfaces it picks"));
  const std::pair<const char*, const char*> renamed[] = {{"NCCL_MIN_NRINGS", "NCCL_MIN_NCHANNELS"},
                                                         {"NCCL_MAX_NRINGS", "NCCL_MAX_NCHANNELS"}};
  for (auto [old_name, new_name] : renamed)
    if (auto v = env(old_name))
      out.push_back(make(Level::warn, "nccl.legacy",
                         std::string(old_name) + "=" + *v + " is the legacy name of " + new_name +
                             " (NCCL still reads it, but " + new_name + " wins when both are set)",
                         std::string("rename it ") + new_name + "=" + *v +
                             ", or drop it: NCCL picks the channel count from the topology, and a fixed one rarely "
                             "helps"));
  if (env("NCCL_ASYNC_ERROR_HANDLING"))
    out.push_back(make(Level::info, "nccl.async",
                       "NCCL_ASYNC_ERROR_HANDLING is PyTorch's setting (now TORCH_NCCL_ASYNC_ERROR_HANDLING), not "
                       "NCCL's: Loom ignores it; its collectives always time out and abort on a dead or hung rank"));
  return out;
}

Finding nccl_settings(const std::vector<std::pair<std::string, std::string>>& vars) {
  if (vars.empty()) return make(Level::info, "nccl.settings", "no NCCL_* variables set: NCCL runs with its defaults");
  std::vector<std::string> items;
  for (const auto& [name, value] : vars) items.push_back(name + "=" + value);
  return make(Level::info, "nccl.settings", "NCCL settings in effect: " + join(items));
}

// ---- rendezvous ------------------------------------------------------------------------------

Findings check_rendezvous(const dist::EnvLookup& env, const std::function<Resolved(const std::string&)>& resolve,
                          const std::function<bool(int)>& port_free, const std::vector<std::string>& local_addresses) {
  Findings out;
  std::string addr = "127.0.0.1";
  bool here = true;
  if (auto master = env("MASTER_ADDR"); !master || master->empty()) {
    out.push_back(make(Level::ok, "rendezvous.addr",
                       "MASTER_ADDR is unset: one-node runs meet on 127.0.0.1 (loomrun sets it); multi-node runs "
                       "need node 0's address"));
  } else {
    addr = *master;
    const Resolved r = resolve(addr);
    if (!r.error.empty() || r.addresses.empty()) {
      out.push_back(
          make(Level::fail, "rendezvous.addr",
               "MASTER_ADDR='" + addr + "' does not resolve" + (r.error.empty() ? "" : ": " + r.error),
               "set MASTER_ADDR to node 0's IP address, or a host name every node resolves (/etc/hosts, DNS)"));
      here = false;
    } else {
      here = std::any_of(r.addresses.begin(), r.addresses.end(), [&](const std::string& a) {
        return is_loopback(a) || std::find(local_addresses.begin(), local_addresses.end(), a) != local_addresses.end();
      });
      out.push_back(make(Level::ok, "rendezvous.addr",
                         "MASTER_ADDR='" + addr + "' resolves to " + join(r.addresses) +
                             (here ? " (this host)" : " (another host: node 0)")));
    }
  }
  int port = 29500;
  const auto given = env("MASTER_PORT");
  const bool explicit_port = given && !given->empty();
  if (explicit_port) {
    auto n = dist::parse_integer(*given);
    if (!n || *n < 1 || *n > 65535) {
      out.push_back(make(Level::fail, "rendezvous.port", "MASTER_PORT='" + *given + "' is not a TCP port",
                         "set MASTER_PORT to a free port between 1024 and 65535, or unset it and let loomrun choose"));
      return out;
    }
    port = int(*n);
  }
  const std::string p = std::to_string(port);
  if (!here) {
    out.push_back(
        make(Level::info, "rendezvous.port", "MASTER_PORT " + p + " is for node 0 to check: run doctor there"));
  } else if (port_free(port)) {
    out.push_back(make(Level::ok, "rendezvous.port",
                       explicit_port ? "MASTER_PORT " + p + " is free on this host"
                                     : "MASTER_PORT is unset; the default port, 29500, is free on this host"));
  } else if (explicit_port) {
    out.push_back(make(Level::fail, "rendezvous.port", dist::net::port_in_use_message(addr, port),
                       "`ss -ltnp 'sport = :" + p + "'` names the process that holds it"));
  } else {
    out.push_back(make(Level::warn, "rendezvous.port",
                       dist::net::port_in_use_message(addr, port) + " (torchrun and other launchers default to 29500)",
                       "loomrun picks a free port by itself; give other launchers --master-port, or stop the process "
                       "`ss -ltnp 'sport = :29500'` names"));
  }
  return out;
}

// ---- facts from this machine -----------------------------------------------------------------

std::vector<std::string> directory_entries(const std::string& dir) {
  std::vector<std::string> out;
  DIR* d = ::opendir(dir.c_str());
  if (!d) return out;
  while (dirent* e = ::readdir(d)) {
    std::string name = e->d_name;
    if (name != "." && name != "..") out.push_back(name);
  }
  ::closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<std::string> nvidia_pci_devices(const std::string& sysfs_pci) {
  std::vector<std::string> out;
  for (const std::string& device : directory_entries(sysfs_pci)) {
    const std::string base = sysfs_pci + "/" + device + "/";
    const std::string vendor = read_line(base + "vendor"), cls = read_line(base + "class");
    if (vendor == "0x10de" && (cls.starts_with("0x0300") || cls.starts_with("0x0302"))) out.push_back(device);
  }
  return out;
}

// ---- the smoke test --------------------------------------------------------------------------

Finding check_smoke(const SmokeResult& r) {
  if (!r.skipped.empty())
    return make(r.skipped_fix.empty() ? Level::info : Level::warn, "smoke", "smoke test skipped: " + r.skipped,
                r.skipped_fix);
  const bool gpu = r.backend == "nccl";
  const std::string what = "all-reduce of " + format("%.0f MiB", double(r.bytes) / (1 << 20)) + " over " +
                           std::to_string(r.ranks) + (gpu ? " GPU" : " CPU") + (r.ranks == 1 ? " rank" : " ranks") +
                           " (" + (gpu ? "NCCL" : "Gloo") + ")";
  const std::string debug = gpu ? "NCCL_DEBUG=INFO" : "LOOM_DIST_DEBUG=1";
  if (!r.wrong.empty())
    return make(Level::fail, "smoke", what + " gave a wrong sum: " + r.wrong,
                "rerun; if it repeats, check the GPUs (`nvidia-smi -q`, Xid errors in dmesg) and whether "
                "NCCL_P2P_DISABLE=1 makes it right (a peer-to-peer fault)");
  if (r.exit_code != 0)
    return make(Level::fail, "smoke",
                what + " failed (exit code " + std::to_string(r.exit_code) + "; the [rank K] lines above say why)",
                "fix the FAIL lines above first, then rerun with " + debug);
  if (r.allreduce_ms < 0)
    return make(Level::fail, "smoke", what + ": the ranks exited without reporting a result", "rerun with " + debug);
  std::string line = what + ": correct sum in " + format("%.2f ms", r.allreduce_ms);
  if (r.ranks > 1)
    line += " (bus bandwidth " +
            format("%.1f GB/s", bandwidth(Collective::all_reduce, r.bytes, r.allreduce_ms * 1e-3, r.ranks).busbw) + ")";
  return make(Level::ok, "smoke", line + "; " + format("%.1f s", r.startup_s) + " in all, with process start-up");
}

// ---- the JSON report -------------------------------------------------------------------------

Json to_json(const Findings& findings) {
  Json out = Json::array();
  for (const Finding& f : findings)
    out.push(Json::object()
                 .set("level", level_name(f.level))
                 .set("check", f.check)
                 .set("message", f.message)
                 .set("fix", f.fix));
  return out;
}

}  // namespace loom::dist::diagnostics
