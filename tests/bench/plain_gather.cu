#include "tests/bench/plain_gather.h"

namespace unifab::bench {
namespace {

__global__ void plainGatherKernel(const char* rows, const int64_t* rowIds, int64_t numRows, int64_t rowBytes, char* out) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x / 32) + threadIdx.x / 32; i < numRows; i += warps) {
    const int4* src = reinterpret_cast<const int4*>(rows + rowIds[i] * rowBytes);
    int4* dst = reinterpret_cast<int4*>(out + i * rowBytes);
    for (int64_t v = lane; v < rowBytes / 16; v += 32) dst[v] = src[v];
  }
}

}  // namespace

cudaError_t launchPlainGather(const char* rows, const int64_t* rowIds, int64_t numRows, int64_t rowBytes, char* out,
                              int sms, cudaStream_t stream) {
  plainGatherKernel<<<sms, 1024, 0, stream>>>(rows, rowIds, numRows, rowBytes, out);
  return cudaGetLastError();
}

}  // namespace unifab::bench
