// Where a pipeline call's host time goes (UNIFAB_PP_TRACE): each call charges the time between
// its steps to the step just done, and the group logs the means per side and per way the call went
// when it is destroyed (NCCL_DEBUG=INFO). Calls of a few KiB are bound by this host time, so this
// is what tells a slow step (a driver query, a wait for the peer's posting) from the GPU's own.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

namespace unifab::collectives::pp {

class HostTrace {
 public:
  enum Step { kCheck, kDescribe, kRingWait, kArrive, kHandles, kStreamOps, kSteps };
  enum Way { kFirst, kSecond, kSlots, kWays };  // rendezvous posted first / second, or the slots

  explicit HostTrace(bool enabled) : enabled_(enabled) {}
  bool enabled() const { return enabled_; }

  // One call's clock, started at construction; does nothing when the trace is off.
  class Call {
   public:
    explicit Call(HostTrace& trace) : trace_(trace) {
      if (trace_.enabled_) last_ = std::chrono::steady_clock::now();
    }
    // Charges the time since the previous lap (or the start) to `step`.
    void lap(Step step) {
      if (!trace_.enabled_) return;
      const auto now = std::chrono::steady_clock::now();
      ns_[step] += static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(now - last_).count());
      last_ = now;
    }
    // The call's steps into the group's sums (side: pp::kSendSide or kRecvSide).
    void finish(int side, Way way) {
      if (!trace_.enabled_) return;
      trace_.calls_[side][way].fetch_add(1, std::memory_order_relaxed);
      for (int s = 0; s < kSteps; ++s) trace_.ns_[side][way][s].fetch_add(ns_[s], std::memory_order_relaxed);
    }

   private:
    HostTrace& trace_;
    std::chrono::steady_clock::time_point last_{};
    uint64_t ns_[kSteps] = {};
  };

  uint64_t calls(int side, Way way) const { return calls_[side][way].load(std::memory_order_relaxed); }
  // Mean microseconds per call of `step` (0 without calls).
  double meanUs(int side, Way way, Step step) const;
  // One INFO line per side and way that had calls: the mean microseconds of each step.
  void log(int rank) const;

 private:
  const bool enabled_;
  std::atomic<uint64_t> calls_[2][kWays] = {};
  std::atomic<uint64_t> ns_[2][kWays][kSteps] = {};
};

}  // namespace unifab::collectives::pp
