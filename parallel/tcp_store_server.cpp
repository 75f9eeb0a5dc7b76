// The TcpStore server: one poll() loop over the listening socket, every client, and a
// wake-up pipe. See tcp_store_server.h for the protocol and why requests are parked.
#include "parallel/tcp_store_server.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "kernels/core/error.h"

namespace loom::dist::wire {

Writer& Writer::u8(uint8_t v) {
  buf_.push_back(static_cast<char>(v));
  return *this;
}

Writer& Writer::u32(uint32_t v) {
  for (int i = 0; i < 4; ++i) buf_.push_back(static_cast<char>(v >> (8 * i)));
  return *this;
}

Writer& Writer::i64(int64_t v) {
  auto u = static_cast<uint64_t>(v);
  for (int i = 0; i < 8; ++i) buf_.push_back(static_cast<char>(u >> (8 * i)));
  return *this;
}

Writer& Writer::bytes(std::string_view v) {
  LOOM_CHECK(v.size() < kMaxFrame, "a store value of ", v.size(), " bytes is too large: the limit is ",
             kMaxFrame, " bytes");
  u32(static_cast<uint32_t>(v.size()));
  buf_.append(v);
  return *this;
}

Writer& Writer::strings(const std::vector<std::string>& v) {
  u32(static_cast<uint32_t>(v.size()));
  for (const auto& s : v) bytes(s);
  return *this;
}

std::string Writer::frame() {
  size_t body = buf_.size() - 4;
  LOOM_CHECK(body < kMaxFrame, "a store request of ", body, " bytes is too large: the limit is ", kMaxFrame);
  for (int i = 0; i < 4; ++i) buf_[i] = static_cast<char>(body >> (8 * i));
  return std::move(buf_);
}

bool Reader::take(size_t n) {
  if (!ok_ || data_.size() - pos_ < n) ok_ = false;
  return ok_;
}

uint8_t Reader::u8() {
  if (!take(1)) return 0;
  return static_cast<uint8_t>(data_[pos_++]);
}

uint32_t Reader::u32() {
  if (!take(4)) return 0;
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= uint32_t(uint8_t(data_[pos_++])) << (8 * i);
  return v;
}

int64_t Reader::i64() {
  if (!take(8)) return 0;
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= uint64_t(uint8_t(data_[pos_++])) << (8 * i);
  return static_cast<int64_t>(v);
}

std::string Reader::bytes() {
  uint32_t n = u32();
  if (!take(n)) return {};
  std::string v(data_.substr(pos_, n));
  pos_ += n;
  return v;
}

std::vector<std::string> Reader::strings() {
  uint32_t n = u32();
  std::vector<std::string> v;
  // Each string takes at least its 4-byte length: a count beyond that is a lie.
  if (!take(0) || n > (data_.size() - pos_) / 4) {
    ok_ = false;
    return v;
  }
  for (uint32_t i = 0; i < n && ok_; ++i) v.push_back(bytes());
  return v;
}

}  // namespace loom::dist::wire

