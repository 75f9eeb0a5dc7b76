// The NCCL process group on real GPUs. At world size 1 every collective runs for every
// dtype, reduction and size (1, 7, 1025, 2^20+3) against a CPU reference, next to Work's
// rules: wait() orders the compute stream, is_completed() turns true, the group holds a
// collective's tensors until it has run, barrier() waits for the compute stream. With two
// or more GPUs, one process per GPU runs the same checks across ranks.
//
// Rank processes are this test binary started again (fork and exec, so each is a fresh
// process: CUDA does not survive a fork) with a filter naming NcclRank.RunsTheCaseItWasStartedFor
// and the case in LOOM_NCCL_TEST_CASE. The timeout tests run there too, since the watchdog
// ends the process it watches. A GPU queue that is provably stuck comes from a host
// function that waits on the compute stream (a Gate), not from a race against a kernel.
#include <cuda_runtime.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "engine/allocator.h"
#include "engine/ops.h"
#include "kernels/config.h"
#include "parallel/nccl_group.h"
#include "parallel/process_group.h"
#include "parallel/store.h"
#include "tests/common/gpu.h"

extern char** environ;

namespace loom::dist {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

#define LOOM_REQUIRE_NCCL()                                                       \
  do {                                                                            \
    if (!LOOM_WITH_NCCL) GTEST_SKIP() << "Loom was built without NCCL: skipping"; \
  } while (0)

const Device kGpu = Device::cuda(0);
constexpr DType kReduceDTypes[] = {DType::f32, DType::f64, DType::bf16, DType::f16, DType::i32, DType::i64};
constexpr DType kAllDTypes[] = {DType::f32, DType::f64, DType::bf16, DType::f16, DType::i32, DType::i64, DType::u8};
constexpr ReduceOp kOps[] = {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min};
constexpr int64_t kSizes[] = {1, 7, 1025, (int64_t(1) << 20) + 3};

std::string temp_path(const std::string& stem) {
  static std::atomic<int> counter{0};
  return (std::filesystem::path(::testing::TempDir()) /
          (stem + "_" + std::to_string(::getpid()) + "_" + std::to_string(counter++)))
      .string();
}

std::shared_ptr<ProcessGroup> open_group(const std::string& store_path, int rank, int size, Device device,
                                         Duration timeout) {
  auto store = std::make_shared<FileStore>(store_path, 0, 60s);
  ProcessGroupOptions options;
  options.timeout = timeout;
  return new_nccl_group(store, rank, size, device, options);
}

// A world-size-1 group on cuda:0 over a fresh FileStore.
struct OneRank {
  explicit OneRank(Duration timeout = 60s) : path(temp_path("nccl_store")) {
    group = open_group(path, 0, 1, kGpu, timeout);
  }
  ~OneRank() {
    group.reset();
    std::filesystem::remove(path);
  }
  std::string path;
  std::shared_ptr<ProcessGroup> group;
};

// ---- values and the CPU reference ---------------------------------------------------

// Rank r's element i: small integers, so sums are exact in every dtype (bf16 included),
// of both signs, so sum, max and min all differ; integer dtypes sit past 16 (i32) and 32
// (i64) bits to catch a narrowed type.
double value(DType dtype, int rank, int64_t i) {
  if (dtype == DType::u8) return double((i * 7 + rank * 3) % 251);
  double v = double((i * 7 + rank * 3) % 11) - 5;
  if (dtype == DType::i32) v += double(1 << 20);
  if (dtype == DType::i64) v += double(int64_t(1) << 40);
  return v;
}

std::vector<double> values(DType dtype, int rank, int64_t n) {
  std::vector<double> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) out[size_t(i)] = value(dtype, rank, i);
  return out;
}

