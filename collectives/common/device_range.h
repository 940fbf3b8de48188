// Checks that a caller's pointer, size and stream belong to the call's device, before anything is
// posted: a host pointer or a size past the end of the allocation would otherwise fail only inside
// the copy, after the peer was already paired with this call.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <unordered_map>

#include "plugin/check.h"

namespace unifab::collectives {

// Whether `pointer` is aligned for elements of `bytes` (a power of two): kernels load them whole,
// and a misaligned load faults the context.
inline bool alignedTo(const void* pointer, size_t bytes) {
  return (reinterpret_cast<uintptr_t>(pointer) & (bytes - 1)) == 0;
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
// device `device`, or managed memory, within one allocation. bytes == 0 passes.
Result checkDeviceRange(const void* data, size_t bytes, int device, const char* name);

// checkDeviceRange for an operation called again and again with the same buffers (a decoding
// loop): a pointer that passed with at least as many bytes is not asked about again, so only new
// buffers cost the driver's queries. Remembers up to kRemembered pointers, then starts over. Only
// passes are remembered: a buffer freed and allocated again smaller at the same address still
// passes with its old size (no worse than without the check).
class CheckedRanges {
 public:
  Result check(const void* data, size_t bytes, int device, const char* name);

 private:
  static constexpr size_t kRemembered = 64;
  std::mutex mutex_;
  std::unordered_map<const void*, size_t> passed_;  // pointer -> bytes it passed with
};

}  // namespace unifab::collectives
