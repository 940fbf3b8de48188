// The low-latency trace records summed up per point (collectives/ep/ll_trace.cc): only each slot's
// newest call counts, unreached stamps are left out, and each call gives its latest and earliest.
#include "collectives/ep/ll_trace.h"

#include <gtest/gtest.h>

#include "kernels/ep/ll_kernels.h"

namespace kep = unifab::kernels::ep;
using unifab::collectives::ep::summarizeLlTrace;

namespace {

constexpr int kBlocks = 2;

void writeRecord(std::vector<uint32_t>& records, int kind, uint64_t epoch, int warp, std::vector<uint32_t> stamps) {
  uint32_t* record = records.data() + kep::llTraceRecord(kind, epoch, warp, kBlocks);
  record[0] = static_cast<uint32_t>(epoch);
  for (size_t i = 0; i < stamps.size(); ++i) record[1 + i] = stamps[i];
}

const unifab::collectives::ep::LlTracePointSummary* find(const std::vector<unifab::collectives::ep::LlTracePointSummary>& all,
                                                         int point) {
  for (const auto& p : all) {
    if (p.point == point) return &p;
  }
  return nullptr;
}

}  // namespace

TEST(LlTrace, NewestCallOfEachSlotCountsAndUnreachedStampsAreLeftOut) {
  std::vector<uint32_t> records(kep::llTraceWords(kBlocks), 0);
  // Slot 5 holds call 69; warp 9 still has call 5's record there (its grid was larger then).
  writeRecord(records, kep::llTraceKind(0, false), 69, 0, {100, 0, 300});
  writeRecord(records, kep::llTraceKind(0, false), 69, 1, {200, 50});
  writeRecord(records, kep::llTraceKind(0, false), 5, 9, {9999, 9999, 9999});
  // Call 70 in slot 6.
  writeRecord(records, kep::llTraceKind(0, false), 70, 3, {400});
  // Call 70's receive-only kernel, apart from its send-only one: a kernel of its own.
  writeRecord(records, kep::llTraceKind(0, true), 70, 3, {600});
  // A combine call: its first point only.
  writeRecord(records, kep::llTraceKind(1, false), 2, 31, {700});
  const auto all = summarizeLlTrace(records, kBlocks);

  const auto* started = find(all, kep::kTraceLlDispatchStarted);
  ASSERT_NE(started, nullptr);
  EXPECT_EQ(started->count, 4u) << "call 5's stale record is not call 69's";
  EXPECT_DOUBLE_EQ(started->meanNs, (100.0 + 200.0 + 400.0 + 600.0) / 4);
  ASSERT_EQ(started->latestNs.size(), 3u) << "the receive-only kernel is a kernel of its own";
  EXPECT_EQ(started->latestNs[0], 200u);
  EXPECT_EQ(started->earliestNs[0], 100u);
  EXPECT_EQ(started->latestNs[1], 400u);
  EXPECT_EQ(started->earliestNs[1], 400u);
  EXPECT_EQ(started->latestNs[2], 600u);

  const auto* second = find(all, kep::kTraceLlDispatchStarted + 1);
  ASSERT_NE(second, nullptr);
  EXPECT_EQ(second->count, 1u) << "a stamp of 0 was not reached";
  EXPECT_DOUBLE_EQ(second->meanNs, 50.0);

  const auto* third = find(all, kep::kTraceLlDispatchStarted + 2);
  ASSERT_NE(third, nullptr);
  EXPECT_EQ(third->count, 1u);
  EXPECT_EQ(find(all, kep::kTraceLlDispatchStarted + 3), nullptr) << "a point no record reached is left out";

  const auto* combine = find(all, kep::kTraceLlCombineStarted);
  ASSERT_NE(combine, nullptr);
  EXPECT_EQ(combine->count, 1u);
  EXPECT_DOUBLE_EQ(combine->meanNs, 700.0);
}

TEST(LlTrace, ShortBufferGivesNothing) {
  std::vector<uint32_t> records(16, 1);
  EXPECT_TRUE(summarizeLlTrace(records, kBlocks).empty());
  EXPECT_TRUE(summarizeLlTrace(records, 0).empty());
}
