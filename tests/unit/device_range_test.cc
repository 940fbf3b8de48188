// The range arithmetic behind the argument checks: CheckedRanges passes a call without asking the
// driver only when its whole range lies inside an allocation that passed, whatever its size (a
// size that would wrap the address space must not slip through), and the overlap test that keeps
// a caller's buffers out of a window.
#include <gtest/gtest.h>

#include <cstdint>

#include "collectives/common/device_range.h"

namespace {

using unifab::collectives::overlaps;
using unifab::collectives::rangeInside;

TEST(DeviceRange, InsideNeedsTheWholeRangeWithinTheAllocation) {
  const uintptr_t begin = 0x10000, end = 0x11000;  // 4 KiB
  EXPECT_TRUE(rangeInside(begin, 4096, begin, end)) << "the allocation itself";
  EXPECT_TRUE(rangeInside(begin + 4080, 16, begin, end)) << "up to the last byte";
  EXPECT_FALSE(rangeInside(begin + 4080, 32, begin, end)) << "past the end: asked of the driver again";
  EXPECT_FALSE(rangeInside(begin - 16, 16, begin, end)) << "before the start";
  EXPECT_FALSE(rangeInside(end, 1, begin, end)) << "one past the end";
  EXPECT_FALSE(rangeInside(begin + 16, SIZE_MAX, begin, end)) << "a size that would wrap";
  EXPECT_FALSE(rangeInside(begin + 16, SIZE_MAX - 15, begin, end)) << "a size that wraps to the start";
  EXPECT_FALSE(rangeInside(begin, 1, begin, begin)) << "an empty range holds nothing";
}

TEST(DeviceRange, OverlapsMeansSharingAByte) {
  const char* begin = reinterpret_cast<const char*>(0x20000);
  const char* end = begin + 256;
  EXPECT_TRUE(overlaps(begin + 255, 1, begin, end));
  EXPECT_TRUE(overlaps(begin - 1, 2, begin, end));
  EXPECT_FALSE(overlaps(end, 16, begin, end)) << "touching the end";
  EXPECT_FALSE(overlaps(begin - 16, 16, begin, end)) << "touching the start";
  EXPECT_FALSE(overlaps(begin, 0, begin, end)) << "no bytes";
  EXPECT_FALSE(overlaps(nullptr, 16, begin, end)) << "no pointer";
}

}  // namespace
