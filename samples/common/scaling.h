// Scaling runs: the same training on 1, 2, 4, ... N ranks of this node (GPUs, or CPU ranks with
// --device cpu), one after another, each through the launcher, and a report of throughput,
// speedup over one rank and efficiency (speedup / ranks) as a table, JSON lines and an SVG
// chart. Each run writes its per-epoch metrics to a temporary file; the last epoch's
// `images_per_s` (or `tokens_per_s`) is the run's throughput.
#pragma once

#include <string>
#include <vector>

namespace loom::samples {

// 1, 2, 4, ... up to `max_ranks`, and max_ranks itself.
std::vector<int> scaling_counts(int max_ranks);

struct ScalingOptions {
  int max_ranks = 1;
  std::string throughput_key = "images_per_s";  // read from each run's metrics
  std::string unit = "img/s";
  std::string json_path, svg_path;               // "" : not written
  // Flags (with their values) removed from the command line before each run.
  std::vector<std::string> drop_flags = {"scaling", "metrics", "plot", "gpus"};
  // Arguments added to every run, and whether the program takes --quiet.
  std::vector<std::string> extra_args;
  bool quiet_flag = true;
};

// Runs argv[0] with the remaining arguments plus --metrics TMP --plot '' (and --quiet) for each
// count, prints the table and writes the reports. Returns 0, or the exit code of the first
// failed run.
int run_scaling(int argc, char** argv, const ScalingOptions& options);

// Parses the last JSON line of a metrics file for a number under `key` (NaN if absent).
double last_metric(const std::string& path, const std::string& key);

}  // namespace loom::samples
