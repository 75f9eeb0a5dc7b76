// POSIX TCP helpers: see socket.h. Connecting retries because ranks start in any order:
// rank 1 may try the store before rank 0 has bound it, exactly as with c10d's TCPStore.
#include "parallel/socket.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <thread>

#include "kernels/core/error.h"

namespace loom::dist::net {

using Clock = std::chrono::steady_clock;

Fd& Fd::operator=(Fd&& other) noexcept {
  if (this != &other) reset(other.release());
  return *this;
}

int Fd::release() {
  int fd = fd_;
  fd_ = -1;
  return fd;
}

void Fd::reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

std::string port_in_use_message(const std::string& addr, int port) {
  return ::loom::detail::str("MASTER_PORT ", port, " on ", addr,
                     " is already in use (another training job, or a previous one still exiting?): "
                     "pick another with --master-port or MASTER_PORT=..., or omit it and let loomrun "
                     "choose a free port");
}

namespace {

// Binds the wildcard address; returns the socket or -1 with errno set.
int bind_wildcard(int port) {
  int fd = ::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd >= 0) {
    int zero = 0, one = 1;
    ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in6 a{};
    a.sin6_family = AF_INET6;
    a.sin6_addr = in6addr_any;
    a.sin6_port = htons(static_cast<uint16_t>(port));
    if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) return fd;
    int saved = errno;
    ::close(fd);
    if (saved != EAFNOSUPPORT && saved != EADDRNOTAVAIL) {
      errno = saved;
      return -1;
    }
  }
  // No IPv6 on this host: plain IPv4.
  fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  a.sin_port = htons(static_cast<uint16_t>(port));
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) return fd;
  int saved = errno;
  ::close(fd);
  errno = saved;
  return -1;
}

}  // namespace

Fd listen_tcp(int port, const std::string& addr) {
  LOOM_CHECK(port >= 0 && port <= 65535, "port ", port, " is out of range: expected 1-65535 (or 0 for any)");
  Fd fd(bind_wildcard(port));
  if (!fd.valid() && errno == EADDRINUSE) LOOM_FAIL(port_in_use_message(addr, port));
  LOOM_CHECK(fd.valid(), "cannot bind port ", port, " for ", addr, ": ", std::strerror(errno));
  // A generous backlog: every rank of a large job may connect at the same moment.
  if (::listen(fd.get(), 2048) != 0) {
    if (errno == EADDRINUSE) LOOM_FAIL(port_in_use_message(addr, port));
    LOOM_FAIL("cannot listen on port ", port, " for ", addr, ": ", std::strerror(errno));
  }
  return fd;
}

int bound_port(int fd) {
  sockaddr_storage a{};
  socklen_t len = sizeof a;
  LOOM_CHECK(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0, "getsockname failed: ",
             std::strerror(errno));
  if (a.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&a)->sin6_port);
  return ntohs(reinterpret_cast<sockaddr_in*>(&a)->sin_port);
}

int free_port() {
  Fd fd(bind_wildcard(0));
  LOOM_CHECK(fd.valid(), "cannot bind any free port: ", std::strerror(errno));
  return bound_port(fd.get());
}

bool port_is_free(int port) {
  Fd fd(bind_wildcard(port));
  // Binding alone does not see a listener that set SO_REUSEADDR too; listening does.
  return fd.valid() && ::listen(fd.get(), 1) == 0;
}

namespace {

// One non-blocking connect attempt bounded by `wait`; returns the socket or -1 (errno set).
int try_connect(const addrinfo* ai, std::chrono::milliseconds wait) {
  int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
  if (fd < 0) return -1;
  int rc = ::connect(fd, ai->ai_addr, ai->ai_addrlen);
  if (rc != 0 && errno == EINPROGRESS) {
    pollfd p{fd, POLLOUT, 0};
    rc = ::poll(&p, 1, static_cast<int>(std::max<int64_t>(wait.count(), 1)));
    if (rc == 0) {
      errno = ETIMEDOUT;
      rc = -1;
    } else if (rc > 0) {
      int err = 0;
      socklen_t len = sizeof err;
      ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
      errno = err;
      rc = err == 0 ? 0 : -1;
    }
  }
  if (rc != 0) {
    int saved = errno;
    ::close(fd);
    errno = saved;
    return -1;
  }
  int flags = ::fcntl(fd, F_GETFL);
  ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return fd;
}

}  // namespace

Fd connect_tcp(const std::string& host, int port, std::chrono::milliseconds timeout) {
  auto start = Clock::now();
  auto deadline = start + timeout;
  auto backoff = std::chrono::milliseconds(10);
  std::string last_error = "no attempt made";
  while (true) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* list = nullptr;
    int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &list);
    if (rc != 0) {
      last_error = ::loom::detail::str("cannot resolve '", host, "': ", ::gai_strerror(rc));
    } else {
      for (addrinfo* ai = list; ai; ai = ai->ai_next) {
        auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
        int fd = try_connect(ai, std::clamp(left, std::chrono::milliseconds(1), std::chrono::milliseconds(2000)));
        if (fd >= 0) {
          ::freeaddrinfo(list);
          return Fd(fd);
        }
        last_error = std::strerror(errno);
      }
      ::freeaddrinfo(list);
    }
    auto now = Clock::now();
    if (now >= deadline) break;
    std::this_thread::sleep_for(std::min<Clock::duration>(backoff, deadline - now));
    backoff = std::min(backoff * 2, std::chrono::milliseconds(500));
  }
  LOOM_FAIL("cannot connect to the store at ", host, ":", port, " after ", elapsed_since(start), " (", last_error,
            "): is rank 0 running, and do all ranks use the same MASTER_ADDR and MASTER_PORT?");
}

std::string elapsed_since(Clock::time_point start) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f s", std::chrono::duration<double>(Clock::now() - start).count());
  return text;
}

void set_nonblocking(int fd) {
  int flags = ::fcntl(fd, F_GETFL);
  LOOM_CHECK(flags >= 0 && ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) == 0, "fcntl(O_NONBLOCK) failed: ",
             std::strerror(errno));
}

void write_all(int fd, const void* data, size_t size, const std::string& what) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    ssize_t n = ::send(fd, p, size, MSG_NOSIGNAL);
    if (n < 0 && errno == ENOTSOCK) n = ::write(fd, p, size);
    if (n < 0 && errno == EINTR) continue;
    LOOM_CHECK(n > 0, "cannot write to ", what, ": ", std::strerror(errno));
    p += n;
    size -= static_cast<size_t>(n);
  }
}

}  // namespace loom::dist::net
