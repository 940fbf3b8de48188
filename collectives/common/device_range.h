// Checks that a caller's pointer, size and stream belong to the call's device, before anything is
// posted: a host pointer or a size past the end of the allocation would otherwise fail only inside
// the copy, after the peer was already paired with this call.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

#include "plugin/check.h"

namespace unifab::collectives {

// Whether `pointer` is aligned for elements of `bytes` (a power of two): kernels load them whole,
// and a misaligned load faults the context.
inline bool alignedTo(const void* pointer, size_t bytes) {
  return (reinterpret_cast<uintptr_t>(pointer) & (bytes - 1)) == 0;
}

// Whether [first, first + bytes) lies inside [begin, end), for any bytes (no wrap).
inline bool rangeInside(uintptr_t first, size_t bytes, uintptr_t begin, uintptr_t end) {
  return first >= begin && first < end && bytes <= end - first;
}

// Whether [pointer, pointer + bytes) meets [begin, end).
inline bool overlaps(const void* pointer, size_t bytes, const char* begin, const char* end) {
  const char* first = static_cast<const char*>(pointer);
  return pointer != nullptr && bytes > 0 && first < end && first + bytes > begin;
}

// The driver's cuPointerGetAttributes, through the runtime (unifab does not link libcuda),
// resolved once; null if this driver lacks it.
using PointerGetAttributes = CUresult(CUDAAPI*)(unsigned int, CUpointer_attribute*, void**, CUdeviceptr);
PointerGetAttributes pointerGetAttributes();

// unifabInvalidArgument unless `stream` belongs to CUDA device `device` (the call's). Not for a
// capturing stream, whose device cannot be queried.
Result checkStreamDevice(cudaStream_t stream, int device);

// unifabInvalidArgument (naming `name`) unless [data, data + bytes) is device memory of CUDA
// device `device`, or managed memory, within one allocation. bytes == 0 passes. On success
// *begin and *end (if given) bound what the answer holds for, so that any range inside gets the
// same answer: the allocation (cudaMalloc, managed), the mapping around `data` (virtual memory,
// whose reported range is the address reservation), else [data, data + bytes).
Result checkDeviceRange(const void* data, size_t bytes, int device, const char* name, uintptr_t* begin = nullptr,
                        uintptr_t* end = nullptr);

// checkDeviceRange for an operation called again and again on the same allocations (a decoding
// loop, a pipeline, a harness that moves its buffers by an offset each call as nccl-tests does): a
// range inside an allocation that passed is not asked about again, so only new allocations cost
// the driver's queries (two or three, 1.5-2 us a call). Remembers up to kRemembered allocations,
// then starts over. Only passes are remembered: after an allocation is freed, a pointer into its
// old extent still passes (a smaller allocation made there, with the old extent as its bound), as
// it would have passed the check before the free; no worse than without the check.
class CheckedRanges {
 public:
  Result check(const void* data, size_t bytes, int device, const char* name);

 private:
  static constexpr size_t kRemembered = 64;
  struct Passed {
    uintptr_t begin, end;
    int device;
  };
  std::mutex mutex_;
  std::vector<Passed> passed_;
};

}  // namespace unifab::collectives
