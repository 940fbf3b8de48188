// unifab-bench's kernel times (tests/bench/kernel_spans.h): what an operation's span counts.
#include <gtest/gtest.h>

#include <vector>

#include "tests/bench/kernel_spans.h"

namespace {

using unifab::bench::operationSpansUs;
using unifab::bench::RecordedKernel;

TEST(KernelSpans, FirstStartToLastEndOfAnOperationsKernels) {
  std::vector<double> spans;
  // Operation 1: two kernels 1000-3000 and 3500-6000 ns on stream 7; operation 2 none.
  EXPECT_EQ(operationSpansUs({{1, 7, 1000, 3000}, {1, 7, 3500, 6000}}, 2, &spans), 1u);
  ASSERT_EQ(spans.size(), 2u);
  EXPECT_DOUBLE_EQ(spans[0], 5.0);
  EXPECT_DOUBLE_EQ(spans[1], 0.0);
}

TEST(KernelSpans, AKernelStartedDuringItsPredecessorCountsFromThePredecessorsEnd) {
  std::vector<double> spans;
  // A barrier kernel (no operation) until 2000, then a dispatch launched as a programmatic
  // dependent at 1500 that ends at 9000, then its combine, started at 4000 (during the dispatch),
  // ending at 15000. Records come in any order.
  const std::vector<RecordedKernel> kernels = {{2, 3, 4000, 15000}, {0, 3, 100, 2000}, {1, 3, 1500, 9000}};
  EXPECT_EQ(operationSpansUs(kernels, 2, &spans), 0u);
  EXPECT_DOUBLE_EQ(spans[0], 7.0);  // from the barrier's end
  EXPECT_DOUBLE_EQ(spans[1], 6.0);  // from the dispatch's end: the two never overlap
}

TEST(KernelSpans, OtherStreamsDoNotDelayAKernel) {
  std::vector<double> spans;
  EXPECT_EQ(operationSpansUs({{0, 1, 10, 50000}, {1, 2, 1000, 4000}}, 1, &spans), 0u);
  EXPECT_DOUBLE_EQ(spans[0], 3.0);
}

TEST(KernelSpans, UnfinishedRecordsAndUnknownOperationsAreLeftOut) {
  std::vector<double> spans;
  // A record handed over before its kernel finished (end 0), one whose operation is past `ids`.
  EXPECT_EQ(operationSpansUs({{1, 5, 1000, 0}, {3, 5, 2000, 9500}, {1, 5, 9000, 10000}}, 2, &spans), 1u);
  EXPECT_DOUBLE_EQ(spans[0], 0.5);  // the unknown operation's kernel still orders the stream: from 9500
  EXPECT_DOUBLE_EQ(spans[1], 0.0);
}

}  // namespace
