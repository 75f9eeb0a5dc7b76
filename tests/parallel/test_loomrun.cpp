// loomrun end to end: it runs rank_echo (tests/parallel/rank_echo.cpp) as 3 ranks and the
// tests read what came out. meson passes both programs' paths in LOOMRUN and RANK_ECHO.
// Every run has a deadline, so a launcher that hangs fails the test instead of the suite.
#include <gtest/gtest.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <set>
#include <tuple>
#include <string>
#include <vector>

#include "kernels/core/error.h"
#include "kernels/cpu/parallel_for.h"
#include "parallel/cpu_shares.h"
#include "parallel/socket.h"

namespace loom::dist {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

std::string program(const char* var) {
  const char* path = std::getenv(var);
  return path ? path : "";
}

struct Outcome {
  int code = -1;
  std::string output;  // stdout and stderr together
  Clock::duration took{};
};

extern "C" char** environ;

// A running loomrun whose stdout and stderr come back through one pipe. `env` holds
// NAME=VALUE entries that replace this process's NAME, and bare NAMEs that it drops.
class Loomrun {
 public:
  explicit Loomrun(std::vector<std::string> args, const std::vector<std::string>& env = {}) {
    args.insert(args.begin(), program("LOOMRUN"));
    std::vector<std::string> vars;
    auto name_of = [](const std::string& v) { return v.substr(0, v.find('=')); };
    for (char** e = environ; *e; ++e) {
      const std::string var = *e;
      if (std::none_of(env.begin(), env.end(), [&](const std::string& x) { return name_of(x) == name_of(var); }))
        vars.push_back(var);
    }
    for (const std::string& x : env)
      if (x.find('=') != std::string::npos) vars.push_back(x);
    std::vector<char*> envp;
    for (auto& v : vars) envp.push_back(v.data());
    envp.push_back(nullptr);
    int fds[2];
    EXPECT_EQ(::pipe(fds), 0);
    start_ = Clock::now();
    pid_ = ::fork();
    if (pid_ == 0) {
      ::dup2(fds[1], 1);
      ::dup2(fds[1], 2);
      ::close(fds[0]);
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execve(argv[0], argv.data(), envp.data());
      ::_exit(126);
    }
    ::close(fds[1]);
    out_ = fds[0];
  }
  ~Loomrun() {
    if (out_ >= 0) ::close(out_);
  }
  pid_t pid() const { return pid_; }

  // Reads until `text` has appeared (true) or the deadline passes (false).
  bool read_until(const std::string& text, Clock::duration limit = 60s) {
    auto deadline = Clock::now() + limit;
    while (output_.find(text) == std::string::npos) {
      if (Clock::now() >= deadline || !read_some(deadline)) return false;
    }
    return true;
  }

  // Reads to the end and reaps loomrun; kills it if it outlives the limit.
  Outcome finish(Clock::duration limit = 120s) {
    auto deadline = Clock::now() + limit;
    while (read_some(deadline)) {
    }
    Outcome run;
    int status = 0;
    if (Clock::now() >= deadline) {
      ::kill(pid_, SIGKILL);
      ADD_FAILURE() << "loomrun did not finish in time; output so far:\n" << output_;
    }
    ::waitpid(pid_, &status, 0);
    run.took = Clock::now() - start_;
    run.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    run.output = output_;
    return run;
  }

 private:
  bool read_some(Clock::time_point deadline) {
    auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return false;
    pollfd p{out_, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left)) <= 0) return false;
    char buf[4096];
    ssize_t n = ::read(out_, buf, sizeof buf);
    if (n <= 0) return false;
    output_.append(buf, static_cast<size_t>(n));
    return true;
  }

  pid_t pid_ = -1;
  int out_ = -1;
  std::string output_;
  Clock::time_point start_;
};

Outcome loomrun(std::vector<std::string> args, const std::vector<std::string>& env = {}) {
  return Loomrun(std::move(args), env).finish();
}

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

class LoomrunTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(program("LOOMRUN").empty()) << "set LOOMRUN to the loomrun binary (meson test does)";
    ASSERT_FALSE(program("RANK_ECHO").empty()) << "set RANK_ECHO to the rank_echo binary (meson test does)";
  }
  std::string echo = program("RANK_ECHO");
};

