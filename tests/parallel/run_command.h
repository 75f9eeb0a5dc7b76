// Runs a program as a shell command with a deadline, for the tests that start Loom's programs
// (train_cnn, train_gpt, bench_pipeline under loomrun): its exit code and its output.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>

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
  const std::string log = (std::filesystem::path(::testing::TempDir()) / "run_command.log").string();
  const std::string full = "timeout " + std::to_string(seconds) + " " + command + " > '" + log + "' 2>&1";
  RunResult r;
  const int status = std::system(full.c_str());
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream in(log);
  std::stringstream s;
  s << in.rdbuf();
  r.output = s.str();
  return r;
}

}  // namespace loom::dist::testing
