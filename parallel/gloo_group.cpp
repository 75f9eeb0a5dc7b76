// The Gloo backend: collectives over CPU tensors with Debian's libgloo-dev (Gloo 0.5, the
// "options" API: gloo::allreduce, allgather, broadcast, barrier, and unbound buffers for
// send/recv), over its TCP transport.
//
// Threading. Collectives run synchronously on the calling thread and return a completed
// Work, so their errors reach the caller from the call itself. send and recv only post
// the transfer and return; their Work's wait() blocks until it is done (a Gloo send
// completes only once the peer has posted the matching recv, so a ring of blocking sends
// would deadlock). The Work keeps the tensor and the transfer alive until then; dropping an
// unwaited Work waits for it.
//
// Reductions. Every reduction goes through our own element function (Gloo's allreduce takes
// one), so one path serves every dtype: bf16 and f16 are combined in float and rounded back
// at each step, integers wrap on overflow instead of being undefined, and max/min keep
// NaNs. avg is sum followed by a division by size() (toward zero for integers). Gloo 0.5
// has no reduce-scatter in its options API, so reduce_scatter all-reduces a copy of `in`
// and keeps this rank's slice: twice the traffic of a ring reduce-scatter, kept for its
// simplicity since CPU ranks are for correctness runs and tests.
//
// Rendezvous. Gloo's full-mesh connection runs over Loom's Store, its keys under "gloo/",
// so one Gloo group per store (a sub-group has a store of its own: new_group). Each rank listens on one address: the interface named by
// GLOO_SOCKET_IFNAME (PyTorch's variable), else the address or host name in
// LOOM_GLOO_IFADDR, else the local address that routes to MASTER_ADDR (127.0.0.1 when
// MASTER_ADDR is unset or local), so single-node jobs stay on the loopback and multi-node
// jobs use the interface that reaches rank 0.
//
// Failure. Gloo's exceptions become loom::Error naming the call (with its sequence number)
// and, where Gloo's message names a peer's address, that peer's rank. After a failure the
// group closes its connections, so peers blocked on this rank fail at once instead of at
// their timeout, and every later call on the group throws. A dead peer's sockets are closed
// by its kernel, so survivors see "closed its connection" within moments. Writing to such
// a socket raises SIGPIPE, which would kill the process: creating a group ignores SIGPIPE
// where it is still at its default action (as Python, and hence PyTorch, does).
#include "kernels/config.h"
#include "parallel/process_group.h"

#if LOOM_WITH_GLOO

#include <arpa/inet.h>
#include <dirent.h>
#include <netdb.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cctype>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <type_traits>
#include <vector>

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/address.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>

#include "parallel/rendezvous.h"
#include "parallel/socket.h"

namespace loom::dist {
namespace {

// ---- rendezvous --------------------------------------------------------------------------

class GlooStore final : public gloo::rendezvous::Store {
 public:
  GlooStore(dist::Store& store, Duration timeout) : store_(store), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    store_.set(kPrefix + key, Bytes(data.begin(), data.end()));
  }
  std::vector<char> get(const std::string& key) override {
    Bytes value = store_.get(kPrefix + key, timeout_);
    std::vector<char> data(value.begin(), value.end());
    read_[key] = data;
    return data;
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    std::vector<std::string> prefixed;
    for (const auto& key : keys) prefixed.push_back(kPrefix + key);
    store_.wait(prefixed, timeout);
  }

  // Every value Gloo read, by key: during connectFullMesh, rank r's key "r" holds the
  // addresses r listened on, one per peer, each Address::bytes() long.
  const std::map<std::string, std::vector<char>>& read() const { return read_; }

