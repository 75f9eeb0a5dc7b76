// Runs a program as a shell command with a deadline, for the tests that start Loom's programs
// (train_cnn, train_gpt, bench_pipeline under loomrun): its exit code and its output.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace loom::dist::testing {

struct RunResult {
  int code = -1;
  std::string output;
};

// stdout and stderr together; `seconds` is the deadline (timeout(1)).
inline RunResult run_command(const std::string& command, int seconds) {
  // One log per run and per process: test binaries run side by side share TempDir().
  static int runs = 0;
  const std::string log = (std::filesystem::path(::testing::TempDir()) /
                           ("run_command_" + std::to_string(::getpid()) + "_" + std::to_string(runs++) + ".log"))
                              .string();
  const std::string full = "timeout " + std::to_string(seconds) + " " + command + " > '" + log + "' 2>&1";
  RunResult r;
  const int status = std::system(full.c_str());
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream in(log);
  std::stringstream s;
  s << in.rdbuf();
  r.output = s.str();
  std::filesystem::remove(log);
  return r;
}

}  // namespace loom::dist::testing
