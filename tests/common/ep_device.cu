#include "tests/common/ep_device.h"
#include "tests/common/ep_values.h"

namespace unifab::test::ep {
namespace {

__global__ void fillKernel(uint16_t* out, int hidden, const int* source, const int* numRows, bool expertMajor,
                           const int* expertOffsets, const int* rowsPerExpert, int localExperts, int rank,
                           uint64_t seed) {
  const int rows = *numRows;
  for (int p = blockIdx.x; p < rows; p += gridDim.x) {
    int expert = -1;
    bool padding = false;
    if (expertMajor) {
      expert = 0;
      while (expert + 1 < localExperts && expertOffsets[expert + 1] <= p) ++expert;
      padding = p - expertOffsets[expert] >= rowsPerExpert[expert];
    }
    int s = padding ? 0 : source[2 * p];
    int t = padding ? 0 : source[2 * p + 1];
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
      out[static_cast<size_t>(p) * hidden + i] = padding ? uint16_t{0x7fc0} : expertOutputBits(seed, rank, s, t, expert, i);
    }
  }
}

}  // namespace

cudaError_t fillExpertOutputs(uint16_t* out, int hidden, const int* source, const int* numRows, bool expertMajor,
                              const int* expertOffsets, const int* rowsPerExpert, int localExperts, int rank,
                              uint64_t seed, int maxRows, cudaStream_t stream) {
  int blocks = maxRows < 4096 ? (maxRows > 0 ? maxRows : 1) : 4096;
  fillKernel<<<blocks, 256, 0, stream>>>(out, hidden, source, numRows, expertMajor, expertOffsets, rowsPerExpert,
                                         localExperts, rank, seed);
  return cudaGetLastError();
}

}  // namespace unifab::test::ep
