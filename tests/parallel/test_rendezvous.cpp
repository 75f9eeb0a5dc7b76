// The env:// contract read from made-up environments (what torchrun/loomrun, mpirun and
// srun set, and what users get wrong), the store join that follows it, and the GPU count
// behind `loomrun --nproc-per-node auto`.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include "kernels/core/error.h"
#include "parallel/launcher.h"
#include "parallel/rendezvous.h"
#include "parallel/socket.h"

namespace loom::dist {
namespace {

using namespace std::chrono_literals;
using Env = std::map<std::string, std::string>;

const Env kTorchrun{{"RANK", "5"},        {"WORLD_SIZE", "8"},           {"LOCAL_RANK", "1"},
                    {"LOCAL_WORLD_SIZE", "4"}, {"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "29500"}};

Env with(Env env, const Env& changes, const std::vector<std::string>& removed = {}) {
  for (const auto& [k, v] : changes) env[k] = v;
  for (const auto& k : removed) env.erase(k);
  return env;
}

TEST(Rendezvous, ReadsTorchrunVariables) {
  RendezvousInfo info = rendezvous_from_env(env_from_map(kTorchrun));
  EXPECT_EQ(info.rank, 5);
  EXPECT_EQ(info.world_size, 8);
  EXPECT_EQ(info.local_rank, 1);
  EXPECT_EQ(info.local_world_size, 4);
  EXPECT_EQ(info.master_addr, "10.0.0.1");
  EXPECT_EQ(info.master_port, 29500);
}

TEST(Rendezvous, FallsBackToMpirunVariables) {
  RendezvousInfo info = rendezvous_from_env(env_from_map(
      {{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "4"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
       {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}, {"MASTER_ADDR", "node0"}, {"MASTER_PORT", "1234"}}));
  EXPECT_EQ(info.rank, 3);
  EXPECT_EQ(info.world_size, 4);
  EXPECT_EQ(info.local_rank, 1);
  EXPECT_EQ(info.local_world_size, 2);
  EXPECT_EQ(info.master_addr, "node0");
}

TEST(Rendezvous, FallsBackToSlurmVariablesAndLaunchNodeAddress) {
  RendezvousInfo info = rendezvous_from_env(env_from_map(
      {{"SLURM_PROCID", "6"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "2"}, {"SLURM_NTASKS_PER_NODE", "4"},
       {"SLURM_LAUNCH_NODE_IPADDR", "192.168.1.7"}, {"MASTER_PORT", "29501"}}));
  EXPECT_EQ(info.rank, 6);
  EXPECT_EQ(info.world_size, 8);
  EXPECT_EQ(info.local_rank, 2);
  EXPECT_EQ(info.local_world_size, 4);
  EXPECT_EQ(info.master_addr, "192.168.1.7");
  EXPECT_EQ(info.master_port, 29501);
}

TEST(Rendezvous, TorchrunNamesWinOverLauncherNames) {
  RendezvousInfo info = rendezvous_from_env(
      env_from_map(with(kTorchrun, {{"OMPI_COMM_WORLD_RANK", "0"}, {"SLURM_PROCID", "1"},
                                    {"SLURM_LAUNCH_NODE_IPADDR", "1.2.3.4"}})));
  EXPECT_EQ(info.rank, 5);
  EXPECT_EQ(info.master_addr, "10.0.0.1");
}

TEST(Rendezvous, OneProcessNeedsNoLocalVariables) {
  RendezvousInfo info = rendezvous_from_env(env_from_map(
      {{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_ADDR", "localhost"}, {"MASTER_PORT", "29500"}}));
  EXPECT_EQ(info.local_rank, 0);
  EXPECT_EQ(info.local_world_size, 1);
}

TEST(Rendezvous, LaunchedWithRankSeesAnyLauncher) {
  EXPECT_FALSE(launched_with_rank(env_from_map({})));
  EXPECT_TRUE(launched_with_rank(env_from_map({{"RANK", "0"}})));
  EXPECT_TRUE(launched_with_rank(env_from_map({{"OMPI_COMM_WORLD_RANK", "0"}})));
  EXPECT_TRUE(launched_with_rank(env_from_map({{"SLURM_PROCID", "0"}})));
}

struct BadEnv {
  const char* what;
  Env env;
  const char* message;  // a part the error must contain
};

TEST(Rendezvous, MissingOrMalformedVariablesAreNamed) {
  const BadEnv cases[] = {
      {"rank not a number", with(kTorchrun, {{"RANK", "x"}}), "RANK='x' is not an integer"},
      {"rank too large", with(kTorchrun, {{"RANK", "8"}}), "RANK=8 is not below WORLD_SIZE=8"},
      {"rank negative", with(kTorchrun, {{"RANK", "-1"}}), "RANK=-1 must be >= 0"},
      {"rank with junk", with(kTorchrun, {{"RANK", "3abc"}}), "RANK='3abc' is not an integer"},
      {"no rank at all", {}, "RANK is not set (nor OMPI_COMM_WORLD_RANK, SLURM_PROCID)"},
      {"world size zero", with(kTorchrun, {{"WORLD_SIZE", "0"}}), "WORLD_SIZE=0 must be >= 1"},
      {"no world size", with(kTorchrun, {}, {"WORLD_SIZE"}), "WORLD_SIZE is not set"},
      {"no local rank", with(kTorchrun, {}, {"LOCAL_RANK"}), "LOCAL_RANK is not set"},
      {"local rank too large", with(kTorchrun, {{"LOCAL_RANK", "4"}}), "LOCAL_RANK=4 is not below LOCAL_WORLD_SIZE=4"},
      {"local world too large", with(kTorchrun, {{"LOCAL_WORLD_SIZE", "16"}}),
       "LOCAL_WORLD_SIZE=16 is larger than WORLD_SIZE=8"},
      {"no master address", with(kTorchrun, {}, {"MASTER_ADDR"}), "MASTER_ADDR is not set"},
      {"empty master address", with(kTorchrun, {{"MASTER_ADDR", ""}}), "MASTER_ADDR is empty"},
      {"no master port", with(kTorchrun, {}, {"MASTER_PORT"}), "MASTER_PORT is not set"},
      {"port not a number", with(kTorchrun, {{"MASTER_PORT", "http"}}), "MASTER_PORT='http' is not an integer"},
      {"port out of range", with(kTorchrun, {{"MASTER_PORT", "70000"}}), "MASTER_PORT=70000 is not a port number"},
      {"slurm rank too large",
       {{"SLURM_PROCID", "4"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "0"}, {"SLURM_NTASKS_PER_NODE", "4"}},
       "SLURM_PROCID=4 is not below SLURM_NTASKS=4"},
      {"mpirun without master",
       {{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
        {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}},
       "-x MASTER_ADDR="},
  };
  for (const auto& c : cases) {
    try {
      rendezvous_from_env(env_from_map(c.env));
      ADD_FAILURE() << c.what << ": no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(c.message), std::string::npos)
          << c.what << ": expected \"" << c.message << "\" in \"" << e.what() << "\"";
    }
  }
}

RendezvousInfo local_info(int rank, int world, int port) { return {rank, world, rank, world, "127.0.0.1", port}; }

// Runs connect_store for each info on its own thread; returns each one's error ("" = joined).
std::vector<std::string> join_all(const std::vector<RendezvousInfo>& infos, Duration timeout) {
  std::vector<std::string> errors(infos.size());
  std::vector<std::unique_ptr<TcpStore>> stores(infos.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < infos.size(); ++i)
    threads.emplace_back([&, i] {
      try {
        stores[i] = connect_store(infos[i], timeout);
      } catch (const Error& e) {
        errors[i] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  return errors;  // the stores (rank 0's server last) go away only now that all are done
}

TEST(ConnectStore, AllRanksJoinAndShareTheStore) {
  int port = net::free_port();
  auto errors = join_all({local_info(0, 3, port), local_info(1, 3, port), local_info(2, 3, port)}, 30s);
  for (const auto& e : errors) EXPECT_EQ(e, "");
}

TEST(ConnectStore, MissingRankIsNamedAfterTheTimeout) {
  int port = net::free_port();
  auto errors = join_all({local_info(0, 3, port), local_info(1, 3, port)}, 1s);
  EXPECT_NE(errors[0].find("rank 2 of 3 did not join"), std::string::npos) << errors[0];
  // Rank 1 either times out too or, when rank 0 gave up first, sees rank 0's store go away.
  EXPECT_TRUE(errors[1].find("of 3 did not join") != std::string::npos ||
              errors[1].find("rank 0, which serves it, has probably exited") != std::string::npos)
      << errors[1];
}

TEST(ConnectStore, RankStartedTwiceIsAnError) {
  int port = net::free_port();
  auto errors = join_all({local_info(0, 2, port), local_info(1, 2, port), local_info(1, 2, port)}, 10s);
  int duplicates = 0;
  for (const auto& e : errors) duplicates += e.find("two processes have RANK=1") != std::string::npos;
  EXPECT_EQ(duplicates, 1) << errors[0] << "\n" << errors[1] << "\n" << errors[2];
}

TEST(ConnectStore, DifferentWorldSizesAreAnError) {
  int port = net::free_port();
  auto errors = join_all({local_info(0, 2, port), local_info(1, 3, port)}, 1s);
  EXPECT_NE(errors[1].find("rank 1 has WORLD_SIZE=3 but rank 0 has WORLD_SIZE=2"), std::string::npos) << errors[1];
}

TEST(AutoNproc, CountsVisibleGpus) {
  auto dev = std::filesystem::path(::testing::TempDir()) / ("loom_dev_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dev);
  for (const char* name : {"nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"}) std::ofstream(dev / name) << "";
  struct Case {
    Env env;
    std::string dev_dir;
    int gpus;
  };
  const std::string none = (dev / "empty").string();
  const Case cases[] = {
      {{}, dev.string(), 2},
      {{{"CUDA_VISIBLE_DEVICES", "1"}}, dev.string(), 1},
      {{{"CUDA_VISIBLE_DEVICES", ""}}, dev.string(), 0},
      {{{"CUDA_VISIBLE_DEVICES", "0,1,2,3"}}, dev.string(), 2},  // no more than exist
      {{{"CUDA_VISIBLE_DEVICES", "0,-1,1"}}, dev.string(), 1},   // CUDA stops at -1
      {{{"CUDA_VISIBLE_DEVICES", "GPU-1a2b,GPU-3c4d,GPU-5e"}}, none, 3},
      {{}, none, 0},
  };
  for (const auto& c : cases) EXPECT_EQ(visible_gpu_count(env_from_map(c.env), c.dev_dir), c.gpus);
  int cpu_ranks = auto_nproc_per_node(env_from_map({}), none);
  EXPECT_GE(cpu_ranks, 1);
  EXPECT_LE(cpu_ranks, 4);
  EXPECT_EQ(auto_nproc_per_node(env_from_map({}), dev.string()), 2);
  std::filesystem::remove_all(dev);
}

}  // namespace
}  // namespace loom::dist
