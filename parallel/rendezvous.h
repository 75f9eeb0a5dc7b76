// The env:// rendezvous contract, as in PyTorch: a launcher puts MASTER_ADDR, MASTER_PORT,
// RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE in each process's environment, rank 0
// serves a TcpStore on MASTER_ADDR:MASTER_PORT, and every rank meets there. loomrun and
// `torchrun --no-python` set these names; where one is missing, mpirun's (OMPI_COMM_WORLD_*)
// and then Slurm's (SLURM_PROCID, ...) are read instead, so `mpirun` and `srun` launch
// Loom programs unchanged (they do not give a master address and port: pass
// `-x MASTER_ADDR=... -x MASTER_PORT=...` to mpirun; under srun MASTER_ADDR defaults to
// SLURM_LAUNCH_NODE_IPADDR, the node that ran srun, which hosts rank 0 under Slurm's default
// block distribution; set MASTER_ADDR where that does not hold).
//
// The environment is read through an EnvLookup so tests can feed made-up environments.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "store.h"

namespace loom::dist {

using EnvLookup = std::function<std::optional<std::string>(const std::string& name)>;

// Reads the real process environment (getenv).
std::optional<std::string> process_env(const std::string& name);
// An environment made of `vars` only.
EnvLookup env_from_map(std::map<std::string, std::string> vars);

struct RendezvousInfo {
  int rank = 0;              // 0 <= rank < world_size
  int world_size = 1;
  int local_rank = 0;        // this process's index on its node: it picks the GPU
  int local_world_size = 1;  // processes on this node
  std::string master_addr;   // where rank 0 serves the store
  int master_port = 0;
  // LOOM_RUN_ID: the same on every rank of one job and different between jobs (loomrun sets
  // it), so a rank that reaches another job's store on a shared port fails before it changes
  // anything there. Empty when no launcher set it; then no job is told from another.
  std::string run_id;
};

// Whether a launcher gave this process a rank (RANK, OMPI_COMM_WORLD_RANK or SLURM_PROCID):
// programs that also run alone use it to choose between one process and a rendezvous.
bool launched_with_rank(const EnvLookup& env = process_env);

// Reads and checks the contract. A missing or malformed variable throws loom::Error naming
// it and the expected form ("RANK='x' is not an integer", "RANK=4 is not below
// WORLD_SIZE=4"). LOCAL_RANK and LOCAL_WORLD_SIZE may be absent only when WORLD_SIZE is 1.
RendezvousInfo rendezvous_from_env(const EnvLookup& env = process_env);

// Rank 0 serves the TcpStore on master_port; every rank connects to it and then waits
// until all world_size ranks have joined, so a rank missing, started twice, or given
// another WORLD_SIZE is an error naming it rather than a hang later on. The whole rendezvous
// takes at most about `timeout`; while rank 0 waits, it prints the ranks still missing to
// stderr every `report_every`, and a rank waiting for rank 0's store to appear says so as often. A rank whose run id differs from rank 0's (another job on the
// same port) fails with the busy-port message before it claims its rank.
std::unique_ptr<TcpStore> connect_store(const RendezvousInfo& info, Duration timeout = Store::kDefaultTimeout,
                                        Duration report_every = std::chrono::seconds(5));

// The whole of `text` as a decimal integer, or nothing.
std::optional<int64_t> parse_integer(std::string_view text);

}  // namespace loom::dist
