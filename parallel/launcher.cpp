// The launcher loop: see launcher.h for the decisions. Signal handlers only write the
// signal number into a pipe; everything else happens in the poll() loop.
#include "parallel/launcher.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <thread>

#include "kernels/core/error.h"
#include "parallel/cpu_shares.h"
#include "parallel/socket.h"

extern char** environ;

namespace loom::dist {

namespace {

using Clock = std::chrono::steady_clock;

int g_signal_pipe = -1;  // write end, for the handlers

void on_signal(int sig) {
  int saved = errno;
  char byte = static_cast<char>(sig);
  [[maybe_unused]] ssize_t n = ::write(g_signal_pipe, &byte, 1);
  errno = saved;
}

// One of a child's output pipes, and the part of a line not yet printed.
struct Stream {
  net::Fd fd;
  int to;  // 1 or 2: loomrun's stdout or stderr
  std::string pending;
};

struct Rank {
  int rank;
  pid_t pid = -1;
  bool running = false;
  Stream out{{}, 1, {}}, err{{}, 2, {}};
};

void say(const std::string& message) {
  std::string line = "loomrun: " + message + "\n";
  try {
    net::write_all(2, line.data(), line.size(), "stderr");
  } catch (const Error&) {
  }
}

std::string plural(size_t n, const char* noun) { return std::to_string(n) + " " + noun + (n == 1 ? "" : "s"); }

class Launcher {
 public:
  explicit Launcher(const LaunchOptions& options) : o_(options) {}
  int run();

 private:
  void spawn(Rank& r, const std::vector<std::string>& base_env, const std::vector<int>* cpus);
  void pump(Stream& s, const std::string& prefix);
  void emit(Stream& s, const std::string& prefix, bool flush_partial);
  void reap();
  void stop(int sig);
  size_t running() const {
    return std::count_if(ranks_.begin(), ranks_.end(), [](const Rank& r) { return r.running; });
  }