TEST_F(LoomrunTest, PrefixesEachRanksOutputAndSetsTheEnvironment) {
  Outcome run = loomrun({"--nproc-per-node", "3", echo});
  EXPECT_EQ(run.code, 0) << run.output;
  for (int r = 0; r < 3; ++r) {
    std::string k = std::to_string(r);
    EXPECT_TRUE(contains(run.output, "[rank " + k + "] rank=" + k + " world=3 local=" + k + "/3 master=127.0.0.1:"))
        << run.output;
    EXPECT_TRUE(contains(run.output, "[rank " + k + "] stderr of " + k + "\n")) << run.output;
  }
}

TEST_F(LoomrunTest, RanksMeetThroughTheRendezvousStore) {
  Outcome run = loomrun({"--nproc-per-node", "3", echo, "--store"});
  EXPECT_EQ(run.code, 0) << run.output;
  for (int r = 0; r < 3; ++r) EXPECT_TRUE(contains(run.output, "[rank " + std::to_string(r) + "] joined 3")) << run.output;
}

TEST_F(LoomrunTest, AFailingRankStopsTheOthersAndGivesItsExitCode) {
  Outcome run = loomrun({"--nproc-per-node", "3", echo, "--fail-rank", "1", "--code", "3", "--sleep", "60"});
  EXPECT_EQ(run.code, 3) << run.output;
  EXPECT_TRUE(contains(run.output, "[rank 1] rank 1 failing now")) << run.output;
  EXPECT_TRUE(contains(run.output, "loomrun: rank 1 (pid ")) << run.output;
  EXPECT_TRUE(contains(run.output, ") exited with code 3; stopping the other 2 ranks")) << run.output;
  EXPECT_LT(run.took, 20s) << "the others were not stopped promptly";
}

TEST_F(LoomrunTest, ARankKilledBySignalGives128PlusTheSignal) {
  Outcome run = loomrun({"--nproc-per-node", "3", echo, "--kill-rank", "2", "--sleep", "60"});
  EXPECT_EQ(run.code, 128 + SIGKILL) << run.output;
  EXPECT_TRUE(contains(run.output, "was killed by signal 9")) << run.output;
  EXPECT_LT(run.took, 20s);
}

TEST_F(LoomrunTest, RanksIgnoringSigtermAreKilledAfterTheGracePeriod) {
  Outcome run = loomrun({"--nproc-per-node", "2", echo, "--fail-rank", "0", "--code", "5", "--ignore-term", "--sleep", "60"});
  EXPECT_EQ(run.code, 5) << run.output;
  EXPECT_TRUE(contains(run.output, "sending SIGKILL")) << run.output;
  EXPECT_GE(run.took, 4s);
  EXPECT_LT(run.took, 40s);
}

TEST_F(LoomrunTest, CtrlCIsPassedToTheRanks) {
  Loomrun run({"--nproc-per-node", "3", echo, "--sleep", "60"});
  for (int r = 0; r < 3; ++r) ASSERT_TRUE(run.read_until("[rank " + std::to_string(r) + "] rank="));
  ::kill(run.pid(), SIGINT);
  Outcome done = run.finish();
  EXPECT_EQ(done.code, 128 + SIGINT) << done.output;
  EXPECT_TRUE(contains(done.output, "passing it to 3 ranks")) << done.output;
  EXPECT_FALSE(contains(done.output, "sending SIGKILL")) << done.output;
}

TEST_F(LoomrunTest, ABusyMasterPortIsNamedBeforeAnyRankStarts) {
  net::Fd taken = net::listen_tcp(0, "127.0.0.1");
  std::string port = std::to_string(net::bound_port(taken.get()));
  Outcome run = loomrun({"--nproc-per-node", "3", "--master-port", port, echo});
  EXPECT_EQ(run.code, 1) << run.output;
  EXPECT_TRUE(contains(run.output, "MASTER_PORT " + port + " on 127.0.0.1 is already in use")) << run.output;
  EXPECT_TRUE(contains(run.output, "pick another with --master-port")) << run.output;
  EXPECT_FALSE(contains(run.output, "[rank ")) << run.output;
}