// op over ranks 0..size-1 of element i; avg truncates toward zero on integers.
double reduced(ReduceOp op, DType dtype, int size, int64_t i) {
  double sum = 0, hi = -INFINITY, lo = INFINITY;
  int64_t isum = 0;
  for (int r = 0; r < size; ++r) {
    double v = value(dtype, r, i);
    sum += v;
    isum += int64_t(v);
    hi = std::max(hi, v);
    lo = std::min(lo, v);
  }
  switch (op) {
    case ReduceOp::sum: return sum;
    case ReduceOp::max: return hi;
    case ReduceOp::min: return lo;
    case ReduceOp::avg: return is_floating(dtype) ? sum / size : double(isum / size);
  }
  return 0;
}

// Sums of small integers are exact; an average rounds in the dtype (NCCL scales each
// input by 1/size before summing floats).
double tolerance(DType dtype, ReduceOp op) {
  if (op != ReduceOp::avg) return 0;
  switch (dtype) {
    case DType::bf16: return 0.125;
    case DType::f16: return 0.02;
    case DType::f32: return 1e-5;
    case DType::f64: return 1e-12;
    default: return 0;
  }
}

Tensor make(DType dtype, const std::vector<double>& v, Device device) {
  return from_vector(v, {int64_t(v.size())}).to(dtype).to(device);
}

::testing::AssertionResult equal(const Tensor& t, const std::vector<double>& expected, double tol) {
  std::vector<double> got = t.to_vector<double>();
  if (got.size() != expected.size())
    return ::testing::AssertionFailure() << got.size() << " elements, expected " << expected.size();
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!(std::abs(got[i] - expected[i]) <= tol) && bad++ == 0) first = i;
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << got.size() << " elements wrong; first at " << first
                                       << ": got " << got[first] << ", expected " << expected[first];
}

std::string label(const char* op, DType dtype, int64_t n, const char* detail = "") {
  std::ostringstream os;
  os << op << " " << dtype_name(dtype) << " n=" << n << " " << detail;
  return os.str();
}

// ---- the collective checks, for any world size ----------------------------------------

void check_all_reduce(ProcessGroup& g, Device device) {
  for (DType dtype : kReduceDTypes) {
    for (int64_t n : kSizes) {
      for (ReduceOp op : kOps) {
        std::vector<double> expected(static_cast<size_t>(n));
        for (int64_t i = 0; i < n; ++i) expected[size_t(i)] = reduced(op, dtype, g.size(), i);
        Tensor t = make(dtype, values(dtype, g.rank(), n), device);
        g.all_reduce(t, op)->wait();
        EXPECT_TRUE(equal(t, expected, tolerance(dtype, op))) << label("all_reduce", dtype, n, reduce_op_name(op));
      }
    }
  }
}

void check_broadcast(ProcessGroup& g, Device device) {
  std::vector<int> roots = {0};
  if (g.size() > 1) roots.push_back(g.size() - 1);
  for (DType dtype : kAllDTypes) {
    for (int64_t n : kSizes) {
      for (int root : roots) {
        Tensor t = make(dtype, values(dtype, g.rank(), n), device);
        g.broadcast(t, root)->wait();
        EXPECT_TRUE(equal(t, values(dtype, root, n), 0)) << label("broadcast", dtype, n) << "root " << root;
      }
    }
  }
}

void check_all_gather(ProcessGroup& g, Device device) {
  for (DType dtype : kReduceDTypes) {
    for (int64_t n : kSizes) {
      std::vector<double> expected;
      for (int r = 0; r < g.size(); ++r) {
        auto part = values(dtype, r, n);
        expected.insert(expected.end(), part.begin(), part.end());
      }
      Tensor in = make(dtype, values(dtype, g.rank(), n), device);
      Tensor out = Tensor::empty({g.size() * n}, dtype, device);
      g.all_gather(out, in)->wait();
      EXPECT_TRUE(equal(out, expected, 0)) << label("all_gather", dtype, n);
    }
  }
}

