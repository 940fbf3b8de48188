/*
 * unifab's declaration of the types NCCL passes to every plugin interface (logger, result codes,
 * profiler callback). Written from NCCL's documented plugin ABI; the layout and values are the
 * ABI, the text is ours. Include only in code that talks to NCCL's plugin tables.
 */
#ifndef UNIFAB_NCCL_COMMON_H_
#define UNIFAB_NCCL_COMMON_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* nccl.h declares the same result enum; reuse it when it came first in this translation unit. */
#ifndef NCCL_H_
typedef enum {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,       /* OS or hardware failure */
  ncclInternalError = 3,     /* NCCL misused the plugin, or a plugin bug */
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,      /* configuration error */
  ncclRemoteError = 6,       /* the peer failed or went away */
  ncclInProgress = 7
} ncclResult_t;
#endif

typedef enum {
  NCCL_LOG_NONE = 0,
  NCCL_LOG_VERSION = 1,
  NCCL_LOG_WARN = 2,
  NCCL_LOG_INFO = 3,
  NCCL_LOG_ABORT = 4,
  NCCL_LOG_TRACE = 5
} ncclDebugLogLevel;

/* Subsystem bits; NCCL filters INFO and TRACE output with NCCL_DEBUG_SUBSYS. */
typedef enum {
  NCCL_INIT = 1,
  NCCL_COLL = 2,
  NCCL_P2P = 4,
  NCCL_SHM = 8,
  NCCL_NET = 16,
  NCCL_GRAPH = 32,
  NCCL_TUNING = 64,
  NCCL_ENV = 128,
  NCCL_ALLOC = 256,
  NCCL_CALL = 512,
  NCCL_PROXY = 1024,
  NCCL_NVLS = 2048,
  NCCL_BOOTSTRAP = 4096,
  NCCL_REG = 8192,
  NCCL_ALL = ~0
} ncclDebugLogSubSys;

typedef void (*ncclDebugLogger_t)(ncclDebugLogLevel level, unsigned long flags, const char* file,
                                  int line, const char* fmt, ...);

/* Net plugins may report per-request events to NCCL's profiler through this callback. */
typedef ncclResult_t (*ncclProfilerCallback_t)(void** eventHandle, int type, void* pluginHandle,
                                               int64_t pluginId, void* extraData);

#ifdef __cplusplus
}
#endif

#endif /* UNIFAB_NCCL_COMMON_H_ */
