#include "collectives/common/copy_engine.h"

#include "collectives/common/cuda_check.h"

namespace unifab::collectives {

Result copyEngineBatch(void* const* dsts, const void* const* srcs, const size_t* sizes, size_t count,
                       cudaStream_t stream) {
  if (count == 0) return unifabSuccess;
  if (stream == nullptr || stream == cudaStreamLegacy) {
    for (size_t i = 0; i < count; ++i) {
      UF_CUDA_CHECK(cudaMemcpyAsync(dsts[i], srcs[i], sizes[i], cudaMemcpyDeviceToDevice, stream));
    }
    return unifabSuccess;
  }
  cudaMemcpyAttributes attributes{};
  attributes.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attributes.flags = cudaMemcpyFlagPreferOverlapWithCompute;
  size_t attributeIndex = 0;
  UF_CUDA_CHECK(cudaMemcpyBatchAsync(dsts, srcs, sizes, count, &attributes, &attributeIndex, 1, stream));
  return unifabSuccess;
}

}  // namespace unifab::collectives
