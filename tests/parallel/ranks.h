// Forked CPU ranks for the multi-process tests of sub-groups and the pipeline: each rank is
// a child process in a Gloo group over a fresh FileStore, reporting through its exit code
// (0 when its body returned, 1 when it threw; it prints what). Each child sets an alarm, so a
// hang fails the test instead of stalling the suite.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/core/error.h"
#include "parallel/process_group.h"
#include "parallel/store.h"

namespace loom::dist::testing {

inline std::string temp_path(const std::string& stem) {
  static std::atomic<int> counter{0};
  return (std::filesystem::path(::testing::TempDir()) /
          (stem + "_" + std::to_string(::getpid()) + "_" + std::to_string(counter++)))
      .string();
}

inline pid_t fork_child(const std::function<void()>& body, int alarm_s = 120) {
  pid_t pid = ::fork();
  if (pid == 0) {
    ::alarm(alarm_s);
    ::setenv("LOOM_NUM_THREADS", "1", 1);
    int code = 1;
    try {
      body();
      code = 0;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "child %d: %s\n", ::getpid(), e.what());
    }
    std::fflush(stdout);
    ::_exit(code);
  }
  return pid;
}

inline int exit_code(pid_t pid) {
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

using RankBody = std::function<void(int rank, std::shared_ptr<ProcessGroup> world)>;

// Runs `body` on `world` forked ranks of one Gloo group; returns their exit codes by rank.
inline std::vector<int> run_ranks_codes(int world, const RankBody& body, ProcessGroupOptions options = {},
                                        int alarm_s = 120) {
  std::string store_path = temp_path("ranks_store");
  if (options.timeout == ProcessGroupOptions{}.timeout) options.timeout = std::chrono::seconds(60);
  std::vector<pid_t> pids;
  for (int rank = 0; rank < world; ++rank)
    pids.push_back(fork_child(
        [&, rank] {
          auto store = std::make_shared<FileStore>(store_path, world, std::chrono::seconds(60));
          body(rank, new_gloo_group(store, rank, world, options));
        },
        alarm_s));
  std::vector<int> codes;
  for (pid_t pid : pids) codes.push_back(exit_code(pid));
  std::filesystem::remove(store_path);
  return codes;
}

// The same, expecting every rank to succeed.
inline void run_ranks(int world, const RankBody& body, ProcessGroupOptions options = {}) {
  auto codes = run_ranks_codes(world, body, options);
  for (size_t r = 0; r < codes.size(); ++r) EXPECT_EQ(codes[r], 0) << "rank " << r << " failed (see its output)";
}

template <class... Parts>
void require(bool ok, const Parts&... parts) {
  if (ok) return;
  std::ostringstream os;
  (os << ... << parts);
  throw std::runtime_error(os.str());
}

// Expects `fn` to throw a loom::Error whose message holds every one of `parts`; returns it.
inline std::string require_error(const std::function<void()>& fn, const std::vector<std::string>& parts) {
  try {
    fn();
  } catch (const Error& e) {
    std::string msg = e.what();
    for (const std::string& p : parts) require(msg.find(p) != std::string::npos, "'", p, "' missing from: ", msg);
    return msg;
  }
  throw std::runtime_error("expected a loom::Error");
}

}  // namespace loom::dist::testing
