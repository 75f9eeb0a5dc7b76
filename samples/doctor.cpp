// doctor: is this machine fit to train? The checks a multi-GPU guide walks through by hand
// (nvidia-smi -L, nvidia-smi topo -m, the driver / CUDA / cuDNN / NCCL version chain, the NCCL
// environment variables, a busy master port) as one program, ending in one all-reduce across
// every local GPU, or across two CPU ranks where there is none.
//
// parallel/diagnostics/machine_probe.h gathers the facts, parallel/diagnostics/doctor_checks.h
// judges them, and this file prints the verdicts, writes the JSON report and runs the smoke
// test. The smoke test runs in fresh processes (this program again, in the hidden --smoke-rank
// mode, started by the launcher behind loomrun): one per GPU over NCCL, as training runs,
// since a CUDA context cannot be carried across fork.
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "engine/ops.h"
#include "kernels/config.h"
#include "parallel/diagnostics/doctor_checks.h"
#include "parallel/diagnostics/machine_probe.h"
#include "parallel/init.h"
#include "parallel/launcher.h"
#include "parallel/socket.h"
#include "samples/common/flags.h"

extern char** environ;

namespace loom::samples::doctor {
namespace {

using namespace dist::diagnostics;

// ---- the smoke test --------------------------------------------------------------------------

constexpr const char* kSmokeRank = "--smoke-rank";

std::string self_path(const char* argv0) {
  char self[PATH_MAX];
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof self - 1);
  return n > 0 ? std::string(self, size_t(n)) : std::string(argv0);
}

// One rank: `doctor --smoke-rank BACKEND MIB TIMEOUT_S RESULT_PREFIX`, under the launcher's
// env:// variables. All-reduces (rank + 1) everywhere, checks every element for the sum
// 1 + ... + size, and writes "ok MS" or "wrong DETAIL" to RESULT_PREFIX.RANK.
int smoke_rank(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "doctor: %s is doctor's own: it runs one rank of the smoke test\n", kSmokeRank);
    return 2;
  }
  const std::string backend = argv[2], prefix = argv[5];
  const auto mib = dist::parse_integer(argv[3]), timeout_s = dist::parse_integer(argv[4]);
  if (!mib || !timeout_s || *mib < 1 || *timeout_s < 1) {
    std::fprintf(stderr, "doctor: %s: bad size or timeout\n", kSmokeRank);
    return 2;
  }
  // A rank stuck where no timeout reaches (a hung driver call) still ends, and the launcher stops the rest.
  ::alarm(unsigned(*timeout_s * 2 + 30));
  try {
    dist::DistContext ctx =
        dist::init_distributed(backend == "nccl" ? "cuda" : "cpu", std::chrono::seconds(*timeout_s));
    // The first collective sets up connections (and NCCL's buffers): it is not timed.
    Tensor warm = full({1024}, 1.0, DType::f32, ctx.device);
    ctx.group->all_reduce(warm)->wait();
    synchronize(ctx.device);
    const int64_t n = *mib * (int64_t(1) << 20) / 4;
    Tensor t = full({n}, double(ctx.rank + 1), DType::f32, ctx.device);
    synchronize(ctx.device);
    const auto start = std::chrono::steady_clock::now();
    ctx.group->all_reduce(t)->wait();
    synchronize(ctx.device);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();

    const Tensor host = t.to(Device::cpu());
    const float* got = host.data<float>();
    const float expected = float(ctx.size) * float(ctx.size + 1) / 2;
    std::string wrong;
    for (int64_t i = 0; i < n && wrong.empty(); ++i)
      if (got[i] != expected)
        wrong = "rank " + std::to_string(ctx.rank) + " has " + std::to_string(got[i]) + " at element " +
                std::to_string(i) + ", expected " + std::to_string(expected);
    std::ofstream(prefix + "." + std::to_string(ctx.rank))
        << (wrong.empty() ? "ok " + std::to_string(ms) : "wrong " + wrong) << "\n";
    ctx.group->barrier()->wait();  // no rank leaves while another still talks to it
    synchronize(ctx.device);
    return wrong.empty() ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "doctor: smoke test rank: %s\n", e.what());
    return 1;
  }
}

