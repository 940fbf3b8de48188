// Device-side inputs and checks for NCCL collective tests: every rank computes every other
// rank's input from (rank, index, seed), so expected outputs need no communication. Inputs are
// small integers held in floats, so sums are exact and checks are bit-exact.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace unifab::test {

// kBroadcast: rank 0's send buffer into every rank's receive buffer (out of place).
enum class Collective { kAllReduce, kAllGather, kReduceScatter, kAllToAll, kBroadcast, kCount };

const char* collectiveName(Collective collective);
// The collective named `name` (as collectiveName spells it), or false.
bool collectiveByName(const char* name, Collective* out);

// Element counts of the send and receive buffers for `bytes`, nccl-tests' size convention (the
// larger buffer of the pair), or false if `bytes` is too small for this rank count.
bool bufferCounts(Collective collective, size_t bytes, int nRanks, size_t* sendCount, size_t* recvCount);

// The count argument of the NCCL call for those buffers (NCCL logs it, times the type size, as
// the call's bytes): the receive count for reduce-scatter, the send count otherwise.
inline size_t ncclCallCount(Collective collective, size_t sendCount, size_t recvCount) {
  return collective == Collective::kReduceScatter ? recvCount : sendCount;
}

cudaError_t fillInput(float* send, size_t sendCount, int rank, uint32_t seed, cudaStream_t stream);
cudaError_t poisonBuffer(void* data, size_t bytes, cudaStream_t stream);
// Adds the number of wrong elements of `recv` to *mismatches (device memory).
cudaError_t countMismatches(Collective collective, const float* recv, size_t recvCount, int rank, int nRanks,
                            uint32_t seed, unsigned long long* mismatches, cudaStream_t stream);

// One thread busy for `nanoseconds`: work the caller puts between two calls (a delay, or what
// overlaps the phases of an operation).
cudaError_t spinOnDevice(long long nanoseconds, cudaStream_t stream);

// Byte patterns for transfers of any size: byte i of (seed) is a hash of both.
cudaError_t fillBytes(void* data, size_t bytes, uint64_t seed, cudaStream_t stream);
// Adds the number of bytes of `data` that differ from the pattern of `seed` to *mismatches.
cudaError_t countByteMismatches(const void* data, size_t bytes, uint64_t seed, unsigned long long* mismatches,
                                cudaStream_t stream);

}  // namespace unifab::test
