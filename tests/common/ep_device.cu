#include "tests/common/ep_device.h"
#include "tests/common/ep_values.h"
#include "tests/common/nccl_session.h"

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

// Low-latency layout: expert e's rows start at e * stride; rows past its count get NaN.
__global__ void fillLowLatencyKernel(uint16_t* out, int hidden, const int* source, const int* recvCount, int stride,
                                     int localExperts, int rank, uint64_t seed) {
  const size_t rows = static_cast<size_t>(localExperts) * stride;
  for (size_t p = blockIdx.x; p < rows; p += gridDim.x) {
    const int expert = static_cast<int>(p / stride);
    const bool valid = static_cast<int>(p % stride) < recvCount[expert];
    const int s = valid ? source[2 * p] : 0;
    const int t = valid ? source[2 * p + 1] : 0;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
      out[p * hidden + i] = valid ? expertOutputBits(seed, rank, s, t, expert, i) : uint16_t{0x7fc0};
    }
  }
}

}  // namespace

cudaError_t fillLowLatencyExpertOutputs(uint16_t* out, int hidden, const int* source, const int* recvCount, int stride,
                                        int localExperts, int rank, uint64_t seed, cudaStream_t stream) {
  fillLowLatencyKernel<<<4096, 256, 0, stream>>>(out, hidden, source, recvCount, stride, localExperts, rank, seed);
  return cudaGetLastError();
}

cudaError_t fillExpertOutputs(uint16_t* out, int hidden, const int* source, const int* numRows, bool expertMajor,
                              const int* expertOffsets, const int* rowsPerExpert, int localExperts, int rank,
                              uint64_t seed, int maxRows, cudaStream_t stream) {
  int blocks = maxRows < 4096 ? (maxRows > 0 ? maxRows : 1) : 4096;
  fillKernel<<<blocks, 256, 0, stream>>>(out, hidden, source, numRows, expertMajor, expertOffsets, rowsPerExpert,
                                         localExperts, rank, seed);
  return cudaGetLastError();
}

DeviceInput::~DeviceInput() {
  cudaFree(x);
  cudaFree(scales);
  cudaFree(topk);
  cudaFree(weights);
}

bool DeviceInput::allocate(const Shape& shape) {
  const size_t tokens = static_cast<size_t>(shape.maxTokens);
  TEST_CUDA_CHECK(cudaMalloc(&x, tokens * shape.hidden * 2));
  TEST_CUDA_CHECK(cudaMalloc(&scales, tokens * (shape.hidden / 128) * sizeof(float) + 16));
  TEST_CUDA_CHECK(cudaMalloc(&topk, tokens * shape.topk * sizeof(int64_t)));
  TEST_CUDA_CHECK(cudaMalloc(&weights, tokens * shape.topk * sizeof(float)));
  return true;
}

bool DeviceInput::upload(const RankInput& in, bool int32Ids, cudaStream_t stream) {
  TEST_CUDA_CHECK(cudaMemcpyAsync(x, in.x.data(), in.x.size(), cudaMemcpyHostToDevice, stream));
  if (in.fp8) {
    TEST_CUDA_CHECK(cudaMemcpyAsync(scales, in.scales.data(), in.scales.size() * sizeof(float), cudaMemcpyHostToDevice,
                                    stream));
  }
  if (int32Ids) {
    ids32_.assign(in.topk.begin(), in.topk.end());
    TEST_CUDA_CHECK(cudaMemcpyAsync(topk, ids32_.data(), ids32_.size() * sizeof(int32_t), cudaMemcpyHostToDevice, stream));
  } else {
    TEST_CUDA_CHECK(cudaMemcpyAsync(topk, in.topk.data(), in.topk.size() * sizeof(int64_t), cudaMemcpyHostToDevice, stream));
  }
  TEST_CUDA_CHECK(cudaMemcpyAsync(weights, in.weights.data(), in.weights.size() * sizeof(float), cudaMemcpyHostToDevice,
                                  stream));
  TEST_CUDA_CHECK(cudaStreamSynchronize(stream));  // ids32_ is reused by the next upload
  return true;
}

}  // namespace unifab::test::ep