SmokeResult run_smoke(const Machine& m, const char* argv0, bool wanted, int64_t mib, int64_t timeout_s) {
  SmokeResult r;
  r.bytes = mib << 20;
  if (!wanted) {
    r.skipped = "--no-smoke";
    return r;
  }
  const int gpus = m.gpus_from_nvml ? 0 : m.driver.cuda_gpus;
  if (LOOM_WITH_NCCL && gpus > 0) {
    r.backend = "nccl";
    r.ranks = gpus;
  } else if (LOOM_WITH_GLOO) {
    r.backend = "gloo";
    r.ranks = 2;
  } else {
    r.skipped = "Loom was built without Gloo, and NCCL has no GPU, so ranks cannot communicate";
    r.skipped_fix = "install libgloo-dev and rebuild Loom";
    return r;
  }
  std::error_code error;
  std::filesystem::path tmp = std::filesystem::temp_directory_path(error);
  std::string dir_template = ((error ? std::filesystem::path("/tmp") : tmp) / "loom-doctor-XXXXXX").string();
  if (!::mkdtemp(dir_template.data())) {
    r.skipped = "cannot create a temporary folder for the ranks' results";
    r.skipped_fix = "check that TMPDIR (or /tmp) is writable";
    return r;
  }
  const std::filesystem::path dir = dir_template;
  const std::string prefix = (dir / "rank").string();

  dist::LaunchOptions options;
  options.command = {self_path(argv0), kSmokeRank, r.backend, std::to_string(mib), std::to_string(timeout_s), prefix};
  options.nproc_per_node = r.ranks;
  options.master_addr = "127.0.0.1";
  options.master_port = dist::net::free_port();
  std::cout << "running the all-reduce over " << r.ranks << (r.backend == "nccl" ? " GPU" : " CPU")
            << (r.ranks == 1 ? " rank" : " ranks") << " ..." << std::endl;
  const auto start = std::chrono::steady_clock::now();
  r.exit_code = dist::launch(options);
  r.startup_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  for (int rank = 0; rank < r.ranks; ++rank) {
    std::ifstream in(prefix + "." + std::to_string(rank));
    std::string word, rest;
    if (!(in >> word)) {
      r.allreduce_ms = -1;
      break;
    }
    std::getline(in >> std::ws, rest);
    if (word == "wrong" && r.wrong.empty()) r.wrong = rest;
    if (word == "ok") r.allreduce_ms = std::max(r.allreduce_ms, std::strtod(rest.c_str(), nullptr));
  }
  std::filesystem::remove_all(dir, error);
  return r;
}

// ---- the report ------------------------------------------------------------------------------

class Report {
 public:
  void section(const std::string& title) { std::cout << "\n" << title << "\n"; }
  void add(const Finding& f) {
    std::cout << level_tag(f.level) << " " << f.message << "\n";
    if (!f.fix.empty()) std::cout << "     fix: " << f.fix << "\n";
    std::cout.flush();
    findings_.push_back(f);
  }
  void add(const Findings& findings) {
    for (const Finding& f : findings) add(f);
  }
  void text(const std::string& block) { std::cout << block << std::flush; }
  const Findings& findings() const { return findings_; }
  int count(Level level) const {
    return int(std::count_if(findings_.begin(), findings_.end(), [&](const Finding& f) { return f.level == level; }));
  }

 private:
  Findings findings_;
};

Json optional_json(const std::optional<std::string>& value) { return value ? Json(*value) : Json(); }