 private:
  static constexpr const char* kPrefix = "gloo/";
  dist::Store& store_;
  Duration timeout_;
  std::map<std::string, std::vector<char>> read_;
};

std::string env_or_empty(const char* name) {
  const char* value = std::getenv(name);
  return value ? value : "";
}

// The local address whose route leads to `host`: connecting a UDP socket sends nothing
// but makes the kernel pick the source address.
std::string local_address_toward(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  int rc = ::getaddrinfo(host.c_str(), "9", &hints, &found);
  LOOM_CHECK(rc == 0, "Gloo group: cannot resolve MASTER_ADDR='", host, "' (", ::gai_strerror(rc),
             "): set GLOO_SOCKET_IFNAME to the network interface, or LOOM_GLOO_IFADDR to this host's address");
  std::string local;
  for (addrinfo* a = found; a && local.empty(); a = a->ai_next) {
    net::Fd fd(::socket(a->ai_family, a->ai_socktype, 0));
    if (!fd.valid() || ::connect(fd.get(), a->ai_addr, a->ai_addrlen) != 0) continue;
    sockaddr_storage self{};
    socklen_t len = sizeof(self);
    if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&self), &len) != 0) continue;
    char text[INET6_ADDRSTRLEN] = {};
    const void* ip = &reinterpret_cast<sockaddr_in&>(self).sin_addr;
    if (self.ss_family == AF_INET6) ip = &reinterpret_cast<sockaddr_in6&>(self).sin6_addr;
    if (::inet_ntop(self.ss_family, ip, text, sizeof(text))) local = text;
  }
  ::freeaddrinfo(found);
  LOOM_CHECK(!local.empty(), "Gloo group: found no local address that routes to MASTER_ADDR='", host,
             "': set GLOO_SOCKET_IFNAME to the network interface, or LOOM_GLOO_IFADDR to this host's address");
  return local;
}

std::shared_ptr<gloo::transport::Device> make_device() {
  gloo::transport::tcp::attr attr;
  std::string where;
  if (std::string ifname = env_or_empty("GLOO_SOCKET_IFNAME"); !ifname.empty()) {
    attr.iface = ifname;
    where = "interface GLOO_SOCKET_IFNAME='" + ifname + "'";
  } else if (std::string addr = env_or_empty("LOOM_GLOO_IFADDR"); !addr.empty()) {
    attr.hostname = addr;
    where = "address LOOM_GLOO_IFADDR='" + addr + "'";
  } else if (std::string master = env_or_empty("MASTER_ADDR"); !master.empty()) {
    attr.hostname = local_address_toward(master);
    where = "address " + attr.hostname + " (the route to MASTER_ADDR='" + master + "')";
  } else {
    attr.hostname = "127.0.0.1";
    where = "the loopback address 127.0.0.1 (MASTER_ADDR is unset)";
  }
  try {
    return gloo::transport::tcp::CreateDevice(attr);
  } catch (const std::exception& e) {
    LOOM_FAIL("Gloo group: cannot listen on ", where, ": ", e.what(),
              ": set GLOO_SOCKET_IFNAME or LOOM_GLOO_IFADDR to an interface or address of this host");
  }
}

void ignore_sigpipe_if_default() {
  struct sigaction current{};
  if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
    struct sigaction ignore{};
    ignore.sa_handler = SIG_IGN;
    ::sigemptyset(&ignore.sa_mask);
    ::sigaction(SIGPIPE, &ignore, nullptr);
  }
}

// "near far" for every connected TCP socket of this process, both ends written as Gloo
// writes addresses in its messages.
std::set<std::string> tcp_connections() {
  std::set<std::string> out;
  DIR* dir = ::opendir("/proc/self/fd");
  if (!dir) return out;
  using gloo::transport::tcp::Address;
  while (dirent* entry = ::readdir(dir)) {
    auto fd = parse_integer(entry->d_name);
    if (!fd) continue;
    sockaddr_storage near{}, far{};
    socklen_t near_len = sizeof(near), far_len = sizeof(far);
    if (::getsockname(int(*fd), reinterpret_cast<sockaddr*>(&near), &near_len) != 0) continue;
    if (near.ss_family != AF_INET && near.ss_family != AF_INET6) continue;
    if (::getpeername(int(*fd), reinterpret_cast<sockaddr*>(&far), &far_len) != 0) continue;
    out.insert(Address(reinterpret_cast<sockaddr*>(&near), near_len).str() + " " +
               Address(reinterpret_cast<sockaddr*>(&far), far_len).str());
  }
  ::closedir(dir);
  return out;
}

