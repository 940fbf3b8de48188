// Device-side signalling between GPUs of one NVLink domain: system-scope release/acquire on
// 64-bit epoch words and bounded waits. Every wait ends after `timeoutNs` (measured with the
// global timer) and records an error instead of hanging the GPU.
#pragma once

#include <cstdint>

namespace unifab::kernels {

__device__ __forceinline__ uint64_t globalTimerNs() {
  uint64_t now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  return now;
}

__device__ __forceinline__ void storeRelease(uint64_t* address, uint64_t value) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(address), "l"(value) : "memory");
}

// Single-copy atomic 64-bit accesses with no ordering: for words that carry their own epoch.
__device__ __forceinline__ void storeRelaxed(uint64_t* address, uint64_t value) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(address), "l"(value) : "memory");
}

__device__ __forceinline__ uint64_t loadRelaxed(const uint64_t* address) {
  uint64_t value;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(address) : "memory");
  return value;
}

__device__ __forceinline__ uint64_t loadAcquire(const uint64_t* address) {
  uint64_t value;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(address) : "memory");
  return value;
}

// Adds the error bit `code` to the group's word in device memory and, the first time, to its
// host-visible mirror (so the host-mapped word is written once per kind, not per thread).
__device__ __forceinline__ void raiseError(int* error, int* hostError, int code) {
  if ((atomicOr(error, code) & code) == 0) atomicOr_system(hostError, code);
}

// Waits until *address >= epoch. False on timeout (raising `timeoutCode`), or at once when an
// earlier wait of the group already timed out: its peers are out of step.
__device__ __forceinline__ bool waitEpoch(const uint64_t* address, uint64_t epoch, uint64_t timeoutNs, int* error,
                                          int* hostError, int timeoutCode) {
  uint64_t start = globalTimerNs();
  while (loadAcquire(address) < epoch) {
    if ((*reinterpret_cast<const volatile int*>(error) & timeoutCode) != 0) return false;
    if (globalTimerNs() - start > timeoutNs) {
      raiseError(error, hostError, timeoutCode);
      return false;
    }
  }
  return true;
}

}  // namespace unifab::kernels