Json report_json(const Machine& m, const std::vector<std::pair<std::string, std::string>>& nccl_vars,
                 const SmokeResult& smoke, const Report& report) {
  const int code = exit_code(report.findings());
  Json gpus = Json::array();
  for (const GpuInfo& g : m.gpus)
    gpus.push(Json::object()
                  .set("index", g.index)
                  .set("name", g.name)
                  .set("uuid", g.uuid)
                  .set("pci", g.pci)
                  .set("memory_total_bytes", g.memory_total)
                  .set("memory_used_bytes", g.memory_used)
                  .set("compute_capability", std::to_string(g.cc_major) + "." + std::to_string(g.cc_minor))
                  .set("sms", g.sms)
                  .set("sm_clock_max_mhz", g.sm_clock_mhz)
                  .set("memory_clock_max_mhz", g.memory_clock_mhz)
                  .set("visible_to_cuda", !m.gpus_from_nvml));
  Json links = Json::array();
  for (size_t i = 0; i < m.links.size(); ++i) {
    Json row = Json::array();
    for (size_t j = 0; j < m.links.size(); ++j) {
      const Link& l = m.links[i][j];
      row.push(Json::object()
                   .set("label", link_label(l, i == j))
                   .set("nvlinks", l.nvlinks)
                   .set("path", l.path)
                   .set("peer_access", l.peer_access < 0 || i == j ? Json() : Json(l.peer_access == 1)));
    }
    links.push(std::move(row));
  }
  auto strings = [](const std::vector<std::string>& items) {
    Json a = Json::array();
    for (const std::string& s : items) a.push(s);
    return a;
  };
  Json env = Json::object();
  for (const auto& [name, value] : nccl_vars) env.set(name, value);
  const DriverFacts& d = m.driver;
  return Json::object()
      .set("tool", "loom doctor")
      .set("fit_to_train", code == 0)
      .set("exit_code", code)
      .set("summary", Json::object()
                          .set("ok", report.count(Level::ok))
                          .set("info", report.count(Level::info))
                          .set("warn", report.count(Level::warn))
                          .set("fail", report.count(Level::fail)))
      .set("build", Json::object()
                        .set("cuda", bool(LOOM_WITH_CUDA))
                        .set("cudnn", bool(LOOM_WITH_CUDNN))
                        .set("nccl", bool(LOOM_WITH_NCCL))
                        .set("gloo", bool(LOOM_WITH_GLOO))
                        .set("cuda_archs", LOOM_CUDA_ARCHS)
                        .set("cudart_version", m.built_cudart)
                        .set("cudnn_version", m.built_cudnn)
                        .set("nccl_version", m.built_nccl))
      .set("driver", Json::object()
                         .set("found", d.driver_cuda > 0 || d.nvml_error.empty())
                         .set("version", d.driver_version)
                         .set("cuda_version", d.driver_cuda)
                         .set("nvml_error", d.nvml_error)
                         .set("nvml_gpus", d.nvml_gpus)
                         .set("cuda_gpus", d.cuda_gpus)
                         .set("cuda_error", d.cuda_error)
                         .set("cuda_visible_devices", optional_json(d.cuda_visible_devices))
                         .set("pci_gpus", strings(d.pci_gpus)))
      .set("runtime", Json::object()
                          .set("cudart_version", m.loaded_cudart)
                          .set("cudnn_version", m.loaded_cudnn)
                          .set("cudnn_cudart_version", m.cudnn_cudart)
                          .set("cudnn_max_device_version", m.cudnn_max_device)
                          .set("nccl_version", m.loaded_nccl))
      .set("gpus", std::move(gpus))
      .set("links", std::move(links))
      .set("network", Json::object()
                          .set("interfaces", strings(m.interfaces))
                          .set("addresses", strings(m.addresses))
                          .set("infiniband", strings(m.infiniband)))
      .set("nccl_env", std::move(env))
      .set("rendezvous", Json::object()
                             .set("master_addr", optional_json(dist::process_env("MASTER_ADDR")))
                             .set("master_port", optional_json(dist::process_env("MASTER_PORT"))))
      .set("smoke", Json::object()
                        .set("backend", smoke.backend)
                        .set("ranks", smoke.ranks)
                        .set("bytes", smoke.bytes)
                        .set("skipped", smoke.skipped)
                        .set("exit_code", smoke.exit_code)
                        .set("allreduce_ms", smoke.allreduce_ms < 0 ? Json() : Json(smoke.allreduce_ms))
                        .set("seconds_with_startup", smoke.startup_s)
                        .set("wrong", smoke.wrong))
      .set("checks", to_json(report.findings()));
}

std::string build_summary(const Machine& m) {
  std::string s = m.built_cudart ? "Loom was built with CUDA " + cuda_version(m.built_cudart).str()
                                 : std::string("Loom was built without CUDA (CPU only)");
  if (m.built_cudart) {
    const std::vector<Arch> archs = parse_cuda_archs(LOOM_CUDA_ARCHS);
    s += " (GPU code: ";
    for (const Arch& a : archs) s += "sm_" + a.str() + " ";
    s += archs.empty() ? "none)" : "and compute_" + archs.back().str() + " PTX)";
  }
  if (m.built_cudnn) s += ", cuDNN " + cudnn_version(m.built_cudnn).str();
  if (m.built_nccl) s += ", NCCL " + nccl_version(m.built_nccl).str();
  s += LOOM_WITH_GLOO ? ", Gloo" : ", without Gloo (no CPU ranks)";
  return s;
}

