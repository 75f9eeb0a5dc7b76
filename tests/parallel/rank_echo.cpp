// rank_echo: the program test_loomrun.cpp launches. It prints what the launcher told it
// (so tests can check the environment, the CPUs it may run on and the output prefixes), can meet the other ranks
// through the env:// rendezvous store, and can fail on purpose in a chosen rank.
//
//   rank_echo [--store] [--fail-rank K --code C] [--kill-rank K] [--ignore-term] [--sleep S]
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "kernels/core/error.h"
#include "kernels/cpu/parallel_for.h"
#include "parallel/cpu_shares.h"
#include "parallel/rendezvous.h"

extern char** environ;

int main(int argc, char** argv) {
  int fail_rank = -1, code = 1, kill_rank = -1;
  double sleep_s = 0;
  bool store = false, ignore_term = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&] { return i + 1 < argc ? std::atof(argv[++i]) : 0.0; };
    if (a == "--store") store = true;
    else if (a == "--ignore-term") ignore_term = true;
    else if (a == "--fail-rank") fail_rank = static_cast<int>(next());
    else if (a == "--code") code = static_cast<int>(next());
    else if (a == "--kill-rank") kill_rank = static_cast<int>(next());
    else if (a == "--sleep") sleep_s = next();
    else {
      std::fprintf(stderr, "rank_echo: unknown argument '%s'\n", a.c_str());
      return 2;
    }
  }
  if (ignore_term) ::signal(SIGTERM, SIG_IGN);
  auto env = [](const char* name) {
    const char* v = std::getenv(name);
    return std::string(v ? v : "?");
  };
  int rank = std::atoi(env("RANK").c_str());
  std::printf("rank=%s world=%s local=%s/%s master=%s:%s\n", env("RANK").c_str(), env("WORLD_SIZE").c_str(),
              env("LOCAL_RANK").c_str(), env("LOCAL_WORLD_SIZE").c_str(), env("MASTER_ADDR").c_str(),
              env("MASTER_PORT").c_str());
  int thread_entries = 0;  // a variable set twice would read differently in other programs
  for (char** e = environ; *e; ++e) thread_entries += std::strncmp(*e, "LOOM_NUM_THREADS=", 17) == 0;
  std::printf("threads=%s (%d set) pool=%d cpus=%s\n", env("LOOM_NUM_THREADS").c_str(), thread_entries,
              loom::cpu::num_threads(),
              loom::dist::cpu_list_text(loom::dist::cpu_ids(loom::dist::usable_cpus())).c_str());
  std::fflush(stdout);
  std::fprintf(stderr, "stderr of %d\n", rank);

  if (store) {
    try {
      auto info = loom::dist::rendezvous_from_env();
      auto s = loom::dist::connect_store(info, std::chrono::seconds(60));
      s->add("hello", 1);
      // Rank 0 serves the store: it waits for everyone's goodbye before taking it down.
      s->set("bye/" + std::to_string(info.rank), "1");
      if (info.rank == 0)
        for (int r = 0; r < info.world_size; ++r) s->wait({"bye/" + std::to_string(r)});
      std::printf("joined %d\n", info.world_size);
      std::fflush(stdout);
    } catch (const loom::Error& e) {
      std::fprintf(stderr, "rank_echo: %s\n", e.what());
      return 1;
    }
  }
  if (rank == fail_rank || rank == kill_rank) {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));  // let the others start
    std::printf("rank %d failing now\n", rank);
    std::fflush(stdout);
    if (rank == kill_rank) ::kill(::getpid(), SIGKILL);
    return code;
  }
  std::this_thread::sleep_for(std::chrono::duration<double>(sleep_s));
  return 0;
}
