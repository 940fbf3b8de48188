// The NCCL host API the extension operations call, resolved at run time from the NCCL the process
// already uses (the one that loaded this plugin, or the application's), so the library adds no
// second copy of NCCL and loads without one. The device API is header-only and must match the
// runtime exactly: init refuses a runtime whose version differs from the headers'.
#pragma once

#include <nccl.h>
#include <nccl_device.h>

#include "plugin/check.h"

namespace unifab::collectives {

struct NcclRuntime {
  int version = 0;
  ncclResult_t (*getVersion)(int*) = nullptr;
  const char* (*getErrorString)(ncclResult_t) = nullptr;
  const char* (*getLastError)(ncclComm_t) = nullptr;
  ncclResult_t (*commCount)(const ncclComm_t, int*) = nullptr;
  ncclResult_t (*commCuDevice)(const ncclComm_t, int*) = nullptr;
  ncclResult_t (*memAlloc)(void**, size_t) = nullptr;
  ncclResult_t (*memFree)(void*) = nullptr;
  ncclResult_t (*windowRegister)(ncclComm_t, void*, size_t, ncclWindow_t*, int) = nullptr;
  ncclResult_t (*windowDeregister)(ncclComm_t, ncclWindow_t) = nullptr;
  ncclResult_t (*devCommCreate)(ncclComm_t, const ncclDevCommRequirements*, ncclDevComm*) = nullptr;
  ncclResult_t (*devCommDestroy)(ncclComm_t, const ncclDevComm*) = nullptr;
  ncclResult_t (*allReduce)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t) = nullptr;
};

// The resolved API; fails with a clear error when NCCL cannot be found or its version differs
// from the headers this library was built with.
Result ncclRuntime(const NcclRuntime** runtime);

// Turns an NCCL result into unifab's, logging the call and NCCL's own explanation.
Result ncclFailure(ncclResult_t result, const char* call, ncclComm_t comm, const char* file, int line);

}  // namespace unifab::collectives

#define UF_NCCL_CHECK(call, comm)                                                       \
  do {                                                                                        \
    ncclResult_t uf_nccl_ = (call);                                                           \
    if (uf_nccl_ != ncclSuccess) return ::unifab::collectives::ncclFailure(uf_nccl_, #call, comm, __FILE__, __LINE__); \
  } while (0)