int run(int argc, char** argv) {
  std::string json;
  bool smoke = true;
  int64_t smoke_mib = 64, timeout_s = 60;
  Flags flags("doctor",
              "Checks whether this machine is fit to train: GPUs and their links, the driver / CUDA / cuDNN / NCCL\n"
              "version chain, the GPU code in the build, NCCL settings, the rendezvous port, and one all-reduce\n"
              "across every GPU (two CPU ranks without one). Prints OK/INFO/WARN/FAIL lines, each problem with\n"
              "its fix; exits 0 when nothing FAILs, 1 otherwise.");
  flags.add("json", &json, "also write every fact and verdict to this JSON file", {}, "FILE");
  flags.add_switch("smoke", &smoke, "run the all-reduce smoke test");
  flags.add("smoke-mib", &smoke_mib, "MiB each rank all-reduces in the smoke test", 1, 4096);
  flags.add("timeout", &timeout_s, "seconds the smoke test's collectives may take", 1, 3600);
  if (!flags.parse(argc, argv).empty()) flags.fail("doctor takes no positional arguments");

  std::cout << "loom doctor: is this machine fit to train?\n";
  Report report;
  report.section("Build");
  const Machine m = probe_machine();
  report.add(Finding{Level::info, "build", build_summary(m), ""});
  report.section("Driver and GPUs");
  report.add(check_driver(m.driver));
  report.add(m.notes);
  report.add(check_gpus(m.gpus));
  if (LOOM_WITH_CUDA && !m.gpus_from_nvml)
    for (const GpuInfo& g : m.gpus) {
      report.add(check_arch(g.index, g.cc_major, g.cc_minor, LOOM_CUDA_ARCHS));
      report.add(check_cudnn_arch(g.index, g.cc_major, g.cc_minor, m.cudnn_max_device));
    }
  if (m.gpus.size() >= 2) {
    report.section("Links between GPUs (as nvidia-smi topo -m: NV<n> NVLinks, PIX/PXB/PHB/NODE/SYS PCIe paths)");
    report.text(link_table(m.links));
    report.add(check_links(m.links));
  }

  report.section("Versions");
  if (!LOOM_WITH_CUDA)
    report.add(Finding{Level::info, "versions", "CUDA, cuDNN and NCCL are not part of this build", ""});
  report.add(check_cuda_chain(m.driver.driver_cuda, m.built_cudart, m.loaded_cudart));
  const int cuda_gpus = m.gpus_from_nvml ? 0 : m.driver.cuda_gpus;
  if (LOOM_WITH_CUDA)
    report.add(check_cudnn(m.built_cudnn, m.loaded_cudnn, m.cudnn_cudart, m.loaded_cudart, m.driver.driver_cuda));
  report.add(check_nccl_version(m.built_nccl, m.loaded_nccl, cuda_gpus));

  report.section("Network and NCCL settings");
  const auto nccl_vars = nccl_variables(environ);
  report.add(nccl_settings(nccl_vars));
  NetFacts net;
  net.gpus = cuda_gpus;
  net.nccl = LOOM_WITH_NCCL;
  net.interfaces = m.interfaces;
  net.infiniband = m.infiniband;
  for (size_t i = 0; i < m.links.size(); ++i)
    for (size_t j = 0; j < m.links.size(); ++j) {
      net.nvlink = net.nvlink || m.links[i][j].nvlinks > 0;
      net.peer_access = net.peer_access || m.links[i][j].peer_access == 1;
    }
  report.add(check_nccl_env(dist::process_env, net));

  report.section("Rendezvous");
  report.add(check_rendezvous(dist::process_env, resolve_host, dist::net::port_is_free, m.addresses));

  report.section("Smoke test");
  const SmokeResult result = run_smoke(m, argv[0], smoke, smoke_mib, timeout_s);
  report.add(check_smoke(result));

  const int code = exit_code(report.findings());
  const int warnings = report.count(Level::warn), failures = report.count(Level::fail);
  std::cout << "\n"
            << (code == 0 ? "verdict: fit to train"
                          : "verdict: NOT fit to train: " + std::to_string(failures) +
                                " FAIL line(s) above, each with its fix")
            << " (" << warnings << " warning" << (warnings == 1 ? "" : "s") << ")\n";
  if (!json.empty()) {
    std::ofstream out(json);
    out << report_json(m, nccl_vars, result, report).dump(2) << "\n";
    out.close();
    if (!out) {
      std::cerr << "doctor: cannot write the JSON report to '" << json << "'\n";
      return 1;
    }
    std::cout << "report written to " << json << "\n";
  }
  return code;
}

}  // namespace
}  // namespace loom::samples::doctor

int main(int argc, char** argv) {
  if (argc >= 2 && std::string(argv[1]) == loom::samples::doctor::kSmokeRank)
    return loom::samples::doctor::smoke_rank(argc, argv);
  try {
    return loom::samples::doctor::run(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "doctor: " << e.what() << "\n";
    return 1;
  }
}
