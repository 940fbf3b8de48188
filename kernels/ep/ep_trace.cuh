// Device side of UNIFAB_EP_TRACE, shared by the high-throughput and low-latency kernels: the
// recording of a trace point into the group's trace buffer (layout: kernels/ep/ep_types.h).
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/ep/ep_types.h"

namespace unifab::kernels::ep {

// Records `point`, reached `since` nanoseconds after the call's start, into `trace` (one thread).
__device__ __forceinline__ void traceRecord(unsigned long long* trace, TracePoint point, uint64_t epoch,
                                            unsigned long long since) {
  atomicAdd(trace + point, since);
  atomicAdd(trace + kTracePoints + point, 1ULL);
  const size_t slot = 2 * kTracePoints + (epoch % kTraceCalls) * kTracePoints + point;
  atomicMax(trace + slot, since);
  atomicMax(trace + kTraceCalls * kTracePoints + slot, ~since);  // the earliest, as its complement
}

}  // namespace unifab::kernels::ep
