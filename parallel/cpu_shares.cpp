#include "parallel/cpu_shares.h"

#include <algorithm>
#include <fstream>
#include <thread>
#include <tuple>

#include "kernels/core/error.h"
#include "kernels/cpu/parallel_for.h"

namespace loom::dist {
namespace {

// A number from /sys/devices/system/cpu/cpuN/topology/NAME, or -1 where there is none.
int topology_value(int cpu, const char* name) {
  std::ifstream in("/sys/devices/system/cpu/cpu" + std::to_string(cpu) + "/topology/" + name);
  int value = -1;
  if (!(in >> value)) return -1;
  return value;
}

bool same_core(const Cpu& a, const Cpu& b) {
  return a.core >= 0 && std::tie(a.package, a.die, a.core) == std::tie(b.package, b.die, b.core);
}

}  // namespace

std::vector<Cpu> usable_cpus() {
  std::vector<int> ids = cpu::affinity_cpus();
  if (ids.empty()) {
    const int n = int(std::max(1u, std::thread::hardware_concurrency()));
    for (int c = 0; c < n; ++c) ids.push_back(c);
  }
  std::vector<Cpu> cpus;
  for (int c : ids)
    cpus.push_back({c, topology_value(c, "physical_package_id"), topology_value(c, "die_id"),
                    topology_value(c, "core_id")});
  std::stable_sort(cpus.begin(), cpus.end(), [](const Cpu& a, const Cpu& b) {
    return std::tie(a.package, a.die, a.core, a.id) < std::tie(b.package, b.die, b.core, b.id);
  });
  return cpus;
}

std::vector<std::vector<int>> cpu_shares(const std::vector<Cpu>& cpus, int ranks) {
  LOOM_CHECK(ranks >= 1 && size_t(ranks) <= cpus.size(), "cannot share ", cpus.size(), " CPUs among ", ranks,
             " ranks: each needs at least one");
  // The units dealt out: whole cores when there are enough of them, else single CPUs.
  std::vector<std::vector<int>> cores;
  for (size_t i = 0; i < cpus.size(); ++i) {
    if (i == 0 || !same_core(cpus[i - 1], cpus[i])) cores.emplace_back();
    cores.back().push_back(cpus[i].id);
  }
  std::vector<std::vector<int>> units;
  if (cores.size() >= size_t(ranks)) units = cores;
  else
    for (const Cpu& c : cpus) units.push_back({c.id});
  const size_t base = units.size() / size_t(ranks), extra = units.size() % size_t(ranks);
  std::vector<std::vector<int>> shares(static_cast<size_t>(ranks));
  size_t at = 0;
  for (size_t r = 0; r < size_t(ranks); ++r)
    for (size_t k = 0; k < base + (r < extra ? 1 : 0); ++k, ++at)
      shares[r].insert(shares[r].end(), units[at].begin(), units[at].end());
  return shares;
}

std::vector<int> cpu_ids(const std::vector<Cpu>& cpus) {
  std::vector<int> ids;
  for (const Cpu& c : cpus) ids.push_back(c.id);
  return ids;
}

std::string cpu_bind_problem(int ranks) {
  const std::vector<Cpu> cpus = usable_cpus();
  if (size_t(ranks) <= cpus.size()) return "";
  return "--cpu-bind gives each rank CPUs of its own, but " + std::to_string(ranks) + " ranks need at least " +
         std::to_string(ranks) + " CPUs and loomrun may use " + std::to_string(cpus.size()) + " (" +
         cpu_list_text(cpu_ids(cpus)) + ")";
}

std::string cpu_list_text(std::vector<int> cpus) {
  std::sort(cpus.begin(), cpus.end());
  std::string text;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    if (!text.empty()) text += ",";
    text += std::to_string(cpus[i]);
    if (j > i) text += "-" + std::to_string(cpus[j]);
    i = j + 1;
  }
  return text;
}

}  // namespace loom::dist
