// The TcpStore's wire protocol and its server (internal to parallel/; users see TcpStore).
//
// Every message is a frame: a u32 length, then that many bytes of body. A request body is
// an Op byte and its fields; a reply body is a Status byte and its fields. Integers are
// little-endian; strings are a u32 length and their bytes. One request is in flight per
// connection at a time, so replies need no ids.
//
//   set    key value          -> ok
//   get    key timeout_ms     -> ok value | timeout [missing keys]
//   add    key delta(i64)     -> ok new(i64) | error message
//   wait   keys timeout_ms    -> ok | timeout [missing keys]
//   check  keys               -> ok present(u8)
//   del    key                -> ok existed(u8)
//
// The server is one thread around poll(): it owns the keys, so it needs no locks. A get or
// wait for a missing key is parked, not retried: the reply goes out when a set or add
// supplies the key, or a timeout reply when the request's deadline passes, whichever
// comes first. The client therefore never has to abandon a request it sent.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "socket.h"
#include "store.h"

namespace loom::dist::wire {

enum class Op : uint8_t { set = 1, get, add, wait, check, del };
enum class Status : uint8_t { ok = 0, timeout, error };
// Nothing a peer says is trusted for an allocation beyond this.
constexpr uint32_t kMaxFrame = 1u << 30;

// Builds one frame.
class Writer {
 public:
  Writer() : buf_(4, '\0') {}
  Writer& u8(uint8_t v);
  Writer& u32(uint32_t v);
  Writer& i64(int64_t v);
  Writer& bytes(std::string_view v);
  Writer& strings(const std::vector<std::string>& v);
  // The finished frame, length prefix filled in.
  std::string frame();

 private:
  std::string buf_;
};

// Reads fields of one frame body; a short or oversized field sets ok() to false.
class Reader {
 public:
  explicit Reader(std::string_view body) : data_(body) {}
  uint8_t u8();
  uint32_t u32();
  int64_t i64();
  std::string bytes();
  std::vector<std::string> strings();
  bool ok() const { return ok_; }

 private:
  bool take(size_t n);
  std::string_view data_;
  size_t pos_ = 0;
  bool ok_ = true;
};

}  // namespace loom::dist::wire

namespace loom::dist {

class TcpStoreServer {
 public:
  // Binds and listens on `port` (0: any); `addr` only names the store in messages.
  TcpStoreServer(int port, const std::string& addr);
  ~TcpStoreServer();
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;

  int port() const { return port_; }

 private:
  using Clock = std::chrono::steady_clock;
  struct Client {
    net::Fd fd;
    std::string in, out;
    bool parked = false;  // a get/wait of this client waits for keys
  };
  struct Waiter {
    int fd;
    wire::Op op;
    std::vector<std::string> keys;
    Clock::time_point deadline;
  };

  void run();
  void serve();
  void accept_clients();
  void read_client(Client& client);
  void handle_frames(Client& client);
  void handle(Client& client, std::string_view body);
  void reply(Client& client, std::string frame);
  void flush(Client& client);
  void answer_waiter(const Waiter& waiter, wire::Status status);
  void wake_waiters();
  void expire_waiters(Clock::time_point now);
  std::vector<std::string> missing(const std::vector<std::string>& keys) const;
  void drop_dead_clients();

  net::Fd listener_;
  int port_ = 0;
  net::Fd wake_read_, wake_write_;  // the destructor writes a byte to stop the thread
  std::unordered_map<int, Client> clients_;
  std::vector<int> dead_;
  std::vector<Waiter> waiters_;
  std::unordered_map<std::string, Bytes> data_;
  std::thread thread_;
};

}  // namespace loom::dist
