// How unifab-bench ep times an operation: CUDA events around one call after an L2 flush and a
// barrier (every rank starts together), the median and 99th percentile over the iterations, the
// time per call of calls issued back to back (median of kBackToBackRuns runs of backToBackCalls()
// calls), and the host time inside one call; each reduced to the slowest rank. With
// Timer::kernelsOnly, timeOp instead records the operation's kernels with CUPTI (KernelTimer) over
// the same flushed, aligned iterations: their GPU time alone, as profiler-based benchmarks report
// it. CUPTI, once on, slows every later launch on the host, so a benchmark runs all its
// event-timed measurements first and the kernel passes after them.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <functional>
#include <vector>

#include "tests/bench/bench_common.h"
#include "tests/bench/kernel_timer.h"
#include "tests/common/nccl_session.h"
#include "tests/common/test_util.h"

namespace unifab::bench {

struct Timer {
  cudaEvent_t start = nullptr, stop = nullptr;
  void* flush = nullptr;
  size_t flushBytes = size_t{256} << 20;
  bool kernelsOnly = false;  // time the operation's kernels alone (where CUPTI is available), nothing else
};

struct OpTimes {
  double us = 0, p99Us = 0, backToBackUs = 0, hostUs = 0;
  double kernelUs = 0, kernelP99Us = 0;  // 0: not measured
  double ownUs = 0;  // this rank's median before the reduction (us is the slowest rank's)
};

// Starts recording on every rank or on none (the passes have barriers): false when a collective
// fails; *started false where any rank's CUPTI refused, which leaves the measure out.
inline bool beginOnAllRanks(test::NcclSession& session, KernelTimer& kernels, bool* started) {
  const bool began = KernelTimer::available() && kernels.begin();
  double refused = began ? 0.0 : 1.0;
  if (!session.maxOverRanks(&refused)) return false;
  *started = refused == 0;
  if (!*started && began) {
    std::vector<double> unused;
    kernels.end(0, &unused);
  }
  return true;
}

// Stops recording and gives the spans of ids 1..ids: *complete false where any rank recorded no
// kernel for some call, which leaves the measure out everywhere.
inline bool endOnAllRanks(test::NcclSession& session, KernelTimer& kernels, uint64_t ids, std::vector<double>* spans,
                          bool* complete) {
  const bool recorded = kernels.end(ids, spans) && std::find(spans->begin(), spans->end(), 0.0) == spans->end();
  double missing = recorded ? 0.0 : 1.0;
  if (!session.maxOverRanks(&missing)) return false;
  *complete = missing == 0;
  return true;
}

// The kernel-time pass of timeOp: a few untimed calls (CUPTI's first records cost), then the same
// flushed, aligned iterations as the event pass, each call's kernels tagged with its iteration.
// Every rank takes part or none does (the pass has barriers).
template <typename Setup, typename Op, typename Teardown>
bool timeKernels(test::NcclSession& session, Timer& timer, int iters, Setup setup, Op op, Teardown teardown,
                 OpTimes* times) {
  KernelTimer kernels;
  bool started = false;
  if (!beginOnAllRanks(session, kernels, &started)) return false;
  if (!started) return true;
  constexpr int kUntimed = 3;
  for (int i = -kUntimed; i < iters; ++i) {
    if (!setup()) return false;
    TEST_CUDA_CHECK(cudaMemsetAsync(timer.flush, i & 0xff, timer.flushBytes, session.stream()));
    if (!session.barrier(false)) return false;
    if (i >= 0) kernels.enter(static_cast<uint64_t>(i) + 1);
    const bool ran = op();
    if (i >= 0) kernels.leave();
    if (!ran || !teardown()) return false;
    TEST_CUDA_CHECK(cudaStreamSynchronize(session.stream()));
  }
  std::vector<double> spans;
  bool complete = false;
  if (!endOnAllRanks(session, kernels, static_cast<uint64_t>(iters), &spans, &complete)) return false;
  if (complete) {
    times->kernelUs = median(spans);
    times->kernelP99Us = percentile(spans, 0.99);
  }
  return true;
}

// Kernel times of a sequence of operations (e.g. dispatch then combine) run `iters` times back
// to back with no flush and no barrier between them, as DeepEP's bench_kineto takes its
// low-latency numbers (its test function run 30 times in a row after one barrier; the profiler's
// mean per kernel). For each op: mean (what DeepEP prints) and median of its kernel spans, the
// slowest rank's; `sumMeanUs` is the sum of the ops' means. Every rank takes part or none does.
struct BackToBackKernelTimes {
  std::vector<double> meanUs, medianUs;
  double sumMeanUs = 0;
  bool measured = false;
};

template <typename Teardown>
bool timeKernelsBackToBack(test::NcclSession& session, int iters, const std::vector<std::function<bool()>>& ops,
                           Teardown teardown, BackToBackKernelTimes* times) {
  *times = BackToBackKernelTimes{};
  KernelTimer kernels;
  bool started = false;
  if (!beginOnAllRanks(session, kernels, &started)) return false;
  if (!started) return true;
  constexpr int kUntimed = 3;
  const size_t nOps = ops.size();
  if (!session.barrier(true)) return false;
  for (int i = -kUntimed; i < iters; ++i) {
    for (size_t k = 0; k < nOps; ++k) {
      if (i >= 0) kernels.enter(static_cast<uint64_t>(i) * nOps + k + 1);
      const bool ran = ops[k]();
      if (i >= 0) kernels.leave();
      if (!ran) return false;
    }
    if (!teardown()) return false;
  }
  TEST_CUDA_CHECK(cudaStreamSynchronize(session.stream()));
  std::vector<double> spans;
  bool complete = false;
  if (!endOnAllRanks(session, kernels, static_cast<uint64_t>(iters) * nOps, &spans, &complete)) return false;
  if (!complete) return true;
  times->meanUs.assign(nOps, 0.0);
  times->medianUs.assign(nOps, 0.0);
  for (size_t k = 0; k < nOps; ++k) {
    std::vector<double> own;
    for (int i = 0; i < iters; ++i) own.push_back(spans[static_cast<size_t>(i) * nOps + k]);
    double sum = 0;
    for (double v : own) sum += v;
    times->meanUs[k] = sum / iters;
    times->medianUs[k] = median(own);
    if (!session.maxOverRanks(&times->meanUs[k]) || !session.maxOverRanks(&times->medianUs[k])) return false;
    times->sumMeanUs += times->meanUs[k];
  }
  times->measured = true;
  return true;
}

// Calls per back-to-back run: by default as many as nccl-tests' default -n, so that whatever a
// run pays once (its first call, which waits for the other rank's; the event's start) weighs as
// it does there (with 10, PP's ~20 us calls read 2-4 us above nccl-tests' in the same device
// call, 2026-11-30). `--b2b N` (parseBackToBack) sets it for a comparison with nccl-tests' -n N.
constexpr int kBackToBackRuns = 5;

// The event pass of timeOp: median and p99 of CUDA events around each flushed, aligned call, the
// host time inside the call, and (backToBack) the time per call of calls in a row.
template <typename Setup, typename Op, typename Teardown>
bool timeEvents(test::NcclSession& session, Timer& timer, int iters, Setup setup, Op op, Teardown teardown,
                bool backToBack, OpTimes* times) {
  std::vector<double> samples, host;
  for (int i = 0; i < iters; ++i) {
    if (!setup()) return false;
    TEST_CUDA_CHECK(cudaMemsetAsync(timer.flush, i & 0xff, timer.flushBytes, session.stream()));
    if (!session.barrier(false)) return false;
    TEST_CUDA_CHECK(cudaEventRecord(timer.start, session.stream()));
    const double hostStart = test::nowSeconds();
    if (!op()) return false;
    host.push_back((test::nowSeconds() - hostStart) * 1e6);
    TEST_CUDA_CHECK(cudaEventRecord(timer.stop, session.stream()));
    if (!teardown()) return false;
    TEST_CUDA_CHECK(cudaEventSynchronize(timer.stop));
    float ms = 0;
    TEST_CUDA_CHECK(cudaEventElapsedTime(&ms, timer.start, timer.stop));
    samples.push_back(ms * 1000.0);
  }
  times->us = median(samples);
  times->p99Us = percentile(samples, 0.99);
  times->hostUs = median(host);
  if (!session.barrier(true)) return false;
  if (backToBack) {
    // The median of kBackToBackRuns runs of backToBackCalls() calls: one run of a few microseconds per
    // call carries the noise of a single host hiccup.
    std::vector<double> runs;
    for (int run = 0; run < kBackToBackRuns; ++run) {
      if (!session.barrier(true)) return false;
      TEST_CUDA_CHECK(cudaEventRecord(timer.start, session.stream()));
      for (int i = 0; i < backToBackCalls(); ++i) {
        if (!op() || !teardown()) return false;
      }
      TEST_CUDA_CHECK(cudaEventRecord(timer.stop, session.stream()));
      TEST_CUDA_CHECK(cudaEventSynchronize(timer.stop));
      float ms = 0;
      TEST_CUDA_CHECK(cudaEventElapsedTime(&ms, timer.start, timer.stop));
      runs.push_back(ms * 1000.0 / backToBackCalls());
    }
    times->backToBackUs = median(runs);
  }
  return true;
}

// Times op() with setup() before the flush (untimed) and teardown() after the stop event
// (untimed): e.g. the dispatch a combine needs, or the receive phase that completes a timed send.
// Back-to-back time (op then teardown, backToBackCalls() times in a row) only where it is asked for:
// where setup is empty and teardown does no GPU work. With timer.kernelsOnly, kernel times alone.
template <typename Setup, typename Op, typename Teardown>
bool timeOp(test::NcclSession& session, Timer& timer, int iters, int warmup, Setup setup, Op op, Teardown teardown,
            bool backToBack, OpTimes* times) {
  for (int i = 0; i < warmup; ++i) {
    if (!setup() || !op() || !teardown()) return false;
  }
  *times = OpTimes{};
  if (timer.kernelsOnly) {
    if (!timeKernels(session, timer, iters, setup, op, teardown, times)) return false;
  } else if (!timeEvents(session, timer, iters, setup, op, teardown, backToBack, times)) {
    return false;
  }
  times->ownUs = times->us;
  for (double* value : {&times->us, &times->p99Us, &times->backToBackUs, &times->hostUs, &times->kernelUs,
                        &times->kernelP99Us}) {
    if (!session.maxOverRanks(value)) return false;
  }
  return true;
}

template <typename Op>
bool timeOp(test::NcclSession& session, Timer& timer, int iters, int warmup, Op op, OpTimes* times) {
  auto nothing = [] { return true; };
  return timeOp(session, timer, iters, warmup, nothing, op, nothing, true, times);
}

}  // namespace unifab::bench
