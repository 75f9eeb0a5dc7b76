// Plain POSIX TCP helpers shared by the TcpStore and loomrun. They exist so that the
// two agree on how a port is bound (wildcard address, dual-stack, SO_REUSEADDR as c10d
// does) and so that a taken port is reported the same way everywhere: naming the
// address and port and saying how to pick another one.
#pragma once

#include <chrono>
#include <cstddef>
#include <string>

namespace loom::dist::net {

// Owns a file descriptor; closes it once.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& other) noexcept : fd_(other.release()) {}
  Fd& operator=(Fd&& other) noexcept;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release();
  void reset(int fd = -1);

 private:
  int fd_ = -1;
};

// "MASTER_PORT 29500 on 127.0.0.1 is already in use (...): pick another with ..."
std::string port_in_use_message(const std::string& addr, int port);

// Binds the wildcard address (IPv6 dual-stack, else IPv4) on `port` (0: the kernel picks
// one) and listens. A taken port throws loom::Error with port_in_use_message(addr, port);
// `addr` is only used in messages.
Fd listen_tcp(int port, const std::string& addr);
// The local port a bound socket ended up on.
int bound_port(int fd);
// A port that was free a moment ago (bind port 0, read it back, close). Another process
// may take it before we use it; loomrun accepts that small race, as torchrun does.
int free_port();
// True when listen_tcp(port, ...) would succeed right now.
bool port_is_free(int port);

// Connects to host:port, retrying refused or unreachable attempts until `timeout`, then
// throws loom::Error naming the address, the time waited and the last error.
Fd connect_tcp(const std::string& host, int port, std::chrono::milliseconds timeout);

// "2.0 s": time since `start`, for timeout messages.
std::string elapsed_since(std::chrono::steady_clock::time_point start);

void set_nonblocking(int fd);
// Writes all of `data` to a blocking fd; throws loom::Error on failure.
void write_all(int fd, const void* data, size_t size, const std::string& what);

}  // namespace loom::dist::net
