// One cudaMemcpyBatchAsync of `count` copies under one set of attributes: the raw copy-engine
// batches the benchmarks time next to what unifab issues.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace unifab::bench {

inline cudaError_t copyBatch(void* const* dsts, const void* const* srcs, const size_t* sizes, size_t count,
                             cudaMemcpySrcAccessOrder order, unsigned flags, cudaStream_t stream) {
  cudaMemcpyAttributes attributes{};
  attributes.srcAccessOrder = order;
  attributes.flags = flags;
  size_t attributeIndex = 0;
  return cudaMemcpyBatchAsync(dsts, srcs, sizes, count, &attributes, &attributeIndex, 1, stream);
}

}  // namespace unifab::bench
