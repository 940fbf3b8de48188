// UNIFAB_PP_TRACE's sums: each lap charges the time since the previous one to its step, calls
// are counted per side and way, and a trace that is off records nothing.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "collectives/pp/host_trace.h"
#include "collectives/pp/rendezvous_protocol.h"

namespace pp = unifab::collectives::pp;
using Trace = pp::HostTrace;

TEST(PpHostTrace, LapsChargeTheTimeSinceThePreviousLap) {
  Trace trace(true);
  for (int call = 0; call < 2; ++call) {
    Trace::Call clock(trace);
    clock.lap(Trace::kCheck);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    clock.lap(Trace::kArrive);
    clock.lap(Trace::kStreamOps);
    clock.finish(pp::kSendSide, Trace::kSecond);
  }
  EXPECT_EQ(trace.calls(pp::kSendSide, Trace::kSecond), 2u);
  EXPECT_EQ(trace.calls(pp::kSendSide, Trace::kFirst), 0u);
  EXPECT_EQ(trace.calls(pp::kRecvSide, Trace::kSecond), 0u);
  // The sleep lands in the step lapped after it, and only there.
  EXPECT_GE(trace.meanUs(pp::kSendSide, Trace::kSecond, Trace::kArrive), 20000.0);
  EXPECT_LT(trace.meanUs(pp::kSendSide, Trace::kSecond, Trace::kCheck), 20000.0);
  EXPECT_LT(trace.meanUs(pp::kSendSide, Trace::kSecond, Trace::kStreamOps), 20000.0);
  EXPECT_EQ(trace.meanUs(pp::kSendSide, Trace::kSecond, Trace::kDescribe), 0.0) << "a step never lapped";
  EXPECT_EQ(trace.meanUs(pp::kRecvSide, Trace::kSlots, Trace::kArrive), 0.0) << "no calls";
}

TEST(PpHostTrace, OffRecordsNothing) {
  Trace trace(false);
  Trace::Call clock(trace);
  std::this_thread::sleep_for(std::chrono::milliseconds(2));
  clock.lap(Trace::kArrive);
  clock.finish(pp::kRecvSide, Trace::kSlots);
  EXPECT_EQ(trace.calls(pp::kRecvSide, Trace::kSlots), 0u);
  EXPECT_EQ(trace.meanUs(pp::kRecvSide, Trace::kSlots, Trace::kArrive), 0.0);
}