void check_reduce_scatter(ProcessGroup& g, Device device) {
  for (DType dtype : kReduceDTypes) {
    for (int64_t n : kSizes) {
      for (ReduceOp op : kOps) {
        std::vector<double> expected(static_cast<size_t>(n));
        for (int64_t i = 0; i < n; ++i) expected[size_t(i)] = reduced(op, dtype, g.size(), g.rank() * n + i);
        Tensor in = make(dtype, values(dtype, g.rank(), g.size() * n), device);
        Tensor out = Tensor::empty({n}, dtype, device);
        g.reduce_scatter(out, in, op)->wait();
        EXPECT_TRUE(equal(out, expected, tolerance(dtype, op)))
            << label("reduce_scatter", dtype, n, reduce_op_name(op));
      }
    }
  }
}

// Around a ring: rank 0 sends first and every other rank receives first, so each send
// meets a posted receive and nothing deadlocks.
void check_send_recv(ProcessGroup& g, Device device) {
  int size = g.size(), rank = g.rank(), next = (rank + 1) % size, prev = (rank + size - 1) % size;
  for (DType dtype : kAllDTypes) {
    for (int64_t n : kSizes) {
      Tensor mine = make(dtype, values(dtype, rank, n), device);
      Tensor got = Tensor::empty({n}, dtype, device);
      WorkPtr sent, received;
      if (rank == 0) {
        sent = g.send(mine, next, 7);
        received = g.recv(got, prev, 7);
      } else {
        received = g.recv(got, prev, 7);
        sent = g.send(mine, next, 7);
      }
      sent->wait();
      received->wait();
      EXPECT_TRUE(equal(got, values(dtype, prev, n), 0)) << label("send/recv", dtype, n);
    }
  }
}

// ---- rank processes ---------------------------------------------------------------------

struct Outcome {
  int code = -1;  // exit status; 128 + signal when killed
  std::string output;
  Clock::duration took{};
};

// Ranks of one test, each this binary again running NcclRank.RunsTheCaseItWasStartedFor
// with its output in a file. Processes still running at destruction are killed.
class RankProcesses {
 public:
  // Starts `ranks` (all of 0..world-1 when empty) of a `world`-rank run of case `name`.
  RankProcesses(const std::string& name, int world, std::vector<int> ranks = {}) : store_(temp_path("nccl_ranks")) {
    if (ranks.empty())
      for (int r = 0; r < world; ++r) ranks.push_back(r);
    std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
    std::vector<std::string> args = {self, "--gtest_filter=NcclRank.RunsTheCaseItWasStartedFor"};
    start_ = Clock::now();
    for (int r : ranks) {
      std::vector<std::string> env;
      bool nvls_set = false;
      for (char** e = environ; *e; ++e) {
        std::string_view var(*e);
        if (var.starts_with("LOOM_NCCL_TEST_") || var.starts_with("GTEST_")) continue;
        nvls_set = nvls_set || var.starts_with("NCCL_NVLS_ENABLE=");
        env.emplace_back(var);
      }
      if (!nvls_set) env.push_back("NCCL_NVLS_ENABLE=0");
      env.push_back("LOOM_NCCL_TEST_CASE=" + name);
      env.push_back("LOOM_NCCL_TEST_RANK=" + std::to_string(r));
      env.push_back("LOOM_NCCL_TEST_WORLD=" + std::to_string(world));
      env.push_back("LOOM_NCCL_TEST_STORE=" + store_);
      std::string log = store_ + "_rank" + std::to_string(r) + ".log";
      pids_.push_back(spawn(self, args, env, log));
      logs_.push_back(log);
    }
  }
  ~RankProcesses() {
    for (pid_t& pid : pids_) {
      if (pid <= 0) continue;
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
    for (const auto& log : logs_) std::filesystem::remove(log);
    std::filesystem::remove(store_);
  }

  // Waits for the i-th process started (killing it once `limit` has passed since the start).
  Outcome finish(size_t i, Clock::duration limit) {
    Outcome out;
    pid_t& pid = pids_.at(i);
    int status = 0;
    while (pid > 0) {
      pid_t got = ::waitpid(pid, &status, WNOHANG);
      if (got == pid) {
        out.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        pid = 0;
      } else if (got < 0) {
        pid = 0;
      } else if (Clock::now() - start_ > limit) {
        ::kill(pid, SIGKILL);
        ::waitpid(pid, &status, 0);
        out.code = 128 + SIGKILL;
        pid = 0;
      } else {
        std::this_thread::sleep_for(20ms);
      }
    }
    out.took = Clock::now() - start_;
    std::ifstream file(logs_[i]);
    out.output.assign(std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>());
    return out;
  }

 private:
  static pid_t spawn(const std::string& path, const std::vector<std::string>& args, const std::vector<std::string>& env,
                     const std::string& log) {
    std::vector<char*> argv, envp;
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    for (const auto& e : env) envp.push_back(const_cast<char*>(e.c_str()));
    envp.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&actions, 1, 2);
    pid_t pid = -1;
    int rc = ::posix_spawn(&pid, path.c_str(), &actions, nullptr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&actions);
    EXPECT_EQ(rc, 0) << "cannot start " << path << ": " << std::strerror(rc);
    return rc == 0 ? pid : -1;
  }

