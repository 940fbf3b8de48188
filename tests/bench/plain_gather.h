// The baseline Engram's gather kernel is measured against: a warp per row, one 16-byte load and
// store per lane at a time, on a given number of SMs.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace unifab::bench {

cudaError_t launchPlainGather(const char* rows, const int64_t* rowIds, int64_t numRows, int64_t rowBytes, char* out,
                              int sms, cudaStream_t stream);

}  // namespace unifab::bench
