// doctor's verdicts (parallel/diagnostics/doctor_checks.h) on made-up machines: version chains,
// GPU code against compute capabilities, driver states, links, NCCL environment traps,
// interface filters, the rendezvous port; then the doctor program itself on this machine,
// whose path meson passes in DOCTOR.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "parallel/diagnostics/doctor_checks.h"
#include "parallel/diagnostics/json.h"
#include "parallel/socket.h"

namespace loom::dist::diagnostics {
namespace {

// The finding named `check` (failing the test when there is none, or several).
Finding only(const Findings& findings, const std::string& check) {
  const Finding* found = nullptr;
  int n = 0;
  for (const Finding& f : findings)
    if (f.check == check) found = &f, ++n;
  EXPECT_EQ(n, 1) << "findings named " << check;
  return found ? *found : Finding{Level::ok, "(none)", "", ""};
}

bool has(const Findings& findings, const std::string& check) {
  for (const Finding& f : findings)
    if (f.check == check) return true;
  return false;
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// ---- versions ------------------------------------------------------------------------------

TEST(DoctorVersions, DecodeEachLibrarysEncoding) {
  EXPECT_EQ(cuda_version(12080).str(), "12.8");
  EXPECT_EQ(cuda_version(13000).str(), "13.0");
  EXPECT_EQ(cudnn_version(91900).str(), "9.19.0");
  EXPECT_EQ(cudnn_version(90100).str(), "9.1.0");
  EXPECT_EQ(cudnn_version(8907).str(), "8.9.7");
  EXPECT_EQ(nccl_version(22809).str(), "2.28.9");
  EXPECT_EQ(nccl_version(21003).str(), "2.10.3");
  EXPECT_EQ(nccl_version(2708).str(), "2.7.8");
  EXPECT_LT(nccl_version(2708), nccl_version(21003));
}

TEST(DoctorVersions, DriverAgainstRuntime) {
  struct Case {
    int driver, built, loaded;
    Level driver_level;
    const char* fix_part;
  } cases[] = {
      {13000, 13000, 13000, Level::ok, ""},
      {13010, 13000, 13000, Level::ok, ""},  // newer driver
      {12090, 12080, 12080, Level::ok, ""},
      {12040, 12080, 12080, Level::warn, "CUDA 12.8"},  // minor-version compatibility
      {12080, 13000, 13000, Level::fail, "580.65.06"},  // older major: nothing runs
      {11080, 12040, 12040, Level::fail, "525.60.13"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(std::to_string(c.driver) + " vs " + std::to_string(c.built));
    const Findings f = check_cuda_chain(c.driver, c.built, c.loaded);
    const Finding d = only(f, "cuda.driver");
    EXPECT_EQ(d.level, c.driver_level) << d.message;
    EXPECT_TRUE(contains(d.fix, c.fix_part)) << d.fix;
    EXPECT_EQ(only(f, "cuda.runtime").level, Level::ok);
  }
}

TEST(DoctorVersions, LoadedRuntimeAgainstBuilt) {
  EXPECT_EQ(only(check_cuda_chain(13000, 13000, 12080), "cuda.runtime").level, Level::fail);
  EXPECT_EQ(only(check_cuda_chain(13000, 13010, 13000), "cuda.runtime").level, Level::warn);
  EXPECT_EQ(only(check_cuda_chain(13020, 13000, 13010), "cuda.runtime").level, Level::ok);
  // Without a driver only the runtime is judged; without CUDA in the build, nothing.
  const Findings no_driver = check_cuda_chain(0, 13000, 13000);
  EXPECT_FALSE(has(no_driver, "cuda.driver"));
  EXPECT_TRUE(has(no_driver, "cuda.runtime"));
  EXPECT_TRUE(check_cuda_chain(0, 0, 0).empty());
}

TEST(DoctorVersions, CudnnChain) {
  struct Case {
    int64_t built, loaded;
    Level level;
  } cases[] = {
      {91900, 91900, Level::ok},   {91400, 91900, Level::ok},  // newer at run time: compatible
      {91900, 91400, Level::warn},                             // older minor than built
      {91900, 8907, Level::fail},                              // another major
      {0, 91900, Level::warn},                                 // built without cuDNN
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(std::to_string(c.built) + " built, " + std::to_string(c.loaded) + " loaded");
    EXPECT_EQ(only(check_cudnn(c.built, c.loaded, 13000, 13000, 13000), "cudnn").level, c.level);
  }
  EXPECT_FALSE(has(check_cudnn(91900, 91900, 13010, 13000, 13000), "cudnn.cuda"));
  EXPECT_EQ(only(check_cudnn(91900, 91900, 12080, 13000, 13000), "cudnn.cuda").level, Level::warn);
  EXPECT_EQ(only(check_cudnn(91900, 91900, 13000, 13000, 12080), "cudnn.cuda").level, Level::fail);
  EXPECT_TRUE(contains(only(check_cudnn(91900, 91900, 13010, 13000, 0), "cudnn").message, "for CUDA 13.1"));
}

TEST(DoctorVersions, NcclChain) {
  EXPECT_EQ(only(check_nccl_version(22809, 22809, 1), "nccl").level, Level::ok);
  EXPECT_EQ(only(check_nccl_version(22809, 22903, 1), "nccl").level, Level::ok);
  EXPECT_EQ(only(check_nccl_version(22809, 22703, 1), "nccl").level, Level::warn);
  EXPECT_EQ(only(check_nccl_version(22809, 0, 1), "nccl").level, Level::fail);
  EXPECT_EQ(only(check_nccl_version(0, 0, 2), "nccl").level, Level::warn);  // GPUs but no NCCL
  EXPECT_TRUE(check_nccl_version(0, 0, 0).empty());                         // CPU-only: not needed
}

// ---- GPU code in the build -------------------------------------------------------------------

TEST(DoctorArch, ParsesTheBuildsArchitectureList) {
  EXPECT_EQ(parse_cuda_archs("80;90"), (std::vector<Arch>{{80, 0}, {90, 0}}));
  EXPECT_EQ(parse_cuda_archs("sm_90a, compute_100f"), (std::vector<Arch>{{90, 'a'}, {100, 'f'}}));
  EXPECT_EQ(parse_cuda_archs("8.6"), (std::vector<Arch>{{86, 0}}));
  EXPECT_EQ(parse_cuda_archs("bad;;90"), (std::vector<Arch>{{90, 0}}));
  EXPECT_TRUE(parse_cuda_archs("").empty());
}

TEST(DoctorArch, CapabilityAgainstBuild) {
  struct Case {
    const char* archs;
    int major, minor;
    Level level;
    const char* part;  // in the message (OK) or the fix (WARN, FAIL)
  } cases[] = {
      {"90", 9, 0, Level::ok, "sm_90"},
      {"80;90", 8, 6, Level::ok, "sm_80"},  // SASS runs on later minors of its major
      {"80;90", 8, 9, Level::ok, "sm_80"},
      {"90", 10, 0, Level::warn, "\"90;100\""},  // newer than all: the PTX, JIT-compiled
      {"75;80", 12, 0, Level::warn, "\"75;80;120\""},
      {"80", 9, 0, Level::warn, "\"80;90\""},
      {"90", 8, 0, Level::fail, "\"80;90\""},  // older than all: nothing runs
      {"90", 7, 5, Level::fail, "\"75;90\""},
      {"80;90", 8, 0, Level::ok, "sm_80"},
      {"90a", 9, 0, Level::ok, "sm_90a"},
      {"90a", 10, 0, Level::fail, "100"},  // arch-specific PTX runs on that GPU only
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(c.archs) + " on " + std::to_string(c.major) + "." + std::to_string(c.minor));
    const Finding f = check_arch(3, c.major, c.minor, c.archs);
    EXPECT_EQ(f.level, c.level) << f.message;
    EXPECT_EQ(f.check, "arch.gpu3");
    EXPECT_TRUE(contains(c.level == Level::ok ? f.message : f.fix, c.part)) << f.message << " / " << f.fix;
  }
}

TEST(DoctorArch, CudnnWarnsOnGpusNewerThanItKnows) {
  EXPECT_TRUE(check_cudnn_arch(0, 9, 0, 1210).empty());
  EXPECT_TRUE(check_cudnn_arch(0, 12, 1, 1210).empty());
  EXPECT_TRUE(check_cudnn_arch(0, 13, 0, 0).empty());  // unknown
  const auto f = check_cudnn_arch(1, 13, 0, 1210);
  ASSERT_EQ(f.size(), 1u);
  EXPECT_EQ(f[0].level, Level::warn);
  EXPECT_TRUE(contains(f[0].message, "12.1"));
}

// ---- the driver and the GPUs -----------------------------------------------------------------

DriverFacts no_driver() {
  DriverFacts f;
  f.built_with_cuda = true;
  f.built_cudart = 13000;
  f.nvml_error = "libnvidia-ml.so.1: cannot open shared object file";
  f.cuda_error = "cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime version";
  return f;
}

DriverFacts with_gpus(int n) {
  DriverFacts f;
  f.built_with_cuda = true;
  f.built_cudart = 13000;
  f.driver_version = "580.95.05";
  f.driver_cuda = 13000;
  f.nvml_gpus = n;
  f.cuda_gpus = n;
  return f;
}

TEST(DoctorDriver, NoDriverSaysSoAndIsNotAFailure) {
  const Findings f = check_driver(no_driver());
  ASSERT_EQ(f.size(), 1u);
  EXPECT_EQ(f[0].level, Level::info);
  EXPECT_EQ(f[0].message, "no NVIDIA driver found: GPU checks skipped; training runs on the CPU");
  EXPECT_EQ(exit_code(f), 0);
}

TEST(DoctorDriver, DriverLibrariesWithoutTheDriverAreNoDriver) {
  DriverFacts facts = no_driver();
  facts.driver_cuda = 13000;  // libcuda answers, but the kernel driver is not loaded
  facts.nvml_error = "nvmlInit: Driver Not Loaded";
  facts.cuda_error = "cudaErrorNoDevice: no CUDA-capable device is detected";
  const Findings f = check_driver(facts);
  EXPECT_EQ(only(f, "driver").level, Level::info);
  EXPECT_EQ(exit_code(f), 0);
}

TEST(DoctorDriver, GpuOnThePciBusWithoutDriver) {
  DriverFacts facts = no_driver();
  facts.pci_gpus = {"0000:18:00.0"};
  const Finding f = only(check_driver(facts), "driver.pci");
  EXPECT_EQ(f.level, Level::warn);
  EXPECT_TRUE(contains(f.message, "0000:18:00.0"));
  EXPECT_TRUE(contains(f.fix, "580.65.06"));
}

TEST(DoctorDriver, States) {
  const Findings good = check_driver(with_gpus(8));
  EXPECT_EQ(only(good, "driver").message, "NVIDIA driver 580.95.05, supporting CUDA 13.0");
  EXPECT_EQ(only(good, "cuda.devices").level, Level::ok);

  DriverFacts hidden = with_gpus(8);
  hidden.cuda_gpus = 0;
  hidden.cuda_visible_devices = "";
  hidden.cuda_error = "cudaErrorNoDevice: no CUDA-capable device is detected";
  EXPECT_EQ(only(check_driver(hidden), "cuda.visible").level, Level::warn);

  DriverFacts some = with_gpus(8);
  some.cuda_gpus = 2;
  some.cuda_visible_devices = "0,1";
  EXPECT_EQ(only(check_driver(some), "cuda.visible").level, Level::info);

  DriverFacts old = with_gpus(1);
  old.cuda_gpus = 0;
  old.cuda_error = "cudaErrorInsufficientDriver: CUDA driver version is insufficient";
  const Finding f = only(check_driver(old), "cuda.devices");
  EXPECT_EQ(f.level, Level::fail);
  EXPECT_TRUE(contains(f.fix, "CUDA 13.0"));

  DriverFacts cpu_build = with_gpus(2);
  cpu_build.built_with_cuda = false;
  EXPECT_EQ(only(check_driver(cpu_build), "cuda.build").level, Level::warn);

  DriverFacts no_gpu = with_gpus(0);
  no_gpu.cuda_error = "cudaErrorNoDevice: no CUDA-capable device is detected";
  EXPECT_EQ(only(check_driver(no_gpu), "cuda.devices").level, Level::info);
}

TEST(DoctorGpus, WarnsWhenOthersHoldTheMemory) {
  GpuInfo g;
  g.index = 1;
  g.name = "NVIDIA H200";
  g.memory_total = uint64_t(140) << 30;
  g.cc_major = 9;
  g.memory_used = uint64_t(1) << 30;
  EXPECT_FALSE(has(check_gpus({g}), "gpu1.memory"));
  EXPECT_TRUE(contains(only(check_gpus({g}), "gpu1").message, "NVIDIA H200, 140.0 GiB, compute capability 9.0"));
  g.memory_used = uint64_t(70) << 30;
  EXPECT_EQ(only(check_gpus({g}), "gpu1.memory").level, Level::warn);
}

// ---- links -----------------------------------------------------------------------------------

TEST(DoctorLinks, CountsNvlinksBetweenTwoGpus) {
  using R = NvLinkEnd::Remote;
  const std::string a = "0000:18:00.0", b = "0000:2a:00.0", c = "0000:3a:00.0";
  const std::vector<NvLinkEnd> a_to_b_twice = {{R::gpu, b}, {R::gpu, b}, {R::gpu, c}};
  const std::vector<NvLinkEnd> b_links = {{R::gpu, a}, {R::gpu, a}};
  EXPECT_EQ(nvlinks_between(a_to_b_twice, b, b_links), 2);
  EXPECT_EQ(nvlinks_between(a_to_b_twice, "0000:2A:00.0", b_links), 2);  // case of the hex digits
  EXPECT_EQ(nvlinks_between(a_to_b_twice, c, {}), 1);
  EXPECT_EQ(nvlinks_between({}, b, b_links), 0);
  const std::vector<NvLinkEnd> switch18(18, NvLinkEnd{R::nvswitch, ""});
  const std::vector<NvLinkEnd> switch12(12, NvLinkEnd{R::nvswitch, ""});
  EXPECT_EQ(nvlinks_between(switch18, b, switch18), 18);  // HGX: NV18 between any two
  EXPECT_EQ(nvlinks_between(switch18, b, switch12), 12);
  EXPECT_EQ(nvlinks_between(switch18, b, b_links), 0);
}

TEST(DoctorLinks, LabelsAndVerdicts) {
  EXPECT_EQ(pcie_path_name(30), "PHB");
  EXPECT_EQ(pcie_path_name(50), "SYS");
  EXPECT_EQ(pcie_path_name(7), "");
  LinkMatrix nv(2, std::vector<Link>(2, Link{18, "SYS", 1}));
  EXPECT_EQ(link_table(nv), "       GPU0   GPU1   \nGPU0   X      NV18   \nGPU1   NV18   X      \n");
  EXPECT_EQ(only(check_links(nv), "links").level, Level::ok);

  LinkMatrix pcie(2, std::vector<Link>(2, Link{0, "PHB", 1}));
  const Finding f = only(check_links(pcie), "links");
  EXPECT_EQ(f.level, Level::info);
  EXPECT_TRUE(contains(f.message, "0-1 (PHB)"));

  LinkMatrix no_p2p(3, std::vector<Link>(3, Link{0, "SYS", 1}));
  no_p2p[0][2].peer_access = 0;
  const Finding p = only(check_links(no_p2p), "links.p2p");
  EXPECT_EQ(p.level, Level::warn);
  EXPECT_TRUE(contains(p.message, "0-2 (SYS)"));
  EXPECT_FALSE(contains(p.message, "0-1"));

  EXPECT_TRUE(check_links(LinkMatrix(1, std::vector<Link>(1))).empty());
}

// ---- NCCL settings ---------------------------------------------------------------------------

TEST(DoctorNccl, InterfaceFilters) {
  const std::vector<std::string> ifs = {"lo", "eth0", "eth1", "docker0", "ib0"};
  struct Case {
    const char* value;
    std::vector<std::string> chosen;
  } cases[] = {
      {"eth", {"eth0", "eth1"}},
      {"eth0", {"eth0"}},
      {"=eth0", {"eth0"}},
      {"=eth", {}},  // '=' compares whole names
      {"^docker,lo", {"eth0", "eth1", "ib0"}},
      {"^=eth0", {"lo", "eth1", "docker0", "ib0"}},
      {"^=eth", {"lo", "eth0", "eth1", "docker0", "ib0"}},
      {"eth1:5000,ib", {"eth1", "ib0"}},
      {"enp", {}},
      {"^e,l,d,i", {}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.value);
    EXPECT_EQ(matching_interfaces(parse_ifname_filter(c.value), ifs), c.chosen);
  }
  const IfnameFilter f = parse_ifname_filter("^=eth0,eth1:1234");
  EXPECT_TRUE(f.exclude);
  EXPECT_TRUE(f.exact);
  EXPECT_EQ(f.names, (std::vector<std::string>{"eth0", "eth1"}));
}

TEST(DoctorNccl, ListsTheNcclVariablesOfAnEnvironment) {
  std::string a = "PATH=/bin", b = "NCCL_DEBUG=INFO", c = "NCCL_IB_DISABLE=1", d = "MY_NCCL_X=1";
  char* envp[] = {a.data(), b.data(), c.data(), d.data(), nullptr};
  const auto vars = nccl_variables(envp);
  ASSERT_EQ(vars.size(), 2u);
  EXPECT_EQ(vars[0], (std::pair<std::string, std::string>{"NCCL_DEBUG", "INFO"}));
  EXPECT_EQ(nccl_settings(vars).message, "NCCL settings in effect: NCCL_DEBUG=INFO, NCCL_IB_DISABLE=1");
  EXPECT_EQ(nccl_settings({}).level, Level::info);
}

NetFacts eight_nvlink_gpus() {
  NetFacts f;
  f.gpus = 8;
  f.nccl = true;
  f.nvlink = f.peer_access = true;
  f.interfaces = {"lo", "eth0"};
  return f;
}

NetFacts cpu_only() {
  NetFacts f;
  f.nccl = true;
  f.interfaces = {"lo", "eth0"};
  return f;
}

Findings nccl_env(std::map<std::string, std::string> vars, const NetFacts& facts) {
  return check_nccl_env(dist::env_from_map(std::move(vars)), facts);
}

TEST(DoctorNccl, P2pDisabledWhereGpusHaveIt) {
  const Finding f = only(nccl_env({{"NCCL_P2P_DISABLE", "1"}}, eight_nvlink_gpus()), "nccl.p2p");
  EXPECT_EQ(f.level, Level::warn);
  EXPECT_TRUE(contains(f.message, "NVLink"));
  NetFacts pcie = eight_nvlink_gpus();
  pcie.nvlink = false;
  EXPECT_TRUE(contains(only(nccl_env({{"NCCL_P2P_DISABLE", "1"}}, pcie), "nccl.p2p").message, "PCIe"));
  NetFacts none = eight_nvlink_gpus();
  none.nvlink = none.peer_access = false;
  EXPECT_EQ(only(nccl_env({{"NCCL_P2P_DISABLE", "1"}}, none), "nccl.p2p").level, Level::info);
  EXPECT_FALSE(has(nccl_env({{"NCCL_P2P_DISABLE", "0"}}, eight_nvlink_gpus()), "nccl.p2p"));
}

TEST(DoctorNccl, IbDisabledWhereInfinibandExists) {
  NetFacts ib = eight_nvlink_gpus();
  ib.infiniband = {"mlx5_0", "mlx5_1"};
  const Finding f = only(nccl_env({{"NCCL_IB_DISABLE", "1"}}, ib), "nccl.ib");
  EXPECT_EQ(f.level, Level::info);
  EXPECT_TRUE(contains(f.message, "mlx5_0, mlx5_1"));
  EXPECT_FALSE(has(nccl_env({{"NCCL_IB_DISABLE", "1"}}, eight_nvlink_gpus()), "nccl.ib"));
}

TEST(DoctorNccl, SocketIfnameNamingNoInterface) {
  const Finding gpu = only(nccl_env({{"NCCL_SOCKET_IFNAME", "ib"}}, eight_nvlink_gpus()), "nccl.ifname");
  EXPECT_EQ(gpu.level, Level::fail);
  EXPECT_TRUE(contains(gpu.message, "lo, eth0"));
  EXPECT_EQ(only(nccl_env({{"NCCL_SOCKET_IFNAME", "^lo,eth"}}, eight_nvlink_gpus()), "nccl.ifname").level, Level::fail);
  EXPECT_EQ(only(nccl_env({{"NCCL_SOCKET_IFNAME", "ib"}}, cpu_only()), "nccl.ifname").level, Level::warn);
  const Finding ok = only(nccl_env({{"NCCL_SOCKET_IFNAME", "=eth0"}}, eight_nvlink_gpus()), "nccl.ifname");
  EXPECT_EQ(ok.level, Level::ok);
  EXPECT_TRUE(contains(ok.message, "selects eth0"));
  EXPECT_EQ(only(nccl_env({{"GLOO_SOCKET_IFNAME", "eth9"}}, cpu_only()), "gloo.ifname").level, Level::fail);
  EXPECT_EQ(only(nccl_env({{"GLOO_SOCKET_IFNAME", "eth0"}}, cpu_only()), "gloo.ifname").level, Level::ok);
}

TEST(DoctorNccl, NvlsOnAMultiGpuHost) {
  EXPECT_EQ(only(nccl_env({}, eight_nvlink_gpus()), "nccl.nvls").level, Level::warn);
  EXPECT_EQ(only(nccl_env({{"NCCL_NVLS_ENABLE", "1"}}, eight_nvlink_gpus()), "nccl.nvls").level, Level::warn);
  EXPECT_EQ(only(nccl_env({{"NCCL_NVLS_ENABLE", "0"}}, eight_nvlink_gpus()), "nccl.nvls").level, Level::ok);
  NetFacts one = eight_nvlink_gpus();
  one.gpus = 1;
  EXPECT_FALSE(has(nccl_env({}, one), "nccl.nvls"));
  EXPECT_FALSE(has(nccl_env({}, cpu_only()), "nccl.nvls"));
}

TEST(DoctorNccl, DebugHintLegacyNamesAndPytorchSettings) {
  EXPECT_EQ(only(nccl_env({}, eight_nvlink_gpus()), "nccl.debug").level, Level::info);
  EXPECT_FALSE(has(nccl_env({{"NCCL_DEBUG", "WARN"}}, eight_nvlink_gpus()), "nccl.debug"));
  EXPECT_FALSE(has(nccl_env({}, cpu_only()), "nccl.debug"));

  const Findings legacy = nccl_env({{"NCCL_MIN_NRINGS", "4"}, {"NCCL_MAX_NRINGS", "4"}}, cpu_only());
  ASSERT_EQ(std::count_if(legacy.begin(), legacy.end(), [](const Finding& f) { return f.check == "nccl.legacy"; }), 2);
  for (const Finding& f : legacy)
    if (f.check == "nccl.legacy") {
      EXPECT_EQ(f.level, Level::warn);
      EXPECT_TRUE(contains(f.fix, "NCCL_MIN_NCHANNELS=4") || contains(f.fix, "NCCL_MAX_NCHANNELS=4")) << f.fix;
    }
  EXPECT_EQ(only(nccl_env({{"NCCL_ASYNC_ERROR_HANDLING", "1"}}, cpu_only()), "nccl.async").level, Level::info);
  EXPECT_TRUE(nccl_env({}, cpu_only()).empty());
}

// ---- rendezvous ------------------------------------------------------------------------------

Resolved resolves_to(std::vector<std::string> addresses) { return {std::move(addresses), ""}; }

TEST(DoctorRendezvous, DefaultsOnAQuietMachine) {
  const Findings f = check_rendezvous(
      dist::env_from_map({}), [](const std::string&) { return Resolved{}; }, [](int port) { return port == 29500; },
      {});
  EXPECT_EQ(only(f, "rendezvous.addr").level, Level::ok);
  const Finding port = only(f, "rendezvous.port");
  EXPECT_EQ(port.level, Level::ok);
  EXPECT_TRUE(contains(port.message, "29500"));
}

TEST(DoctorRendezvous, UnresolvableAddressAndBadPort) {
  auto nowhere = [](const std::string&) { return Resolved{{}, "Name or service not known"}; };
  const Findings f =
      check_rendezvous(dist::env_from_map({{"MASTER_ADDR", "node0.invalid"}}), nowhere, [](int) { return true; }, {});
  EXPECT_EQ(only(f, "rendezvous.addr").level, Level::fail);
  EXPECT_TRUE(contains(only(f, "rendezvous.addr").message, "Name or service not known"));
  EXPECT_EQ(only(f, "rendezvous.port").level, Level::info);  // not this host's to check

  const Findings bad = check_rendezvous(
      dist::env_from_map({{"MASTER_PORT", "70000"}}), [](const std::string&) { return Resolved{}; },
      [](int) { return true; }, {});
  EXPECT_EQ(only(bad, "rendezvous.port").level, Level::fail);
}

TEST(DoctorRendezvous, LocalOrRemoteMaster) {
  auto free = [](int) { return true; };
  const Findings local =
      check_rendezvous(dist::env_from_map({{"MASTER_ADDR", "gpu-node"}}),
                       [](const std::string&) { return resolves_to({"10.0.0.5"}); }, free, {"10.0.0.5"});
  EXPECT_TRUE(contains(only(local, "rendezvous.addr").message, "(this host)"));
  EXPECT_EQ(only(local, "rendezvous.port").level, Level::ok);
  const Findings remote =
      check_rendezvous(dist::env_from_map({{"MASTER_ADDR", "gpu-node"}}),
                       [](const std::string&) { return resolves_to({"10.0.0.7"}); }, free, {"10.0.0.5"});
  EXPECT_TRUE(contains(only(remote, "rendezvous.addr").message, "another host"));
  EXPECT_EQ(only(remote, "rendezvous.port").level, Level::info);
}

TEST(DoctorRendezvous, BusyPortOfOurOwn) {
  const dist::net::Fd taken = dist::net::listen_tcp(0, "127.0.0.1");
  const int port = dist::net::bound_port(taken.get());
  auto unused = [](const std::string&) { return Resolved{}; };
  const Findings f = check_rendezvous(dist::env_from_map({{"MASTER_PORT", std::to_string(port)}}), unused,
                                      dist::net::port_is_free, {});
  const Finding busy = only(f, "rendezvous.port");
  EXPECT_EQ(busy.level, Level::fail);
  EXPECT_EQ(busy.message, dist::net::port_in_use_message("127.0.0.1", port));
  EXPECT_TRUE(contains(busy.fix, std::to_string(port)));
  // The default port taken is a warning only: loomrun picks a free one itself.
  const Findings by_default = check_rendezvous(dist::env_from_map({}), unused, [](int) { return false; }, {});
  EXPECT_EQ(only(by_default, "rendezvous.port").level, Level::warn);
}

// ---- machine facts, the smoke verdict, the report --------------------------------------------

TEST(DoctorFacts, FindsNvidiaGpusInAPciTree) {
  const auto root = std::filesystem::path(::testing::TempDir()) / "doctor_pci";
  std::filesystem::remove_all(root);
  auto device = [&](const std::string& name, const std::string& vendor, const std::string& cls) {
    std::filesystem::create_directories(root / name);
    std::ofstream(root / name / "vendor") << vendor << "\n";
    std::ofstream(root / name / "class") << cls << "\n";
  };
  device("0000:18:00.0", "0x10de", "0x030200");  // a data-centre GPU (3D controller)
  device("0000:19:00.0", "0x10de", "0x040300");  // its audio function
  device("0000:20:00.0", "0x8086", "0x030000");  // another vendor's display
  device("0000:21:00.0", "0x10de", "0x030000");  // a GPU with a display
  EXPECT_EQ(nvidia_pci_devices(root.string()), (std::vector<std::string>{"0000:18:00.0", "0000:21:00.0"}));
  EXPECT_TRUE(nvidia_pci_devices((root / "absent").string()).empty());
}

TEST(DoctorSmoke, Verdicts) {
  SmokeResult r;
  r.backend = "gloo";
  r.ranks = 2;
  r.bytes = int64_t(64) << 20;
  r.allreduce_ms = 40;
  r.startup_s = 1.5;
  const Finding ok = check_smoke(r);
  EXPECT_EQ(ok.level, Level::ok);
  EXPECT_TRUE(contains(ok.message, "all-reduce of 64 MiB over 2 CPU ranks (Gloo): correct sum in 40.00 ms"))
      << ok.message;
  SmokeResult failed = r;
  failed.exit_code = 1;
  EXPECT_EQ(check_smoke(failed).level, Level::fail);
  SmokeResult wrong = r;
  wrong.wrong = "rank 1 has 2 at element 0, expected 3";
  EXPECT_EQ(check_smoke(wrong).level, Level::fail);
  SmokeResult silent = r;
  silent.allreduce_ms = -1;
  EXPECT_EQ(check_smoke(silent).level, Level::fail);
  SmokeResult skipped;
  skipped.skipped = "--no-smoke";
  EXPECT_EQ(check_smoke(skipped).level, Level::info);
  skipped.skipped_fix = "install libgloo-dev";
  EXPECT_EQ(check_smoke(skipped).level, Level::warn);
}

TEST(DoctorReport, JsonAndExitCode) {
  Json doc = Json::object();
  doc.set("text", "a \"quoted\"\nline\t\x01").set("n", 3).set("x", 0.5).set("no", Json()).set("yes", true);
  doc.set("list", Json::array().push(1).push("two"));
  doc.set("empty", Json::object());
  EXPECT_EQ(doc.dump(),
            "{\"text\":\"a \\\"quoted\\\"\\u000aline\\u0009\\u0001\",\"n\":3,\"x\":0.5,\"no\":null,\"yes\":true,"
            "\"list\":[1,\"two\"],\"empty\":{}}");
  EXPECT_EQ(Json::array().push(1).dump(2), "[\n  1\n]");
  // The JSON-lines layout of metrics files, which scaling.cpp's last_metric reads as "key": value.
  Json line = Json::object().set("epoch", 3).set("loss", 0.25).set("nan", NAN);
  EXPECT_EQ(line.set("list", Json::array().push(1).push(2)).dump_line(),
            "{\"epoch\": 3, \"loss\": 0.25, \"nan\": null, \"list\": [1, 2]}");
  EXPECT_EQ(Json::object().set("k", 1).set("k", 2).dump(), "{\"k\":2}");  // setting again replaces in place
  Findings f = {{Level::ok, "a", "fine", ""}, {Level::warn, "b", "slow", "fix it"}};
  EXPECT_EQ(exit_code(f), 0);
  f.push_back({Level::fail, "c", "broken", "mend it"});
  EXPECT_EQ(exit_code(f), 1);
  EXPECT_EQ(to_json(f).dump(),
            "[{\"level\":\"ok\",\"check\":\"a\",\"message\":\"fine\",\"fix\":\"\"},"
            "{\"level\":\"warn\",\"check\":\"b\",\"message\":\"slow\",\"fix\":\"fix it\"},"
            "{\"level\":\"fail\",\"check\":\"c\",\"message\":\"broken\",\"fix\":\"mend it\"}]");
}

// ---- the program -----------------------------------------------------------------------------

// A strict JSON reader, enough to prove the report is valid JSON and to look inside it.
struct Value {
  enum class Kind { null, boolean, number, string, array, object } kind = Kind::null;
  bool boolean = false;
  double number = 0;
  std::string text;
  std::vector<Value> items;
  std::vector<std::pair<std::string, Value>> members;
  const Value* get(const std::string& key) const {
    for (const auto& [k, v] : members)
      if (k == key) return &v;
    return nullptr;
  }
};

class Reader {
 public:
  explicit Reader(std::string_view s) : s_(s) {}
  Value document() {
    Value v = value();
    space();
    if (i_ != s_.size()) fail("text after the value");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& what) { throw std::runtime_error(what + " at byte " + std::to_string(i_)); }
  void space() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\n' || s_[i_] == '\t' || s_[i_] == '\r')) ++i_;
  }
  bool eat(char c) {
    space();
    if (i_ < s_.size() && s_[i_] == c) return ++i_, true;
    return false;
  }
  void expect(char c) {
    if (!eat(c)) fail(std::string("expected '") + c + "'");
  }
  bool word(std::string_view w) {
    if (s_.substr(i_, w.size()) != w) return false;
    i_ += w.size();
    return true;
  }
  std::string string() {
    expect('"');
    std::string out;
    while (true) {
      if (i_ >= s_.size()) fail("unterminated string");
      char c = s_[i_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("raw control character in a string");
      if (c != '\\') {
        out += c;
        continue;
      }
      if (i_ >= s_.size()) fail("unterminated escape");
      char e = s_[i_++];
      if (e == 'u') {
        for (int k = 0; k < 4; ++k)
          if (i_ >= s_.size() || !std::isxdigit(static_cast<unsigned char>(s_[i_++]))) fail("bad \\u escape");
        out += '?';
      } else if (std::string_view("\"\\/bfnrt").find(e) != std::string_view::npos) {
        out += e == 'n' ? '\n' : e == 't' ? '\t' : e;
      } else {
        fail("bad escape");
      }
    }
  }
  Value value() {
    space();
    Value v;
    if (i_ >= s_.size()) fail("expected a value");
    const char c = s_[i_];
    if (c == '{') {
      v.kind = Value::Kind::object;
      ++i_;
      if (eat('}')) return v;
      do {
        space();
        std::string key = string();
        expect(':');
        v.members.emplace_back(std::move(key), value());
      } while (eat(','));
      expect('}');
    } else if (c == '[') {
      v.kind = Value::Kind::array;
      ++i_;
      if (eat(']')) return v;
      do v.items.push_back(value());
      while (eat(','));
      expect(']');
    } else if (c == '"') {
      v.kind = Value::Kind::string;
      v.text = string();
    } else if (word("true")) {
      v.kind = Value::Kind::boolean;
      v.boolean = true;
    } else if (word("false")) {
      v.kind = Value::Kind::boolean;
    } else if (word("null")) {
    } else {
      const size_t start = i_;
      if (s_[i_] == '-') ++i_;
      auto digits = [&] {
        const size_t from = i_;
        while (i_ < s_.size() && std::isdigit(static_cast<unsigned char>(s_[i_]))) ++i_;
        if (i_ == from) fail("expected digits");
      };
      digits();
      if (i_ < s_.size() && s_[i_] == '.') ++i_, digits();
      if (i_ < s_.size() && (s_[i_] == 'e' || s_[i_] == 'E')) {
        ++i_;
        if (i_ < s_.size() && (s_[i_] == '+' || s_[i_] == '-')) ++i_;
        digits();
      }
      v.kind = Value::Kind::number;
      v.number = std::stod(std::string(s_.substr(start, i_ - start)));
    }
    return v;
  }

  std::string_view s_;
  size_t i_ = 0;
};

struct Outcome {
  int code = -1;
  std::string output;
};

// Runs doctor with `args` through the shell, with the rendezvous variables cleared and a
// deadline, and returns its exit code and its output (stdout and stderr together).
Outcome doctor(const std::string& args, const std::string& env = "") {
  const char* path = std::getenv("DOCTOR");
  EXPECT_NE(path, nullptr) << "DOCTOR is not set: run the test through meson";
  const std::string command =
      "timeout 240 env -u MASTER_ADDR -u MASTER_PORT -u RANK -u WORLD_SIZE -u GLOO_SOCKET_IFNAME " + env + " '" +
      std::string(path ? path : "doctor") + "' " + args + " 2>&1";
  Outcome run;
  FILE* pipe = ::popen(command.c_str(), "r");
  EXPECT_NE(pipe, nullptr);
  if (!pipe) return run;
  char buf[4096];
  while (size_t n = std::fread(buf, 1, sizeof buf, pipe)) run.output.append(buf, n);
  const int status = ::pclose(pipe);
  run.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return run;
}

bool nvml_present() {
  void* lib = ::dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib) ::dlclose(lib);
  return lib != nullptr;
}

TEST(DoctorProgram, ChecksThisMachineAndWritesJson) {
  const std::string json = (std::filesystem::path(::testing::TempDir()) / "doctor_report.json").string();
  std::filesystem::remove(json);
  const Outcome run = doctor("--json '" + json + "' --smoke-mib 4");
  SCOPED_TRACE(run.output);
  EXPECT_TRUE(contains(run.output, "verdict: "));
  std::ifstream in(json);
  ASSERT_TRUE(in) << "no JSON report at " << json;
  std::stringstream text;
  text << in.rdbuf();
  Value report;
  ASSERT_NO_THROW(report = Reader(text.str()).document()) << text.str();
  ASSERT_EQ(report.kind, Value::Kind::object);
  for (const char* key : {"tool", "fit_to_train", "exit_code", "summary", "build", "driver", "runtime", "gpus", "links",
                          "network", "nccl_env", "rendezvous", "smoke", "checks"})
    EXPECT_NE(report.get(key), nullptr) << "no key " << key;
  ASSERT_NE(report.get("exit_code"), nullptr);
  EXPECT_EQ(int(report.get("exit_code")->number), run.code);
  ASSERT_NE(report.get("checks"), nullptr);
  ASSERT_EQ(report.get("checks")->kind, Value::Kind::array);
  EXPECT_FALSE(report.get("checks")->items.empty());
  for (const Value& check : report.get("checks")->items)
    for (const char* key : {"level", "check", "message", "fix"}) EXPECT_NE(check.get(key), nullptr) << key;

  if (nvml_present()) return;  // a GPU machine: its verdict depends on it
  // No driver here: doctor says so, checks the rest, runs two CPU ranks over Gloo and passes.
  EXPECT_EQ(run.code, 0);
  EXPECT_TRUE(contains(run.output, "INFO no NVIDIA driver found: GPU checks skipped; training runs on the CPU"));
  EXPECT_TRUE(contains(run.output, "over 2 CPU ranks (Gloo): correct sum"));
  EXPECT_TRUE(contains(run.output, "verdict: fit to train"));
  EXPECT_FALSE(report.get("driver")->get("found")->boolean);
  EXPECT_TRUE(report.get("fit_to_train")->boolean);
  EXPECT_EQ(report.get("smoke")->get("backend")->text, "gloo");
  EXPECT_EQ(int(report.get("smoke")->get("ranks")->number), 2);
}

TEST(DoctorProgram, FailsOnABusyMasterPortAndNamesTheFixes) {
  const dist::net::Fd taken = dist::net::listen_tcp(0, "127.0.0.1");
  const int port = dist::net::bound_port(taken.get());
  const Outcome run = doctor("--no-smoke", "MASTER_PORT=" + std::to_string(port) + " NCCL_MIN_NRINGS=4");
  SCOPED_TRACE(run.output);
  EXPECT_EQ(run.code, 1);
  EXPECT_TRUE(contains(run.output, "FAIL " + dist::net::port_in_use_message("127.0.0.1", port)));
  EXPECT_TRUE(contains(run.output, "WARN NCCL_MIN_NRINGS=4 is the legacy name of NCCL_MIN_NCHANNELS"));
  EXPECT_TRUE(contains(run.output, "fix: rename it NCCL_MIN_NCHANNELS=4"));
  EXPECT_TRUE(contains(run.output, "INFO smoke test skipped: --no-smoke"));
  EXPECT_TRUE(contains(run.output, "verdict: NOT fit to train"));
}

TEST(DoctorProgram, Help) {
  const Outcome run = doctor("--help");
  EXPECT_EQ(run.code, 0);
  EXPECT_TRUE(contains(run.output, "usage: doctor")) << run.output;
  EXPECT_TRUE(contains(run.output, "--json FILE")) << run.output;
}

}  // namespace
}  // namespace loom::dist::diagnostics
