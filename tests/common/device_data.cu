#include "tests/common/device_data.h"

#include "tests/common/test_util.h"

#include <cstring>

namespace unifab::test {
namespace {

__host__ __device__ inline float inputValue(int rank, size_t index, uint32_t seed) {
  return static_cast<float>((static_cast<uint64_t>(rank) * 131u + index * 7u + seed * 17u) % 509u);
}

__global__ void fillKernel(float* send, size_t count, int rank, uint32_t seed) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    send[i] = inputValue(rank, i, seed);
  }
}

__global__ void checkKernel(Collective collective, const float* recv, size_t count, int rank, int nRanks,
                            uint32_t seed, unsigned long long* mismatches) {
  unsigned long long wrong = 0;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    float expected = 0;
    switch (collective) {
      case Collective::kAllReduce:
        for (int r = 0; r < nRanks; ++r) expected += inputValue(r, i, seed);
        break;
      case Collective::kAllGather: {
        size_t chunk = count / nRanks;
        expected = inputValue(static_cast<int>(i / chunk), i % chunk, seed);
        break;
      }
      case Collective::kReduceScatter:
        for (int r = 0; r < nRanks; ++r) expected += inputValue(r, static_cast<size_t>(rank) * count + i, seed);
        break;
      case Collective::kAllToAll: {
        size_t chunk = count / nRanks;
        int source = static_cast<int>(i / chunk);
        expected = inputValue(source, static_cast<size_t>(rank) * chunk + i % chunk, seed);
        break;
      }
      case Collective::kBroadcast:
        expected = inputValue(0, i, seed);
        break;
      default:
        break;
    }
    // Bitwise comparison: a NaN poison never equals anything.
    if (__float_as_uint(recv[i]) != __float_as_uint(expected)) ++wrong;
  }
  if (wrong != 0) atomicAdd(mismatches, wrong);
}

__global__ void poisonKernel(uint32_t* data, size_t words) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < words;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    data[i] = 0x7fc0dead;  // a NaN
  }
}

unsigned gridFor(size_t count) {
  size_t blocks = (count + 255) / 256;
  return static_cast<unsigned>(blocks < 1024 ? (blocks > 0 ? blocks : 1) : 1024);
}

// Byte i of a pattern: the low byte of a hash of (seed, i).
__device__ __forceinline__ uint8_t patternByte(uint64_t seed, size_t i) {
  return static_cast<uint8_t>(mix64(seed * 0x9e3779b97f4a7c15ULL + i));
}

__global__ void fillBytesKernel(uint8_t* data, size_t bytes, uint64_t seed) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < bytes;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    data[i] = patternByte(seed, i);
  }
}

__global__ void checkBytesKernel(const uint8_t* data, size_t bytes, uint64_t seed, unsigned long long* mismatches) {
  unsigned long long bad = 0;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < bytes;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    bad += data[i] != patternByte(seed, i) ? 1 : 0;
  }
  if (bad != 0) atomicAdd(mismatches, bad);
}

__global__ void spinKernel(long long nanoseconds) {
  long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < nanoseconds);
}

}  // namespace

cudaError_t spinOnDevice(long long nanoseconds, cudaStream_t stream) {
  spinKernel<<<1, 1, 0, stream>>>(nanoseconds);
  return cudaGetLastError();
}

cudaError_t fillBytes(void* data, size_t bytes, uint64_t seed, cudaStream_t stream) {
  if (bytes == 0) return cudaSuccess;
  fillBytesKernel<<<gridFor(bytes), 256, 0, stream>>>(static_cast<uint8_t*>(data), bytes, seed);
  return cudaGetLastError();
}

cudaError_t countByteMismatches(const void* data, size_t bytes, uint64_t seed, unsigned long long* mismatches,
                                cudaStream_t stream) {
  if (bytes == 0) return cudaSuccess;
  checkBytesKernel<<<gridFor(bytes), 256, 0, stream>>>(static_cast<const uint8_t*>(data), bytes, seed, mismatches);
  return cudaGetLastError();
}

const char* collectiveName(Collective collective) {
  switch (collective) {
    case Collective::kAllReduce:
      return "all_reduce";
    case Collective::kAllGather:
      return "all_gather";
    case Collective::kReduceScatter:
      return "reduce_scatter";
    case Collective::kAllToAll:
      return "alltoall";
    case Collective::kBroadcast:
      return "broadcast";
    default:
      return "?";
  }
}

bool collectiveByName(const char* name, Collective* out) {
  for (int c = 0; c < static_cast<int>(Collective::kCount); ++c) {
    if (strcmp(name, collectiveName(static_cast<Collective>(c))) == 0) {
      *out = static_cast<Collective>(c);
      return true;
    }
  }
  return false;
}

bool bufferCounts(Collective collective, size_t bytes, int nRanks, size_t* sendCount, size_t* recvCount) {
  size_t total = bytes / sizeof(float);
  size_t n = static_cast<size_t>(nRanks);
  switch (collective) {
    case Collective::kAllReduce:
    case Collective::kBroadcast:
      *sendCount = *recvCount = total;
      return total > 0;
    case Collective::kAllGather:
      *sendCount = total / n;
      *recvCount = *sendCount * n;
      return *sendCount > 0;
    case Collective::kReduceScatter:
      *recvCount = total / n;
      *sendCount = *recvCount * n;
      return *recvCount > 0;
    case Collective::kAllToAll:
      *sendCount = *recvCount = total / n * n;
      return total / n > 0;
    default:
      return false;
  }
}

cudaError_t fillInput(float* send, size_t sendCount, int rank, uint32_t seed, cudaStream_t stream) {
  fillKernel<<<gridFor(sendCount), 256, 0, stream>>>(send, sendCount, rank, seed);
  return cudaGetLastError();
}

cudaError_t poisonBuffer(void* data, size_t bytes, cudaStream_t stream) {
  poisonKernel<<<gridFor(bytes / 4), 256, 0, stream>>>(static_cast<uint32_t*>(data), bytes / 4);
  return cudaGetLastError();
}

cudaError_t countMismatches(Collective collective, const float* recv, size_t recvCount, int rank, int nRanks,
                            uint32_t seed, unsigned long long* mismatches, cudaStream_t stream) {
  checkKernel<<<gridFor(recvCount), 256, 0, stream>>>(collective, recv, recvCount, rank, nRanks, seed, mismatches);
  return cudaGetLastError();
}

}  // namespace unifab::test
