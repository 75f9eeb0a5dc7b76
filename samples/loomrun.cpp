// loomrun: Loom's single-node launcher, torchrun's counterpart. This file is the command
// line: it parses the flags, settles the rank count and the master port (a free one when
// none is given, a clear error when the given one is taken, checked before anything is
// started), and hands over to loom::dist::launch() (parallel/launcher.h), which runs and
// supervises the ranks.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/core/error.h"
#include "parallel/cpu_shares.h"
#include "parallel/launcher.h"
#include "parallel/socket.h"

namespace {

constexpr const char* kHelp = R"(usage: loomrun [--nproc-per-node N|auto] [--nnodes M --node-rank R]
               [--master-addr A] [--master-port P] [--cpu-bind] PROGRAM [ARGS...]

Starts N copies of PROGRAM on this node, one per rank, and supervises them.

Each rank gets the env:// variables that Loom's rendezvous (and PyTorch's) reads:
  RANK              this process's rank, node_rank * N + LOCAL_RANK
  WORLD_SIZE        M * N
  LOCAL_RANK        0 .. N-1 on this node: Loom programs pick their GPU from it
                    (cuda:LOCAL_RANK) before any other CUDA call
  LOCAL_WORLD_SIZE  N
  MASTER_ADDR, MASTER_PORT   where rank 0 serves the rendezvous store
CUDA_VISIBLE_DEVICES and the rest of the environment are passed on unchanged.

Flags (--flag value or --flag=value; --nproc_per_node style is accepted too):
  --nproc-per-node N|auto  ranks on this node (default 1). auto: one per visible GPU
                   (the entries of CUDA_VISIBLE_DEVICES, else the /dev/nvidiaN devices);
                   on a machine without GPUs, one per CPU core, at most 4.
  --nnodes M       nodes in the job (default 1); run loomrun once on each node.
  --node-rank R    this node's index, 0 .. M-1 (default 0); node 0 hosts rank 0.
  --master-addr A  host name or address of node 0 (default: $MASTER_ADDR, else
                   127.0.0.1); required when M > 1.
  --master-port P  TCP port for the rendezvous store (default: $MASTER_PORT; on one
                   node, else a free port that loomrun picks); required when M > 1.
                   On node 0 loomrun checks that the port is free before starting.
  --cpu-bind       pin each rank to a share of its own of the CPUs loomrun may use:
                   whole cores (their counts differing by at most one) when there are
                   at least as many cores as ranks, else single CPUs. The operating
                   system then cannot move one rank's threads onto another's cores,
                   and each rank's CPU kernels run a thread per CPU of its share.
                   Needs a CPU per rank. Without it every rank may use every CPU and
                   runs a thread per CPU, or LOOM_NUM_THREADS threads when that is set.
  -h, --help       this text.

Output: every line a rank prints is prefixed with "[rank K] " (stdout to stdout,
stderr to stderr). Ranks write to pipes, so flush your own output per line.
Ranks run in their own process groups and cannot read from the terminal.

Failure: when a rank exits with a non-zero code or dies from a signal, loomrun says
which, sends SIGTERM to the other ranks (SIGKILL after 5 s), and exits with that
rank's code (128+N for signal N). Ctrl-C (SIGINT), SIGTERM and SIGHUP are passed on to
the ranks; a second Ctrl-C kills them at once. loomrun exits 0 when all ranks do, and 2
for a bad command line.

Examples:
  loomrun --nproc-per-node auto ./train_cnn --epochs 10
  loomrun --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 --nproc-per-node 8 ./train_gpt
)";

struct UsageError {
  std::string message;
};

int parse_count(std::string_view flag, const std::string& value, int min, const char* expected) {
  auto n = loom::dist::parse_integer(value);
  if (!n || *n < min || *n > 1'000'000)
    throw UsageError{std::string(flag) + " expects " + expected + ", got '" + value + "'"};
  return static_cast<int>(*n);
}

bool is_runnable(const std::string& program) {
  if (program.find('/') != std::string::npos) return ::access(program.c_str(), X_OK) == 0;
  const char* path = std::getenv("PATH");
  std::string_view dirs = path ? path : "/usr/bin:/bin";
  while (true) {
    size_t colon = dirs.find(':');
    std::string dir(dirs.substr(0, colon));
    if (::access(((dir.empty() ? "." : dir) + "/" + program).c_str(), X_OK) == 0) return true;
    if (colon == std::string_view::npos) return false;
    dirs.remove_prefix(colon + 1);
  }
}

