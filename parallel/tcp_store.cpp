// TcpStore: the client side of the protocol in tcp_store_server.h, and rank 0's server.
// One connection per store, one request at a time under a mutex, so a TcpStore can be
// shared by threads. A get or wait sends its timeout to the server, which answers
// "timeout" when it passes; the client's own deadline is only a backstop for a server
// that stopped answering. The other requests are answered at once, so their deadline is the
// store's timeout itself. A new connection first sends one such request (check of no keys):
// something on the port that is not a TcpStore fails there, within the timeout, instead of
// leaving the first get to wait for an answer that never comes.
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <mutex>

#include "kernels/core/error.h"
#include "parallel/store.h"
#include "parallel/tcp_store_server.h"

namespace loom::dist {

using Clock = std::chrono::steady_clock;
using wire::Op;
using wire::Status;

namespace {
// How long past a request's own timeout the client waits before calling the server stuck.
constexpr Duration kReplyGrace = std::chrono::seconds(30);
}  // namespace

struct TcpStore::Connection {
  std::mutex mutex;
  net::Fd fd;
  std::string name;    // "TcpStore at host:port"
  std::string broken;  // why the connection can no longer be used, once it cannot

  // Sends one request frame and returns the reply body, which must arrive within `limit`.
  std::string request(const std::string& frame, Duration limit) {
    LOOM_CHECK(broken.empty(), name, " cannot be used any more: ", broken);
    try {
      auto start = Clock::now();
      net::write_all(fd.get(), frame.data(), frame.size(), name);
      std::string header = receive(4, start, limit);
      uint32_t size = wire::Reader(header).u32();
      LOOM_CHECK(size <= wire::kMaxFrame, name, " sent a reply of ", size,
                 " bytes, which is not the TcpStore protocol: is MASTER_PORT another program's port?");
      return receive(size, start, limit);
    } catch (const Error& e) {
      // The reply stream is out of step now; later requests must not read this reply.
      broken = e.what();
      fd.reset();
      throw;
    }
  }