// ---- element types and reductions ----------------------------------------------------------

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

template <class T>
constexpr bool is_half = std::is_same_v<T, bf16> || std::is_same_v<T, f16>;

template <class T>
T add(T a, T b) {
  if constexpr (is_half<T>) {
    return T(float(a) + float(b));
  } else if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;
    return T(U(a) + U(b));
  } else {
    return a + b;
  }
}

// NaN wins, as in PyTorch: `a` is kept when it is NaN or larger.
template <class T>
T larger(T a, T b) {
  if constexpr (is_half<T>) return T(larger(float(a), float(b)));
  else return (a != a || a > b) ? a : b;
}

template <class T>
T smaller(T a, T b) {
  if constexpr (is_half<T>) return T(smaller(float(a), float(b)));
  else return (a != a || a < b) ? a : b;
}

template <class T, T (*Combine)(T, T)>
void elementwise(void* out, const void* a, const void* b, size_t n) {
  auto* o = static_cast<T*>(out);
  const auto* x = static_cast<const T*>(a);
  const auto* y = static_cast<const T*>(b);
  for (size_t i = 0; i < n; ++i) o[i] = Combine(x[i], y[i]);
}

template <class T>
gloo::AllreduceOptions::Func reduction(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg: return &elementwise<T, add<T>>;
    case ReduceOp::max: return &elementwise<T, larger<T>>;
    case ReduceOp::min: return &elementwise<T, smaller<T>>;
  }
  return nullptr;
}

template <class T>
void divide(T* data, int64_t n, int by) {
  for (int64_t i = 0; i < n; ++i) {
    if constexpr (is_half<T>) data[i] = T(float(data[i]) / float(by));
    else data[i] = T(data[i] / T(by));
  }
}

// ---- the group's connection state ----------------------------------------------------------

// What the group and its pending point-to-point Works share: the Gloo context, how to name
// a peer from an address in Gloo's messages, and whether an earlier call broke the group.
struct Comm {
  std::shared_ptr<gloo::rendezvous::Context> context;
  int rank = 0;
  std::map<std::string, int> rank_of_address;  // peers' addresses as Gloo's messages write them
  std::mutex mu;
  std::string broken;  // the first failure, once there is one

  void check_usable(const std::string& call) {
    std::lock_guard lock(mu);
    LOOM_CHECK(broken.empty(), "Gloo ", call, " on rank ", rank, ": the group is unusable after an earlier failure (",
               broken, "): create a new group");
  }

  // Records the failure, closes every connection so that peers waiting on this rank fail
  // now, and throws the message.
  [[noreturn]] void fail(const std::string& call, const std::string& gloo_message, Duration timeout) {
    std::string message = ::loom::detail::str("Gloo ", call, " failed on rank ", rank, ": ",
                                              explain(gloo_message, timeout), " [gloo: ", gloo_message, "]");
    {
      std::lock_guard lock(mu);
      if (broken.empty()) broken = call + " failed";
    }
    try {
      context->closeConnections();
    } catch (const std::exception&) {
      // Closing is best effort: the error below is what the caller needs.
    }
    throw Error(message);
  }

  // Whether `msg` names `address` ("[10.0.0.2]:4242"), and not a longer port that starts
  // with the same digits.
  static bool mentions(const std::string& msg, const std::string& address) {
    for (size_t at = msg.find(address); at != std::string::npos; at = msg.find(address, at + 1)) {
      size_t end = at + address.size();
      if (end == msg.size() || !std::isdigit(static_cast<unsigned char>(msg[end]))) return true;
    }
    return false;
  }

  std::string explain(const std::string& msg, Duration timeout) const {
    auto has = [&](const char* s) { return msg.find(s) != std::string::npos; };
    if (has("Timed out") || has("timeout"))
      return ::loom::detail::str("no answer within the group timeout of ", timeout.count(),
                                 " ms: a peer hung, is far behind, or called a different collective (rerun with "
                                 "LOOM_DIST_DEBUG=1 to check the calls)");
    std::string who = "a peer";
    for (const auto& [address, peer] : rank_of_address)
      if (mentions(msg, address)) who = "rank " + std::to_string(peer);
    if (has("closed") || has("reset") || has("Read error") || has("EOF") || has("Broken pipe") || has("writev"))
      return who + " closed its connection (did its process exit or crash? look for its error first)";
    return who == "a peer" ? "the transport failed" : "the connection to " + who + " failed";
  }

