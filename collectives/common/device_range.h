// Checks that a caller's pointer and size describe device memory a copy on `device` may touch,
// before anything is posted: a host pointer or a size past the end of the allocation would
// otherwise fail only inside the copy, after the peer was already paired with this call.
#pragma once

#include <cstddef>

#include "plugin/check.h"

namespace unifab::collectives {

// unifabInvalidArgument (naming `name`) unless [data, data + bytes) is device memory of CUDA
// device `device`, or managed memory, within one allocation. bytes == 0 passes.
Result checkDeviceRange(const void* data, size_t bytes, int device, const char* name);

}  // namespace unifab::collectives