  std::string store_;
  std::vector<pid_t> pids_;
  std::vector<std::string> logs_;
  Clock::time_point start_;
};

// Holds a stream busy until opened, or until `limit` passes, so a test that fails early
// does not leave the GPU stuck for the tests after it.
class Gate {
 public:
  Gate(StreamHandle stream, Clock::duration limit) : stream_(stream), deadline_(Clock::now() + limit) {
    EXPECT_EQ(cudaLaunchHostFunc(static_cast<cudaStream_t>(stream), &Gate::wait, this), cudaSuccess);
  }
  ~Gate() {
    open();
    cudaStreamSynchronize(static_cast<cudaStream_t>(stream_));  // the host function reads this object
  }
  void open() { open_.store(true); }

 private:
  static void wait(void* self) {
    auto* gate = static_cast<Gate*>(self);
    while (!gate->open_.load() && Clock::now() < gate->deadline_) std::this_thread::sleep_for(1ms);
  }
  StreamHandle stream_;
  Clock::time_point deadline_;
  std::atomic<bool> open_{false};
};

int env_int(const char* name) { return std::atoi(std::getenv(name)); }

// What a rank process does, by case name.
void run_rank_case(const std::string& name) {
  int rank = env_int("LOOM_NCCL_TEST_RANK"), world = env_int("LOOM_NCCL_TEST_WORLD");
  std::string store = std::getenv("LOOM_NCCL_TEST_STORE");
  Device device = Device::cuda(rank);
  if (name == "collectives") {
    auto g = open_group(store, rank, world, device, 120s);
    check_all_reduce(*g, device);
    check_broadcast(*g, device);
    check_all_gather(*g, device);
    check_reduce_scatter(*g, device);
    check_send_recv(*g, device);
    WorkPtr done = g->barrier();
    EXPECT_TRUE(done->is_completed());
  } else if (name == "stalled_stream") {
    // The compute stream never frees up, so the collective behind it never starts.
    auto g = open_group(store, rank, world, device, 2s);
    Tensor t = ones({1024}, DType::f32, device);
    synchronize(device);
    Gate gate(compute_stream(device), 600s);
    g->all_reduce(t);
    std::this_thread::sleep_for(120s);  // the watchdog ends the process long before
  } else if (name == "silent_peer") {
    // Both ranks join; rank 1 then never calls the collective rank 0 waits in.
    auto g = open_group(store, rank, world, device, 3s);
    if (rank == 0) {
      Tensor t = ones({1024}, DType::f32, device);
      g->all_reduce(t)->wait();
      synchronize(device);
    }
    std::this_thread::sleep_for(120s);
  } else if (name == "absent_peer") {
    // Rank 1 never starts: initialisation must time out and name it, not hang.
    try {
      open_group(store, rank, world, device, 3s);
      ADD_FAILURE() << "a group of 2 formed with rank 1 absent";
    } catch (const Error& e) {
      std::string what = e.what();
      EXPECT_NE(what.find("did not finish within"), std::string::npos) << what;
      EXPECT_NE(what.find("rank 1 never joined"), std::string::npos) << what;
    }
  } else {
    ADD_FAILURE() << "unknown case " << name;
  }
}