  template <class F>
  void run(const std::string& call, Duration timeout, F&& body) {
    check_usable(call);
    try {
      body();
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      fail(call, e.what(), timeout);
    }
  }
};

class DoneWork final : public Work {
 public:
  void wait() override {}
  bool is_completed() override { return true; }
};

// A posted send or recv; wait() blocks until the transfer is done.
class TransferWork final : public Work {
 public:
  enum class Kind { send, recv };
  TransferWork(std::shared_ptr<Comm> comm, Tensor t, std::unique_ptr<gloo::transport::UnboundBuffer> buffer, Kind kind,
               std::string call, Duration timeout)
      : comm_(std::move(comm)), t_(std::move(t)), buffer_(std::move(buffer)), kind_(kind), call_(std::move(call)),
        timeout_(timeout) {}
  ~TransferWork() override {
    if (!done_) {
      try {
        wait();
      } catch (const std::exception&) {
        // Nobody asked for the result; the group is marked broken for the next call.
      }
    }
  }

  void wait() override {
    if (!error_.empty()) throw Error(error_);
    if (done_) return;
    done_ = true;
    try {
      comm_->run(call_, timeout_, [&] {
        bool completed = kind_ == Kind::send ? buffer_->waitSend(timeout_) : buffer_->waitRecv(timeout_);
        if (!completed) throw gloo::IoException("the transfer was aborted");
      });
    } catch (const Error& e) {
      error_ = e.what();
      throw;
    }
    completed_ = true;
  }
  bool is_completed() override { return completed_; }

 private:
  std::shared_ptr<Comm> comm_;
  Tensor t_;  // keeps the memory alive until the transfer is done
  std::unique_ptr<gloo::transport::UnboundBuffer> buffer_;
  Kind kind_;
  std::string call_;
  Duration timeout_;
  bool done_ = false, completed_ = false;
  std::string error_;  // what wait() threw, thrown again by every later wait()
};

// ---- the group -----------------------------------------------------------------------------

class ProcessGroupGloo final : public ProcessGroup {
 public:
  ProcessGroupGloo(std::shared_ptr<Store> store, int rank, int size, ProcessGroupOptions options)
      : ProcessGroup(std::move(store), rank, size, options), comm_(std::make_shared<Comm>()) {
    ignore_sigpipe_if_default();
    comm_->rank = rank;
    auto device = make_device();
    comm_->context = std::make_shared<gloo::rendezvous::Context>(rank, size);
    comm_->context->setTimeout(timeout());
    GlooStore gloo_store(this->store(), timeout());
    try {
      comm_->context->connectFullMesh(gloo_store, device);
    } catch (const std::exception& e) {
      LOOM_FAIL("Gloo group: rank ", rank, " of ", size, " could not connect to its peers within ", timeout().count(),
                " ms: ", e.what(), ": does every rank call new_gloo_group with the same size, and can the ranks reach ",
                device->str(), "? (GLOO_SOCKET_IFNAME or LOOM_GLOO_IFADDR pick the interface)");
    }
    try {
      use_every_pair();
    } catch (const std::exception& e) {
      LOOM_FAIL("Gloo group: rank ", rank, " of ", size, " connected, but the first exchange with its peers failed: ",
                e.what());
    }
    map_peer_addresses(gloo_store);
  }

  std::string backend() const override { return "gloo"; }

 protected:
  std::shared_ptr<ProcessGroup> make_subgroup(std::shared_ptr<Store> store, int rank, int size,
                                              ProcessGroupOptions options) override {
    return new_gloo_group(std::move(store), rank, size, options);
  }

  WorkPtr all_reduce_impl(const Tensor& t, ReduceOp op) override {
    std::string call = describe_call("all_reduce", t, reduce_op_name(op));
    if (size() > 1 && t.numel() > 0) all_reduce_raw(call, t.data_ptr(), t.numel(), t.dtype(), op);
    return done();
  }

