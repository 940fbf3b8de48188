#include "collectives/common/device_range.h"

#include <cstdint>

#include "collectives/common/cuda_check.h"

namespace unifab::collectives {
PointerGetAttributes pointerGetAttributes() {
  static const PointerGetAttributes resolved = [] {
    void* function = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuPointerGetAttributes", &function, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      function = nullptr;
    }
    return reinterpret_cast<PointerGetAttributes>(function);
  }();
  return resolved;
}

Result checkStreamDevice(cudaStream_t stream, int device) {
  int streamDevice = device;
  UF_CUDA_CHECK(cudaStreamGetDevice(stream, &streamDevice));
  if (streamDevice != device) {
    return UF_ERROR(unifabInvalidArgument, kExt, "stream belongs to CUDA device %d, the call's is device %d", streamDevice,
                    device);
  }
  return unifabSuccess;
}

namespace {

// Pointer queries are pure, but a thread inside a global or thread-local stream capture is barred
// from "potentially unsafe" calls, which would fail and invalidate the caller's capture: the
// queries run in relaxed mode, the thread's own mode restored after.
class RelaxedCaptureScope {
 public:
  RelaxedCaptureScope() { ok_ = cudaThreadExchangeStreamCaptureMode(&previous_) == cudaSuccess; }
  ~RelaxedCaptureScope() {
    if (ok_) (void)cudaThreadExchangeStreamCaptureMode(&previous_);
  }
  RelaxedCaptureScope(const RelaxedCaptureScope&) = delete;
  RelaxedCaptureScope& operator=(const RelaxedCaptureScope&) = delete;

 private:
  cudaStreamCaptureMode previous_ = cudaStreamCaptureModeRelaxed;
  bool ok_ = false;
};

}  // namespace

Result checkDeviceRange(const void* data, size_t bytes, int device, const char* name, uintptr_t* begin,
                        uintptr_t* end) {
  const CUdeviceptr at = reinterpret_cast<CUdeviceptr>(data);
  uintptr_t covered[2] = {at, at + bytes};
  if (bytes == 0) return unifabSuccess;
  RelaxedCaptureScope relaxed;
  cudaPointerAttributes attributes{};
  UF_CUDA_CHECK(cudaPointerGetAttributes(&attributes, data));
  const bool managed = attributes.type == cudaMemoryTypeManaged;
  if (attributes.type != cudaMemoryTypeDevice && !managed) {
    return UF_ERROR(unifabInvalidArgument, kExt, "%s=%p is not device memory (a host or unregistered pointer)", name, data);
  }
  if (!managed && attributes.device != device) {
    return UF_ERROR(unifabInvalidArgument, kExt, "%s=%p is memory of CUDA device %d, the call's is device %d", name, data,
                    attributes.device, device);
  }
  // The extent is checked for cudaMalloc'd memory (legacy-IPC capable) only: a VMM range may be
  // several mappings side by side (PyTorch's expandable segments), each reported as its own range.
  if (PointerGetAttributes get = pointerGetAttributes()) {
    CUpointer_attribute which[3] = {CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                                    CU_POINTER_ATTRIBUTE_RANGE_SIZE};
    int legacy = 0;
    CUdeviceptr start = 0;
    size_t size = 0;
    void* values[3] = {&legacy, &start, &size};
    if (get(3, which, values, at) == CUDA_SUCCESS && size > 0 && at >= start && at - start < size) {
      if (legacy != 0 && bytes > size - static_cast<size_t>(at - start)) {
        return UF_ERROR(unifabInvalidArgument, kExt,
                        "%s=%p with %zu bytes runs past the end of its allocation (%zu bytes left from there)", name,
                        data, bytes, size - static_cast<size_t>(at - start));
      }
      if (legacy != 0 || managed) {
        // An allocation of its own: type, device and extent hold for all of it.
        covered[0] = start;
        covered[1] = start + size;
      } else {
        // Virtual memory (cuMem, stream-ordered pools): the range is the address reservation,
        // which may hold unmapped pages or another device's memory; the answer holds for the
        // mapping around `at`.
        CUpointer_attribute mappingWhich[2] = {CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR, CU_POINTER_ATTRIBUTE_MAPPING_SIZE};
        CUdeviceptr mappingBase = 0;
        size_t mappingSize = 0;
        void* mappingValues[2] = {&mappingBase, &mappingSize};
        if (get(2, mappingWhich, mappingValues, at) == CUDA_SUCCESS && mappingSize > 0 && at >= mappingBase &&
            at - mappingBase < mappingSize) {
          covered[0] = mappingBase;
          covered[1] = mappingBase + mappingSize;
        }
      }
    }
  }
  if (begin != nullptr) *begin = covered[0];
  if (end != nullptr) *end = covered[1];
  return unifabSuccess;
}

Result CheckedRanges::check(const void* data, size_t bytes, int device, const char* name) {
  if (bytes == 0) return unifabSuccess;
  const uintptr_t first = reinterpret_cast<uintptr_t>(data);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const Passed& p : passed_) {
      if (p.device == device && rangeInside(first, bytes, p.begin, p.end)) return unifabSuccess;
    }
  }
  uintptr_t begin = 0, end = 0;
  UF_CHECK(checkDeviceRange(data, bytes, device, name, &begin, &end));
  std::lock_guard<std::mutex> lock(mutex_);
  if (passed_.size() >= kRemembered) passed_.clear();
  passed_.push_back(Passed{begin, end, device});
  return unifabSuccess;
}

}  // namespace unifab::collectives
