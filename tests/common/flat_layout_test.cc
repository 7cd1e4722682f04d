#include "common/flat_layout.h"

#include "gtest/gtest.h"

namespace lathe {
namespace {

TEST(FlatLayoutTest, RanksOwnContiguousPaddedSlices) {
  EXPECT_EQ(ShardNumel(10, 3), 4);
  EXPECT_EQ(ShardNumel(12, 3), 4);
  EXPECT_EQ(ShardNumel(0, 2), 0);
  FlatRange r0 = OwnedRange(10, 0, 3), r2 = OwnedRange(10, 2, 3);
  EXPECT_EQ(r0.begin, 0);
  EXPECT_EQ(r0.end, 4);
  EXPECT_EQ(r2.begin, 8);
  EXPECT_EQ(r2.end, 10);                     // two elements and two of padding
  EXPECT_EQ(OwnedRange(2, 3, 4).size(), 0);  // all padding
  EXPECT_EQ(Intersect({0, 5}, {3, 9}).size(), 2);
  EXPECT_EQ(Intersect({0, 3}, {5, 9}).size(), 0);
  FlatLayout layout;
  layout.Add("a", {2, 3}, true);
  layout.Add("b", {5}, false);
  EXPECT_EQ(layout.numel, 11);
  EXPECT_EQ(layout.entries[1].offset, 6);
  EXPECT_FALSE(layout.entries[1].weight_decay);
}

}  // namespace
}  // namespace lathe