  WorkPtr broadcast_impl(const Tensor& t, int root) override {
    std::string call = describe_call("broadcast", t, "root " + std::to_string(root));
    if (size() > 1 && t.numel() > 0)
      comm_->run(call, timeout(), [&] {
        gloo::BroadcastOptions opts(comm_->context);
        opts.setOutput(static_cast<uint8_t*>(t.data_ptr()), t.nbytes());
        opts.setRoot(root);
        opts.setTag(tag());
        gloo::broadcast(opts);
      });
    return done();
  }

  WorkPtr all_gather_impl(const Tensor& out, const Tensor& in) override {
    std::string call = describe_call("all_gather", in);
    if (in.numel() == 0) return done();
    // In place (`in` is this rank's slice of `out`, as FSDP gathers): gloo takes no input then.
    const bool in_place =
        static_cast<char*>(in.data_ptr()) == static_cast<char*>(out.data_ptr()) + rank() * in.nbytes();
    if (size() == 1) {
      if (!in_place) std::memcpy(out.data_ptr(), in.data_ptr(), in.nbytes());
      return done();
    }
    comm_->run(call, timeout(), [&] {
      gloo::AllgatherOptions opts(comm_->context);
      if (!in_place) opts.setInput(static_cast<uint8_t*>(in.data_ptr()), in.nbytes());
      opts.setOutput(static_cast<uint8_t*>(out.data_ptr()), out.nbytes());
      opts.setTag(tag());
      gloo::allgather(opts);
    });
    return done();
  }

  WorkPtr reduce_scatter_impl(const Tensor& out, const Tensor& in, ReduceOp op) override {
    std::string call = describe_call("reduce_scatter", in, reduce_op_name(op));
    if (out.numel() == 0) return done();
    std::vector<uint8_t> scratch(in.nbytes());
    std::memcpy(scratch.data(), in.data_ptr(), in.nbytes());
    if (size() > 1) all_reduce_raw(call, scratch.data(), in.numel(), in.dtype(), op);
    std::memcpy(out.data_ptr(), scratch.data() + size_t(rank()) * out.nbytes(), out.nbytes());
    return done();
  }

  WorkPtr send_impl(const Tensor& t, int dst, int tag) override {
    return transfer(t, dst, tag, TransferWork::Kind::send);
  }

  WorkPtr recv_impl(const Tensor& t, int src, int tag) override {
    return transfer(t, src, tag, TransferWork::Kind::recv);
  }

  WorkPtr barrier_impl() override {
    if (size() > 1)
      comm_->run(describe_call("barrier", Tensor()), timeout(), [&] {
        gloo::BarrierOptions opts(comm_->context);
        opts.setTag(tag());
        gloo::barrier(opts);
      });
    return done();
  }

 private:
  Duration timeout() const { return options().timeout; }
  // Collectives run one at a time, so any tag would do; the sequence number keeps Gloo's
  // slots distinct from one call to the next.
  uint32_t tag() const { return uint32_t(sequence_number()); }
  static WorkPtr done() { return std::make_shared<DoneWork>(); }

  void all_reduce_raw(const std::string& call, void* data, int64_t n, DType dtype, ReduceOp op) {
    with_type(dtype, [&]<class T>(T) {
      comm_->run(call, timeout(), [&] {
        gloo::AllreduceOptions opts(comm_->context);
        opts.setOutput(static_cast<T*>(data), size_t(n));
        opts.setReduceFunction(reduction<T>(op));
        opts.setTag(tag());
        gloo::allreduce(opts);
      });
      if (op == ReduceOp::avg) divide(static_cast<T*>(data), n, size());
    });
  }