  const LaunchOptions& o_;
  std::string run_id_;
  std::vector<Rank> ranks_;
  bool stopping_ = false, killed_ = false;
  Clock::time_point kill_at_;
  int exit_code_ = 0;
};

// The job's LOOM_RUN_ID (rendezvous.h). On one node, a new one per launch (host, pid, time).
// Several nodes must share one, which only the user can give: LOOM_RUN_ID from the
// environment, else none.
std::string job_run_id(int nnodes) {
  if (nnodes > 1) return process_env("LOOM_RUN_ID").value_or("");
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  const auto now = std::chrono::system_clock::now().time_since_epoch();
  return ::loom::detail::str(host, "-", ::getpid(), "-", std::chrono::duration_cast<std::chrono::microseconds>(now).count());
}

std::string prefix_of(const Rank& r) { return "[rank " + std::to_string(r.rank) + "] "; }

// cpus: with bind_cpus, the rank's share of the node's CPUs (cpu_shares.h), which it then
// runs on alone (and its CPU kernels' threads default to their count); else null.
void Launcher::spawn(Rank& r, const std::vector<std::string>& base_env, const std::vector<int>* cpus) {
  int world = o_.nproc_per_node * o_.nnodes;
  std::vector<std::string> env = base_env;
  // The rank's CPU mask, sized for its largest id (hosts may have more than CPU_SETSIZE).
  const int highest = cpus ? *std::max_element(cpus->begin(), cpus->end()) : 0;
  std::unique_ptr<cpu_set_t, void (*)(cpu_set_t*)> cpu_set(cpus ? CPU_ALLOC(highest + 1) : nullptr,
                                                           [](cpu_set_t* p) { if (p) CPU_FREE(p); });
  LOOM_CHECK(!cpus || cpu_set, "cannot allocate a CPU mask for ", highest + 1, " CPUs");
  const size_t cpu_set_bytes = CPU_ALLOC_SIZE(highest + 1);
  if (cpus) {
    CPU_ZERO_S(cpu_set_bytes, cpu_set.get());
    for (int c : *cpus) CPU_SET_S(c, cpu_set_bytes, cpu_set.get());
  }
  env.push_back("RANK=" + std::to_string(r.rank));
  env.push_back("WORLD_SIZE=" + std::to_string(world));
  env.push_back("LOCAL_RANK=" + std::to_string(r.rank - o_.node_rank * o_.nproc_per_node));
  env.push_back("LOCAL_WORLD_SIZE=" + std::to_string(o_.nproc_per_node));
  env.push_back("MASTER_ADDR=" + o_.master_addr);
  env.push_back("MASTER_PORT=" + std::to_string(o_.master_port));
  if (!run_id_.empty()) env.push_back("LOOM_RUN_ID=" + run_id_);
  // Everything the child needs is built before fork: only async-signal-safe calls after it.
  std::vector<char*> argv, envp;
  for (const auto& a : o_.command) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  for (auto& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::string exec_failed = "loomrun: cannot run '" + o_.command[0] + "': ";
  std::string bind_failed =
      cpus ? "loomrun: cannot bind rank " + std::to_string(r.rank) + " to CPUs " + cpu_list_text(*cpus) + ": " : "";
  const pid_t supervisor = ::getpid();

  int out[2], err[2];
  LOOM_CHECK(::pipe2(out, O_CLOEXEC) == 0 && ::pipe2(err, O_CLOEXEC) == 0, "pipe2 failed: ", std::strerror(errno));
  // Signals stay blocked across fork until the child has dropped loomrun's handlers, which
  // would otherwise write into loomrun's signal pipe from the child.
  sigset_t all, old_mask;
  sigfillset(&all);
  ::sigprocmask(SIG_BLOCK, &all, &old_mask);
  pid_t pid = ::fork();
  if (pid == 0) {
    // The rank dies with its supervisor: the kernel sends SIGKILL when loomrun's thread
    // ends, even by kill -9. Should loomrun have died before the request took hold, the
    // parent is already another process, and the rank must not start.
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != supervisor) ::_exit(128 + SIGKILL);
    ::setpgid(0, 0);
    ::dup2(out[1], 1);
    ::dup2(err[1], 2);
    struct sigaction dfl{};
    dfl.sa_handler = SIG_DFL;
    for (int sig : {SIGCHLD, SIGINT, SIGTERM, SIGHUP, SIGPIPE}) ::sigaction(sig, &dfl, nullptr);
    ::sigprocmask(SIG_SETMASK, &old_mask, nullptr);
    if (cpus && ::sched_setaffinity(0, cpu_set_bytes, cpu_set.get()) != 0) {
      const char* why = std::strerror(errno);
      [[maybe_unused]] ssize_t n = ::write(2, bind_failed.data(), bind_failed.size());
      n = ::write(2, why, std::strlen(why));
      n = ::write(2, "\n", 1);
      ::_exit(127);
    }
    ::execvpe(argv[0], argv.data(), envp.data());
    const char* why = std::strerror(errno);
    [[maybe_unused]] ssize_t n = ::write(2, exec_failed.data(), exec_failed.size());
    n = ::write(2, why, std::strlen(why));
    n = ::write(2, "\n", 1);
    ::_exit(127);
  }
  int fork_errno = errno;
  ::sigprocmask(SIG_SETMASK, &old_mask, nullptr);
  ::close(out[1]);
  ::close(err[1]);
  if (pid < 0) {
    ::close(out[0]);
    ::close(err[0]);
    LOOM_FAIL("cannot start rank ", r.rank, ": fork failed: ", std::strerror(fork_errno));
  }
  ::setpgid(pid, pid);  // also here, so a signal sent right after fork finds the group
  r.out.fd.reset(out[0]);
  r.err.fd.reset(err[0]);
  net::set_nonblocking(out[0]);
  net::set_nonblocking(err[0]);
  r.pid = pid;
  r.running = true;
}

void Launcher::emit(Stream& s, const std::string& prefix, bool flush_partial) {
  std::string text;
  size_t start = 0, nl;
  while ((nl = s.pending.find('\n', start)) != std::string::npos) {
    text += prefix;
    text.append(s.pending, start, nl + 1 - start);
    start = nl + 1;
  }
  s.pending.erase(0, start);
  // A line that never ends (a progress bar) is printed in pieces rather than held forever.
  if (!s.pending.empty() && (flush_partial || s.pending.size() > 64 * 1024)) {
    text += prefix + s.pending + "\n";
    s.pending.clear();
  }
  if (text.empty()) return;
  try {
    net::write_all(s.to, text.data(), text.size(), s.to == 1 ? "stdout" : "stderr");
  } catch (const Error&) {
    // Our own output is gone (a closed pipe): keep supervising the ranks regardless.
  }
}

// Reads what the pipe holds now; closes it at end of file.
void Launcher::pump(Stream& s, const std::string& prefix) {
  char buf[64 * 1024];
  while (s.fd.valid()) {
    ssize_t n = ::read(s.fd.get(), buf, sizeof buf);
    if (n > 0) {
      s.pending.append(buf, static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    s.fd.reset();  // end of file, or an error that ends this stream
  }
  emit(s, prefix, !s.fd.valid());
}

void Launcher::stop(int sig) {
  // The whole group, so helpers a rank started stop too. Only groups of ranks not yet
  // reaped: a reaped leader's number may already belong to some other process group.
  for (const Rank& r : ranks_)
    if (r.running) ::kill(-r.pid, sig);
  if (!stopping_) kill_at_ = Clock::now() + o_.grace;
  stopping_ = true;
}

void Launcher::reap() {
  for (Rank& r : ranks_) {
    int status = 0;
    if (!r.running || ::waitpid(r.pid, &status, WNOHANG) != r.pid) continue;
    r.running = false;
    // Print the rank's last words before saying that it failed.
    pump(r.out, prefix_of(r));
    pump(r.err, prefix_of(r));
    bool failed = !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    if (!failed || stopping_) continue;
    std::string how;
    if (WIFEXITED(status)) {
      exit_code_ = WEXITSTATUS(status);
      how = "exited with code " + std::to_string(exit_code_);
    } else {
      int sig = WTERMSIG(status);
      exit_code_ = 128 + sig;
      how = "was killed by signal " + std::to_string(sig) + " (" + ::strsignal(sig) + ")";
    }
    size_t others = running();
    say("rank " + std::to_string(r.rank) + " (pid " + std::to_string(r.pid) + ") " + how +
        (others ? "; stopping the other " + plural(others, "rank") : ""));
    stop(SIGTERM);
  }
}

int Launcher::run() {
  int pipe_fds[2];
  LOOM_CHECK(::pipe2(pipe_fds, O_CLOEXEC | O_NONBLOCK) == 0, "pipe2 failed: ", std::strerror(errno));
  net::Fd signal_read(pipe_fds[0]), signal_write(pipe_fds[1]);
  g_signal_pipe = signal_write.get();
  struct sigaction action{}, old_chld{}, old_int{}, old_term{}, old_hup{}, old_pipe{};
  action.sa_handler = on_signal;
  action.sa_flags = SA_RESTART;
  sigemptyset(&action.sa_mask);
  ::sigaction(SIGCHLD, &action, &old_chld);
  ::sigaction(SIGINT, &action, &old_int);
  ::sigaction(SIGTERM, &action, &old_term);
  ::sigaction(SIGHUP, &action, &old_hup);
  struct sigaction ignore{};
  ignore.sa_handler = SIG_IGN;
  ::sigaction(SIGPIPE, &ignore, &old_pipe);

  std::vector<std::string> base_env;
  for (char** e = environ; *e; ++e) {
    std::string var = *e;
    std::string name = var.substr(0, var.find('='));
    static const char* ours[] = {"RANK",        "WORLD_SIZE",  "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                 "MASTER_ADDR", "MASTER_PORT", "LOOM_RUN_ID"};
    if (std::none_of(std::begin(ours), std::end(ours), [&](const char* n) { return name == n; }))
      base_env.push_back(var);
  }
  run_id_ = job_run_id(o_.nnodes);
  for (int i = 0; i < o_.nproc_per_node; ++i) ranks_.push_back(Rank{o_.node_rank * o_.nproc_per_node + i});
  // With bind_cpus, each rank's share of the CPUs (launch() checked there is a CPU per rank).
  const std::vector<std::vector<int>> shares =
      o_.bind_cpus ? cpu_shares(usable_cpus(), o_.nproc_per_node) : std::vector<std::vector<int>>{};
  try {
    for (size_t i = 0; i < ranks_.size(); ++i) spawn(ranks_[i], base_env, o_.bind_cpus ? &shares[i] : nullptr);
  } catch (const Error& e) {
    say(e.what());
    exit_code_ = 1;
    stop(SIGTERM);
  }

  while (running() > 0) {
    std::vector<pollfd> fds{{signal_read.get(), POLLIN, 0}};
    std::vector<std::pair<Stream*, const Rank*>> streams;
    for (Rank& r : ranks_)
      for (Stream* s : {&r.out, &r.err})
        if (s->fd.valid()) {
          fds.push_back({s->fd.get(), POLLIN, 0});
          streams.emplace_back(s, &r);
        }
    // A timeout even when idle: a backstop should a SIGCHLD byte ever be lost.
    int64_t timeout_ms = 1000;
    if (stopping_ && !killed_)
      timeout_ms = std::clamp<int64_t>(std::chrono::ceil<std::chrono::milliseconds>(kill_at_ - Clock::now()).count(), 0, 1000);
    ::poll(fds.data(), fds.size(), static_cast<int>(timeout_ms));

    char sigs[64];
    ssize_t n;
    while ((n = ::read(signal_read.get(), sigs, sizeof sigs)) > 0) {
      for (ssize_t i = 0; i < n; ++i) {
        int sig = sigs[i];
        if (sig == SIGCHLD) continue;
        if (stopping_ && !killed_ && sig == SIGINT) {  // a second Ctrl-C: stop now
          say("second SIGINT: killing the ranks");
          stop(SIGKILL);
          killed_ = true;
          continue;
        }
        if (exit_code_ == 0) exit_code_ = 128 + sig;
        if (!stopping_) say("got signal " + std::to_string(sig) + " (" + ::strsignal(sig) + "); passing it to " +
                            plural(running(), "rank"));
        stop(sig);
      }
    }
    for (size_t i = 1; i < fds.size(); ++i)
      if (fds[i].revents) pump(*streams[i - 1].first, prefix_of(*streams[i - 1].second));
    reap();
    if (stopping_ && !killed_ && Clock::now() >= kill_at_ && running() > 0) {
      std::string late;
      for (const Rank& r : ranks_)
        if (r.running) late += (late.empty() ? "" : ", ") + std::to_string(r.rank);
      say("rank(s) " + late + " did not stop within " + net::elapsed_since(kill_at_ - o_.grace) +
          " of being told to; sending SIGKILL");
      stop(SIGKILL);
      killed_ = true;
    }
  }
  for (Rank& r : ranks_) {  // what was written before the last exit, and unfinished lines
    pump(r.out, prefix_of(r));
    pump(r.err, prefix_of(r));
    emit(r.out, prefix_of(r), true);
    emit(r.err, prefix_of(r), true);
  }

  ::sigaction(SIGCHLD, &old_chld, nullptr);
  ::sigaction(SIGINT, &old_int, nullptr);
  ::sigaction(SIGTERM, &old_term, nullptr);
  ::sigaction(SIGHUP, &old_hup, nullptr);
  ::sigaction(SIGPIPE, &old_pipe, nullptr);
  g_signal_pipe = -1;
  return exit_code_;
}

}  // namespace

int launch(const LaunchOptions& options) {
  LOOM_CHECK(!options.command.empty(), "loomrun: no program to run");
  LOOM_CHECK(options.nproc_per_node >= 1, "nproc_per_node must be >= 1, got ", options.nproc_per_node);
  LOOM_CHECK(options.nnodes >= 1 && options.node_rank >= 0 && options.node_rank < options.nnodes,
             "node_rank ", options.node_rank, " must be in 0..nnodes-1 (nnodes=", options.nnodes, ")");
  LOOM_CHECK(options.master_port >= 1 && options.master_port <= 65535, "master_port ", options.master_port,
             " is not a port number 1-65535");
  if (options.bind_cpus) {
    const std::string problem = cpu_bind_problem(options.nproc_per_node);
    LOOM_CHECK(problem.empty(), problem);
  }
  return Launcher(options).run();
}

int visible_gpu_count(const EnvLookup& env, const std::string& dev_dir) {
  int devices = 0;
  if (DIR* dir = ::opendir(dev_dir.c_str())) {
    while (dirent* e = ::readdir(dir)) {
      std::string_view name = e->d_name;
      if (name.starts_with("nvidia") && name.size() > 6 && parse_integer(name.substr(6))) ++devices;
    }
    ::closedir(dir);
  }
  auto visible = env("CUDA_VISIBLE_DEVICES");
  if (!visible) return devices;
  int listed = 0;
  std::string_view rest = *visible;
  while (!rest.empty()) {
    size_t comma = rest.find(',');
    std::string_view entry = rest.substr(0, comma);
    auto index = parse_integer(entry);
    bool valid = (index && *index >= 0) || entry.starts_with("GPU-") || entry.starts_with("MIG-");
    if (!valid) break;  // CUDA ignores this entry and all after it
    ++listed;
    rest = comma == std::string_view::npos ? std::string_view{} : rest.substr(comma + 1);
  }
  return devices > 0 ? std::min(listed, devices) : listed;
}

int auto_nproc_per_node(const EnvLookup& env, const std::string& dev_dir) {
  int gpus = visible_gpu_count(env, dev_dir);
  if (gpus > 0) return gpus;
  return static_cast<int>(std::clamp(std::thread::hardware_concurrency(), 1u, 4u));
}

}  // namespace loom::dist
