// Helpers shared by both EP modes: consecutive aligned arrays carved out of one allocation (window
// layouts as offsets, device memory as one zeroed cudaMalloc), and checks of user arguments.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "collectives/common/cuda_check.h"
#include "collectives/common/device_range.h"

namespace unifab::collectives::ep {

// User structs may carry any bit pattern in an enum field; reading it as the enum type when it holds
// an unlisted value is undefined behaviour in C++, so validation reads the raw integer instead.
template <typename Enum>
int rawEnum(const Enum& field) {
  static_assert(sizeof(Enum) == sizeof(int), "C enums in unifab.h are int-sized");
  int value;
  std::memcpy(&value, &field, sizeof value);
  return value;
}

constexpr size_t kCarveAlign = 256;

inline size_t alignUp(size_t value) { return (value + kCarveAlign - 1) / kCarveAlign * kCarveAlign; }

inline bool aligned16(const void* pointer) { return alignedTo(pointer, 16); }

// unifabInvalidArgument unless top-k ids (of `idBytes`) and weights (floats; may be NULL) are
// aligned to their elements, for both modes' dispatch.
Result checkTopkAlignment(const void* topkIdx, size_t idBytes, const float* topkWeights);

// Carves consecutive aligned arrays out of one allocation.
class Carver {
 public:
  explicit Carver(char* base) : base_(base) {}
  // Offset of the next `bytes`, rounded up so that the following array starts aligned.
  size_t reserve(size_t bytes) {
    const size_t offset = offset_;
    offset_ = alignUp(offset_ + bytes);
    return offset;
  }
  template <typename T>
  T* take(size_t count) {
    return reinterpret_cast<T*>(base_ + reserve(sizeof(T) * count));
  }
  size_t used() const { return offset_; }

 private:
  char* base_;
  size_t offset_ = 0;
};

// One zeroed device allocation for every array `carveAll` takes from a Carver: a pass over a null
// base measures, the second hands out the pointers, so the list of arrays is written once.
template <typename CarveAll>
Result allocateCarved(void** memory, CarveAll carveAll) {
  Carver measure(nullptr);
  carveAll(measure);
  UF_CUDA_CHECK(cudaMalloc(memory, measure.used()));
  UF_CUDA_CHECK(cudaMemset(*memory, 0, measure.used()));
  Carver carve(static_cast<char*>(*memory));
  carveAll(carve);
  return unifabSuccess;
}

}  // namespace unifab::collectives::ep
