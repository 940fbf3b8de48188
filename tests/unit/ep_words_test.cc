// The tagged count words of the EP kernels (kernels/ep/ep_types.h): a word is its own arrival
// flag, so its packing must keep the epoch, rows and block count apart at their limits.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels/ep/ep_types.h"

namespace kep = unifab::kernels::ep;

namespace {

TEST(EpWords, BlockWordKeepsRowsBlocksAndEpochApartAtTheirLimits) {
  const int maxRows = 1 << 20;  // collectives/ep: kMaxTokensPerRank
  const uint64_t epochs[] = {1, 2, 0xffffffffULL, 0x100000001ULL};
  const int rowsCases[] = {0, 1, 4095, maxRows};
  const int blockCases[] = {1, 24, 132, kep::kMaxBlocks};
  for (uint64_t epoch : epochs) {
    for (int rows : rowsCases) {
      for (int blocks : blockCases) {
        const uint64_t word = kep::blockWord(epoch, rows, blocks);
        EXPECT_EQ(kep::blockWordRows(word), rows) << epoch << " " << rows << " " << blocks;
        EXPECT_EQ(kep::blockWordBlocks(word), blocks) << epoch << " " << rows << " " << blocks;
        EXPECT_TRUE(kep::countWordIsFrom(word, epoch));
        EXPECT_FALSE(kep::countWordIsFrom(word, epoch + 1)) << "a word of the previous call must not pass";
      }
    }
  }
}

TEST(EpWords, AZeroedWindowHoldsNoWordOfTheFirstCall) {
  // The window starts zeroed and the first dispatch has epoch 1.
  EXPECT_FALSE(kep::countWordIsFrom(0, 1));
  EXPECT_TRUE(kep::countWordIsFrom(kep::countWord(1, 0), 1));
}

TEST(EpWords, ConsecutiveDispatchesAlternateWordSetsAndSkipAZeroLowHalf) {
  // Around the wrap of the low half, where the epoch skips, and from the first call.
  for (uint64_t last : {0ULL, 1ULL, 0xfffffffdULL, 0xfffffffeULL, 0xffffffffULL, 0x1fffffffeULL, 0x1ffffffffULL}) {
    const uint64_t next = kep::nextDispatchEpoch(last);
    EXPECT_GT(next, last);
    EXPECT_NE(static_cast<uint32_t>(next), 0u) << "a zeroed word would pass as dispatch " << next;
    EXPECT_NE(kep::wordSet(next), kep::wordSet(last)) << "dispatches " << last << " and " << next << " share a word set";
  }
}

TEST(EpWords, SourceOrderStartsAtTheReceiversNextRankAndEndsWithItself) {
  // The documented rank-major order (include/unifab/unifab.h): at rank d, sources d+1, d+2, ...
  // wrapping around, d's own rows last; each position is taken by exactly one source.
  for (int nRanks : {1, 2, 3, 8, kep::kMaxRanks}) {
    for (int receiver = 0; receiver < nRanks; ++receiver) {
      std::vector<int> at(nRanks, -1);
      for (int s = 0; s < nRanks; ++s) {
        const int position = kep::sourcePosition(s, receiver, nRanks);
        ASSERT_GE(position, 0);
        ASSERT_LT(position, nRanks);
        EXPECT_EQ(at[position], -1) << "two sources at one position";
        at[position] = s;
      }
      EXPECT_EQ(at[nRanks - 1], receiver) << "own rows last";
      if (nRanks > 1) {
        EXPECT_EQ(at[0], (receiver + 1) % nRanks) << "the next rank first";
      }
      for (int a = 0; a < nRanks; ++a) {
        EXPECT_FALSE(kep::sourceBefore(receiver, a, receiver, nRanks));
        for (int b = 0; b < nRanks; ++b) {
          EXPECT_EQ(kep::sourceBefore(a, b, receiver, nRanks),
                    kep::sourcePosition(a, receiver, nRanks) < kep::sourcePosition(b, receiver, nRanks));
        }
      }
    }
  }
  // With two ranks, each rank's rows are first at its peer: they need no count of the peer's.
  EXPECT_EQ(kep::sourcePosition(1, 0, 2), 0);
  EXPECT_EQ(kep::sourcePosition(0, 1, 2), 0);
}

TEST(EpWords, ExpertOwnerMatchesDivisionForEveryExpertCount) {
  // Every split of up to kMaxExperts global experts over ranks, every expert id.
  for (int local = 1; local <= kep::kMaxExperts; ++local) {
    const unifab::kernels::FastDivisor owner = unifab::kernels::makeFastDivisor(local);
    ASSERT_TRUE(unifab::kernels::fastDivisorCovers(owner, kep::kMaxExperts - 1));
    for (int id = 0; id < kep::kMaxExperts; ++id) {
      ASSERT_EQ(unifab::kernels::quotientOf(owner, id), id / local) << "id " << id << ", " << local << " per rank";
    }
  }
}

TEST(FastDivisor, ExactUpToItsBound) {
  // Every divisor the kernels use (experts a rank up to kMaxExperts, parts a row up to 147, ranks
  // up to 64, tokens up to 1024) over every dividend below 2^16, then the last dividends the bound
  // admits.
  namespace uk = unifab::kernels;
  for (int d = 1; d <= kep::kMaxExperts + 64; ++d) {
    const uk::FastDivisor f = uk::makeFastDivisor(d);
    int wrong = 0;
    for (int n = 0; n < (1 << 16); ++n) wrong += uk::quotientOf(f, n) != n / d || n - uk::quotientOf(f, n) * d != n % d;
    const uint64_t largest = std::min<uint64_t>(d == 1 ? 0xFFFFFFFFull : 0xFFFFFFFFull / (d - 1), 0x7FFFFFFF);
    ASSERT_TRUE(uk::fastDivisorCovers(f, largest)) << d;
    for (uint64_t n = largest - 4096; n <= largest; ++n) wrong += uk::quotientOf(f, static_cast<int>(n)) != static_cast<int>(n / d);
    ASSERT_EQ(wrong, 0) << "divisor " << d;
  }
  EXPECT_FALSE(uk::fastDivisorCovers(uk::makeFastDivisor(3), 1ULL << 31));
}

}  // namespace
