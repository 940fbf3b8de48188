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

// Orders this thread's earlier accesses, and those of threads it synchronised with (a warp or
// block barrier), before its later ones at system scope: the release half of a flag protocol.
// Lighter than __threadfence_system(), which is a sequentially consistent fence.
__device__ __forceinline__ void fenceAcqRelSystem() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
// The same at GPU scope: for words that only this GPU's other blocks read.
__device__ __forceinline__ void fenceAcqRelGpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

// Single-copy atomic 64-bit accesses with no ordering: for words that carry their own epoch.
__device__ __forceinline__ void storeRelaxed(uint64_t* address, uint64_t value) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(address), "l"(value) : "memory");
}

__device__ __forceinline__ uint64_t loadRelaxed(const uint64_t* address) {
  uint64_t value;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(address) : "memory");
  return value;
}

// Acquire at GPU scope: for words that this GPU's other blocks publish.
__device__ __forceinline__ uint64_t loadAcquireGpu(const uint64_t* address) {
  uint64_t value;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(value) : "l"(address) : "memory");
  return value;
}

__device__ __forceinline__ uint64_t loadAcquire(const uint64_t* address) {
  uint64_t value;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(address) : "memory");
  return value;
}

// Adds `value` to a 64-bit counter, ordered after this thread's earlier accesses (system scope:
// the counter may be a peer GPU's).
__device__ __forceinline__ void addRelease(uint64_t* address, uint64_t value) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(address), "l"(value) : "memory");
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

// Where a bounded wait reports: an error word of bits in device memory and its host-visible
// mirror (raiseError), and how long any single wait may last.
struct WaitBounds {
  int* error;
  int* hostError;
  uint64_t timeoutNs;
};

// True once any wait under `w` has timed out (raising `timeoutCode`): its peers are out of step.
__device__ __forceinline__ bool timedOut(const WaitBounds& w, int timeoutCode) {
  return (*reinterpret_cast<const volatile int*>(w.error) & timeoutCode) != 0;
}

// The same, for poll `polls` of a wait: the group's error word is read every eighth poll only.
// Every waiting warp of the GPU reads that one line, and reading it at every poll cost the LL
// dispatch + combine 0.5-0.7 us (docs/benchmarks/ep-ll.md).
__device__ __forceinline__ bool timedOutAtPoll(const WaitBounds& w, int timeoutCode, unsigned polls) {
  return polls % 8 == 0 && timedOut(w, timeoutCode);
}

// The bound of a warp's own poll loop (one whose polls are warp-wide loads, not a `ready()`):
// after each poll that found the data not there yet, `expired` is true in every lane once the wait
// has lasted longer than `w.timeoutNs` (raising `timeoutCode`) or another wait under `w` timed out.
// Lane 0 keeps the clock; the whole warp calls it together.
struct WarpDeadline {
  uint64_t start = 0;
  bool started = false;  // apart from the poll count, which may wrap in a wait of hours
  __device__ bool expired(const WaitBounds& w, int timeoutCode, unsigned polls, int lane) {
    bool stop = false;
    if (lane == 0) {
      if (!started) {
        start = globalTimerNs();
        started = true;
      } else if (timedOutAtPoll(w, timeoutCode, polls)) {
        stop = true;
      } else if (globalTimerNs() - start > w.timeoutNs) {
        raiseError(w.error, w.hostError, timeoutCode);
        stop = true;
      }
    }
    return __shfl_sync(0xffffffff, stop, 0);
  }
};

// The sleep between the polls of a word many warps wait for at once: 32 ns, doubling to 256 ns.
struct PollPause {
  unsigned ns = 32;
  __device__ void sleep() {
    __nanosleep(ns);
    ns = min(ns * 2, 256u);
  }
};

// Spins until `ready()` (a relaxed read of the awaited word), bounded by the timeout: false on
// timeout (raising it) or soon after another wait under `w` has timed out (timedOutAtPoll). kPause
// sleeps between polls (PollPause) where many warps wait at once.
template <bool kPause, typename Ready>
__device__ __forceinline__ bool waitBounded(const WaitBounds& w, int timeoutCode, Ready ready) {
  if (ready()) return true;
  const uint64_t start = globalTimerNs();
  PollPause pause;
  for (unsigned polls = 1; !ready(); ++polls) {
    if (timedOutAtPoll(w, timeoutCode, polls)) return false;
    if (globalTimerNs() - start > w.timeoutNs) {
      raiseError(w.error, w.hostError, timeoutCode);
      return false;
    }
    if (kPause) pause.sleep();
  }
  return true;
}

// Every block of a grid calls this when its share is written (all threads of the block). The
// last block to arrive gets true, with all other blocks' writes ordered before what it does next:
// at system scope when it then tells a peer GPU that those writes landed, at GPU scope when only
// this GPU (or a peer that needs no data of ours) hears of it. `finished` returns to zero for the
// next kernel.
template <bool kSystemScope = true>
__device__ __forceinline__ bool lastBlockToFinish(unsigned* finished) {
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    if (kSystemScope) {
      __threadfence_system();
    } else {
      __threadfence();
    }
    last = atomicAdd(finished, 1u) == gridDim.x - 1;
    if (last) {
      __threadfence();
      *finished = 0;
    }
  }
  __syncthreads();
  return last;
}

}  // namespace unifab::kernels
