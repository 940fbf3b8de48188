// CUDA calls inside the result idiom: a failing call becomes an unifabUnhandledCudaError naming
// the call and CUDA's reason.
#pragma once

#include <cuda_runtime.h>

#include "plugin/check.h"

#define UF_CUDA_CHECK(call)                                                                           \
  do {                                                                                                \
    cudaError_t uf_cuda_ = (call);                                                                    \
    if (uf_cuda_ != cudaSuccess) {                                                                    \
      return UF_ERROR(unifabUnhandledCudaError, kExt, "%s failed: %s", #call, cudaGetErrorString(uf_cuda_)); \
    }                                                                                                 \
  } while (0)