  std::string receive(size_t size, Clock::time_point start, Duration limit) {
    auto deadline = start + limit;
    std::string out(size, '\0');
    size_t got = 0;
    while (got < size) {
      auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
      LOOM_CHECK(left > 0, name, " did not answer in ", net::elapsed_since(start),
                 ": is rank 0's process stuck or stopped?");
      pollfd p{fd.get(), POLLIN, 0};
      int rc = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left, 60'000)));
      if (rc < 0 && errno == EINTR) continue;
      LOOM_CHECK(rc >= 0, "poll on ", name, " failed: ", std::strerror(errno));
      if (rc == 0) continue;
      ssize_t n = ::recv(fd.get(), out.data() + got, size - got, 0);
      if (n < 0 && errno == EINTR) continue;
      LOOM_CHECK(n != 0, "lost the connection to the ", name,
                 ": rank 0, which serves it, has probably exited (look at its output for the first error)");
      LOOM_CHECK(n > 0, "cannot read from ", name, ": ", std::strerror(errno));
      got += static_cast<size_t>(n);
    }
    return out;
  }
};

TcpStore::TcpStore(std::string host, int port, Role role, Duration timeout)
    : Store(timeout), host_(std::move(host)), port_(port) {
  LOOM_CHECK(!host_.empty(), "TcpStore needs a host name or address (MASTER_ADDR), got an empty one");
  LOOM_CHECK(port >= 0 && port <= 65535, "TcpStore port ", port, " is out of range: expected 1-65535",
             role == Role::server ? " (or 0 to pick a free one)" : "");
  if (role == Role::server) {
    server_ = std::make_unique<TcpStoreServer>(port, host_);
    port_ = server_->port();
  } else {
    LOOM_CHECK(port != 0, "a TcpStore client needs the server's port (MASTER_PORT), got 0");
  }
  connection_ = std::make_unique<Connection>();
  connection_->name = describe();
  const auto start = Clock::now();
  connection_->fd = net::connect_tcp(host_, port_, this->timeout());
  const Duration left = std::max(Duration(1), this->timeout() - std::chrono::ceil<Duration>(Clock::now() - start));
  std::string reply;
  try {
    reply = connection_->request(wire::Writer().u8(uint8_t(Op::check)).strings({}).frame(), left);
  } catch (const Error& e) {
    LOOM_FAIL("something accepts connections on ", host_, ":", port_, " but does not answer as a TcpStore (",
              e.what(), "): is MASTER_PORT another program's port? Pick another with --master-port or MASTER_PORT");
  }
  wire::Reader in(reply);
  LOOM_CHECK(static_cast<Status>(in.u8()) == Status::ok && in.ok(), "something accepts connections on ", host_, ":",
             port_, " but answers in another protocol than a TcpStore's: is MASTER_PORT another program's port?");
}

TcpStore::~TcpStore() = default;

std::string TcpStore::describe() const { return ::loom::detail::str("TcpStore at ", host_, ":", port_); }

namespace {

std::string_view view(const Bytes& b) { return {reinterpret_cast<const char*>(b.data()), b.size()}; }

// Reads the status byte; turns an error reply into a loom::Error.
Status status_of(wire::Reader& in, const std::string& name) {
  auto status = static_cast<Status>(in.u8());
  if (status == Status::error) LOOM_FAIL(in.bytes());
  LOOM_CHECK(in.ok() && (status == Status::ok || status == Status::timeout), name,
             " sent a malformed reply: is MASTER_PORT another program's port?");
  return status;
}

}  // namespace

void TcpStore::set_impl(const std::string& key, const Bytes& value) {
  std::lock_guard lock(connection_->mutex);
  connection_->request(wire::Writer().u8(uint8_t(Op::set)).bytes(key).bytes(view(value)).frame(), timeout());
}

Bytes TcpStore::get_impl(const std::string& key, Duration timeout) {
  auto start = Clock::now();
  std::string body;
  {
    std::lock_guard lock(connection_->mutex);
    body = connection_->request(
        wire::Writer().u8(uint8_t(Op::get)).bytes(key).i64(timeout.count()).frame(), timeout + kReplyGrace);
  }
  wire::Reader in(body);
  if (status_of(in, connection_->name) == Status::timeout) fail_timeout({key}, {key}, start);
  std::string value = in.bytes();
  LOOM_CHECK(in.ok(), connection_->name, " sent a malformed reply to get('", key, "')");
  return Bytes(value.begin(), value.end());
}

int64_t TcpStore::add_impl(const std::string& key, int64_t delta) {
  std::string body;
  {
    std::lock_guard lock(connection_->mutex);
    body = connection_->request(wire::Writer().u8(uint8_t(Op::add)).bytes(key).i64(delta).frame(), timeout());
  }
  wire::Reader in(body);
  status_of(in, connection_->name);
  int64_t value = in.i64();
  LOOM_CHECK(in.ok(), connection_->name, " sent a malformed reply to add('", key, "')");
  return value;
}

void TcpStore::wait_impl(const std::vector<std::string>& keys, Duration timeout) {
  auto start = Clock::now();
  std::string body;
  {
    std::lock_guard lock(connection_->mutex);
    body = connection_->request(
        wire::Writer().u8(uint8_t(Op::wait)).strings(keys).i64(timeout.count()).frame(), timeout + kReplyGrace);
  }
  wire::Reader in(body);
  if (status_of(in, connection_->name) == Status::timeout) fail_timeout(keys, in.strings(), start);
}

bool TcpStore::check_impl(const std::vector<std::string>& keys) {
  std::string body;
  {
    std::lock_guard lock(connection_->mutex);
    body = connection_->request(wire::Writer().u8(uint8_t(Op::check)).strings(keys).frame(), timeout());
  }
  wire::Reader in(body);
  status_of(in, connection_->name);
  return in.u8() == 1;
}

bool TcpStore::delete_key_impl(const std::string& key) {
  std::string body;
  {
    std::lock_guard lock(connection_->mutex);
    body = connection_->request(wire::Writer().u8(uint8_t(Op::del)).bytes(key).frame(), timeout());
  }
  wire::Reader in(body);
  status_of(in, connection_->name);
  return in.u8() == 1;
}

}  // namespace loom::dist