std::string contains(const std::string& text, const std::string& part) {
  return text.find(part) == std::string::npos ? "missing \"" + part + "\"" : "";
}

// ---- tests --------------------------------------------------------------------------------

TEST(NcclRank, RunsTheCaseItWasStartedFor) {
  LOOM_REQUIRE_CUDA();
  LOOM_REQUIRE_NCCL();
  const char* name = std::getenv("LOOM_NCCL_TEST_CASE");
  if (!name) GTEST_SKIP() << "runs only inside the rank processes the multi-process NCCL tests start";
  run_rank_case(name);
}

TEST(NcclGroup, NewNcclGroupSaysWhenLoomHasNoNccl) {
  LOOM_REQUIRE_CUDA();
  if (LOOM_WITH_NCCL) GTEST_SKIP() << "this build has NCCL";
  auto store = std::make_shared<FileStore>(temp_path("nccl_store"), 1, 5s);
  try {
    new_nccl_group(store, 0, 1, kGpu);
    ADD_FAILURE() << "new_nccl_group worked without NCCL";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no NCCL"), std::string::npos) << e.what();
  }
}

TEST(NcclGroup, RefusesACpuDevice) {
  LOOM_REQUIRE_CUDA();
  LOOM_REQUIRE_NCCL();
  std::string path = temp_path("nccl_store");
  try {
    open_group(path, 0, 1, Device::cpu(), 10s);
    ADD_FAILURE() << "an NCCL group formed on the CPU";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("CUDA device"), std::string::npos) << e.what();
  }
  std::filesystem::remove(path);
}

TEST(NcclGroup, AllReduceMatchesTheCpuForEveryDtypeOpAndSize) {
  LOOM_REQUIRE_CUDA();
  LOOM_REQUIRE_NCCL();
  OneRank one;
  EXPECT_EQ(one.group->backend(), "nccl");
  check_all_reduce(*one.group, kGpu);
}

TEST(NcclGroup, BroadcastMatchesTheCpuForEveryDtypeAndSize) {
  LOOM_REQUIRE_CUDA();
  LOOM_REQUIRE_NCCL();
  OneRank one;
  check_broadcast(*one.group, kGpu);
}

TEST(NcclGroup, AllGatherMatchesTheCpuForEveryDtypeAndSize) {
  LOOM_REQUIRE_CUDA();
  LOOM_REQUIRE_NCCL();
  OneRank one;
  check_all_gather(*one.group, kGpu);
}

TEST(NcclGroup, ReduceScatterMatchesTheCpuForEveryDtypeOpAndSize) {
  LOOM_REQUIRE_CUDA();
  LOOM_REQUIRE_NCCL();
  OneRank one;
  check_reduce_scatter(*one.group, kGpu);
}

TEST(NcclGroup, EmptyTensorsPassThrough) {
  LOOM_REQUIRE_CUDA();
  LOOM_REQUIRE_NCCL();
  OneRank one;
  Tensor empty = Tensor::empty({0}, DType::f32, kGpu);
  WorkPtr work = one.group->all_reduce(empty);
  work->wait();
  synchronize(kGpu);
  EXPECT_TRUE(work->is_completed());
}

TEST(NcclGroup, WaitOrdersTheComputeStreamAfterTheCollective) {
  LOOM_REQUIRE_CUDA();
  LOOM_REQUIRE_NCCL();
  OneRank one;
  // Enough queued work that a collective not ordered after it, or an op not ordered after
  // the collective, would read the wrong values.
  const int64_t n = int64_t(1) << 24;
  Tensor in = zeros({n}, DType::f32, kGpu), step = ones({n}, DType::f32, kGpu);
  for (int k = 0; k < 20; ++k) add_(in, step);
  Tensor out = Tensor::empty({n}, DType::f32, kGpu);
  WorkPtr work = one.group->all_gather(out, in);
  work->wait();
  Tensor doubled = out * 2.0;
  EXPECT_EQ(max(doubled).item(), 40.0);
  EXPECT_EQ(-max(-doubled).item(), 40.0);
}

