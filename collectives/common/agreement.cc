#include "collectives/common/agreement.h"

#include <vector>

#include "collectives/common/cuda_check.h"
#include "collectives/common/device_guard.h"
#include "plugin/log.h"

namespace unifab::collectives {

Result allRanksMax(const NcclRuntime& nccl, ncclComm_t comm, int64_t* values, size_t count) {
  // On the communicator's device whatever the current one is: a rank called with the wrong one
  // still takes part, and learns its refusal together with the others.
  int device = -1;
  UF_NCCL_CHECK(nccl.commCuDevice(comm, &device), comm);
  DeviceGuard guard(device);
  cudaStream_t stream = nullptr;
  int64_t* scratch = nullptr;
  UF_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // The stream and scratch words are released on every path; the first failure is the result.
  auto body = [&]() -> Result {
    UF_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&scratch), count * sizeof(int64_t), stream));
    UF_CUDA_CHECK(cudaMemcpyAsync(scratch, values, count * sizeof(int64_t), cudaMemcpyHostToDevice, stream));
    UF_NCCL_CHECK(nccl.allReduce(scratch, scratch, count, ncclInt64, ncclMax, comm, stream), comm);
    UF_CUDA_CHECK(cudaMemcpyAsync(values, scratch, count * sizeof(int64_t), cudaMemcpyDeviceToHost, stream));
    UF_CUDA_CHECK(cudaStreamSynchronize(stream));
    return unifabSuccess;
  };
  Result result = body();
  if (scratch != nullptr) UF_CUDA_WARN(cudaFreeAsync(scratch, stream));
  UF_CUDA_WARN(cudaStreamSynchronize(stream));
  UF_CUDA_WARN(cudaStreamDestroy(stream));
  return result;
}

std::vector<int64_t> agreementWords(bool locallyValid, const int64_t* values, size_t count) {
  // The complements' maximum is the minimum's complement, with no overflow at INT64_MIN.
  std::vector<int64_t> words(2 * count + 1);
  for (size_t i = 0; i < count; ++i) {
    words[i] = values[i];
    words[count + i] = ~values[i];
  }
  words[2 * count] = locallyValid ? 0 : 1;
  return words;
}

Result agreementVerdict(const char* operation, bool locallyValid, const int64_t* values, const char* const* names,
                        size_t count, const std::vector<int64_t>& maxima) {
  if (maxima.size() != 2 * count + 1) {
    return UF_ERROR(unifabInternalError, kExt, "%s: %zu agreement words for %zu values", operation, maxima.size(), count);
  }
  if (maxima[2 * count] != 0) {
    if (!locallyValid) return unifabInvalidArgument;  // the caller returns its own, logged error
    return UF_ERROR(unifabInvalidUsage, kExt, "%s: another rank refused its arguments (its log says why); this rank "
                    "refuses too", operation);
  }
  for (size_t i = 0; i < count; ++i) {
    const int64_t highest = maxima[i], lowest = ~maxima[count + i];
    if (lowest != highest) {
      return UF_ERROR(unifabInvalidUsage, kExt,
                      "%s: the ranks disagree on %s (this rank %lld; across ranks %lld..%lld); every rank must pass "
                      "the same", operation, names[i], static_cast<long long>(values[i]),
                      static_cast<long long>(lowest), static_cast<long long>(highest));
    }
  }
  return unifabSuccess;
}

Result agreeAcrossRanks(const NcclRuntime& nccl, ncclComm_t comm, const char* operation, bool locallyValid,
                        const int64_t* values, const char* const* names, size_t count) {
  std::vector<int64_t> words = agreementWords(locallyValid, values, count);
  UF_CHECK(allRanksMax(nccl, comm, words.data(), words.size()));
  return agreementVerdict(operation, locallyValid, values, names, count, words);
}

}  // namespace unifab::collectives
