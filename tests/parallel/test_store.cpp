// Store behaviour, proven once for both stores (TcpStore and FileStore) by a test suite
// parameterised over the kind, plus what is particular to each. Cross-process cases fork
// real processes, as ranks are; the child reports through its exit code.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <thread>

#include "kernels/core/error.h"
#include "parallel/socket.h"
#include "parallel/store.h"

namespace loom::dist {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

enum class Kind { tcp, file };

std::string temp_path(const std::string& stem) {
  static std::atomic<int> counter{0};
  return (std::filesystem::path(::testing::TempDir()) /
          (stem + "_" + std::to_string(::getpid()) + "_" + std::to_string(counter++)))
      .string();
}

// Runs `body` in a forked process; returns its exit code (0: every check passed).
template <class F>
pid_t fork_rank(F body) {
  pid_t pid = ::fork();
  if (pid == 0) {
    int code = 1;
    try {
      code = body();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "child %d: %s\n", ::getpid(), e.what());
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

class StoreTest : public ::testing::TestWithParam<Kind> {
 protected:
  void SetUp() override {
    if (GetParam() == Kind::tcp) {
      first_ = std::make_unique<TcpStore>("127.0.0.1", 0, TcpStore::Role::server, 30s);
      port_ = static_cast<TcpStore&>(*first_).port();
    } else {
      path_ = temp_path("filestore");
      first_ = std::make_unique<FileStore>(path_, 0, 30s);
    }
  }
  void TearDown() override {
    first_.reset();
    if (!path_.empty()) std::filesystem::remove(path_);
  }
  // Another rank's view of the same store.
  std::unique_ptr<Store> open(Duration timeout = 30s) {
    if (GetParam() == Kind::tcp) return std::make_unique<TcpStore>("127.0.0.1", port_, TcpStore::Role::client, timeout);
    return std::make_unique<FileStore>(path_, 0, timeout);
  }

  std::unique_ptr<Store> first_;  // rank 0's store: the TcpStore server
  int port_ = 0;
  std::string path_;
};

TEST_P(StoreTest, SetGetAddAndWaitAcrossProcesses) {
  constexpr int kWorld = 4;
  auto rank_body = [&](Store& s, int rank) {
    s.set("rank/" + std::to_string(rank), "hello from " + std::to_string(rank));
    s.add("arrived", 1);
    std::vector<std::string> keys;
    for (int r = 0; r < kWorld; ++r) keys.push_back("rank/" + std::to_string(r));
    s.wait(keys);
    for (int r = 0; r < kWorld; ++r)
      if (s.get_string(keys[r]) != "hello from " + std::to_string(r)) return 3;
    return 0;
  };
  std::vector<pid_t> children;
  for (int rank = 1; rank < kWorld; ++rank)
    children.push_back(fork_rank([&, rank] {
      auto s = open();
      return rank_body(*s, rank);
    }));
  EXPECT_EQ(rank_body(*first_, 0), 0);
  for (pid_t pid : children) EXPECT_EQ(exit_code(pid), 0);
  EXPECT_EQ(first_->get_string("arrived"), std::to_string(kWorld));
  EXPECT_EQ(first_->add("arrived", 0), kWorld);
}

TEST_P(StoreTest, GetBlocksUntilAnotherRankSetsTheKey) {
  auto other = open();
  auto start = Clock::now();
  std::thread setter([&] {
    std::this_thread::sleep_for(200ms);
    other->set("late", "finally");
  });
  EXPECT_EQ(first_->get_string("late"), "finally");
  EXPECT_GE(Clock::now() - start, 150ms);
  setter.join();
}

TEST_P(StoreTest, GetTimeoutNamesTheKeyAndTheStore) {
  auto start = Clock::now();
  try {
    first_->get("never/set", 300ms);
    FAIL() << "get of a missing key returned";
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("key 'never/set'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("timed out after "), std::string::npos) << msg;
    EXPECT_NE(msg.find(GetParam() == Kind::tcp ? "127.0.0.1:" + std::to_string(port_) : path_), std::string::npos)
        << msg;
  }
  EXPECT_GE(Clock::now() - start, 250ms);
  // The store is still usable after a timeout.
  first_->set("after", "ok");
  EXPECT_EQ(first_->get_string("after"), "ok");
}

TEST_P(StoreTest, WaitTimeoutListsTheKeysStillMissing) {
  first_->set("here", "1");
  auto other = open();
  try {
    other->wait({"here", "absent"}, 300ms);
    FAIL() << "wait for a missing key returned";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("still missing: 'absent')"), std::string::npos) << e.what();
  }
}

TEST_P(StoreTest, CheckIsNonBlockingAndDeleteRemoves) {
  EXPECT_FALSE(first_->check({"k"}));
  first_->set("k", "v");
  auto other = open();
  EXPECT_TRUE(other->check({"k"}));
  EXPECT_FALSE(other->check({"k", "other"}));
  EXPECT_TRUE(other->delete_key("k"));
  EXPECT_FALSE(first_->check({"k"}));
  EXPECT_FALSE(first_->delete_key("k"));
}

TEST_P(StoreTest, AddToAValueThatIsNotAnIntegerNamesTheKey) {
  first_->set("text", "abc");
  try {
    first_->add("text", 1);
    FAIL() << "add to a non-integer worked";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot add to store key 'text'"), std::string::npos) << e.what();
  }
  EXPECT_EQ(first_->add("counter", 5), 5);  // the store still answers
  EXPECT_EQ(first_->add("counter", -7), -2);
}

TEST_P(StoreTest, ConcurrentAddsFromManyClientsAllCount) {
  constexpr int kThreads = 6, kAdds = 50;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&] {
      auto s = open();
      for (int i = 0; i < kAdds; ++i) s->add("sum", 1);
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(first_->add("sum", 0), kThreads * kAdds);
}

TEST_P(StoreTest, ManyParkedGetsAllWakeOnOneSet) {
  constexpr int kWaiters = 8;
  std::atomic<int> woke{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kWaiters; ++t)
    threads.emplace_back([&] {
      auto s = open();
      if (s->get_string("go") == "now") ++woke;
    });
  std::this_thread::sleep_for(100ms);
  first_->set("go", "now");
  for (auto& t : threads) t.join();
  EXPECT_EQ(woke, kWaiters);
}

TEST_P(StoreTest, BinaryValuesRoundTrip) {
  Bytes value(1 << 20);
  for (size_t i = 0; i < value.size(); ++i) value[i] = static_cast<uint8_t>(i * 7 + 3);
  value[0] = 0;
  first_->set("blob", value);
  EXPECT_EQ(open()->get("blob"), value);
}

INSTANTIATE_TEST_SUITE_P(Stores, StoreTest, ::testing::Values(Kind::tcp, Kind::file),
                         [](const auto& info) { return info.param == Kind::tcp ? "Tcp" : "File"; });

TEST(TcpStore, BusyPortIsNamedWithHowToPickAnother) {
  net::Fd taken = net::listen_tcp(0, "127.0.0.1");
  int port = net::bound_port(taken.get());
  try {
    TcpStore store("127.0.0.1", port, TcpStore::Role::server, 5s);
    FAIL() << "a second server bound a taken port";
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("MASTER_PORT " + std::to_string(port) + " on 127.0.0.1 is already in use"), std::string::npos)
        << msg;
    EXPECT_NE(msg.find("--master-port"), std::string::npos) << msg;
  }
}

TEST(TcpStore, ClientGivesUpConnectingAfterItsTimeout) {
  int port = net::free_port();
  auto start = Clock::now();
  try {
    TcpStore store("127.0.0.1", port, TcpStore::Role::client, 500ms);
    FAIL() << "connected to a port nobody serves";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot connect to the store at 127.0.0.1:" + std::to_string(port)),
              std::string::npos)
        << e.what();
  }
  EXPECT_GE(Clock::now() - start, 400ms);
}

TEST(TcpStore, ClientStartedBeforeTheServerRetriesUntilItIsUp) {
  int port = net::free_port();
  std::unique_ptr<TcpStore> server;
  std::thread late([&] {
    std::this_thread::sleep_for(300ms);
    server = std::make_unique<TcpStore>("127.0.0.1", port, TcpStore::Role::server, 30s);
    server->set("up", "yes");
  });
  TcpStore client("127.0.0.1", port, TcpStore::Role::client, 30s);
  EXPECT_EQ(client.get_string("up"), "yes");
  late.join();
}

TEST(TcpStore, LosingTheServerIsReportedAsRankZeroExiting) {
  auto server = std::make_unique<TcpStore>("127.0.0.1", 0, TcpStore::Role::server, 30s);
  TcpStore client("127.0.0.1", server->port(), TcpStore::Role::client, 30s);
  std::thread stopper([&] {
    std::this_thread::sleep_for(200ms);
    server.reset();
  });
  try {
    client.get("never");
    FAIL() << "get returned after the server stopped";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 0, which serves it, has probably exited"), std::string::npos)
        << e.what();
  }
  stopper.join();
}

TEST(FileStore, LastOfWorldSizeUsersRemovesTheFile) {
  std::string path = temp_path("filestore_cleanup");
  {
    FileStore a(path, 2), b(path, 2);
    a.set("x", "1");
    EXPECT_EQ(b.get_string("x"), "1");
  }
  EXPECT_FALSE(std::filesystem::exists(path));
}

TEST(FileStore, CorruptFileIsNamedWithWhatToDo) {
  std::string path = temp_path("filestore_corrupt");
  std::ofstream(path) << "\x07garbage";
  FileStore store(path, 0, 1s);
  try {
    store.check({"x"});
    FAIL() << "read a corrupt file";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(path + " is corrupt at byte 0"), std::string::npos) << e.what();
  }
  std::filesystem::remove(path);
}

TEST(FileStore, UnwritableFolderIsNamed) {
  try {
    FileStore store("/nonexistent-folder/loom/store", 0, 1s);
    FAIL() << "opened a file in a missing folder";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent-folder/loom/store"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace loom::dist
