#include "collectives/common/nccl_runtime.h"

#include <dlfcn.h>

#include <mutex>
#include <string>

namespace unifab::collectives {
namespace {

// The NCCL already mapped into the process wins; only if there is none is one loaded.
void* openNccl() {
  for (const char* name : {"libnccl.so.2", "libnccl.so"}) {
    if (void* handle = dlopen(name, RTLD_NOW | RTLD_NOLOAD | RTLD_GLOBAL)) return handle;
  }
  if (dlsym(RTLD_DEFAULT, "ncclCommWindowRegister") != nullptr) return RTLD_DEFAULT;
  return dlopen("libnccl.so.2", RTLD_NOW | RTLD_GLOBAL);
}

template <typename Function>
bool resolve(void* library, const char* name, Function* out) {
  *out = reinterpret_cast<Function>(dlsym(library, name));
  return *out != nullptr;
}

struct Resolution {
  NcclRuntime runtime;
  Result result = unifabSuccess;
  std::string why;  // the failure's message, repeated by every later call
};

Resolution resolveOnce() {
  Resolution r;
  void* library = openNccl();
  if (library == nullptr) {
    r.result = UF_ERROR(unifabSystemError, kExt, "cannot find NCCL (libnccl.so.2) in the process: %s", dlerror());
    return r;
  }
  NcclRuntime& n = r.runtime;
  bool ok = resolve(library, "ncclGetVersion", &n.getVersion) && resolve(library, "ncclGetErrorString", &n.getErrorString) &&
            resolve(library, "ncclGetLastError", &n.getLastError) && resolve(library, "ncclCommCount", &n.commCount) &&
            resolve(library, "ncclCommCuDevice", &n.commCuDevice) &&
            resolve(library, "ncclMemAlloc", &n.memAlloc) && resolve(library, "ncclMemFree", &n.memFree) &&
            resolve(library, "ncclCommWindowRegister", &n.windowRegister) &&
            resolve(library, "ncclCommWindowDeregister", &n.windowDeregister) &&
            resolve(library, "ncclDevCommCreate", &n.devCommCreate) &&
            resolve(library, "ncclDevCommDestroy", &n.devCommDestroy) && resolve(library, "ncclAllReduce", &n.allReduce);
  if (!ok) {
    r.result = UF_ERROR(unifabInvalidUsage, kExt,
                        "the NCCL in this process lacks the device API (ncclDevCommCreate, windows): NCCL >= %d.%d "
                        "is required", NCCL_MAJOR, NCCL_MINOR);
    return r;
  }
  if (n.getVersion(&n.version) != ncclSuccess) {
    r.result = UF_ERROR(unifabInternalError, kExt, "ncclGetVersion failed");
    return r;
  }
  if (n.version != NCCL_VERSION_CODE) {
    // Device-API structures are compiled into our kernels: any other version corrupts memory.
    r.result = UF_ERROR(unifabInvalidUsage, kExt,
                        "NCCL runtime version %d differs from the headers unifab was built with (%d): rebuild "
                        "unifab with NCCL_HOME pointing at the NCCL this process uses", n.version, NCCL_VERSION_CODE);
    return r;
  }
  UF_INFO(kExt, kLogInit, "extension operations use NCCL %d (device API)", n.version);
  return r;
}

}  // namespace

Result ncclRuntime(const NcclRuntime** runtime) {
  static std::once_flag once;
  static Resolution resolution;
  std::call_once(once, [] {
    resolution = resolveOnce();
    if (resolution.result != unifabSuccess) resolution.why = lastErrorMessage();
  });
  if (resolution.result != unifabSuccess) {
    return UF_ERROR(resolution.result, kExt, "NCCL is unavailable to the extension operations: %s", resolution.why.c_str());
  }
  *runtime = &resolution.runtime;
  return unifabSuccess;
}

Result ncclFailure(ncclResult_t result, const char* call, ncclComm_t comm, const char* file, int line) {
  const NcclRuntime* n = nullptr;
  const char* reason = "";
  const char* detail = "";
  if (ncclRuntime(&n) == unifabSuccess) {
    reason = n->getErrorString(result);
    detail = comm != nullptr ? n->getLastError(comm) : "";
  }
  Result code = result == ncclSystemError     ? unifabSystemError
                : result == ncclInvalidArgument ? unifabInvalidArgument
                : result == ncclInvalidUsage    ? unifabInvalidUsage
                : result == ncclRemoteError     ? unifabRemoteError
                : result == ncclUnhandledCudaError ? unifabUnhandledCudaError
                                                   : unifabInternalError;
  return fail(code, LogComponent::kExt, file, line, "%s failed: %s%s%s", call, reason, detail[0] ? ": " : "", detail);
}

}  // namespace unifab::collectives