TEST(NcclGroup, IsCompletedTurnsTrueWithoutWait) {
  LOOM_REQUIRE_CUDA();
  LOOM_REQUIRE_NCCL();
  OneRank one;
  Tensor t = ones({1025}, DType::f32, kGpu);
  WorkPtr work = one.group->all_reduce(t);
  auto deadline = Clock::now() + 30s;
  while (!work->is_completed() && Clock::now() < deadline) std::this_thread::sleep_for(1ms);
  EXPECT_TRUE(work->is_completed());
}

TEST(NcclGroup, HoldsTheTensorsOfACollectiveUntilItHasRun) {
  LOOM_REQUIRE_CUDA();
  LOOM_REQUIRE_NCCL();
  OneRank one;
  synchronize(kGpu);
  size_t before = memory::stats(kGpu).allocated;
  const int64_t n = int64_t(1) << 20;
  WorkPtr work;
  {
    Gate gate(compute_stream(kGpu), 30s);
    {
      Tensor in = Tensor::empty({n}, DType::f32, kGpu), out = Tensor::empty({n}, DType::f32, kGpu);
      work = one.group->all_gather(out, in);
    }  // the caller's handles are gone; the collective has not started
    EXPECT_GE(memory::stats(kGpu).allocated, before + 2 * size_t(n) * 4);
    EXPECT_FALSE(work->is_completed());
    gate.open();
  }
  auto deadline = Clock::now() + 10s;
  while (memory::stats(kGpu).allocated > before && Clock::now() < deadline) std::this_thread::sleep_for(5ms);
  EXPECT_TRUE(work->is_completed());
  EXPECT_EQ(memory::stats(kGpu).allocated, before);
}

TEST(NcclGroup, BarrierReturnsAfterTheComputeStreamWorkBeforeIt) {
  LOOM_REQUIRE_CUDA();
  LOOM_REQUIRE_NCCL();
  OneRank one;
  const int64_t n = int64_t(1) << 24;
  Tensor x = zeros({n}, DType::f32, kGpu), step = ones({n}, DType::f32, kGpu);
  for (int k = 0; k < 20; ++k) add_(x, step);
  Event marker;
  marker.record(compute_stream(kGpu));
  WorkPtr work = one.group->barrier();
  EXPECT_TRUE(marker.query());
  EXPECT_TRUE(work->is_completed());
}

TEST(NcclGroup, RejectsATensorOnAnotherDevice) {
  LOOM_REQUIRE_CUDA();
  LOOM_REQUIRE_NCCL();
  OneRank one;
  try {
    one.group->all_reduce(ones({4}));
    ADD_FAILURE() << "an NCCL group took a CPU tensor";
  } catch (const Error& e) {
    std::string what = e.what();
    EXPECT_TRUE(what.find("CPU") != std::string::npos || what.find("cpu") != std::string::npos) << what;
  }
  if (cuda_device_count() < 2) return;
  try {
    one.group->all_reduce(ones({4}, DType::f32, Device::cuda(1)));
    ADD_FAILURE() << "an NCCL group on cuda:0 took a tensor on cuda:1";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cuda:1"), std::string::npos) << e.what();
  }
}

TEST(NcclGroup, RefusesToSendToItself) {
  LOOM_REQUIRE_CUDA();
  LOOM_REQUIRE_NCCL();
  OneRank one;
  Tensor t = ones({4}, DType::f32, kGpu);
  EXPECT_THROW(one.group->send(t, 0), Error);
  EXPECT_THROW(one.group->recv(t, 0), Error);
}