int run(int argc, char** argv) {
  loom::dist::LaunchOptions options;
  std::string nproc = "1", addr, port;
  if (auto env = loom::dist::process_env("MASTER_ADDR")) addr = *env;
  if (auto env = loom::dist::process_env("MASTER_PORT")) port = *env;
  int i = 1;
  for (; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--") {
      ++i;
      break;
    }
    if (arg.empty() || arg[0] != '-') break;  // PROGRAM: it and all after it are the command
    if (arg == "-h" || arg == "--help") {
      std::fputs(kHelp, stdout);
      return 0;
    }
    std::string flag = arg.substr(0, arg.find('=')), value;
    for (size_t c = 2; c < flag.size(); ++c)
      if (flag[c] == '_') flag[c] = '-';
    if (arg.find('=') != std::string::npos) {
      value = arg.substr(arg.find('=') + 1);
    } else if (flag == "--nproc-per-node" || flag == "--nnodes" || flag == "--node-rank" ||
               flag == "--master-addr" || flag == "--master-port") {
      if (i + 1 >= argc) throw UsageError{flag + " expects a value, got nothing"};
      value = argv[++i];
    }
    if (flag == "--cpu-bind") {
      if (arg.find('=') != std::string::npos) throw UsageError{"--cpu-bind takes no value, got '" + arg + "'"};
      options.bind_cpus = true;
    } else if (flag == "--nproc-per-node") {
      nproc = value;
    } else if (flag == "--nnodes") {
      options.nnodes = parse_count(flag, value, 1, "a number of nodes >= 1");
    } else if (flag == "--node-rank") {
      options.node_rank = parse_count(flag, value, 0, "this node's index, an integer >= 0");
    } else if (flag == "--master-addr") {
      if (value.empty()) throw UsageError{"--master-addr expects a host name or address, got ''"};
      addr = value;
    } else if (flag == "--master-port") {
      port = value;
    } else {
      throw UsageError{"unknown flag '" + arg + "'"};
    }
  }
  if (i >= argc) throw UsageError{"no program given: loomrun --nproc-per-node N PROGRAM [ARGS...]"};
  options.command.assign(argv + i, argv + argc);

  options.nproc_per_node = nproc == "auto" ? loom::dist::auto_nproc_per_node()
                                           : parse_count("--nproc-per-node", nproc, 1, "a number of ranks >= 1 or 'auto'");
  if (options.bind_cpus)
    if (std::string problem = loom::dist::cpu_bind_problem(options.nproc_per_node); !problem.empty())
      throw UsageError{problem};
  // A thread count the ranks would ignore (parallel_for.cpp reads positive integers only)
  // is named here instead.
  if (auto threads = loom::dist::process_env("LOOM_NUM_THREADS"); threads && !threads->empty())
    parse_count("LOOM_NUM_THREADS", *threads, 1, "a number of threads >= 1, or unset for a thread per CPU");
  if (options.node_rank >= options.nnodes)
    throw UsageError{"--node-rank " + std::to_string(options.node_rank) + " is not below --nnodes " +
                     std::to_string(options.nnodes) + ": nodes are numbered 0 to M-1"};
  if (options.nnodes > 1 && (addr.empty() || port.empty()))
    throw UsageError{"--nnodes " + std::to_string(options.nnodes) +
                     " needs --master-addr and --master-port (or MASTER_ADDR and MASTER_PORT): "
                     "every node must meet at the same address of node 0"};
  options.master_addr = addr.empty() ? "127.0.0.1" : addr;
  if (!port.empty()) {
    options.master_port = parse_count("--master-port (or MASTER_PORT)", port, 0, "a TCP port number 1-65535");
    if (options.master_port > 65535) throw UsageError{"--master-port expects a TCP port number 1-65535, got '" + port + "'"};
  }
  if (options.master_port == 0) {
    if (options.nnodes > 1) throw UsageError{"--master-port 0 works only on one node: give every node the same port"};
    options.master_port = loom::dist::net::free_port();
  } else if (options.node_rank == 0 && !loom::dist::net::port_is_free(options.master_port)) {
    std::cerr << "loomrun: " << loom::dist::net::port_in_use_message(options.master_addr, options.master_port) << "\n";
    return 1;
  }
  if (!is_runnable(options.command[0])) {
    std::cerr << "loomrun: cannot run '" << options.command[0] << "': "
              << (options.command[0].find('/') == std::string::npos ? "not found in PATH" : "no such executable file")
              << "\n";
    return 127;
  }
  return loom::dist::launch(options);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const UsageError& e) {
    std::cerr << "loomrun: " << e.message << " (loomrun --help explains the flags)\n";
    return 2;
  } catch (const std::exception& e) {  // loom::Error, and std::bad_alloc and the like
    std::cerr << "loomrun: " << e.what() << "\n";
    return 1;
  }
}
