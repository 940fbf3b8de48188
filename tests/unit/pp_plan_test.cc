// Pipeline send/recv chunking: every byte once, in order, sequences continuing across transfers,
// slots in rotation, and a slot reused only after the chunk that last used it was released.
#include <gtest/gtest.h>

#include "collectives/pp/pp_plan.h"

namespace {

using unifab::collectives::pp::Chunk;
using unifab::collectives::pp::chunkCount;
using unifab::collectives::pp::kMaxChunksPerCall;
using unifab::collectives::pp::planChunks;

TEST(PpPlan, CoversEveryByteOnceInOrder) {
  for (size_t bytes : {size_t{0}, size_t{1}, size_t{4095}, size_t{4096}, size_t{4097}, size_t{3} << 20}) {
    const auto chunks = planChunks(bytes, 4096, 4, 0);
    size_t next = 0;
    for (const Chunk& c : chunks) {
      EXPECT_EQ(c.offset, next);
      EXPECT_GT(c.bytes, 0u);
      EXPECT_LE(c.bytes, 4096u);
      next += c.bytes;
    }
    EXPECT_EQ(next, bytes);
    EXPECT_EQ(chunks.size(), (bytes + 4095) / 4096);
  }
}

TEST(PpPlan, SequencesContinueAndSlotsRotate) {
  const auto first = planChunks(10 * 100, 100, 4, 0);
  const auto second = planChunks(3 * 100, 100, 4, first.size());
  ASSERT_EQ(first.size(), 10u);
  EXPECT_EQ(second.front().sequence, 11u);
  std::vector<Chunk> all(first);
  all.insert(all.end(), second.begin(), second.end());
  for (size_t i = 0; i < all.size(); ++i) {
    EXPECT_EQ(all[i].sequence, i + 1);
    EXPECT_EQ(all[i].slot, static_cast<int>(i % 4));
    // A slot's previous user is the chunk 4 earlier: that one must be released first.
    EXPECT_EQ(all[i].reuseAfter, i + 1 > 4 ? i + 1 - 4 : 0u);
    if (i >= 4) {
      EXPECT_EQ(all[i - 4].slot, all[i].slot);
    }
  }
}

TEST(PpPlan, ChunkCountMatchesThePlan) {
  for (size_t bytes : {size_t{0}, size_t{1}, size_t{99}, size_t{100}, size_t{101}, size_t{12800}, size_t{12801}}) {
    EXPECT_EQ(chunkCount(bytes, 100), planChunks(bytes, 100, 4, 0).size()) << bytes;
  }
  // The default group (8 MiB slots) takes 1 GiB in one call and no more.
  EXPECT_EQ(chunkCount(size_t{1} << 30, size_t{8} << 20), kMaxChunksPerCall);
  EXPECT_GT(chunkCount((size_t{1} << 30) + 1, size_t{8} << 20), kMaxChunksPerCall);
  // Near SIZE_MAX the count must not wrap to a small number that passes the per-call bound.
  EXPECT_EQ(chunkCount(SIZE_MAX, size_t{8} << 20), SIZE_MAX / (size_t{8} << 20) + 1);
  EXPECT_GT(chunkCount(SIZE_MAX - 5, 100), kMaxChunksPerCall);
}

TEST(PpPlan, LastChunkNearTheTopOfTheSizeRangeEndsThePlan) {
  // A plan that ends within one slot of SIZE_MAX: the offsets must not wrap back to 0.
  const size_t slot = size_t{1} << 62;
  const auto chunks = planChunks(SIZE_MAX, slot, 4, 0);
  ASSERT_EQ(chunks.size(), 4u);
  EXPECT_EQ(chunks.back().offset, 3 * slot);
  EXPECT_EQ(chunks.back().bytes, SIZE_MAX - 3 * slot);
}

}  // namespace
