// The verdicts of creation's agreement step on every rank, with NCCL's all-reduce of maxima
// simulated: every rank must get the same answer, naming what the ranks disagree on.
#include "collectives/common/agreement.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "plugin/check.h"
#include "tests/unit/log_capture.h"

using unifab::collectives::agreementVerdict;
using unifab::collectives::agreementWords;

namespace {

const char* const kNames[] = {"hidden", "topk"};

struct Rank {
  bool valid;
  std::vector<int64_t> values;
};

// Each rank's verdict after the element-wise maximum of every rank's words.
std::vector<unifab::Result> verdicts(const std::vector<Rank>& ranks) {
  std::vector<int64_t> maxima;
  for (const Rank& rank : ranks) {
    std::vector<int64_t> words = agreementWords(rank.valid, rank.values.data(), rank.values.size());
    if (maxima.empty()) maxima = words;
    for (size_t i = 0; i < words.size(); ++i) maxima[i] = std::max(maxima[i], words[i]);
  }
  std::vector<unifab::Result> results;
  for (const Rank& rank : ranks) {
    results.push_back(
        agreementVerdict("test", rank.valid, rank.values.data(), kNames, rank.values.size(), maxima));
  }
  return results;
}

TEST(Agreement, AlikeAndValidRanksGoOn) {
  for (unifab::Result r : verdicts({{true, {7168, 8}}, {true, {7168, 8}}, {true, {7168, 8}}})) {
    EXPECT_EQ(r, unifabSuccess);
  }
  // Extreme values compare exactly (the complements do not overflow at INT64_MIN).
  for (unifab::Result r : verdicts({{true, {INT64_MIN, INT64_MAX}}, {true, {INT64_MIN, INT64_MAX}}})) {
    EXPECT_EQ(r, unifabSuccess);
  }
}

TEST(Agreement, EveryRankNamesTheFirstValueTheyDisagreeOnWithItsRange) {
  unifab::test::LogCapture log;
  std::vector<unifab::Result> results = verdicts({{true, {7168, 8}}, {true, {4096, 8}}, {true, {7168, 6}}});
  for (unifab::Result r : results) EXPECT_EQ(r, unifabInvalidUsage);
  EXPECT_TRUE(log.warned("the ranks disagree on hidden (this rank 4096; across ranks 4096..7168)"));
  EXPECT_FALSE(log.warned("disagree on topk")) << "the first field decides";
  std::vector<unifab::Result> extremes = verdicts({{true, {INT64_MIN, 1}}, {true, {INT64_MAX, 1}}});
  for (unifab::Result r : extremes) EXPECT_EQ(r, unifabInvalidUsage);
}

TEST(Agreement, ARankThatRefusedAloneTakesEveryRankWithIt) {
  unifab::test::LogCapture log;
  std::vector<unifab::Result> results = verdicts({{true, {7168, 8}}, {false, {7168, 8}}, {true, {7168, 8}}});
  EXPECT_EQ(results[1], unifabInvalidArgument) << "the refusing rank returns its own error";
  EXPECT_EQ(results[0], unifabInvalidUsage);
  EXPECT_EQ(results[2], unifabInvalidUsage);
  EXPECT_TRUE(log.warned("another rank refused its arguments"));
  // A refusal wins over a disagreement: the refusing rank's values may be anything.
  std::vector<unifab::Result> mixed = verdicts({{true, {7168, 8}}, {false, {-1, -1}}});
  EXPECT_EQ(mixed[0], unifabInvalidUsage);
  EXPECT_EQ(mixed[1], unifabInvalidArgument);
}

TEST(Agreement, NoValuesJustTheFlag) {
  std::vector<unifab::Result> ok = verdicts({{true, {}}, {true, {}}});
  EXPECT_EQ(ok[0], unifabSuccess);
  EXPECT_EQ(ok[1], unifabSuccess);
  std::vector<unifab::Result> refused = verdicts({{true, {}}, {false, {}}});
  EXPECT_EQ(refused[0], unifabInvalidUsage);
  EXPECT_EQ(refused[1], unifabInvalidArgument);
}

}  // namespace
