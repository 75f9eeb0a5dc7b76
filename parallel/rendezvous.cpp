// env:// rendezvous: see rendezvous.h. Each field is looked up in a fixed order of
// variable names (PyTorch's, then mpirun's, then Slurm's), and every message names the
// variable that was actually read, so "SLURM_PROCID=4 is not below SLURM_NTASKS=4" points
// at what the user has to fix.
#include "parallel/rendezvous.h"

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "kernels/core/error.h"
#include "parallel/socket.h"

namespace loom::dist {

std::optional<std::string> process_env(const std::string& name) {
  const char* value = std::getenv(name.c_str());
  if (value == nullptr) return std::nullopt;
  return std::string(value);
}

EnvLookup env_from_map(std::map<std::string, std::string> vars) {
  return [vars = std::move(vars)](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

std::optional<int64_t> parse_integer(std::string_view text) {
  int64_t value = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || ec != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return value;
}

namespace {

// The names one field may come from, in order of preference.
struct Field {
  std::vector<std::string> names;
  const char* expected;  // the form, for messages
};

const Field kRank{{"RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"}, "an integer 0 <= RANK < WORLD_SIZE"};
const Field kWorldSize{{"WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS"}, "the number of ranks, >= 1"};
const Field kLocalRank{{"LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"},
                       "this process's index on its node, 0 <= LOCAL_RANK < LOCAL_WORLD_SIZE"};
const Field kLocalWorldSize{{"LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"},
                            "the number of ranks on this node, >= 1"};
const Field kMasterAddr{{"MASTER_ADDR", "SLURM_LAUNCH_NODE_IPADDR"}, "the host name or IP address of rank 0"};
const Field kMasterPort{{"MASTER_PORT"}, "a TCP port number 1-65535, the same on every rank"};

// A variable that was found: its name and text.
struct Found {
  std::string name;
  std::string text;
};

std::optional<Found> find(const EnvLookup& env, const Field& field) {
  for (const auto& name : field.names)
    if (auto value = env(name)) return Found{name, *value};
  return std::nullopt;
}

std::string alternatives(const Field& field) {
  std::string out = field.names[0] + " is not set";
  if (field.names.size() > 1) {
    out += " (nor ";
    for (size_t i = 1; i < field.names.size(); ++i) out += (i > 1 ? ", " : "") + field.names[i];
    out += ")";
  }
  return out;
}

// Reads an integer field; absent gives nullopt, malformed or below `min` throws.
std::optional<Found> read_int(const EnvLookup& env, const Field& field, int64_t min, int64_t& value) {
  auto found = find(env, field);
  if (!found) return std::nullopt;
  auto parsed = parse_integer(found->text);
  LOOM_CHECK(parsed.has_value(), found->name, "='", found->text, "' is not an integer: expected ", field.expected);
  LOOM_CHECK(*parsed >= min, found->name, "=", *parsed, " must be >= ", min, ": expected ", field.expected);
  LOOM_CHECK(*parsed <= 1'000'000'000, found->name, "=", *parsed, " is too large: expected ", field.expected);
  value = *parsed;
  return found;
}

}  // namespace

bool launched_with_rank(const EnvLookup& env) { return find(env, kRank).has_value(); }

RendezvousInfo rendezvous_from_env(const EnvLookup& env) {
  constexpr const char* kHint =
      ": start this program with loomrun, torchrun --no-python, mpirun or srun, or set RANK, WORLD_SIZE, "
      "MASTER_ADDR and MASTER_PORT yourself";
  int64_t rank = 0, world_size = 0, local_rank = 0, local_world_size = 0, port = 0;

  auto rank_var = read_int(env, kRank, 0, rank);
  LOOM_CHECK(rank_var, alternatives(kRank), ": expected ", kRank.expected, kHint);
  auto world_var = read_int(env, kWorldSize, 1, world_size);
  LOOM_CHECK(world_var, alternatives(kWorldSize), ": expected ", kWorldSize.expected, kHint);
  LOOM_CHECK(rank < world_size, rank_var->name, "=", rank, " is not below ", world_var->name, "=", world_size,
             ": ranks are numbered 0 to ", world_var->name, "-1");

  auto local_var = read_int(env, kLocalRank, 0, local_rank);
  auto local_size_var = read_int(env, kLocalWorldSize, 1, local_world_size);
  if (world_size == 1) {  // one process alone: there is only one thing the local values can be
    if (!local_var) local_rank = 0;
    if (!local_size_var) local_world_size = 1;
  }
  LOOM_CHECK(local_var || world_size == 1, alternatives(kLocalRank), ": expected ", kLocalRank.expected,
             " (it chooses this rank's GPU)");
  LOOM_CHECK(local_size_var || world_size == 1, alternatives(kLocalWorldSize), ": expected ",
             kLocalWorldSize.expected, " (under srun, pass --ntasks-per-node)");
  std::string local_name = local_var ? local_var->name : "LOCAL_RANK";
  std::string local_size_name = local_size_var ? local_size_var->name : "LOCAL_WORLD_SIZE";
  LOOM_CHECK(local_rank < local_world_size, local_name, "=", local_rank, " is not below ", local_size_name, "=",
             local_world_size);
  LOOM_CHECK(local_world_size <= world_size, local_size_name, "=", local_world_size, " is larger than ",
             world_var->name, "=", world_size);

  auto addr = find(env, kMasterAddr);
  LOOM_CHECK(addr, alternatives(kMasterAddr), ": expected ", kMasterAddr.expected,
             " (under mpirun, pass -x MASTER_ADDR=<host of rank 0>)");
  LOOM_CHECK(!addr->text.empty(), addr->name, " is empty: expected ", kMasterAddr.expected);
  auto port_var = read_int(env, kMasterPort, 1, port);
  LOOM_CHECK(port_var, alternatives(kMasterPort), ": expected ", kMasterPort.expected,
             " (under mpirun, pass -x MASTER_PORT=<port>)");
  LOOM_CHECK(port <= 65535, port_var->name, "=", port, " is not a port number: expected ", kMasterPort.expected);

  return {static_cast<int>(rank), static_cast<int>(world_size), static_cast<int>(local_rank),
          static_cast<int>(local_world_size), addr->text, static_cast<int>(port), env("LOOM_RUN_ID").value_or("")};
}

namespace {

// A rank other than 0 first waits until something listens at MASTER_ADDR:MASTER_PORT, saying
// every `report_every` that it is waiting and for whom, so that a rank whose rank 0 never
// started is not silent until its timeout. (Whether what listens is a store, and this job's,
// is checked next, by the store's first request.)
void wait_for_store(const RendezvousInfo& info, Duration timeout, Duration report_every,
                    std::chrono::steady_clock::time_point start) {
  const auto deadline = start + timeout;
  for (;;) {
    const auto left = std::chrono::ceil<Duration>(deadline - std::chrono::steady_clock::now());
    try {
      net::connect_tcp(info.master_addr, info.master_port, std::clamp(std::min(left, report_every), Duration(1), timeout));
      return;
    } catch (const Error& e) {
      if (std::chrono::steady_clock::now() >= deadline)
        LOOM_FAIL("rank ", info.rank, ": rank 0's store at ", info.master_addr, ":", info.master_port,
                  " did not appear within ", net::elapsed_since(start),
                  ": did rank 0 start, with the same MASTER_ADDR and MASTER_PORT? (", e.what(), ")");
      const std::string line = ::loom::detail::str(
          "rank ", info.rank, ": waiting for rank 0's store at ", info.master_addr, ":", info.master_port, " (",
          net::elapsed_since(start), " of the ", std::chrono::duration_cast<std::chrono::seconds>(timeout).count(),
          " s timeout)\n");
      std::fputs(line.c_str(), stderr);
      std::fflush(stderr);
    }
  }
}

}  // namespace

std::unique_ptr<TcpStore> connect_store(const RendezvousInfo& info, Duration timeout, Duration report_every) {
  auto role = info.rank == 0 ? TcpStore::Role::server : TcpStore::Role::client;
  auto start = std::chrono::steady_clock::now();
  if (info.rank != 0) wait_for_store(info, timeout, report_every, start);
  auto store = std::make_unique<TcpStore>(info.master_addr, info.master_port, role,
                                          std::max(Duration(1), std::chrono::ceil<Duration>(
                                                                    start + timeout - std::chrono::steady_clock::now())));
  store->set_timeout(timeout);
  const std::string prefix = "loom/rendezvous/";

  // Another job's store answers on a port both were given: leave it alone (read only).
  if (info.rank == 0) store->set(prefix + "run_id", info.run_id);
  std::string run_id = store->get_string(prefix + "run_id");
  LOOM_CHECK(run_id == info.run_id, "rank ", info.rank, ": the ", store->describe(),
             " belongs to another job (its run id is '", run_id, "', this job's '", info.run_id,
             "'), so nothing was changed there: ", net::port_in_use_message(info.master_addr, info.master_port));

  // Every rank must agree on the world size; rank 0's is the reference.
  if (info.rank == 0) store->set(prefix + "world_size", std::to_string(info.world_size));
  std::string world = store->get_string(prefix + "world_size");
  LOOM_CHECK(world == std::to_string(info.world_size), "rank ", info.rank, " has WORLD_SIZE=", info.world_size,
             " but rank 0 has WORLD_SIZE=", world, ": every rank must be started with the same world size");

  int64_t claims = store->add(prefix + "rank/" + std::to_string(info.rank), 1);
  LOOM_CHECK(claims == 1, "rank ", info.rank, " joined the ", store->describe(), " ", claims,
             " times: two processes have RANK=", info.rank, " (is another job using the same MASTER_PORT?)");

  std::vector<std::string> keys;
  for (int r = 0; r < info.world_size; ++r) keys.push_back(prefix + "rank/" + std::to_string(r));
  // The ranks that have not joined, if the store can still tell (rank 0 may have given up
  // and taken it down already).
  auto missing = [&]() -> std::string {
    try {
      std::string listed;
      int count = 0;
      for (int r = 0; r < info.world_size; ++r)
        if (!store->check({keys[r]})) listed += (count++ ? ", " : "") + std::to_string(r);
      return (count == 1 ? "rank " : "ranks ") + listed;
    } catch (const Error&) {
      return "some ranks";
    }
  };
  const auto deadline = start + timeout;
  for (;;) {
    const auto left = std::chrono::ceil<Duration>(deadline - std::chrono::steady_clock::now());
    try {
      store->wait(keys, std::clamp(std::min(left, report_every), Duration(1), timeout));
      return store;
    } catch (const StoreTimeout&) {
      if (std::chrono::steady_clock::now() >= deadline)
        LOOM_FAIL("rank ", info.rank, ": ", missing(), " of ", info.world_size, " did not join the ",
                  store->describe(), " within ", net::elapsed_since(start),
                  ": did they start, with the same MASTER_ADDR and MASTER_PORT?");
      if (info.rank == 0) {
        const std::string line = ::loom::detail::str(
            "rank 0: waiting for ", missing(), " of ", info.world_size, " to join the ", store->describe(), " (",
            net::elapsed_since(start), " of the ", std::chrono::duration_cast<std::chrono::seconds>(timeout).count(),
            " s timeout)\n");
        std::fputs(line.c_str(), stderr);
        std::fflush(stderr);
      }
    }
  }
}

}  // namespace loom::dist
