// Sub-groups, the device mesh and batched point to point, on Gloo over forked CPU ranks:
// groups made from one world store run collectives at the same time without reading each
// other's keys (with the debug ledger on, too); a rank that asks for another list is named;
// a 2 x 2 mesh hands each rank the right row and column; neighbours that send to each other
// at once through batch_isend_irecv do not deadlock.
#include <gtest/gtest.h>

#include "engine/ops.h"
#include "parallel/device_mesh.h"
#include "ranks.h"

namespace loom::dist {
namespace {

using namespace std::chrono_literals;
using testing::require;
using testing::require_error;
using testing::run_ranks;

// True when every element of the f32 tensor t is v.
bool all_equal(const Tensor& t, double v) {
  for (float x : t.to_vector<float>())
    if (double(x) != v) return false;
  return true;
}

// The first element of the f32 tensor t, for messages.
double first(const Tensor& t) { return double(t.to_vector<float>().at(0)); }

// The sum over `ranks` of (r + 1) * (step + 1).
double expected_sum(const std::vector<int>& ranks, int step) {
  double s = 0;
  for (int r : ranks) s += double(r + 1) * (step + 1);
  return s;
}

TEST(Groups, TwoDisjointGroupsRunAtOnce) {
  for (bool debug : {false, true}) {
    run_ranks(4, [](int rank, std::shared_ptr<ProcessGroup> world) {
      auto low = world->new_group({0, 1});
      auto high = world->new_group({2, 3});
      auto mine = rank < 2 ? low : high;
      require(mine != nullptr && (rank < 2 ? high : low) == nullptr, "rank ", rank, " got the wrong groups");
      require(mine->size() == 2 && mine->rank() == rank % 2, "rank ", rank, " has rank ", mine->rank(), " of ",
              mine->size());
      require(mine->world_ranks() == (rank < 2 ? std::vector<int>{0, 1} : std::vector<int>{2, 3}), "world ranks");
      std::vector<int> members = rank < 2 ? std::vector<int>{0, 1} : std::vector<int>{2, 3};
      for (int step = 0; step < 50; ++step) {
        Tensor t = full({1000}, double(rank + 1) * (step + 1));
        mine->all_reduce(t)->wait();
        require(all_equal(t, expected_sum(members, step)), "step ", step, ": rank ", rank, " got ", first(t));
      }
      world->barrier()->wait();
    }, {.debug = debug});
  }
}

TEST(Groups, OverlappingGroupsAndTheWorld) {
  run_ranks(3, [](int rank, std::shared_ptr<ProcessGroup> world) {
    auto a = world->new_group({0, 1});
    auto b = world->new_group({2, 1});  // rank 1 is in both, as rank 1 of b
    for (int step = 0; step < 10; ++step) {
      Tensor t = full({5}, double(rank + 1) * (step + 1));
      if (a) {
        a->all_reduce(t)->wait();
        require(all_equal(t, expected_sum({0, 1}, step)), "group a on rank ", rank);
      }
      Tensor u = full({5}, double(rank + 1) * (step + 1));
      if (b) {
        require(rank != 1 || b->rank() == 1, "rank 1 should be rank 1 of {2, 1}");
        b->all_reduce(u)->wait();
        require(all_equal(u, expected_sum({2, 1}, step)), "group b on rank ", rank);
      }
      Tensor w = full({3}, 1.0);
      world->all_reduce(w)->wait();
      require(all_equal(w, 3.0), "world on rank ", rank);
    }
  }, {.debug = true});
}

TEST(Groups, RanksThatAskForAnotherListAreNamed) {
  // Rank 0 is first of its list {0, 1} and publishes it; ranks 1 and 2 ask for {0, 1, 2},
  // read rank 0's list and must fail naming both. Rank 0 then waits for rank 1 in a group
  // that never forms and fails by its timeout; only the two named failures are checked.
  auto codes = testing::run_ranks_codes(3, [](int rank, std::shared_ptr<ProcessGroup> world) {
    if (rank == 0) {
      world->new_group({0, 1});
      return;
    }
    require_error([&] { world->new_group({0, 1, 2}); }, {"new_group #0", "asked for ranks", "[0,1,2]", "[0,1]"});
  }, {.timeout = 5s});
  EXPECT_EQ(codes[1], 0);
  EXPECT_EQ(codes[2], 0);
}

TEST(Groups, BadListsAreRejected) {
  run_ranks(2, [](int, std::shared_ptr<ProcessGroup> world) {
    require_error([&] { world->new_group({}); }, {"empty"});
    require_error([&] { world->new_group({0, 2}); }, {"rank 2", "out of range"});
    require_error([&] { world->new_group({1, 1}); }, {"rank 1 appears twice"});
  });
}

TEST(Mesh, TwoByTwoHandsOutRowsAndColumns) {
  run_ranks(4, [](int rank, std::shared_ptr<ProcessGroup> world) {
    DeviceMesh mesh(world, {2, 2}, {"pp", "dp"});
    require(mesh.coordinate("pp") == rank / 2 && mesh.coordinate("dp") == rank % 2, "coordinates of ", rank);
    auto dp = mesh.group("dp"), pp = mesh.group("pp");
    require(dp->world_ranks() == std::vector<int>{rank / 2 * 2, rank / 2 * 2 + 1}, "dp group of ", rank);
    require(pp->world_ranks() == std::vector<int>{rank % 2, rank % 2 + 2}, "pp group of ", rank);
    // Both dimensions at once: the row sum and the column sum.
    Tensor row = full({8}, double(rank + 1)), col = full({8}, double(rank + 1));
    dp->all_reduce(row)->wait();
    pp->all_reduce(col)->wait();
    require(all_equal(row, expected_sum(dp->world_ranks(), 0)), "row sum on ", rank);
    require(all_equal(col, expected_sum(pp->world_ranks(), 0)), "column sum on ", rank);
    if (rank == 0) {
      std::string table = mesh.table();
      require(table == "       dp=0 dp=1\n"
                       "pp=0      0    1\n"
                       "pp=1      2    3\n",
              "table:\n", table);
    }
    require(mesh.rank_at({1, 0}) == 2 && mesh.coordinates_of(3) == std::vector<int>{1, 1}, "rank_at");
    require_error([&] { mesh.group("tp"); }, {"no dimension 'tp'", "pp, dp"});
    require_error([&] { DeviceMesh(world, {3, 2}, {"pp", "dp"}); }, {"6 ranks", "world has 4"});
  });
}

TEST(Mesh, ThreeDimensionsPrintOneTablePerOuterIndex) {
  run_ranks(8, [](int rank, std::shared_ptr<ProcessGroup> world) {
    DeviceMesh mesh(world, {2, 2, 2}, {"pp", "dp", "shard"});
    require(mesh.group("shard")->world_ranks() == std::vector<int>{rank / 2 * 2, rank / 2 * 2 + 1}, "shard group");
    require(mesh.group("pp")->world_ranks() == std::vector<int>{rank % 4, rank % 4 + 4}, "pp group");
    if (rank == 0) {
      std::string table = mesh.table();
      require(table.find("pp=1:\n") != std::string::npos && table.find("dp=1         6       7") != std::string::npos,
              "table:\n", table);
    }
  });
}

// HSDP inside pipeline stages: {"replicate", "shard"} flattened into "dp" gives each rank the
// 4 ranks of its pp row in mesh order, whose coordinate is replicate * 2 + shard; a sum over
// it adds those 4 ranks alone. Dimensions that are not adjacent, and a name taken, are refused.
TEST(Mesh, FlattenedDimensionsFormTheRanksThatDifferAlongThemAlone) {
  run_ranks(8, [](int rank, std::shared_ptr<ProcessGroup> world) {
    DeviceMesh mesh(world, {2, 2, 2}, {"pp", "replicate", "shard"});
    auto dp = mesh.flatten({"replicate", "shard"}, "dp");
    const int row = rank / 4 * 4;
    require(dp->world_ranks() == std::vector<int>{row, row + 1, row + 2, row + 3}, "dp group of ", rank);
    require(mesh.group("dp") == dp && mesh.size("dp") == 4, "the flattened group by name");
    require(mesh.coordinate("dp") == mesh.coordinate("replicate") * 2 + mesh.coordinate("shard") &&
                mesh.coordinate("dp") == dp->rank(),
            "dp coordinate of ", rank);
    Tensor sum_dp = full({4}, double(rank + 1));
    dp->all_reduce(sum_dp)->wait();
    require(all_equal(sum_dp, expected_sum(dp->world_ranks(), 0)), "dp sum on ", rank);
    auto whole = mesh.flatten({"pp", "replicate", "shard"}, "all");
    require(whole->size() == 8 && whole->rank() == rank, "all three flattened");
    require_error([&] { mesh.flatten({"pp", "shard"}, "ps"); }, {"pp, shard are not adjacent"});
    require_error([&] { mesh.flatten({"replicate"}, "dp"); }, {"has a dimension 'dp' already"});
    require_error([&] { mesh.group("tp"); }, {"no dimension 'tp'", "pp, replicate, shard, dp, all"});
  });
}

TEST(BatchP2P, NeighboursSendToEachOtherAtOnce) {
  run_ranks(4, [](int rank, std::shared_ptr<ProcessGroup> world) {
    const int n = world->size(), next = (rank + 1) % n, prev = (rank + n - 1) % n;
    for (int round = 0; round < 5; ++round) {
      // Every rank sends first in program order, to both neighbours, large enough that a
      // blocking send would wait for the peer's receive.
      Tensor to_next = full({100000}, double(rank * 10 + round)), to_prev = full({3}, double(rank * 100 + round));
      Tensor from_prev = zeros({100000}), from_next = zeros({3});
      auto works = world->batch_isend_irecv({P2POp::send(to_next, next, 1), P2POp::send(to_prev, prev, 2),
                                             P2POp::recv(from_prev, prev, 1), P2POp::recv(from_next, next, 2)});
      require(works.size() == 4, "one Work per op");
      for (auto& w : works) w->wait();
      require(all_equal(from_prev, double(prev * 10 + round)), "from prev on ", rank, ": ", first(from_prev));
      require(all_equal(from_next, double(next * 100 + round)), "from next on ", rank, ": ", first(from_next));
    }
    require_error([&] { world->batch_isend_irecv({P2POp::send(zeros({1}), rank, 0)}); }, {"is this rank"});
  });
}

}  // namespace
}  // namespace loom::dist