TEST(NcclGroup, ProgressEntriesNameTheRanksBehind) {
  LOOM_REQUIRE_CUDA();
  using detail::nccl_ranks_behind;
  EXPECT_EQ(detail::nccl_progress_key(3, 1), "nccl/3/progress/1");
  EXPECT_EQ(detail::nccl_progress_value(2, 5), "2 5");
  std::string text = nccl_ranks_behind(0, 3, {"2 3", "2 2", std::nullopt, "3 3", "x"});
  EXPECT_EQ(contains(text, "rank 1 (issued 2) has not issued collective #3"), "") << text;
  EXPECT_EQ(contains(text, "rank 2 never joined"), "") << text;
  EXPECT_EQ(contains(text, "rank 4 left a progress entry"), "") << text;
  EXPECT_EQ(text.find("3 (issued"), std::string::npos) << text;
  EXPECT_EQ(contains(nccl_ranks_behind(1, 2, {"0 1", "1 2", "2 0"}), "ranks 0 (issued 1), 2 (issued 0) have"), "");
  EXPECT_EQ(contains(nccl_ranks_behind(0, 1, {"0 1", "0 1"}), "none is behind"), "");
  EXPECT_EQ(contains(nccl_ranks_behind(0, 0, {"0 0", std::nullopt}), "rank 1 never joined"), "");
  EXPECT_EQ(contains(nccl_ranks_behind(0, 4, {"3 4"}), "no other rank"), "");
}

TEST(NcclGroup, EveryCollectiveMatchesTheCpuAcrossAllVisibleGpus) {
  LOOM_REQUIRE_CUDA();
  LOOM_REQUIRE_NCCL();
  int world = cuda_device_count();
  if (world < 2) GTEST_SKIP() << "needs 2 or more GPUs, this machine shows " << world;
  RankProcesses ranks("collectives", world);
  for (int r = 0; r < world; ++r) {
    Outcome out = ranks.finish(size_t(r), 480s);
    EXPECT_EQ(out.code, 0) << "rank " << r << " of " << world << ":\n" << out.output;
  }
}

TEST(NcclGroup, StuckCollectiveEndsTheProcessNamingIt) {
  LOOM_REQUIRE_CUDA();
  LOOM_REQUIRE_NCCL();
  RankProcesses ranks("stalled_stream", 1);
  Outcome out = ranks.finish(0, 90s);
  EXPECT_EQ(out.code, 1) << out.output;
  for (const char* part :
       {"rank 0 of 1 on cuda:0", "all_reduce", "did not finish within the timeout of 2.0 s", "exiting with status 1"})
    EXPECT_EQ(contains(out.output, part), "") << out.output;
  // The 2 s timeout, the watchdog's tick, and at most the abort's 10 s grace.
  EXPECT_LT(out.took, 40s) << out.output;
}

TEST(NcclGroup, SilentPeerEndsTheWaitingRankNamingThePeer) {
  LOOM_REQUIRE_CUDA();
  LOOM_REQUIRE_NCCL();
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs 2 GPUs, this machine shows " << cuda_device_count();
  RankProcesses ranks("silent_peer", 2);
  Outcome out = ranks.finish(0, 120s);
  EXPECT_EQ(out.code, 1) << out.output;
  // Depending on NCCL's connection set-up the call times out while being issued or while
  // running; either way the message names it, the timeout and the rank behind.
  for (const char* part :
       {"rank 0 of 2", "all_reduce", "within the timeout of 3.0 s", "rank 1 (issued 0) has not issued collective #1"})
    EXPECT_EQ(contains(out.output, part), "") << out.output;
  EXPECT_LT(out.took, 60s) << out.output;
}

TEST(NcclGroup, AbsentPeerMakesInitialisationFailNamingIt) {
  LOOM_REQUIRE_CUDA();
  LOOM_REQUIRE_NCCL();
  RankProcesses ranks("absent_peer", 2, {0});
  Outcome out = ranks.finish(0, 90s);
  EXPECT_EQ(out.code, 0) << out.output;
}

}  // namespace
}  // namespace loom::dist
