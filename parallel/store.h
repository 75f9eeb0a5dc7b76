// Key-value stores for rendezvous, modelled on PyTorch c10d's Store. Ranks use a store to
// find each other before any collective exists: to exchange NCCL unique ids or Gloo
// addresses, count arrivals, and hold barriers. Values are opaque bytes; add() keeps its
// counter as decimal text (as c10d does), so get() on a counter reads back "3".
//
// Public entry points check their arguments and then call the implementation's *_impl,
// so TcpStore and FileStore only do what differs between them.
//
//   TcpStore  rank 0 serves the keys from a background thread; every rank, rank 0
//             included, talks to it over one TCP connection. For jobs on several nodes.
//             Like c10d's, it listens on every interface and has no authentication:
//             anyone who reaches MASTER_PORT can read and write keys, so keep jobs on
//             trusted networks.
//   FileStore records appended, under flock, to a file every process can see (a local
//             disk, or a shared file system). For single-node jobs and tests.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "../kernels/core/error.h"

namespace loom::dist {

using Bytes = std::vector<uint8_t>;
using Duration = std::chrono::milliseconds;

// What get() and wait() throw when they run out of time: a loom::Error, distinct so that a
// caller can tell "not yet" from "the store is gone".
class StoreTimeout : public Error {
 public:
  using Error::Error;
};

class Store {
 public:
  // c10d's default: long enough for the slowest rank to load its data before a barrier.
  static constexpr Duration kDefaultTimeout = std::chrono::seconds(300);

  explicit Store(Duration timeout) : timeout_(bounded(timeout)) {}
  virtual ~Store() = default;
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  void set(const std::string& key, const Bytes& value);
  void set(const std::string& key, std::string_view value);
  // Blocks until `key` is present, for at most `timeout` (default: timeout()), and returns
  // its value; on timeout throws loom::Error naming the key, the store and the time waited.
  Bytes get(const std::string& key);
  Bytes get(const std::string& key, Duration timeout);
  std::string get_string(const std::string& key);
  // Adds `delta` to the integer under `key` (absent counts as 0) and returns the new value.
  int64_t add(const std::string& key, int64_t delta);
  // Blocks until every key is present; the timeout error names the keys still missing.
  void wait(const std::vector<std::string>& keys);
  void wait(const std::vector<std::string>& keys, Duration timeout);
  // Whether every key is present right now; never blocks.
  bool check(const std::vector<std::string>& keys);
  // Removes `key`; returns whether it was present.
  bool delete_key(const std::string& key);

  Duration timeout() const { return timeout_; }
  void set_timeout(Duration timeout) { timeout_ = bounded(timeout); }
  // Timeouts are kept within [0, one year], so deadlines computed from them cannot overflow.
  static Duration bounded(Duration timeout) {
    return std::clamp(timeout, Duration::zero(), Duration(std::chrono::hours(24 * 365)));
  }
  // "TcpStore at 10.0.0.1:29500", "FileStore at /tmp/x": for messages.
  virtual std::string describe() const = 0;

  // How many groups of `backend` ("nccl", ...) this process has made on this store before,
  // counted up by the call. Every rank makes its groups on a store in the same order, so the
  // numbers agree across ranks and key each group's bootstrap entries apart.
  int take_group_number(const std::string& backend);

 protected:
  virtual void set_impl(const std::string& key, const Bytes& value) = 0;
  virtual Bytes get_impl(const std::string& key, Duration timeout) = 0;
  virtual int64_t add_impl(const std::string& key, int64_t delta) = 0;
  virtual void wait_impl(const std::vector<std::string>& keys, Duration timeout) = 0;
  virtual bool check_impl(const std::vector<std::string>& keys) = 0;
  virtual bool delete_key_impl(const std::string& key) = 0;

  // Throws the StoreTimeout every store throws when a wait runs out of time.
  [[noreturn]] void fail_timeout(const std::vector<std::string>& keys, const std::vector<std::string>& missing,
                                 std::chrono::steady_clock::time_point start) const;

 private:
  Duration timeout_;
  std::mutex groups_mutex_;
  std::map<std::string, int> groups_made_;
};

class TcpStoreServer;
struct FileStoreState;

class TcpStore final : public Store {
 public:
  enum class Role { server, client };

  // server: binds `port` (0: any free port; see port()) on every interface, serves from a
  // background thread, and connects to itself like any client. client: connects to
  // host:port, retrying until `timeout`. A taken port throws loom::Error naming it and
  // saying how to pick another.
  TcpStore(std::string host, int port, Role role, Duration timeout = kDefaultTimeout);
  ~TcpStore() override;

  int port() const { return port_; }
  const std::string& host() const { return host_; }
  std::string describe() const override;

 protected:
  void set_impl(const std::string& key, const Bytes& value) override;
  Bytes get_impl(const std::string& key, Duration timeout) override;
  int64_t add_impl(const std::string& key, int64_t delta) override;
  void wait_impl(const std::vector<std::string>& keys, Duration timeout) override;
  bool check_impl(const std::vector<std::string>& keys) override;
  bool delete_key_impl(const std::string& key) override;

 private:
  struct Connection;
  std::string host_;
  int port_;
  std::unique_ptr<TcpStoreServer> server_;  // rank 0 only
  std::unique_ptr<Connection> connection_;
};

class FileStore final : public Store {
 public:
  // `world_size` > 0: the last of that many FileStores on `path` to be destroyed deletes
  // the file, as c10d's FileStore does. 0: the file is left for the caller to remove. A file
  // left over by a crashed run still holds its keys, so give each run a fresh path.
  FileStore(std::string path, int world_size = 0, Duration timeout = kDefaultTimeout);
  ~FileStore() override;

  const std::string& path() const { return path_; }
  std::string describe() const override;

 protected:
  void set_impl(const std::string& key, const Bytes& value) override;
  Bytes get_impl(const std::string& key, Duration timeout) override;
  int64_t add_impl(const std::string& key, int64_t delta) override;
  void wait_impl(const std::vector<std::string>& keys, Duration timeout) override;
  bool check_impl(const std::vector<std::string>& keys) override;
  bool delete_key_impl(const std::string& key) override;

 private:
  std::string path_;
  int world_size_;
  std::unique_ptr<FileStoreState> state_;
};

// A view of another store with every key under `prefix`, as c10d's PrefixStore: a process
// sub-group (ProcessGroup::new_group) bootstraps and keeps its ledger through one, so
// groups that share the world's store never read each other's keys.
class PrefixStore final : public Store {
 public:
  PrefixStore(std::shared_ptr<Store> base, std::string prefix);

  const std::string& prefix() const { return prefix_; }
  std::string describe() const override;

 protected:
  void set_impl(const std::string& key, const Bytes& value) override;
  Bytes get_impl(const std::string& key, Duration timeout) override;
  int64_t add_impl(const std::string& key, int64_t delta) override;
  void wait_impl(const std::vector<std::string>& keys, Duration timeout) override;
  bool check_impl(const std::vector<std::string>& keys) override;
  bool delete_key_impl(const std::string& key) override;

 private:
  std::vector<std::string> prefixed(const std::vector<std::string>& keys) const;

  std::shared_ptr<Store> base_;
  std::string prefix_;
};

namespace detail {
// The integer add() keeps under `key` (an absent key is 0); throws loom::Error naming the
// key when the value there was set to something that is not a decimal integer.
int64_t counter_value(const std::string& key, const Bytes* value);
Bytes counter_bytes(int64_t value);
}  // namespace detail

}  // namespace loom::dist
