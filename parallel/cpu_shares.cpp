#include "parallel/cpu_shares.h"

#include <sched.h>

#include <algorithm>
#include <fstream>
#include <thread>
#include <tuple>

#include "kernels/core/error.h"

namespace loom::dist {
namespace {

// A number from /sys/devices/system/cpu/cpuN/topology/NAME, or -1 where there is none.
int topology_value(int cpu, const char* name) {
  std::ifstream in("/sys/devices/system/cpu/cpu" + std::to_string(cpu) + "/topology/" + name);
  int value = -1;
  if (!(in >> value)) return -1;
  return value;
}

}  // namespace

std::vector<int> usable_cpus() {
  std::vector<int> cpus;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof set, &set) == 0) {
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &set)) cpus.push_back(c);
  }
  if (cpus.empty()) {
    const int n = int(std::max(1u, std::thread::hardware_concurrency()));
    for (int c = 0; c < n; ++c) cpus.push_back(c);
  }
  struct Place {
    int package, core, cpu;
  };
  std::vector<Place> places;
  for (int c : cpus) places.push_back({topology_value(c, "physical_package_id"), topology_value(c, "core_id"), c});
  std::stable_sort(places.begin(), places.end(), [](const Place& a, const Place& b) {
    return std::tie(a.package, a.core, a.cpu) < std::tie(b.package, b.core, b.cpu);
  });
  for (size_t i = 0; i < places.size(); ++i) cpus[i] = places[i].cpu;
  return cpus;
}

std::vector<std::vector<int>> cpu_shares(const std::vector<int>& cpus, int ranks) {
  LOOM_CHECK(ranks >= 1 && size_t(ranks) <= cpus.size(), "cannot share ", cpus.size(), " CPUs among ", ranks,
             " ranks: each needs at least one");
  const size_t base = cpus.size() / size_t(ranks), extra = cpus.size() % size_t(ranks);
  std::vector<std::vector<int>> shares;
  size_t at = 0;
  for (size_t r = 0; r < size_t(ranks); ++r) {
    const size_t n = base + (r < extra ? 1 : 0);
    shares.emplace_back(cpus.begin() + ptrdiff_t(at), cpus.begin() + ptrdiff_t(at + n));
    at += n;
  }
  return shares;
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