namespace loom::dist {

using wire::Op;
using wire::Status;

TcpStoreServer::TcpStoreServer(int port, const std::string& addr) {
  listener_ = net::listen_tcp(port, addr);
  net::set_nonblocking(listener_.get());
  port_ = net::bound_port(listener_.get());
  int fds[2];
  LOOM_CHECK(::pipe2(fds, O_CLOEXEC) == 0, "pipe2 failed: ", std::strerror(errno));
  wake_read_.reset(fds[0]);
  wake_write_.reset(fds[1]);
  thread_ = std::thread([this] { run(); });
}

TcpStoreServer::~TcpStoreServer() {
  char byte = 0;
  while (::write(wake_write_.get(), &byte, 1) < 0 && errno == EINTR) {
  }
  thread_.join();
}

void TcpStoreServer::run() {
  try {
    serve();
  } catch (const std::exception& e) {
    // Clients see their connection close and report that the store went away.
    std::fprintf(stderr, "loom: the TcpStore server on port %d stopped: %s\n", port_, e.what());
  }
}

void TcpStoreServer::serve() {
  std::vector<pollfd> fds;
  while (true) {
    fds.assign({{wake_read_.get(), POLLIN, 0}, {listener_.get(), POLLIN, 0}});
    for (auto& [fd, client] : clients_)
      fds.push_back({fd, static_cast<short>(POLLIN | (client.out.empty() ? 0 : POLLOUT)), 0});
    int timeout_ms = -1;
    if (!waiters_.empty()) {
      auto next = std::min_element(waiters_.begin(), waiters_.end(), [](auto& a, auto& b) {
                    return a.deadline < b.deadline;
                  })->deadline;
      auto left = std::chrono::ceil<std::chrono::milliseconds>(next - Clock::now()).count();
      timeout_ms = static_cast<int>(std::clamp<int64_t>(left, 0, 60'000));
    }
    if (::poll(fds.data(), fds.size(), timeout_ms) < 0) {
      LOOM_CHECK(errno == EINTR, "poll failed: ", std::strerror(errno));
      continue;
    }
    if (fds[0].revents) return;
    if (fds[1].revents) accept_clients();
    for (size_t i = 2; i < fds.size(); ++i) {
      if (!fds[i].revents) continue;
      auto it = clients_.find(fds[i].fd);
      if (it == clients_.end()) continue;
      if (fds[i].revents & POLLOUT) flush(it->second);
      if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) read_client(it->second);
    }
    expire_waiters(Clock::now());
    drop_dead_clients();
  }
}

void TcpStoreServer::accept_clients() {
  while (true) {
    int fd = ::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) return;  // EAGAIN, or a connection that vanished before we took it
    clients_[fd].fd.reset(fd);
  }
}

void TcpStoreServer::read_client(Client& client) {
  char buf[64 * 1024];
  while (true) {
    ssize_t n = ::recv(client.fd.get(), buf, sizeof buf, 0);
    if (n > 0) {
      client.in.append(buf, static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) dead_.push_back(client.fd.get());
    break;
  }
  handle_frames(client);
}

void TcpStoreServer::handle_frames(Client& client) {
  size_t pos = 0;
  while (!client.parked && client.in.size() - pos >= 4) {
    wire::Reader header(std::string_view(client.in).substr(pos, 4));
    uint32_t size = header.u32();
    if (size > wire::kMaxFrame) {
      dead_.push_back(client.fd.get());
      break;
    }
    if (client.in.size() - pos - 4 < size) break;
    // Copy: handling may wake waiters, whose replies must not alias this buffer.
    std::string body = client.in.substr(pos + 4, size);
    pos += 4 + size;
    handle(client, body);
  }
  client.in.erase(0, pos);
}

void TcpStoreServer::handle(Client& client, std::string_view body) {
  wire::Reader in(body);
  auto op = static_cast<Op>(in.u8());
  wire::Writer out;
  auto park = [&](std::vector<std::string> keys, int64_t timeout_ms) {
    client.parked = true;
    auto wait = Store::bounded(Duration(timeout_ms));  // a peer's number: keep the deadline finite
    waiters_.push_back({client.fd.get(), op, std::move(keys), Clock::now() + wait});
  };
  switch (op) {
    case Op::set: {
      std::string key = in.bytes(), value = in.bytes();
      if (!in.ok()) break;
      data_[key] = Bytes(value.begin(), value.end());
      reply(client, out.u8(uint8_t(Status::ok)).frame());
      wake_waiters();
      return;
    }
    case Op::get:
    case Op::wait: {
      std::vector<std::string> keys = op == Op::get ? std::vector<std::string>{in.bytes()} : in.strings();
      int64_t timeout_ms = in.i64();
      if (!in.ok()) break;
      if (missing(keys).empty()) {
        answer_waiter({client.fd.get(), op, keys, {}}, Status::ok);
      } else {
        park(std::move(keys), timeout_ms);
      }
      return;
    }
    case Op::add: {
      std::string key = in.bytes();
      int64_t delta = in.i64();
      if (!in.ok()) break;
      auto it = data_.find(key);
      try {
        int64_t value = detail::counter_value(key, it == data_.end() ? nullptr : &it->second) + delta;
        data_[key] = detail::counter_bytes(value);
        reply(client, out.u8(uint8_t(Status::ok)).i64(value).frame());
      } catch (const Error& e) {
        reply(client, out.u8(uint8_t(Status::error)).bytes(e.what()).frame());
        return;
      }
      wake_waiters();
      return;
    }
    case Op::check: {
      std::vector<std::string> keys = in.strings();
      if (!in.ok()) break;
      reply(client, out.u8(uint8_t(Status::ok)).u8(missing(keys).empty() ? 1 : 0).frame());
      return;
    }
    case Op::del: {
      std::string key = in.bytes();
      if (!in.ok()) break;
      bool existed = data_.erase(key) > 0;
      reply(client, out.u8(uint8_t(Status::ok)).u8(existed ? 1 : 0).frame());
      return;
    }
  }
  // Not our protocol (a port scanner, or a different program on MASTER_PORT): hang up.
  dead_.push_back(client.fd.get());
}

void TcpStoreServer::reply(Client& client, std::string frame) {
  client.out += frame;
  flush(client);
}

void TcpStoreServer::flush(Client& client) {
  while (!client.out.empty()) {
    ssize_t n = ::send(client.fd.get(), client.out.data(), client.out.size(), MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      if (errno != EAGAIN && errno != EWOULDBLOCK) dead_.push_back(client.fd.get());
      return;
    }
    client.out.erase(0, static_cast<size_t>(n));
  }
}

void TcpStoreServer::answer_waiter(const Waiter& waiter, Status status) {
  auto it = clients_.find(waiter.fd);
  if (it == clients_.end()) return;
  Client& client = it->second;
  wire::Writer out;
  out.u8(uint8_t(status));
  if (status == Status::timeout) {
    out.strings(missing(waiter.keys));
  } else if (waiter.op == Op::get) {
    const Bytes& value = data_.at(waiter.keys[0]);
    out.bytes(std::string_view(reinterpret_cast<const char*>(value.data()), value.size()));
  }
  client.parked = false;
  reply(client, out.frame());
}

void TcpStoreServer::wake_waiters() {
  std::vector<Waiter> ready;
  std::erase_if(waiters_, [&](Waiter& w) {
    if (!missing(w.keys).empty()) return false;
    ready.push_back(std::move(w));
    return true;
  });
  for (const Waiter& w : ready) {
    answer_waiter(w, Status::ok);
    // The client may have sent more while it waited (it does not today, but could).
    if (auto it = clients_.find(w.fd); it != clients_.end()) handle_frames(it->second);
  }
}

void TcpStoreServer::expire_waiters(Clock::time_point now) {
  std::vector<Waiter> expired;
  std::erase_if(waiters_, [&](Waiter& w) {
    if (w.deadline > now) return false;
    expired.push_back(std::move(w));
    return true;
  });
  for (const Waiter& w : expired) {
    answer_waiter(w, Status::timeout);
    if (auto it = clients_.find(w.fd); it != clients_.end()) handle_frames(it->second);
  }
}

std::vector<std::string> TcpStoreServer::missing(const std::vector<std::string>& keys) const {
  std::vector<std::string> out;
  for (const auto& key : keys)
    if (!data_.contains(key)) out.push_back(key);
  return out;
}

void TcpStoreServer::drop_dead_clients() {
  for (int fd : dead_) {
    std::erase_if(waiters_, [fd](const Waiter& w) { return w.fd == fd; });
    clients_.erase(fd);
  }
  dead_.clear();
}

}  // namespace loom::dist
