// Samplers: orders, permutations that change with the epoch, and distributed shards that are
// disjoint, cover the dataset and have equal lengths for every world size.
#include <algorithm>
#include <map>
#include <numeric>

#include "data/sampler.h"
#include "tests/data/fixtures.h"

namespace loom::data {
namespace {

std::vector<int64_t> sorted(std::vector<int64_t> v) {
  std::sort(v.begin(), v.end());
  return v;
}

std::vector<int64_t> range(int64_t n) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), int64_t{0});
  return v;
}

TEST(SequentialSampler, GivesTheDatasetInOrderEveryEpoch) {
  const SequentialSampler s(5);
  EXPECT_EQ(s.size(), 5);
  EXPECT_EQ(s.indices(0), range(5));
  EXPECT_EQ(s.indices(7), range(5));
  EXPECT_TRUE(SequentialSampler(0).indices(0).empty());
}

TEST(RandomSampler, IsAPermutationThatChangesWithTheEpoch) {
  const RandomSampler s(100, 1234);
  EXPECT_EQ(s.size(), 100);
  const std::vector<int64_t> e0 = s.indices(0), e1 = s.indices(1);
  EXPECT_EQ(sorted(e0), range(100));
  EXPECT_EQ(sorted(e1), range(100));
  EXPECT_NE(e0, range(100));
  EXPECT_NE(e0, e1);
  EXPECT_EQ(e0, s.indices(0));                       // same seed and epoch: same order
  EXPECT_EQ(e1, RandomSampler(100, 1234).indices(1));  // from a fresh sampler too
  EXPECT_NE(e0, RandomSampler(100, 1235).indices(0));  // another seed: another order
  EXPECT_EQ(RandomSampler(1, 0).indices(3), range(1));
}

TEST(RandomSampler, EveryPositionTakesManyValuesOverEpochs) {
  const RandomSampler s(10, 9);
  std::map<int64_t, int> first;
  for (int64_t e = 0; e < 200; ++e) first[s.indices(e)[0]]++;
  EXPECT_EQ(first.size(), 10u);
}

struct DistCase {
  int64_t n;
  int world;
};

// Dataset sizes divisible and not, smaller than the world, for world sizes 1 to 4.
std::vector<DistCase> dist_cases() {
  std::vector<DistCase> cases;
  for (int world = 1; world <= 4; ++world)
    for (int64_t n : {1, 2, 3, 5, 8, 10, 11, 13, 24})
      cases.push_back({n, world});
  return cases;
}

TEST(DistributedSampler, ShardsHaveEqualLengthsAndCoverTheDataset) {
  for (const DistCase& c : dist_cases()) {
    for (Shuffle shuffle : {Shuffle::no, Shuffle::yes}) {
      SCOPED_TRACE(testing::Message() << "n " << c.n << ", world " << c.world << ", shuffle " << bool(shuffle));
      const int64_t per_rank = (c.n + c.world - 1) / c.world;
      std::vector<int64_t> all;
      for (int rank = 0; rank < c.world; ++rank) {
        const DistributedSampler s(c.n, rank, c.world, shuffle, 7, DropLast::no);
        const std::vector<int64_t> mine = s.indices(2);
        EXPECT_EQ(s.size(), per_rank);
        EXPECT_EQ(int64_t(mine.size()), per_rank);
        all.insert(all.end(), mine.begin(), mine.end());
      }
      // Every index at least once, and the entries beyond the n distinct ones are the padding.
      std::map<int64_t, int> count;
      for (int64_t i : all) count[i]++;
      EXPECT_EQ(int64_t(count.size()), c.n);
      EXPECT_EQ(count.begin()->first, 0);
      EXPECT_EQ(count.rbegin()->first, c.n - 1);
      const int64_t padding = per_rank * c.world - c.n;
      int64_t repeats = 0;
      for (auto [index, k] : count) repeats += k - 1;
      EXPECT_EQ(repeats, padding);
      if (c.n % c.world == 0) {
        EXPECT_EQ(sorted(all), range(c.n));  // no padding: a partition
      }
    }
  }
}

TEST(DistributedSampler, DropLastGivesDisjointShardsOfEqualLength) {
  for (const DistCase& c : dist_cases()) {
    for (Shuffle shuffle : {Shuffle::no, Shuffle::yes}) {
      SCOPED_TRACE(testing::Message() << "n " << c.n << ", world " << c.world << ", shuffle " << bool(shuffle));
      std::vector<int64_t> all;
      for (int rank = 0; rank < c.world; ++rank) {
        const DistributedSampler s(c.n, rank, c.world, shuffle, 7, DropLast::yes);
        const std::vector<int64_t> mine = s.indices(5);
        EXPECT_EQ(int64_t(mine.size()), c.n / c.world);
        EXPECT_EQ(s.size(), c.n / c.world);
        all.insert(all.end(), mine.begin(), mine.end());
      }
      const std::vector<int64_t> s = sorted(all);
      EXPECT_EQ(std::adjacent_find(s.begin(), s.end()), s.end());  // no index twice
      EXPECT_EQ(int64_t(s.size()), c.n / c.world * c.world);
      for (int64_t i : s) EXPECT_TRUE(i >= 0 && i < c.n);
    }
  }
}

TEST(DistributedSampler, WithoutShuffleRanksTakeInterleavedPositions) {
  EXPECT_EQ(DistributedSampler(10, 0, 3, Shuffle::no).indices(0), (std::vector<int64_t>{0, 3, 6, 9}));
  EXPECT_EQ(DistributedSampler(10, 1, 3, Shuffle::no).indices(0), (std::vector<int64_t>{1, 4, 7, 0}));
  EXPECT_EQ(DistributedSampler(10, 2, 3, Shuffle::no).indices(0), (std::vector<int64_t>{2, 5, 8, 1}));
  EXPECT_EQ(DistributedSampler(10, 2, 3, Shuffle::no, 0, DropLast::yes).indices(0), (std::vector<int64_t>{2, 5, 8}));
  // More padding than data: the order wraps round again, as PyTorch's does.
  EXPECT_EQ(DistributedSampler(2, 3, 4, Shuffle::no).indices(0), (std::vector<int64_t>{1}));
}

TEST(DistributedSampler, OrderIsFixedBySeedAndEpoch) {
  const DistributedSampler a(50, 1, 3, Shuffle::yes, 11);
  const DistributedSampler b(50, 1, 3, Shuffle::yes, 11);
  EXPECT_EQ(a.indices(4), b.indices(4));
  EXPECT_NE(a.indices(4), a.indices(5));
  EXPECT_NE(a.indices(4), DistributedSampler(50, 1, 3, Shuffle::yes, 12).indices(4));
  // Every rank cuts its shard from the same permutation: RandomSampler's.
  const std::vector<int64_t> perm = random_permutation(50, 11, 4);
  const std::vector<int64_t> mine = a.indices(4);
  for (size_t k = 0; k < mine.size(); ++k) EXPECT_EQ(mine[k], perm[(k * 3 + 1) % 50]);
  EXPECT_EQ(RandomSampler(50, 11).indices(4), perm);
}

TEST(DistributedSampler, RejectsABadRankOrWorld) {
  EXPECT_LOOM_ERROR(DistributedSampler(10, 3, 3), "rank 3 is out of range for world_size 3");
  EXPECT_LOOM_ERROR(DistributedSampler(10, -1, 3), "rank -1");
  EXPECT_LOOM_ERROR(DistributedSampler(10, 0, 0), "world_size must be >= 1");
  EXPECT_LOOM_ERROR(RandomSampler(-1, 0), "dataset size must be >= 0");
}

}  // namespace
}  // namespace loom::data
