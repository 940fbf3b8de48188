// Engram's copy-engine plan: adjacent ids on one rank merge into one copy, a repeat or a jump or a
// change of rank starts a new one, every output row is covered once, and ids outside the peers'
// rows are reported with their index.
#include <gtest/gtest.h>

#include "collectives/engram/engram_plan.h"

namespace {

using unifab::collectives::engram::planRuns;
using unifab::collectives::engram::RowRun;

TEST(EngramPlan, AdjacentIdsMergeAndEveryRowIsCoveredOnce) {
  // 2 peers from rank 0, 100 rows each: ids 5,6,7 | 7 (repeat) | 99 | 100,101 (next rank) | 3
  const std::vector<int64_t> ids = {5, 6, 7, 7, 99, 100, 101, 3};
  std::vector<RowRun> runs;
  size_t bad = 0;
  ASSERT_TRUE(planRuns(ids, 0, 2, 100, &runs, &bad));
  ASSERT_EQ(runs.size(), 5u);
  EXPECT_EQ(runs[0].peer, 0);
  EXPECT_EQ(runs[0].firstRow, 5);
  EXPECT_EQ(runs[0].rows, 3);
  EXPECT_EQ(runs[1].firstRow, 7);   // a repeat is its own copy
  EXPECT_EQ(runs[2].firstRow, 99);  // row 99 and row 100 are on different ranks
  EXPECT_EQ(runs[3].peer, 1);
  EXPECT_EQ(runs[3].firstRow, 0);
  EXPECT_EQ(runs[3].rows, 2);
  EXPECT_EQ(runs[4].firstOut, 7u);
  size_t covered = 0;
  for (const RowRun& r : runs) {
    EXPECT_EQ(r.firstOut, covered);
    covered += static_cast<size_t>(r.rows);
  }
  EXPECT_EQ(covered, ids.size());
}

TEST(EngramPlan, IdsOutsideThePeersAreReported) {
  std::vector<RowRun> runs;
  size_t bad = 0;
  // Peers are ranks 2 and 3 (rows 200..399): 199 and 400 are not theirs.
  EXPECT_FALSE(planRuns({250, 199}, 2, 2, 100, &runs, &bad));
  EXPECT_EQ(bad, 1u);
  EXPECT_FALSE(planRuns({400}, 2, 2, 100, &runs, &bad));
  EXPECT_EQ(bad, 0u);
  EXPECT_FALSE(planRuns({-1}, 0, 1, 100, &runs, &bad));
  EXPECT_TRUE(planRuns({}, 0, 1, 100, &runs, &bad));
  EXPECT_TRUE(runs.empty());
}

}  // namespace
