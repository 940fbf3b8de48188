#include "tests/bench/kernel_timer.h"

#include "tests/bench/kernel_spans.h"

#include <cstdio>
#include <cstdlib>

#ifdef UNIFAB_BENCH_HAS_CUPTI
#include <cupti.h>

#include <mutex>
#include <unordered_map>
#include <utility>
#endif

namespace unifab::bench {

#ifdef UNIFAB_BENCH_HAS_CUPTI
namespace {

struct KernelRecord {
  uint32_t correlation, stream;
  uint64_t startNs, endNs;
};

// Filled by CUPTI's buffer callbacks (its own thread), read by end() after a flush.
struct Recorded {
  std::mutex mutex;
  std::vector<KernelRecord> kernels;
  std::unordered_map<uint32_t, uint64_t> externalIds;  // CUPTI correlation id -> our id
  std::string failure;                                 // the first CUPTI call that failed
};

Recorded& recorded() {
  static Recorded r;
  return r;
}

constexpr size_t kBufferBytes = size_t{1} << 20;
constexpr CUpti_ExternalCorrelationKind kIdKind = CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM0;

void CUPTIAPI bufferRequested(uint8_t** buffer, size_t* size, size_t* maxRecords) {
  // CUPTI wants 8-byte aligned buffers; a null buffer makes it drop records, which end() notices
  // as ids without kernels.
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = *buffer != nullptr ? kBufferBytes : 0;
  *maxRecords = 0;
}

void CUPTIAPI bufferCompleted(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t validSize) {
  Recorded& r = recorded();
  std::lock_guard<std::mutex> lock(r.mutex);
  CUpti_Activity* record = nullptr;
  while (cuptiActivityGetNextRecord(buffer, validSize, &record) == CUPTI_SUCCESS) {
    if (record->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) {
      const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
      r.kernels.push_back({k->correlationId, k->streamId, k->start, k->end});
    } else if (record->kind == CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION) {
      const auto* e = reinterpret_cast<const CUpti_ActivityExternalCorrelation*>(record);
      if (e->externalKind == kIdKind) r.externalIds[e->correlationId] = e->externalId;
    }
  }
  std::free(buffer);
}

bool cuptiOk(CUptiResult result, const char* call) {
  if (result == CUPTI_SUCCESS) return true;
  const char* text = nullptr;
  cuptiGetResultString(result, &text);
  Recorded& r = recorded();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (r.failure.empty()) r.failure = std::string(call) + ": " + (text != nullptr ? text : "unknown CUPTI error");
  return false;
}

// The activity kinds a recording turns on. CONCURRENT_KERNEL, unlike KERNEL, leaves kernels free to
// overlap as they would unprofiled; CUPTI ties our ids to launches only while the API records are
// on (with kernels alone it gave no correlation records on 2 x H200).
constexpr CUpti_ActivityKind kKinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_RUNTIME,
                                         CUPTI_ACTIVITY_KIND_DRIVER, CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION};

// Turns every kind off. CUPTI's hooks stay attached afterwards (with the API records once on, every
// later launch took 2-3 us more on the host, measured on 2 x H200): callers record only after all
// their event-timed measurements (ep_timing.h's kernel pass).
void disableKinds() {
  for (CUpti_ActivityKind kind : kKinds) cuptiActivityDisable(kind);
}

}  // namespace

bool KernelTimer::available() {
  Recorded& r = recorded();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.failure.empty();
}

std::string KernelTimer::unavailableReason() {
  Recorded& r = recorded();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.failure;
}

bool KernelTimer::begin() {
  if (!available()) return false;
  {
    Recorded& r = recorded();
    std::lock_guard<std::mutex> lock(r.mutex);
    r.kernels.clear();
    r.externalIds.clear();
  }
  static const bool registered = cuptiOk(cuptiActivityRegisterCallbacks(bufferRequested, bufferCompleted),
                                         "cuptiActivityRegisterCallbacks");
  bool ok = registered;
  for (CUpti_ActivityKind kind : kKinds) ok = ok && cuptiOk(cuptiActivityEnable(kind), "cuptiActivityEnable");
  if (!ok) disableKinds();  // nothing half-enabled stays behind
  return ok;
}

void KernelTimer::enter(uint64_t id) { cuptiOk(cuptiActivityPushExternalCorrelationId(kIdKind, id), "push id"); }

void KernelTimer::leave() {
  uint64_t last = 0;
  cuptiOk(cuptiActivityPopExternalCorrelationId(kIdKind, &last), "pop id");
}

bool KernelTimer::end(uint64_t ids, std::vector<double>* spansUs) {
  const bool flushed = cuptiOk(cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED), "cuptiActivityFlushAll");
  disableKinds();
  Recorded& r = recorded();
  std::lock_guard<std::mutex> lock(r.mutex);
  const size_t kernelRecords = r.kernels.size(), correlationRecords = r.externalIds.size();
  std::vector<RecordedKernel> kernels;
  kernels.reserve(r.kernels.size());
  for (const KernelRecord& k : r.kernels) {
    const auto it = r.externalIds.find(k.correlation);
    kernels.push_back({it != r.externalIds.end() ? it->second : 0, k.stream, k.startNs, k.endNs});
  }
  r.kernels.clear();
  r.externalIds.clear();
  if (!flushed || !r.failure.empty()) return false;
  const uint64_t empty = operationSpansUs(std::move(kernels), ids, spansUs);
  if (empty != 0) {
    fprintf(stderr, "unifab-bench: kernel times: %llu of %llu calls without recorded kernels (%zu kernel records, %zu"
            " correlation records)\n", static_cast<unsigned long long>(empty), static_cast<unsigned long long>(ids),
            kernelRecords, correlationRecords);
  }
  return true;
}

#else  // built without CUPTI

bool KernelTimer::available() { return false; }
std::string KernelTimer::unavailableReason() { return "unifab-bench was built without CUPTI"; }
bool KernelTimer::begin() { return false; }
void KernelTimer::enter(uint64_t) {}
void KernelTimer::leave() {}
bool KernelTimer::end(uint64_t, std::vector<double>*) { return false; }

#endif

}  // namespace unifab::bench
