/*
 * unifab public C API.
 *
 * unifab is loaded by NCCL as its network and tuner plugin (NCCL_NET_PLUGIN=unifab) and linked by
 * applications that call its extension operations on their existing ncclComm_t. This header is
 * the application side: result codes, error reporting and version queries, shared by every
 * extension operation.
 *
 * Conventions for every function declared here:
 *  - the return value is a unifabResult_t; on failure a message naming the offending argument is
 *    logged through NCCL's logger (prefix "EXT/unifab") and kept for unifabGetLastError();
 *  - argument structs start with a `size` field set by their UNIFAB_*_INIT macro, so that later
 *    versions can grow them without breaking binaries built against this header.
 */
#ifndef UNIFAB_UNIFAB_H_
#define UNIFAB_UNIFAB_H_

#ifdef __cplusplus
extern "C" {
#endif

#define UNIFAB_VERSION_MAJOR 0
#define UNIFAB_VERSION_MINOR 1
#define UNIFAB_VERSION_PATCH 0
#define UNIFAB_VERSION_CODE (UNIFAB_VERSION_MAJOR * 10000 + UNIFAB_VERSION_MINOR * 100 + UNIFAB_VERSION_PATCH)

#if defined(__GNUC__)
#define UNIFAB_API __attribute__((visibility("default")))
#else
#define UNIFAB_API
#endif

/* The first seven values equal NCCL's ncclResult_t, so results convert in both directions. */
typedef enum {
  unifabSuccess = 0,
  unifabUnhandledCudaError = 1, /* a CUDA call failed */
  unifabSystemError = 2,        /* an operating-system call failed */
  unifabInternalError = 3,      /* a bug in unifab, or NCCL misusing a plugin table */
  unifabInvalidArgument = 4,    /* an argument is out of its documented bounds */
  unifabInvalidUsage = 5,       /* a call sequence or configuration that is not allowed */
  unifabRemoteError = 6,        /* a peer failed, closed its connection or disagreed */
  unifabInProgress = 7,         /* an asynchronous operation has not completed yet */
  unifabTimeout = 8,            /* a bounded wait expired (peer or device stalled) */
  unifabNumResults = 9
} unifabResult_t;

/* A static, human-readable name for a result code. Never NULL. */
UNIFAB_API const char* unifabGetErrorString(unifabResult_t result);

/* The message of the most recent failure on the calling thread ("" if none). The pointer stays
 * valid until the next unifab call on this thread. */
UNIFAB_API const char* unifabGetLastError(void);

/* The library's version as UNIFAB_VERSION_CODE, which may differ from the header's. */
UNIFAB_API unifabResult_t unifabGetVersion(int* version);

#ifdef __cplusplus
}
#endif

#endif /* UNIFAB_UNIFAB_H_ */