TEST_F(LoomrunTest, BadCommandLinesNameTheFlag) {
  struct Case {
    std::vector<std::string> args;
    const char* message;
  };
  const Case cases[] = {
      {{"--nproc-per-node", "x", "prog"}, "--nproc-per-node expects a number of ranks >= 1 or 'auto', got 'x'"},
      {{"--nproc-per-node", "0", "prog"}, "--nproc-per-node expects a number of ranks >= 1 or 'auto', got '0'"},
      {{"--nproc-per-node"}, "--nproc-per-node expects a value, got nothing"},
      {{"--bogus", "prog"}, "unknown flag '--bogus'"},
      {{"--nnodes", "2", "prog"}, "--nnodes 2 needs --master-addr and --master-port"},
      {{"--nnodes", "2", "--node-rank", "2", "prog"}, "--node-rank 2 is not below --nnodes 2"},
      {{"--master-port", "99999", "prog"}, "--master-port expects a TCP port number 1-65535, got '99999'"},
      {{}, "no program given"},
  };
  for (const auto& c : cases) {
    Outcome run = loomrun(c.args);
    EXPECT_EQ(run.code, 2) << c.message << "\n" << run.output;
    EXPECT_TRUE(contains(run.output, c.message)) << "expected \"" << c.message << "\" in:\n" << run.output;
    EXPECT_TRUE(contains(run.output, "loomrun --help")) << run.output;
  }
}

// A machine of `cores` cores of `threads` hardware threads, CPU c + k * cores being thread k
// of core c (Linux's usual numbering), in the core order usable_cpus() gives.
std::vector<Cpu> machine(int cores, int threads) {
  std::vector<Cpu> cpus;
  for (int c = 0; c < cores; ++c)
    for (int k = 0; k < threads; ++k) cpus.push_back({c + k * cores, 0, 0, c});
  return cpus;
}

TEST(CpuShares, RanksGetWholeCoresWhenThereAreEnough) {
  // 8 cores of 2 threads among 3 ranks: 3, 3 and 2 cores, no core split between two ranks.
  const auto shares = cpu_shares(machine(8, 2), 3);
  ASSERT_EQ(shares.size(), 3u);
  EXPECT_EQ(shares[0], (std::vector<int>{0, 8, 1, 9, 2, 10}));
  EXPECT_EQ(shares[1], (std::vector<int>{3, 11, 4, 12, 5, 13}));
  EXPECT_EQ(shares[2], (std::vector<int>{6, 14, 7, 15}));
  // Fewer cores than ranks: single CPUs in core order, sizes differing by at most one.
  const auto many = cpu_shares(machine(2, 2), 3);
  EXPECT_EQ(many, (std::vector<std::vector<int>>{{0, 2}, {1}, {3}}));
  // Where sysfs says nothing of cores, every CPU is a core of its own.
  const auto plain = cpu_shares({{0}, {1}, {2}, {3}, {4}}, 2);
  EXPECT_EQ(plain, (std::vector<std::vector<int>>{{0, 1, 2}, {3, 4}}));
  EXPECT_THROW(cpu_shares(machine(2, 2), 5), Error);
  EXPECT_THROW(cpu_shares(machine(2, 2), 0), Error);
  EXPECT_EQ(cpu_list_text({3, 0, 1, 2, 8, 10, 11}), "0-3,8,10-11");
  EXPECT_EQ(cpu_list_text({5}), "5");
}

TEST(CpuShares, UsableCpusAreTheAffinityMaskInCoreOrder) {
  const std::vector<Cpu> usable = usable_cpus();
  ASSERT_FALSE(usable.empty());
  const std::vector<int> ids = cpu_ids(usable);
  EXPECT_EQ(std::set<int>(ids.begin(), ids.end()).size(), ids.size());
  cpu_set_t mask;
  CPU_ZERO(&mask);
  ASSERT_EQ(::sched_getaffinity(0, sizeof mask, &mask), 0);
  EXPECT_EQ(int(ids.size()), CPU_COUNT(&mask));
  for (int id : ids) EXPECT_TRUE(CPU_ISSET(id, &mask)) << id;
  for (size_t i = 1; i < usable.size(); ++i)  // core order: (package, die, core) never goes back
    EXPECT_LE(std::tie(usable[i - 1].package, usable[i - 1].die, usable[i - 1].core),
              std::tie(usable[i].package, usable[i].die, usable[i].core));
}

