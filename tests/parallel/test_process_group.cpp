// The process-group contract, proven on the Gloo backend over real processes: every
// collective on every dtype and reduction, at sizes that do and do not divide evenly,
// against a reference computed from the inputs each rank is known to hold (rank r holds
// value(i, r) at index i); point-to-point in a ring; the argument checks; the debug ledger
// turning a mismatched call into an error; and a dead or hung rank turning into an error on
// the survivors within the timeout.
//
// Ranks are forked children meeting through a FileStore. A child reports through its exit
// code: 0 when every check passed, otherwise it prints what failed. Each child sets an
// alarm, so a hang ends as a failed test rather than a stuck run. Forking after the parent
// has run tensor ops is safe (the CPU thread pool is remade in the child); one test proves it.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <regex>
#include <thread>

#include "engine/ops.h"
#include "kernels/core/error.h"
#include "parallel/process_group.h"
#include "parallel/store.h"

namespace loom::dist {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

const std::vector<DType> kDtypes = {DType::f32, DType::f64, DType::bf16, DType::f16, DType::i32, DType::i64};
const std::vector<ReduceOp> kOps = {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min};
const std::vector<int64_t> kSizes = {1, 7, 1025, 65537};

// ---- processes -----------------------------------------------------------------------------

std::string temp_path(const std::string& stem) {
  static std::atomic<int> counter{0};
  return (std::filesystem::path(::testing::TempDir()) /
          (stem + "_" + std::to_string(::getpid()) + "_" + std::to_string(counter++)))
      .string();
}

// What a failed check in a child throws; fork_rank prints it and exits with 1.
struct CheckFailed : std::runtime_error {
  using std::runtime_error::runtime_error;
};

template <class... Args>
void require(bool cond, const Args&... args) {
  if (!cond) throw CheckFailed(::loom::detail::str(args...));
}

template <class F>
pid_t fork_rank(int rank, F body) {
  pid_t pid = ::fork();
  if (pid == 0) {
    ::alarm(60);
    int code = 1;
    try {
      code = body();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
    }
    ::_exit(code);
  }
  return pid;
}

int exit_code(pid_t pid) {
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

using RankBody = std::function<int(int rank, std::shared_ptr<Store> store)>;

// Forks `world` ranks sharing a fresh FileStore; returns their exit codes by rank.
std::vector<int> run_ranks(int world, const RankBody& body) {
  std::string path = temp_path("pg_store");
  std::vector<pid_t> pids;
  for (int rank = 0; rank < world; ++rank)
    pids.push_back(fork_rank(rank, [&, rank] { return body(rank, std::make_shared<FileStore>(path, 0, 20s)); }));
  std::vector<int> codes;
  for (pid_t pid : pids) codes.push_back(exit_code(pid));
  std::filesystem::remove(path);
  return codes;
}

using GroupBody = std::function<void(ProcessGroup& group)>;

// Every rank makes a Gloo group and runs `body`, which throws CheckFailed on a wrong result.
std::vector<int> run_group(int world, const GroupBody& body, ProcessGroupOptions options = {.timeout = 20s}) {
  return run_ranks(world, [&](int rank, std::shared_ptr<Store> store) {
    auto group = new_gloo_group(store, rank, world, options);
    body(*group);
    return 0;
  });
}

void expect_all_zero(const std::vector<int>& codes) {
  for (size_t r = 0; r < codes.size(); ++r) EXPECT_EQ(codes[r], 0) << "rank " << r << " failed (see its output)";
}

// ---- values --------------------------------------------------------------------------------

bool is_half(DType d) { return d == DType::bf16 || d == DType::f16; }

// What rank r holds at index i: small mixed-sign integers, which every dtype holds exactly
// and whose sums over four ranks bf16 and f16 still hold exactly; wider types also get a
// term that differs per element and per rank, and i64 one past 32 bits.
double value(int64_t i, int r, DType dtype) {
  if (dtype == DType::u8) return double((i * 7 + r * 13) % 251);
  double v = double((i * 7 + r * 13) % 23) - 11 + r;
  if (!is_half(dtype)) v += double(i % 65536) * (r + 1);
  if (dtype == DType::i64) v += double(int64_t(1) << 40);
  return v;
}

template <class F>
void with_type(DType dtype, F&& f) {
  switch (dtype) {
    case DType::f32: return f(float{});
    case DType::f64: return f(double{});
    case DType::bf16: return f(bf16{});
    case DType::f16: return f(f16{});
    case DType::i32: return f(int32_t{});
    case DType::i64: return f(int64_t{});
    case DType::u8: return f(uint8_t{});
  }
}

double read(const Tensor& t, int64_t i) {
  double out = 0;
  with_type(t.dtype(), [&]<class T>(T) { out = double(t.data<T>()[i]); });
  return out;
}

void write(const Tensor& t, int64_t i, double v) {
  with_type(t.dtype(), [&]<class T>(T) {
    if constexpr (std::is_same_v<T, bf16> || std::is_same_v<T, f16>) t.data<T>()[i] = T(float(v));
    else t.data<T>()[i] = T(v);
  });
}

// A tensor of `n` elements holding value(offset + i, rank) at i.
Tensor filled(int64_t n, DType dtype, int rank, int64_t offset = 0) {
  Tensor t = Tensor::empty({n}, dtype);
  for (int64_t i = 0; i < n; ++i) write(t, i, value(offset + i, rank, dtype));
  return t;
}

// The reduction of value(i, r) over r, rounded as the group rounds it.
double reference(ReduceOp op, int64_t i, int world, DType dtype) {
  double acc = value(i, 0, dtype);
  for (int r = 1; r < world; ++r) {
    double v = value(i, r, dtype);
    if (op == ReduceOp::max) acc = std::max(acc, v);
    else if (op == ReduceOp::min) acc = std::min(acc, v);
    else acc += v;
  }
  if (op != ReduceOp::avg) return acc;
  switch (dtype) {
    case DType::f64: return acc / world;
    case DType::f32: return double(float(acc) / float(world));
    case DType::bf16: return float(bf16(float(acc) / float(world)));
    case DType::f16: return float(f16(float(acc) / float(world)));
    default: return double(int64_t(acc) / world);
  }
}

void require_values(const Tensor& t, const std::function<double(int64_t)>& expected, const std::string& what) {
  for (int64_t i = 0; i < t.numel(); ++i) {
    double got = read(t, i), want = expected(i);
    require(got == want, what, ": element ", i, " is ", got, ", expected ", want);
  }
}

std::string case_name(const char* op, DType dtype, int64_t n, const char* detail = "") {
  return ::loom::detail::str(op, " ", detail, " ", dtype_name(dtype), " n=", n);
}

// ---- collectives at world sizes 2, 3 and 4 -------------------------------------------------

class GlooGroupTest : public ::testing::TestWithParam<int> {
 protected:
  int world() const { return GetParam(); }
};

TEST_P(GlooGroupTest, AllReduceMatchesTheReferenceForEveryDtypeOpAndSize) {
  int world = this->world();
  expect_all_zero(run_group(world, [&](ProcessGroup& g) {
    for (DType dtype : kDtypes)
      for (ReduceOp op : kOps)
        for (int64_t n : kSizes) {
          Tensor t = filled(n, dtype, g.rank());
          auto work = g.all_reduce(t, op);
          work->wait();
          require(work->is_completed(), "all_reduce's Work is not completed after wait()");
          require_values(t, [&](int64_t i) { return reference(op, i, world, dtype); },
                         case_name("all_reduce", dtype, n, reduce_op_name(op)));
        }
  }));
}

TEST_P(GlooGroupTest, BroadcastCopiesTheRootsTensorFromEveryRoot) {
  int world = this->world();
  expect_all_zero(run_group(world, [&](ProcessGroup& g) {
    std::vector<DType> dtypes = kDtypes;
    dtypes.push_back(DType::u8);
    for (int root = 0; root < world; ++root)
      for (DType dtype : dtypes)
        for (int64_t n : kSizes) {
          Tensor t = filled(n, dtype, g.rank());
          g.broadcast(t, root)->wait();
          require_values(t, [&](int64_t i) { return value(i, root, dtype); },
                         case_name("broadcast", dtype, n, ("root " + std::to_string(root)).c_str()));
        }
  }));
}

TEST_P(GlooGroupTest, AllGatherConcatenatesEveryRanksInputInRankOrder) {
  int world = this->world();
  expect_all_zero(run_group(world, [&](ProcessGroup& g) {
    for (DType dtype : kDtypes)
      for (int64_t n : kSizes) {
        Tensor in = filled(n, dtype, g.rank());
        Tensor out = Tensor::empty({world, n}, dtype);
        g.all_gather(out, in)->wait();
        std::string what = case_name("all_gather", dtype, n);
        require_values(out, [&](int64_t j) { return value(j % n, int(j / n), dtype); }, what);
        require_values(in, [&](int64_t i) { return value(i, g.rank(), dtype); }, what + " (input changed)");
        // In place: the input is this rank's slice of the output.
        Tensor whole = Tensor::empty({world * n}, dtype);
        Tensor mine = whole.slice(0, g.rank() * n, (g.rank() + 1) * n);
        copy_(mine, in);
        g.all_gather(whole, mine)->wait();
        require_values(whole, [&](int64_t j) { return value(j % n, int(j / n), dtype); }, what + " in place");
      }
  }));
}

TEST_P(GlooGroupTest, ReduceScatterLeavesEachRankItsSliceOfTheReduction) {
  int world = this->world();
  expect_all_zero(run_group(world, [&](ProcessGroup& g) {
    for (DType dtype : kDtypes)
      for (ReduceOp op : kOps)
        for (int64_t n : kSizes) {
          Tensor in = filled(world * n, dtype, g.rank());
          Tensor out = Tensor::empty({n}, dtype);
          g.reduce_scatter(out, in, op)->wait();
          std::string what = case_name("reduce_scatter", dtype, n, reduce_op_name(op));
          int64_t first = int64_t(g.rank()) * n;
          require_values(out, [&](int64_t i) { return reference(op, first + i, world, dtype); }, what);
          require_values(in, [&](int64_t j) { return value(j, g.rank(), dtype); }, what + " (input changed)");
          // In place: the output is this rank's slice of the input.
          g.reduce_scatter(in.slice(0, first, first + n), in, op)->wait();
          require_values(in.slice(0, first, first + n),
                         [&](int64_t i) { return reference(op, first + i, world, dtype); }, what + " in place");
        }
  }));
}

TEST_P(GlooGroupTest, SendAndRecvAroundARingMatchByPeerAndTag) {
  int world = this->world();
  expect_all_zero(run_group(world, [&](ProcessGroup& g) {
    int next = (g.rank() + 1) % world, prev = (g.rank() + world - 1) % world;
    for (DType dtype : {DType::f32, DType::bf16, DType::i64, DType::u8})
      for (int64_t n : kSizes) {
        // Two messages per neighbour, received in the opposite order to the one they were
        // sent in: tags, not arrival, decide which buffer gets which.
        Tensor a = filled(n, dtype, g.rank()), b = filled(n + 1, dtype, g.rank() + world);
        Tensor got_a = Tensor::empty({n}, dtype), got_b = Tensor::empty({n + 1}, dtype);
        auto send_a = g.send(a, next, 3);
        auto send_b = g.send(b, next, 7);
        auto recv_b = g.recv(got_b, prev, 7);
        auto recv_a = g.recv(got_a, prev, 3);
        for (auto& w : {send_a, send_b, recv_b, recv_a}) w->wait();
        for (auto& w : {send_a, send_b, recv_b, recv_a})
          require(w->is_completed(), "a send/recv Work is not completed after wait()");
        std::string what = case_name("send/recv", dtype, n);
        require_values(got_a, [&](int64_t i) { return value(i, prev, dtype); }, what + " tag 3");
        require_values(got_b, [&](int64_t i) { return value(i, prev + world, dtype); }, what + " tag 7");
      }
    // Point-to-point calls are not collectives: they take no sequence number.
    require(g.sequence_number() == 0, "send/recv changed the sequence number to ", g.sequence_number());
  }));
}

TEST_P(GlooGroupTest, BarrierReturnsOnlyOnceTheLastRankArrives) {
  int world = this->world();
  expect_all_zero(run_group(world, [&](ProcessGroup& g) {
    g.barrier()->wait();  // everyone connected and ready
    auto start = Clock::now();
    if (g.rank() == world - 1) std::this_thread::sleep_for(300ms);
    g.barrier()->wait();
    auto waited = Clock::now() - start;
    require(waited >= 250ms, "barrier returned after ",
            std::chrono::duration_cast<std::chrono::milliseconds>(waited).count(),
            " ms, before the last rank (300 ms late) arrived");
    require(g.sequence_number() == 2, "two barriers counted as ", g.sequence_number());
  }));
}

TEST_P(GlooGroupTest, EmptyTensorsAreAcceptedByEveryCall) {
  int world = this->world();
  expect_all_zero(run_group(world, [&](ProcessGroup& g) {
    Tensor empty = Tensor::empty({0}, DType::f32), rows = Tensor::empty({world, 0}, DType::f32);
    g.all_reduce(empty, ReduceOp::avg)->wait();
    g.broadcast(empty, world - 1)->wait();
    g.all_gather(rows, empty)->wait();
    g.reduce_scatter(empty, rows)->wait();
    int next = (g.rank() + 1) % world, prev = (g.rank() + world - 1) % world;
    auto sent = g.send(empty, next);
    g.recv(empty, prev)->wait();
    sent->wait();
    require(g.sequence_number() == 4, "four collectives counted as ", g.sequence_number());
  }));
}

INSTANTIATE_TEST_SUITE_P(Gloo, GlooGroupTest, ::testing::Values(2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return "world" + std::to_string(info.param);
                         });

// ---- argument checks -----------------------------------------------------------------------

// Runs `call` and returns its loom::Error message ("" when it did not throw).
std::string error_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

#define EXPECT_ERROR_HAS(call, text)                                           \
  do {                                                                         \
    std::string message_ = error_of([&] { call; });                            \
    EXPECT_NE(message_.find(text), std::string::npos) << "message: " << message_; \
  } while (0)

TEST(ProcessGroupChecks, BadArgumentsNameTheCollectiveTheArgumentAndWhatWasExpected) {
  std::string path = temp_path("pg_checks");
  auto store = std::make_shared<FileStore>(path, 0, 10s);
  auto g = new_gloo_group(store, 0, 1, {.timeout = 10s});
  EXPECT_EQ(g->backend(), "gloo");
  Tensor t = Tensor::empty({4}, DType::f32);
  Tensor grid = Tensor::empty({2, 3}, DType::f32);

  EXPECT_ERROR_HAS(g->all_reduce(Tensor()), "all_reduce: `t` is undefined");
  EXPECT_ERROR_HAS(g->all_reduce(Tensor::empty({4}, DType::u8)), "all_reduce: `t` has dtype u8; expected f32");
  EXPECT_ERROR_HAS(g->all_reduce(grid.t()), "all_reduce: `t` must be contiguous (shape (3, 2), strides (1, 3))");
  EXPECT_ERROR_HAS(g->broadcast(t, 1), "broadcast: `root` = 1 is out of range for a group of size 1");
  EXPECT_ERROR_HAS(g->broadcast(t, -1), "broadcast: `root` = -1 is out of range");
  EXPECT_ERROR_HAS(g->all_gather(Tensor::empty({5}, DType::f32), t),
                   "all_gather: `out` must hold size() * in.numel() = 1 * 4 = 4 elements, got 5");
  EXPECT_ERROR_HAS(g->all_gather(Tensor::empty({4}, DType::f64), t),
                   "all_gather: `out` and `in` must have the same dtype, got f64 and f32");
  EXPECT_ERROR_HAS(g->all_gather(t, Tensor()), "all_gather: `in` is undefined");
  Tensor six = Tensor::empty({6}, DType::f32);
  EXPECT_ERROR_HAS(g->all_gather(six.slice(0, 0, 4), six.slice(0, 2, 6)),
                   "all_gather: `out` and `in` overlap other than as slice 0 (this rank's) of the larger one");
  EXPECT_ERROR_HAS(g->reduce_scatter(six.slice(0, 1, 5), six.slice(0, 0, 4)),
                   "reduce_scatter: `out` and `in` overlap other than as slice 0");
  EXPECT_ERROR_HAS(g->reduce_scatter(t, Tensor::empty({3}, DType::f32)),
                   "reduce_scatter: `in` must hold size() * out.numel() = 1 * 4 = 4 elements, got 3");
  EXPECT_ERROR_HAS(g->reduce_scatter(Tensor::empty({4}, DType::i32), t),
                   "reduce_scatter: `out` and `in` must have the same dtype, got i32 and f32");
  EXPECT_ERROR_HAS(g->send(t, 0), "send: `dst` = 0 is this rank");
  EXPECT_ERROR_HAS(g->send(t, 1), "send: `dst` = 1 is out of range for a group of size 1");
  EXPECT_ERROR_HAS(g->send(t, 0, -1), "send: `tag` = -1 must be >= 0");
  EXPECT_ERROR_HAS(g->recv(t, 2), "recv: `src` = 2 is out of range");
  EXPECT_ERROR_HAS(g->recv(grid.t(), 0), "recv: `t` must be contiguous");
  // A rejected call is not counted, so the ranks' sequence numbers stay in step.
  EXPECT_EQ(g->sequence_number(), 0);

  // u8 is accepted where only bytes move; a group of one is the identity.
  Tensor bytes = Tensor::empty({3}, DType::u8);
  bytes.data<uint8_t>()[0] = 9;
  g->broadcast(bytes, 0)->wait();
  EXPECT_EQ(bytes.data<uint8_t>()[0], 9);
  t.data<float>()[0] = 2.5f;
  g->all_reduce(t, ReduceOp::avg)->wait();
  EXPECT_EQ(t.data<float>()[0], 2.5f);
  EXPECT_EQ(g->sequence_number(), 2);
  EXPECT_EQ(std::string(reduce_op_name(ReduceOp::min)), "min");
  g.reset();
  std::filesystem::remove(path);
}

TEST(ProcessGroupChecks, RankOutsideTheGroupIsRejectedBeforeConnecting) {
  std::string path = temp_path("pg_bad_rank");
  auto store = std::make_shared<FileStore>(path, 0, 1s);
  EXPECT_ERROR_HAS(new_gloo_group(store, 2, 2), "rank 2 is out of range for a group of size 2");
  EXPECT_ERROR_HAS(new_gloo_group(store, 0, 0), "size must be at least 1, got 0");
  EXPECT_ERROR_HAS(new_gloo_group(store, 0, 1, {.timeout = 0ms}), "the timeout must be positive");
  std::filesystem::remove(path);
}

// ---- where ranks listen ---------------------------------------------------------------------

TEST(GlooAddress, TheInterfaceComesFromTheEnvironment) {
  // MASTER_ADDR: the address that routes to it; GLOO_SOCKET_IFNAME: that interface.
  for (const char* setting : {"MASTER_ADDR=localhost", "GLOO_SOCKET_IFNAME=lo"}) {
    expect_all_zero(run_ranks(2, [&](int rank, std::shared_ptr<Store> store) {
      ::putenv(const_cast<char*>(setting));
      auto g = new_gloo_group(store, rank, 2, {.timeout = 10s});
      Tensor t = filled(3, DType::i64, rank);
      g->all_reduce(t)->wait();
      require_values(t, [&](int64_t i) { return reference(ReduceOp::sum, i, 2, DType::i64); }, setting);
      return 0;
    }));
  }
  expect_all_zero(run_ranks(1, [](int, std::shared_ptr<Store> store) {
    ::setenv("GLOO_SOCKET_IFNAME", "nosuchif0", 1);
    std::string message = error_of([&] { new_gloo_group(store, 0, 1); });
    require(message.find("Gloo group: cannot listen on interface GLOO_SOCKET_IFNAME='nosuchif0'") != std::string::npos,
            "unexpected error: '", message, "'");
    return 0;
  }));
}

// ---- the debug ledger ----------------------------------------------------------------------

TEST(ProcessGroupDebugLedger, MismatchedCollectivesFailOnBothRanksNamingBothCalls) {
  auto start = Clock::now();
  auto codes = run_ranks(2, [](int rank, std::shared_ptr<Store> store) {
    auto g = new_gloo_group(store, rank, 2, {.timeout = 10s, .debug = true});
    Tensor t = filled(10, DType::f32, rank);
    g->all_reduce(t)->wait();  // #1 matches on both ranks
    std::string message = error_of([&] {
      if (rank == 0) g->all_reduce(t);
      else g->broadcast(t, 0);
    });
    std::string want =
        "rank 1 called broadcast #2 (root 0, f32, (10,)) but rank 0 called all_reduce #2 (sum, f32, (10,))";
    require(message.find(want) != std::string::npos, "expected an error containing '", want, "', got '", message, "'");
    return 0;
  });
  expect_all_zero(codes);
  EXPECT_LT(Clock::now() - start, 8s) << "the mismatch was found by a timeout, not by the ledger";
}

TEST(ProcessGroupDebugLedger, TurnedOnByTheEnvironmentAndKeepsOnlyRecentEntries) {
  expect_all_zero(run_ranks(3, [](int rank, std::shared_ptr<Store> store) {
    ::setenv("LOOM_DIST_DEBUG", "1", 1);
    auto g = new_gloo_group(store, rank, 3, {.timeout = 10s});
    require(g->options().debug, "LOOM_DIST_DEBUG=1 did not turn debug mode on");
    Tensor t = filled(5, DType::i32, rank);
    for (int k = 0; k < 4; ++k) g->all_reduce(t, ReduceOp::max)->wait();
    // #5: once any rank is past it, rank 0 has checked it and so deleted the entries of #4,
    // as it deleted those of #1 to #3 at the calls after them.
    g->barrier()->wait();
    require(store->check({"ledger/gloo/5/0", "ledger/gloo/5/" + std::to_string(rank)}),
            "the ledger entries of the latest call are missing");
    for (int seq = 1; seq <= 4; ++seq)
      require(!store->check({"ledger/gloo/" + std::to_string(seq) + "/" + std::to_string(rank)}),
              "the ledger entry of call #", seq, " was not deleted");
    return 0;
  }));
}

// ---- fork after tensor work ----------------------------------------------------------------

TEST(ProcessGroupFork, RanksForkedRightAfterTheParentUsedTheThreadPoolCanComputeAndCommunicate) {
  // The parent's pool workers may be mid-step at the instant of the fork; the children must
  // not inherit a pool whose mutex one of those vanished workers holds. Many short children
  // make that instant likely to be hit if the pool were inherited.
  Tensor a = ones({1 << 20}), b = full({1 << 20}, 2.0);
  for (int k = 0; k < 40; ++k) {
    Tensor c = add(a, b);
    pid_t pid = fork_rank(0, [&] { return add(c, a).data<float>()[12345] == 4.0f ? 0 : 3; });
    ASSERT_EQ(exit_code(pid), 0) << "child " << k << " failed or hung computing after the fork";
  }
  Tensor c = add(a, b);
  expect_all_zero(run_group(2, [&](ProcessGroup& g) {
    Tensor t = mul(c, double(g.rank() + 1));  // 3 and 6
    g.all_reduce(t)->wait();
    require(t.data<float>()[777] == 9.0f, "all_reduce after the fork gave ", t.data<float>()[777]);
  }));
}

// ---- failures ------------------------------------------------------------------------------

TEST(GlooFailure, ARankThatExitsMakesTheOthersFailFastNamingTheCollective) {
  constexpr auto kTimeout = 10s;
  expect_all_zero(run_ranks(3, [&](int rank, std::shared_ptr<Store> store) {
    auto g = new_gloo_group(store, rank, 3, {.timeout = kTimeout});
    g->barrier()->wait();
    if (rank == 1) ::_exit(0);  // dies between collectives, without closing anything itself
    Tensor t = filled(65537, DType::f32, rank);
    auto start = Clock::now();
    std::string message = error_of([&] { g->all_reduce(t)->wait(); });
    auto took = Clock::now() - start;
    require(message.find("Gloo all_reduce #2 (sum, f32, (65537,)) failed on rank " + std::to_string(rank)) !=
                std::string::npos,
            "the error does not name the collective: '", message, "'");
    // Usually rank 1; a survivor that fails first closes its connections too, so a slower
    // one may see that survivor's close first.
    require(std::regex_search(message, std::regex("rank [012] closed its connection")),
            "the error does not name the rank that left: '", message, "'");
    require(took < kTimeout / 2, "the survivors waited ",
            std::chrono::duration_cast<std::chrono::milliseconds>(took).count(), " ms: the exit was not noticed");
    std::string later = error_of([&] { g->barrier(); });
    require(later.find("unusable after an earlier failure") != std::string::npos,
            "a call after the failure did not say the group is unusable: '", later, "'");
    return 0;
  }));
}

TEST(GlooFailure, ARecvFromARankThatExitedFailsNamingTheTransfer) {
  expect_all_zero(run_ranks(2, [](int rank, std::shared_ptr<Store> store) {
    auto g = new_gloo_group(store, rank, 2, {.timeout = 10s});
    g->barrier()->wait();
    if (rank == 1) ::_exit(0);
    Tensor t = Tensor::empty({10}, DType::f32);
    WorkPtr work;
    // The loss may be noticed when the recv is posted or while waiting for it.
    std::string message = error_of([&] {
      work = g->recv(t, 1, 4);
      work->wait();
    });
    require(message.find("Gloo recv (from rank 1, tag 4, f32, (10,)) failed on rank 0: rank 1 closed its connection") !=
                std::string::npos,
            "unexpected error: '", message, "'");
    if (work) require(!error_of([&] { work->wait(); }).empty(), "a second wait() on a failed recv did not throw");
    return 0;
  }));
}

TEST(GlooFailure, ARankThatNeverJoinsFailsGroupCreationAtTheTimeout) {
  expect_all_zero(run_ranks(2, [](int rank, std::shared_ptr<Store> store) {
    if (rank == 1) return 0;
    auto start = Clock::now();
    std::string message = error_of([&] { new_gloo_group(store, 0, 2, {.timeout = 1s}); });
    auto took = Clock::now() - start;
    require(message.find("Gloo group: rank 0 of 2 could not connect to its peers within 1000 ms") != std::string::npos,
            "unexpected error: '", message, "'");
    require(took < 4s, "group creation gave up only after ",
            std::chrono::duration_cast<std::chrono::milliseconds>(took).count(), " ms");
    return 0;
  }));
}

TEST(GlooFailure, AHungRankMakesTheOthersFailAtTheTimeout) {
  constexpr auto kTimeout = 2s;
  expect_all_zero(run_ranks(2, [&](int rank, std::shared_ptr<Store> store) {
    auto g = new_gloo_group(store, rank, 2, {.timeout = kTimeout});
    g->barrier()->wait();
    if (rank == 1) {
      std::this_thread::sleep_for(kTimeout + 2s);  // never calls the collective
      return 0;
    }
    Tensor t = filled(10, DType::f64, rank);
    auto start = Clock::now();
    std::string message = error_of([&] { g->broadcast(t, 1)->wait(); });
    auto took = Clock::now() - start;
    require(message.find("Gloo broadcast #2 (root 1, f64, (10,)) failed on rank 0: no answer within the group "
                         "timeout of 2000 ms") != std::string::npos,
            "unexpected error: '", message, "'");
    require(took >= kTimeout - 100ms && took < kTimeout + 3s, "the timeout fired after ",
            std::chrono::duration_cast<std::chrono::milliseconds>(took).count(), " ms");
    return 0;
  }));
}

}  // namespace
}  // namespace loom::dist
