#include "samples/common/scaling.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "parallel/init.h"
#include "parallel/launcher.h"
#include "parallel/socket.h"
#include "samples/common/metrics.h"

namespace loom::samples {

std::vector<int> scaling_counts(int max_ranks) {
  std::vector<int> counts;
  for (int n = 1; n < max_ranks; n *= 2) counts.push_back(n);
  counts.push_back(std::max(max_ranks, 1));
  return counts;
}

double last_metric(const std::string& path, const std::string& key) {
  std::ifstream in(path);
  std::string line, last;
  while (std::getline(in, line))
    if (!line.empty()) last = line;
  const std::string needle = "\"" + key + "\": ";
  const size_t at = last.find(needle);
  if (at == std::string::npos) return NAN;
  return std::strtod(last.c_str() + at + needle.size(), nullptr);
}

int run_scaling(int argc, char** argv, const ScalingOptions& options) {
  const std::vector<std::string> base = dist::command_without(argc, argv, options.drop_flags);
  const std::string tmp = (std::filesystem::temp_directory_path() /
                           ("loom_scaling_" + std::to_string(::getpid()) + ".jsonl")).string();
  MetricsLog json(options.json_path);
  Series speedup{"speedup", {}}, ideal{"ideal", {}}, efficiency{"efficiency %", {}};
  double single = NAN;
  std::printf("%6s %14s %9s %11s\n", "ranks", options.unit.c_str(), "speedup", "efficiency");
  for (int ranks : scaling_counts(options.max_ranks)) {
    std::filesystem::remove(tmp);
    dist::LaunchOptions launch;
    launch.command = base;
    for (const std::string& extra : options.extra_args) launch.command.push_back(extra);
    for (const char* extra : {"--metrics", tmp.c_str(), "--plot", ""}) launch.command.push_back(extra);
    if (options.quiet_flag) launch.command.push_back("--quiet");
    launch.nproc_per_node = ranks;
    launch.master_port = dist::net::free_port();
    std::fflush(stdout);
    if (int code = dist::launch(launch); code != 0) {
      std::fprintf(stderr, "scaling: the run on %d rank(s) failed with exit code %d\n", ranks, code);
      std::filesystem::remove(tmp);
      return code;
    }
    const double rate = last_metric(tmp, options.throughput_key);
    if (ranks == 1) single = rate;
    const double s = rate / single, e = s / ranks;
    std::printf("%6d %14.0f %9.2f %10.1f%%\n", ranks, rate, s, 100 * e);
    std::fflush(stdout);
    json.write({{"ranks", int64_t(ranks)}, {options.throughput_key, rate}, {"speedup", s}, {"efficiency", e}});
    speedup.points.emplace_back(ranks, s);
    ideal.points.emplace_back(ranks, ranks);
    efficiency.points.emplace_back(ranks, 100 * e);
  }
  std::filesystem::remove(tmp);
  if (!options.svg_path.empty())
    write_svg_chart(options.svg_path, "scaling over ranks",
                    {{"speedup", "ranks", "x one rank", {speedup, ideal}},
                     {"efficiency", "ranks", "%", {efficiency}}});
  return 0;
}

}  // namespace loom::samples