// CPU kernels' threads default to the CPUs the process may run on, not the machine's.
TEST(CpuShares, TheKernelsThreadsDefaultToTheAffinityMask) {
  const std::vector<int> ids = cpu_ids(usable_cpus());
  const pid_t child = ::fork();
  if (child == 0) {
    ::unsetenv("LOOM_NUM_THREADS");
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(ids.front(), &one);
    if (::sched_setaffinity(0, sizeof one, &one) != 0) ::_exit(2);
    ::_exit(cpu::num_threads() == 1 ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
}

// Each rank's LOOM_NUM_THREADS ("?" when unset) and how many times it is set, its CPU
// kernels' threads and the CPUs it may run on, from rank_echo's second line.
std::string share_line(int rank, const std::string& threads, int set, int pool, const std::string& cpus) {
  return "[rank " + std::to_string(rank) + "] threads=" + threads + " (" + std::to_string(set) +
         " set) pool=" + std::to_string(pool) + " cpus=" + cpus + "\n";
}

TEST_F(LoomrunTest, WithoutCpuBindRanksShareEveryCpuAndTheThreadSetting) {
  const std::vector<Cpu> cpus = usable_cpus();
  const std::string all = cpu_list_text(cpu_ids(cpus));
  const int n = int(cpus.size());
  Outcome run = loomrun({"--nproc-per-node", "2", echo}, {"LOOM_NUM_THREADS"});
  EXPECT_EQ(run.code, 0) << run.output;
  for (int r = 0; r < 2; ++r) EXPECT_TRUE(contains(run.output, share_line(r, "?", 0, n, all))) << run.output;
  // The user's own setting is passed on unchanged, and once.
  run = loomrun({"--nproc-per-node", "2", echo}, {"LOOM_NUM_THREADS=5"});
  EXPECT_EQ(run.code, 0) << run.output;
  for (int r = 0; r < 2; ++r) EXPECT_TRUE(contains(run.output, share_line(r, "5", 1, 5, all))) << run.output;
  // One the ranks could not use is named before any starts.
  run = loomrun({"--nproc-per-node", "2", echo}, {"LOOM_NUM_THREADS=many"});
  EXPECT_EQ(run.code, 2) << run.output;
  EXPECT_TRUE(contains(run.output, "LOOM_NUM_THREADS expects a number of threads >= 1, or unset for a thread per "
                                   "CPU, got 'many'"))
      << run.output;
  EXPECT_FALSE(contains(run.output, "[rank ")) << run.output;
}

TEST_F(LoomrunTest, CpuBindPinsEachRankToItsOwnCpus) {
  const std::vector<Cpu> cpus = usable_cpus();
  if (cpus.size() < 2) GTEST_SKIP() << "one CPU: no two ranks can have CPUs of their own";
  const auto shares = cpu_shares(cpus, 2);
  Outcome run = loomrun({"--nproc-per-node", "2", "--cpu-bind", echo}, {"LOOM_NUM_THREADS"});
  EXPECT_EQ(run.code, 0) << run.output;
  for (int r = 0; r < 2; ++r)  // pinned, and a thread per CPU of the share
    EXPECT_TRUE(contains(run.output, share_line(r, "?", 0, int(shares[size_t(r)].size()),
                                                cpu_list_text(shares[size_t(r)]))))
        << run.output;
  // More ranks than CPUs, or a value given to the flag, is a bad command line.
  const std::string too_many = std::to_string(cpus.size() + 1);
  run = loomrun({"--nproc-per-node", too_many, "--cpu-bind", echo});
  EXPECT_EQ(run.code, 2) << run.output;
  EXPECT_TRUE(contains(run.output, "--cpu-bind gives each rank CPUs of its own, but " + too_many + " ranks need at least " +
                                       too_many + " CPUs and loomrun may use " + std::to_string(cpus.size()) + " (" +
                                       cpu_list_text(cpu_ids(cpus)) + ")"))
      << run.output;
  EXPECT_FALSE(contains(run.output, "[rank ")) << run.output;
  run = loomrun({"--cpu-bind=yes", echo});
  EXPECT_EQ(run.code, 2) << run.output;
  EXPECT_TRUE(contains(run.output, "--cpu-bind takes no value, got '--cpu-bind=yes'")) << run.output;
}

TEST_F(LoomrunTest, AMissingProgramIsNamed) {
  Outcome run = loomrun({"--nproc-per-node", "2", "no-such-program-loom"});
  EXPECT_EQ(run.code, 127) << run.output;
  EXPECT_TRUE(contains(run.output, "cannot run 'no-such-program-loom': not found in PATH")) << run.output;
}

TEST_F(LoomrunTest, HelpDocumentsTheFlagsAndTheEnvironment) {
  Outcome run = loomrun({"--help"});
  EXPECT_EQ(run.code, 0);
  for (const char* text : {"--nproc-per-node N|auto", "--nnodes", "--node-rank", "--master-addr", "--master-port",
                           "--cpu-bind", "LOOM_NUM_THREADS", "LOCAL_RANK", "CUDA_VISIBLE_DEVICES", "at most 4", "128+N"})
    EXPECT_TRUE(contains(run.output, text)) << "--help does not mention " << text;
}

}  // namespace
}  // namespace loom::dist
