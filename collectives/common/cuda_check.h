// CUDA calls inside the result idiom: a failing call becomes an unifabUnhandledCudaError naming
// the call and CUDA's reason. Teardown paths, which have no caller to return to (destructors),
// log the failure with UF_CUDA_WARN and carry on releasing the rest.
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

#define UF_CUDA_WARN(call)                                                                           \
  do {                                                                                               \
    cudaError_t uf_cuda_ = (call);                                                                   \
    if (uf_cuda_ != cudaSuccess) UF_WARN(kExt, "%s failed: %s", #call, cudaGetErrorString(uf_cuda_)); \
  } while (0)