  WorkPtr transfer(const Tensor& t, int peer, int tag, TransferWork::Kind kind) {
    bool sending = kind == TransferWork::Kind::send;
    std::string call = describe_call(sending ? "send" : "recv", t,
                                     (sending ? "to rank " : "from rank ") + std::to_string(peer) + ", tag " +
                                         std::to_string(tag));
    if (t.nbytes() == 0) return done();
    std::unique_ptr<gloo::transport::UnboundBuffer> buffer;
    comm_->run(call, timeout(), [&] {
      buffer = comm_->context->createUnboundBuffer(t.data_ptr(), t.nbytes());
      if (sending) buffer->send(peer, uint64_t(tag));
      else buffer->recv(peer, uint64_t(tag));
    });
    return std::make_shared<TransferWork>(comm_, t, std::move(buffer), kind, call, timeout());
  }

  // Sends one byte to every peer and receives one from each, so that every connection is up
  // before map_peer_addresses lists them.
  void use_every_pair() {
    const uint64_t slot = uint64_t(0xf0) << 56;  // a prefix no Gloo collective and no user tag uses
    char outgoing = 1;
    std::vector<char> incoming(size());
    std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> sends, recvs;
    for (int r = 0; r < size(); ++r) {
      if (r == rank()) continue;
      recvs.push_back(comm_->context->createUnboundBuffer(&incoming[r], 1));
      recvs.back()->recv(r, slot);
      sends.push_back(comm_->context->createUnboundBuffer(&outgoing, 1));
      sends.back()->send(r, slot);
    }
    for (auto& buffer : recvs) buffer->waitRecv(timeout());
    for (auto& buffer : sends) buffer->waitSend(timeout());
  }

  // Gloo's errors name a peer by an address without saying whose it is. Depending on which
  // side opened the connection, it is either the far end of our connection to the peer
  // or the address the peer listened on during the rendezvous. So every rank publishes
  // both ends of its TCP connections (a connection of ours whose reverse rank r holds is
  // our connection to r), and the rendezvous values Gloo read give every rank's listening
  // addresses.
  void map_peer_addresses(const GlooStore& rendezvous) {
    if (size() == 1) return;
    auto& map = comm_->rank_of_address;
    std::set<std::string> mine = tcp_connections();
    std::string listing;
    for (const auto& line : mine) listing += line + "\n";
    store().set("gloo/connections/" + std::to_string(rank()), listing);
    for (int r = 0; r < size(); ++r) {
      if (r == rank()) continue;
      Bytes theirs = store().get("gloo/connections/" + std::to_string(r), timeout());
      std::string text(theirs.begin(), theirs.end());
      for (size_t pos = 0, end; pos < text.size(); pos = end + 1) {
        end = text.find('\n', pos);
        if (end == std::string::npos) end = text.size();
        std::string line = text.substr(pos, end - pos);
        size_t space = line.find(' ');
        if (space == std::string::npos) continue;
        std::string near = line.substr(0, space), far = line.substr(space + 1);
        if (mine.count(far + " " + near)) map[near] = r;
      }
    }
    const size_t width = comm_->context->getPair(rank() == 0 ? 1 : 0)->address().bytes().size();
    for (const auto& [key, addresses] : rendezvous.read()) {
      auto r = parse_integer(key);
      if (!r || *r < 0 || *r >= size() || *r == rank() || addresses.size() % width != 0) continue;
      for (size_t at = 0; at < addresses.size(); at += width) {
        std::vector<char> bytes(addresses.begin() + at, addresses.begin() + at + width);
        map.emplace(gloo::transport::tcp::Address(bytes).str(), int(*r));
      }
    }
  }

  std::shared_ptr<Comm> comm_;
};

}  // namespace

std::shared_ptr<ProcessGroup> new_gloo_group(std::shared_ptr<Store> store, int rank, int size,
                                             ProcessGroupOptions options) {
  return std::make_shared<ProcessGroupGloo>(std::move(store), rank, size, options);
}

}  // namespace loom::dist

#else  // !LOOM_WITH_GLOO

namespace loom::dist {

std::shared_ptr<ProcessGroup> new_gloo_group(std::shared_ptr<Store>, int, int, ProcessGroupOptions) {
  LOOM_FAIL("new_gloo_group: Loom was built without Gloo: install libgloo-dev (apt-get install libgloo-dev), "
            "then reconfigure and rebuild (meson setup --reconfigure <builddir> && ninja -C <builddir>)");
}

}  // namespace loom::dist

#endif
