// Ranks kept under supervision: a rendezvous that names the ranks it still waits for and
// gives up at its timeout, a port held by something that is not a store, a second job on a
// first job's port, ranks that disagree on their steps before the first one, and loomrun
// killed with SIGKILL taking its ranks with it. Over real sockets and processes on this
// machine (suite dist); meson passes loomrun's and rank_echo's paths in LOOMRUN, RANK_ECHO.
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "parallel/init.h"
#include "parallel/rendezvous.h"
#include "parallel/socket.h"
#include "parallel/store.h"

namespace loom::dist {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

RendezvousInfo info_for(int rank, int world, int port, const std::string& run_id = "") {
  RendezvousInfo info;
  info.rank = rank, info.world_size = world, info.local_rank = rank, info.local_world_size = world;
  info.master_addr = "127.0.0.1", info.master_port = port, info.run_id = run_id;
  return info;
}

TEST(Rendezvous, RankZeroNamesTheMissingRanksWhileItWaitsAndStopsAtTheTimeout) {
  const int port = net::free_port();
  testing::internal::CaptureStderr();
  const auto start = Clock::now();
  const std::string error = error_of([&] { connect_store(info_for(0, 3, port), 2500ms, 1000ms); });
  const auto took = Clock::now() - start;
  const std::string said = testing::internal::GetCapturedStderr();
  EXPECT_TRUE(contains(error, "ranks 1, 2 of 3 did not join")) << error;
  EXPECT_TRUE(contains(said, "rank 0: waiting for ranks 1, 2 of 3 to join")) << said;
  EXPECT_GE(std::count(said.begin(), said.end(), '\n'), 2) << said;
  EXPECT_LT(took, 6s);
}

TEST(Rendezvous, ARankWhoseRankZeroNeverStartsSaysSoWhileItWaitsAndStopsAtTheTimeout) {
  const int port = net::free_port();
  testing::internal::CaptureStderr();
  const auto start = Clock::now();
  const std::string error = error_of([&] { connect_store(info_for(2, 3, port), 2500ms, 1000ms); });
  const auto took = Clock::now() - start;
  const std::string said = testing::internal::GetCapturedStderr();
  EXPECT_TRUE(contains(error, "rank 2: rank 0's store at 127.0.0.1:" + std::to_string(port) + " did not appear"))
      << error;
  EXPECT_TRUE(contains(said, "rank 2: waiting for rank 0's store at 127.0.0.1:" + std::to_string(port))) << said;
  EXPECT_GE(std::count(said.begin(), said.end(), '\n'), 2) << said;
  EXPECT_LT(took, 6s);
}

TEST(Rendezvous, SomethingOnThePortThatIsNotAStoreFailsWithinTheTimeout) {
  // A listening socket that never answers: the kernel accepts the connection for it.
  net::Fd listener = net::listen_tcp(0, "127.0.0.1");
  const int port = net::bound_port(listener.get());
  const auto start = Clock::now();
  const std::string error = error_of([&] { connect_store(info_for(1, 2, port), 2s); });
  EXPECT_LT(Clock::now() - start, 5s);
  EXPECT_TRUE(contains(error, "does not answer as a TcpStore")) << error;
  EXPECT_TRUE(contains(error, "MASTER_PORT")) << error;
}

TEST(Rendezvous, ARankOfAnotherJobLeavesTheFirstJobsStoreAlone) {
  // The first job's rank 0 serves the store and has written its run id.
  TcpStore first("127.0.0.1", 0, TcpStore::Role::server, 10s);
  first.set("loom/rendezvous/run_id", "job-a");
  first.set("loom/rendezvous/world_size", "2");
  const std::string error = error_of([&] { connect_store(info_for(1, 2, first.port(), "job-b"), 5s); });
  EXPECT_TRUE(contains(error, "belongs to another job")) << error;
  EXPECT_TRUE(contains(error, "is already in use")) << error;
  EXPECT_FALSE(first.check({"loom/rendezvous/rank/1"}));  // nothing claimed there
}

// ---- ranks that disagree before the first step ------------------------------------------

// Runs `body` in two forked Gloo ranks; returns what each one threw.
std::vector<std::string> in_two_ranks(const std::function<void(const DistContext&, int rank)>& body) {
  const std::string dir = ::testing::TempDir();
  const std::string store_path = dir + "/supervision_store_" + std::to_string(::getpid());
  std::filesystem::remove(store_path);
  std::vector<pid_t> pids;
  for (int rank = 0; rank < 2; ++rank) {
    pid_t pid = ::fork();
    if (pid == 0) {
      ::alarm(60);
      std::string message = "(no error)";
      try {
        DistContext ctx;
        ctx.active = true, ctx.rank = rank, ctx.size = 2;
        ctx.store = std::make_shared<FileStore>(store_path, 0, 20s);
        ctx.group = new_gloo_group(ctx.store, rank, 2, {.timeout = 20s});
        body(ctx, rank);
      } catch (const std::exception& e) {
        message = e.what();
      }
      std::ofstream(dir + "/supervision_rank" + std::to_string(rank) + "_" + std::to_string(::getppid())) << message;
      ::_exit(0);
    }
    pids.push_back(pid);
  }
  std::vector<std::string> out;
  for (int rank = 0; rank < 2; ++rank) {
    int status = 0;
    ::waitpid(pids[size_t(rank)], &status, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "rank " << rank << " status " << status;
    std::ifstream in(dir + "/supervision_rank" + std::to_string(rank) + "_" + std::to_string(::getpid()));
    std::stringstream s;
    s << in.rdbuf();
    out.push_back(s.str());
  }
  std::filesystem::remove(store_path);
  return out;
}

std::vector<std::string> check_in_two_ranks(const std::vector<std::vector<SharedValue>>& values) {
  return in_two_ranks([&](const DistContext& ctx, int rank) {
    check_same_on_every_rank(ctx, values[size_t(rank)], "use the same flags");
  });
}

TEST(SameOnEveryRank, RanksThatAgreeGoOn) {
  const std::vector<SharedValue> same = {{"training images", 600}, {"steps per epoch", 12}};
  for (const std::string& message : check_in_two_ranks({same, same})) EXPECT_EQ(message, "(no error)");
}

TEST(SameOnEveryRank, RanksThatDisagreeStopNamingBothRanksAndValues) {
  const std::vector<std::string> messages =
      check_in_two_ranks({{{"training images", 600}, {"steps per epoch", 12}, {"batch size", 50}},
                          {{"training images", 400}, {"steps per epoch", 8}, {"batch size", 50}}});
  for (const std::string& m : messages) {
    EXPECT_TRUE(contains(m, "ranks 1 and 0 disagree before the first step")) << m;
    EXPECT_TRUE(contains(m, "training images: rank 1 has 400, rank 0 has 600")) << m;
    EXPECT_TRUE(contains(m, "steps per epoch: rank 1 has 8, rank 0 has 12")) << m;
    EXPECT_FALSE(contains(m, "batch size")) << m;
    EXPECT_TRUE(contains(m, "use the same flags")) << m;
  }
}

// A check that fails on one rank (rank 1's shard holds a NaN) ends both: rank 1 with its own
// error, rank 0 with one naming rank 1, instead of waiting in its next collective.
TEST(CheckOnEveryRank, AFaultFoundOnOneRankEndsEveryRank) {
  const std::vector<std::string> messages = in_two_ranks([](const DistContext& ctx, int rank) {
    check_on_every_rank(
        ctx, [&] { LOOM_CHECK(rank != 1, "shard 1 holds NaN"); }, "the check of the resumed weights");
  });
  EXPECT_TRUE(contains(messages[1], "shard 1 holds NaN")) << messages[1];
  EXPECT_TRUE(contains(messages[0], "rank 0: rank 1 failed the check of the resumed weights")) << messages[0];
  const std::vector<std::string> fine =
      in_two_ranks([](const DistContext& ctx, int) { check_on_every_rank(ctx, [] {}, "nothing"); });
  for (const std::string& m : fine) EXPECT_EQ(m, "(no error)");
}

// ---- loomrun ------------------------------------------------------------------------------

std::string program(const char* var) {
  const char* path = std::getenv(var);
  return path ? path : "";
}

// Starts loomrun with `args`, its output into `log`; returns its pid.
pid_t start_loomrun(const std::vector<std::string>& args, const std::string& log) {
  pid_t pid = ::fork();
  if (pid == 0) {
    std::FILE* f = std::fopen(log.c_str(), "w");
    ::dup2(::fileno(f), 1);
    ::dup2(::fileno(f), 2);
    std::vector<std::string> all = args;
    all.insert(all.begin(), program("LOOMRUN"));
    std::vector<char*> argv;
    for (auto& a : all) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv(argv[0], argv.data());
    ::_exit(126);
  }
  return pid;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// The pids whose parent is `parent` (from /proc).
std::vector<pid_t> children_of(pid_t parent) {
  std::vector<pid_t> out;
  for (const auto& e : std::filesystem::directory_iterator("/proc")) {
    const std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream stat(e.path() / "stat");
    std::string line;
    std::getline(stat, line);
    const size_t close = line.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(line.substr(close + 2));
    char state;
    pid_t ppid = 0;
    rest >> state >> ppid;
    if (ppid == parent) out.push_back(pid_t(std::stol(name)));
  }
  return out;
}

// Alive: present and not a zombie waiting to be reaped.
bool alive(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return false;
  const size_t close = line.rfind(')');
  return close != std::string::npos && close + 2 < line.size() && line[close + 2] != 'Z';
}

TEST(Loomrun, RanksDieWithALoomrunKilledBySigkill) {
  ASSERT_FALSE(program("LOOMRUN").empty() || program("RANK_ECHO").empty()) << "meson test sets LOOMRUN, RANK_ECHO";
  const std::string log = ::testing::TempDir() + "/supervision_kill.log";
  const pid_t loomrun = start_loomrun({"--nproc-per-node", "2", program("RANK_ECHO"), "--sleep", "60"}, log);
  std::vector<pid_t> ranks;
  for (auto deadline = Clock::now() + 20s; Clock::now() < deadline && ranks.size() < 2;
       std::this_thread::sleep_for(50ms))
    ranks = children_of(loomrun);
  ASSERT_EQ(ranks.size(), 2u) << read_file(log);
  std::this_thread::sleep_for(300ms);  // the ranks are past their start
  ::kill(loomrun, SIGKILL);
  ::waitpid(loomrun, nullptr, 0);
  for (pid_t rank : ranks) {
    auto deadline = Clock::now() + 5s;
    while (alive(rank) && Clock::now() < deadline) std::this_thread::sleep_for(20ms);
    EXPECT_FALSE(alive(rank)) << "rank pid " << rank << " outlived its launcher";
    if (alive(rank)) ::kill(rank, SIGKILL);
  }
}

// Each job trains for a second or two, so the first one's store is up while the second
// one's ranks start.
TEST(Loomrun, TwoJobsStartedAtOnceOnOnePortLeaveOneRunningAndNameTheBusyPort) {
  ASSERT_FALSE(program("LOOMRUN").empty() || program("TRAIN_CNN").empty()) << "meson test sets LOOMRUN, TRAIN_CNN";
  if (!std::filesystem::exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"))
    GTEST_SKIP() << "Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist)";
  // The port comes from free_port(), and another process (a parallel test's ephemeral socket)
  // may take it before either job starts: then both jobs rightly find it in use, and the
  // attempt is drawn again, once at most. Three attempts must find the two jobs racing.
  int trials = 0, skipped = 0;
  for (int attempt = 0; attempt < 6 && trials < 3; ++attempt) {
    SCOPED_TRACE("attempt " + std::to_string(attempt));
    const std::string port = std::to_string(net::free_port());
    const std::vector<std::string> args = {"--nproc-per-node", "2", "--master-port", port, program("TRAIN_CNN"),
                                           "--device", "cpu", "--subset", "512", "--test-subset", "100", "--epochs",
                                           "1", "--workers", "0", "--quiet", "--metrics", "", "--plot", ""};
    const std::string log_a = ::testing::TempDir() + "/supervision_a.log", log_b = ::testing::TempDir() + "/supervision_b.log";
    const pid_t a = start_loomrun(args, log_a), b = start_loomrun(args, log_b);
    int status_a = 0, status_b = 0;
    ::waitpid(a, &status_a, 0);
    ::waitpid(b, &status_b, 0);
    const std::string out_a = read_file(log_a), out_b = read_file(log_b);
    const bool a_ok = WIFEXITED(status_a) && WEXITSTATUS(status_a) == 0;
    const bool b_ok = WIFEXITED(status_b) && WEXITSTATUS(status_b) == 0;
    // Two jobs alone never both lose: only one of them can listen on the port. Both losing
    // once is taken for a third process; twice fails the test (below).
    if (!a_ok && !b_ok && contains(out_a, "is already in use") && contains(out_b, "is already in use")) {
      ++skipped;
      std::printf("both jobs found port %s in use; drawing another\nA:\n%s\nB:\n%s\n", port.c_str(), out_a.c_str(),
                  out_b.c_str());
      continue;
    }
    ++trials;
    EXPECT_NE(a_ok, b_ok) << "A:\n" << out_a << "\nB:\n" << out_b;
    const std::string& winner = a_ok ? out_a : out_b;
    const std::string& loser = a_ok ? out_b : out_a;
    EXPECT_TRUE(contains(winner, "[rank 0] epoch 1: train loss")) << winner;
    EXPECT_TRUE(contains(loser, "is already in use")) << loser;
    EXPECT_FALSE(contains(winner + loser, "times: two processes")) << winner << loser;
  }
  EXPECT_LE(skipped, 1) << "both jobs found the port in use in " << skipped << " attempts";
  EXPECT_EQ(trials, 3);
}

}  // namespace
}  // namespace loom::dist
