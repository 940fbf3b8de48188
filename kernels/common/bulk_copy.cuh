// Hopper's bulk-copy engine (TMA, cp.async.bulk) for 1-D copies between global and shared memory:
// loads complete on a shared-memory barrier, stores in bulk groups. The bytes in flight live in
// shared memory, not in registers, so one lane can keep a whole row moving.
// sm_90 only; addresses 16-byte aligned, sizes multiples of 16.
#pragma once

#include <cstdint>

namespace unifab::kernels {

__device__ __forceinline__ uint32_t sharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// kArrivals arrivals complete a phase (with bulk loads, one: the issuing lane's, which also
// announces the bytes to expect).
template <uint32_t kArrivals = 1>
__device__ __forceinline__ void barrierInit(uint64_t* barrier) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(sharedAddress(barrier)), "n"(kArrivals) : "memory");
}

// One arrival, releasing the calling thread's earlier writes to the threads that wait for the phase.
__device__ __forceinline__ void barrierArrive(uint64_t* barrier) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" ::"r"(sharedAddress(barrier)) : "memory");
}

// Makes barrier initialisation visible to the bulk-copy engine before its first use.
__device__ __forceinline__ void barrierInitFence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

// The issuing lane's arrival, announcing `bytes` that the copies of this phase will deliver
// (0: the phase completes at once).
__device__ __forceinline__ void barrierExpect(uint64_t* barrier, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(sharedAddress(barrier)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void bulkLoad(void* sharedDst, const void* globalSrc, uint32_t bytes, uint64_t* barrier) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   sharedAddress(sharedDst)),
               "l"(globalSrc), "r"(bytes), "r"(sharedAddress(barrier))
               : "memory");
}

// Whether the barrier's phase of parity `phase` has completed (acquiring what its arrivals
// released), after the hardware's own bounded wait for it.
__device__ __forceinline__ bool barrierTryWait(uint64_t* barrier, uint32_t phase) {
  uint32_t done;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
      : "=r"(done)
      : "r"(sharedAddress(barrier)), "r"(phase)
      : "memory");
  return done != 0;
}

// Waits for the barrier's phase of parity `phase` to complete. No timeout: the phase depends only
// on copies already issued from this GPU's memory system, never on another rank.
__device__ __forceinline__ void barrierWait(uint64_t* barrier, uint32_t phase) {
  while (!barrierTryWait(barrier, phase)) {
  }
}

// Stores `bytes` of shared memory to global memory (local, or a peer's through an NVLink mapping)
// as one bulk group of the issuing thread.
__device__ __forceinline__ void bulkStore(void* globalDst, const void* sharedSrc, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(globalDst),
               "r"(sharedAddress(sharedSrc)), "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// Waits until the issuing thread's bulk stores have read their shared memory (it may be reused);
// the writes themselves may still be on their way.
__device__ __forceinline__ void bulkStoresRead() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }

// Waits until the issuing thread's bulk stores are complete (visible to this GPU's later accesses
// after the usual fences).
__device__ __forceinline__ void bulkStoresDone() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

}  // namespace unifab::kernels
