// The Hopper attention kernels' grid layout (kernels/core/head_groups.h): every (head, index)
// block exactly once for any group size, groups of heads with the index slowest inside them,
// and balanced group sizes.
#include <gtest/gtest.h>

#include <set>
#include <utility>

#include "kernels/core/head_groups.h"

using loom::head_groups::balanced;
using loom::head_groups::place;

TEST(HeadGroups, EveryBlockOnceForAnyGroupSize) {
  for (unsigned heads : {1u, 2u, 3u, 5u, 12u, 17u, 192u, 2560u})
    for (unsigned per_head : {1u, 2u, 3u, 8u, 16u, 17u})
      for (unsigned group = 1; group <= heads; group = group < 8 ? group + 1 : group * 3) {
        std::set<std::pair<unsigned, unsigned>> seen;
        for (unsigned b = 0; b < heads * per_head; ++b) {
          const auto at = place(b, heads, per_head, group);
          ASSERT_LT(at.head, heads) << heads << " heads, " << per_head << " per head, groups of " << group;
          ASSERT_LT(at.index, per_head) << heads << " heads, " << per_head << " per head, groups of " << group;
          seen.insert({at.head, at.index});
        }
        EXPECT_EQ(seen.size(), size_t(heads) * per_head)
            << heads << " heads, " << per_head << " per head, groups of " << group;
      }
}

TEST(HeadGroups, IndexSlowestInsideAGroup) {
  // 10 heads in groups of 4 (the last of 2), 3 blocks a head.
  const unsigned expect[][2] = {{0, 0}, {1, 0}, {2, 0}, {3, 0}, {0, 1}, {1, 1}, {2, 1}, {3, 1}, {0, 2}, {1, 2},
                                {2, 2}, {3, 2}, {4, 0}, {5, 0}, {6, 0}, {7, 0}, {4, 1}, {5, 1}, {6, 1}, {7, 1},
                                {4, 2}, {5, 2}, {6, 2}, {7, 2}, {8, 0}, {9, 0}, {8, 1}, {9, 1}, {8, 2}, {9, 2}};
  for (unsigned b = 0; b < 30; ++b) {
    const auto at = place(b, 10, 3, 4);
    EXPECT_EQ(at.head, expect[b][0]) << "block " << b;
    EXPECT_EQ(at.index, expect[b][1]) << "block " << b;
  }
  // One group of every head: the heads fastest; groups of one head: a head's blocks together.
  EXPECT_EQ(place(13, 12, 4, 12).head, 1u);
  EXPECT_EQ(place(13, 12, 4, 12).index, 1u);
  EXPECT_EQ(place(13, 12, 4, 1).head, 3u);
  EXPECT_EQ(place(13, 12, 4, 1).index, 1u);
}

TEST(HeadGroups, BalancedGroups) {
  EXPECT_EQ(balanced(128, 24), 22);  // 6 groups: 22 x 5 and 18, not 24 x 5 and 8
  EXPECT_EQ(balanced(192, 33), 32);
  EXPECT_EQ(balanced(128, 16), 16);
  EXPECT_EQ(balanced(1, 5), 1);
  EXPECT_EQ(balanced(12, 0), 1);
  EXPECT_EQ(balanced(12, 100), 12);
  for (int64_t heads = 1; heads <= 300; ++heads)
    for (int64_t wanted = 1; wanted <= heads; ++wanted) {
      const int64_t g = balanced(heads, wanted), groups = (heads + wanted - 1) / wanted;
      ASSERT_LE(g, wanted) << heads << " heads, " << wanted << " wanted";
      ASSERT_EQ((heads + g - 1) / g, groups) << heads << " heads, " << wanted << " wanted";
      ASSERT_GT(heads - (groups - 1) * g, g - groups) << heads << " heads, " << wanted << " wanted";
    }
}
