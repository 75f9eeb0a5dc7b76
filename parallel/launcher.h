// The single-node launcher behind loomrun (samples/loomrun.cpp parses the flags): it
// starts one process per rank with the env:// variables set, prefixes every line they
// print with "[rank K] ", and tears the group down when one fails, exiting with that
// rank's code, as torchrun does.
//
// Design decisions:
// - One poll() loop in the calling thread reads every child's stdout and stderr pipes and
//   a self-pipe fed by the SIGCHLD/SIGINT/SIGTERM/SIGHUP handlers, so output, exits and
//   Ctrl-C are handled in one place, without threads.
// - Each child dies with loomrun (PR_SET_PDEATHSIG, SIGKILL), so a loomrun that is itself
//   killed with SIGKILL leaves no unsupervised ranks behind. Call launch() from a thread
//   that outlives the ranks (the main thread): the signal follows the thread that forked.
// - Each job gets a run id (LOOM_RUN_ID): a rank of a second job started on the same master
//   port at the same moment reaches the first job's store, sees another run id there and
//   fails with the busy-port message, leaving the first job alone.
// - Each child runs in its own process group: Ctrl-C reaches loomrun alone, which passes
//   it on once, and stopping a rank also stops any processes it started. The price: a rank
//   cannot read from the terminal (stdin from a file or pipe works).
// - With bind_cpus (--cpu-bind) each rank is pinned to a share of the node's CPUs of its own
//   (cpu_shares.h), and its CPU kernels' threads default to the share's size. Without it
//   the ranks share every CPU, each making a thread per CPU unless LOOM_NUM_THREADS says
//   otherwise: while one rank of a pipeline waits, another's threads use its cores.
// - CUDA_VISIBLE_DEVICES is passed on unchanged: every rank sees every GPU and a Loom
//   program selects its device from LOCAL_RANK before any other CUDA call.
// - A child's stdout is a pipe, so C stdio buffers it fully; Loom's logging flushes each
//   line, and programs of your own should flush (std::endl, fflush, or setvbuf _IOLBF).
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include "rendezvous.h"

namespace loom::dist {

struct LaunchOptions {
  std::vector<std::string> command;  // PROGRAM ARGS...; PROGRAM is looked up in PATH
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;                 // this node; its ranks are node_rank*nproc_per_node + local_rank
  std::string master_addr = "127.0.0.1";
  int master_port = 0;               // must be set: loomrun picks one before calling launch()
  // Pin each rank to its own share of the CPUs this process may use (the shares, in core
  // order, differ in size by at most one); needs at least one CPU per rank.
  bool bind_cpus = false;
  // How long stopped ranks get between SIGTERM and SIGKILL.
  std::chrono::milliseconds grace = std::chrono::seconds(5);
};

// Runs the ranks of this node and waits for them. Returns what loomrun exits with: 0 when
// every rank succeeded, else the first failing rank's exit code (128+N for signal N), or
// 128+N when loomrun itself was stopped by signal N.
int launch(const LaunchOptions& options);

// GPUs this process may use: the entries of CUDA_VISIBLE_DEVICES when it is set (up to the
// first invalid one, as CUDA reads it), else the /dev/nvidiaN device files in `dev_dir`.
int visible_gpu_count(const EnvLookup& env = process_env, const std::string& dev_dir = "/dev");
// --nproc-per-node auto: one rank per visible GPU; without GPUs, one per CPU core, at most 4
// (CPU ranks share the cores, and more of them only add communication).
int auto_nproc_per_node(const EnvLookup& env = process_env, const std::string& dev_dir = "/dev");

}  // namespace loom::dist
