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
 *    versions can grow them without breaking binaries built against this header;
 *  - groups and tables are checked against those the library created and has not destroyed: a
 *    destroyed one passed again is refused (unifabInvalidArgument), destroying it twice too;
 *    destroying NULL does nothing;
 *  - a collective creation with a NULL configuration or output pointer on some rank still takes
 *    part in the ranks' agreement, so every rank is refused and none is left waiting;
 *  - "device pointer" means memory of the call's GPU (cudaMalloc, a memory pool, a VMM mapping)
 *    or managed memory: host memory, pinned or not, and other GPUs' memory are refused, as is an
 *    allocation that ends before the bytes the call reads (a high-throughput combine's
 *    expertOutput: at least one row).
 */
#ifndef UNIFAB_UNIFAB_H_
#define UNIFAB_UNIFAB_H_

#include <stddef.h>
#include <stdint.h>

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

/* Opaque handles of NCCL and CUDA, declared exactly as nccl.h and cuda_runtime_api.h do. */
typedef struct ncclComm* ncclComm_t;
typedef struct CUstream_st* cudaStream_t;

/* ============================================================================================
 * Expert parallelism (MoE dispatch and combine) on an existing NCCL communicator.
 *
 * An EP group owns one symmetric window registered on the caller's communicator (all ranks must
 * share an NVLink domain for the high-throughput mode of this version). Dispatch sends every
 * token once to each rank that hosts one of its top-k experts; combine returns expert outputs to
 * the tokens' ranks and sums them. Every call runs on the caller's stream and waits for nothing on
 * the host, except with hostCounts=1 or UNIFAB_EP_VALIDATE=1; such calls cannot be captured in a
 * CUDA graph, every other call can (as long as a prepared routing is free: four per group, one
 * per live handle).
 *
 * Every rank of a group makes the same calls in the same order (a dispatch everywhere, cached
 * everywhere with the handles of the same earlier dispatch, or not at all), and a group's calls
 * are ordered on one stream or by the caller's events: the calls share the group's window and
 * counters. A rank that makes another call than its peers is reported by a timeout
 * (UNIFAB_EP_TIMEOUT_MS) in most cases; a cached re-dispatch on some ranks only, or of different
 * dispatches, is not detected and corrupts the received rows.
 * ============================================================================================ */

typedef struct unifabEpGroup* unifabEpGroup_t;
typedef struct unifabEpHandle* unifabEpHandle_t;

/* High throughput: unifabEpDispatch/unifabEpCombine (training, prefill). Low latency:
 * unifabEpLowLatencyDispatch/unifabEpLowLatencyCombine (decoding, maxTokensPerRank <= 1024). */
typedef enum { unifabEpHighThroughput = 0, unifabEpLowLatency = 1 } unifabEpMode_t;
typedef enum { unifabEpBf16 = 0, unifabEpFp8E4M3 = 1 } unifabEpDtype_t;
typedef enum { unifabEpIndexInt64 = 0, unifabEpIndexInt32 = 1 } unifabEpIndexType_t;

/* Received-token layout. Rank-major: rows grouped by source rank, the sources in the order
 * rank + 1, rank + 2, ..., nRanks - 1, 0, ..., rank (from the receiving rank's next one, wrapping
 * around: its own rows last), each source's tokens in their original order; recvRowsPerRank gives
 * each source's row count. (Each rank's rows come first at one receiver, so that they need no
 * other rank's count before they leave: with two ranks, no remote row waits for the peer's
 * routing.) Expert-major: one row per (token, local expert), experts in ascending order, each
 * expert's rows in the rank-major order of their sources and tokens, every expert's region
 * starting at a multiple of `expertAlignment` rows (padding rows are left unspecified). */
typedef enum { unifabEpRankMajor = 0, unifabEpExpertMajor = 1 } unifabEpLayout_t;

#define UNIFAB_EP_SCALE_BLOCK 128 /* FP8 payloads carry one float scale per 128 values */

typedef struct {
  size_t size;                /* sizeof(unifabEpConfig_t) */
  unifabEpMode_t mode;
  int numExperts;             /* global experts, a multiple of the rank count */
  int maxTokensPerRank;       /* most tokens any rank dispatches in one call */
  int hidden;                 /* values per token */
  int topk;                   /* experts per token, 1..32 */
  int maxSms;                 /* SM cap for every call; 0 = the tuner's choice */
  int programmaticLaunch;     /* low latency, sm_90: 1 = each call's kernel is a programmatic dependent
                                 launch: the GPU schedules it while the stream's previous kernel
                                 finishes, and it waits for that kernel's completion before it reads
                                 or writes any memory (a previous kernel that triggers early, as the
                                 group's own do, lets it start sooner); 0 = plain stream order */
} unifabEpConfig_t;
#define UNIFAB_EP_CONFIG_INIT {sizeof(unifabEpConfig_t), unifabEpHighThroughput, 0, 0, 0, 0, 0, 1}

/* Bytes of symmetric memory a group with this configuration registers on each rank. */
UNIFAB_API unifabResult_t unifabEpBufferSize(const unifabEpConfig_t* config, int nRanks, size_t* bytes);

/* Collective over `comm`: every rank calls it with the same configuration. The ranks compare
 * their configurations first: if they differ, or any rank's is invalid, every rank is refused
 * (unifabInvalidUsage naming the field, or saying another rank refused; the invalid rank returns
 * its own error) and none is left waiting. */
UNIFAB_API unifabResult_t unifabEpCreate(ncclComm_t comm, const unifabEpConfig_t* config, unifabEpGroup_t* group);
/* Collective; waits for outstanding work of the group on the device. */
UNIFAB_API unifabResult_t unifabEpDestroy(unifabEpGroup_t group);

typedef struct {
  size_t size;                     /* sizeof(unifabEpDispatchArgs_t) */
  int numTokens;                   /* 0..maxTokensPerRank */
  unifabEpDtype_t dtype;
  const void* x;                   /* [numTokens, hidden] BF16 or FP8 e4m3, 16-byte aligned */
  const float* scales;             /* FP8 only: [numTokens, hidden/128] */
  const void* topkIdx;             /* [numTokens, topk] global expert ids, -1 = none */
  unifabEpIndexType_t topkIdxType;
  const float* topkWeights;        /* [numTokens, topk] or NULL */
  unifabEpLayout_t layout;
  int expertAlignment;             /* expert-major only, >= 1 */
  int numSms;                      /* 0 = the group's choice, else <= the group's cap */
  unifabEpHandle_t cachedHandle;   /* reuse this handle's routing: topkIdx is ignored */
  int hostCounts;                  /* 1: also return counts on the host (waits on the stream) */
} unifabEpDispatchArgs_t;
#define UNIFAB_EP_DISPATCH_ARGS_INIT \
  {sizeof(unifabEpDispatchArgs_t), 0, unifabEpBf16, 0, 0, 0, unifabEpIndexInt64, 0, unifabEpRankMajor, 1, 0, 0, 0}

/* Outputs of a dispatch. Device pointers point into the group's buffer and stay valid until the
 * next dispatch on the group; their capacity is the worst case (maxRows rows). */
typedef struct {
  size_t size;                     /* sizeof(unifabEpDispatchResult_t) */
  void* recvX;                     /* [maxRows, hidden] in the dispatch dtype */
  float* recvScales;               /* FP8: [maxRows, hidden/128]; else NULL */
  int* recvTopkIdx;                /* [maxRows, topk] local expert ids, -1 where not on this rank */
  float* recvTopkWeights;          /* [maxRows, topk]; 0 where not on this rank */
  int* recvSource;                 /* [maxRows, 2] (source rank, source token) */
  int* numRecvRows;                /* device scalar: rows written */
  int* recvRowsPerRank;            /* device [nRanks]: rank-major rows from each source */
  int* recvRowsPerExpert;          /* device [numLocalExperts]: rows for each local expert */
  int* expertOffsets;              /* device [numLocalExperts + 1]: expert-major region starts */
  int maxRows;                     /* capacity of the row arrays */
  int hostNumRecvRows;             /* with hostCounts: */
  int hostRecvRowsPerExpert[1024]; /*   per local expert (up to 1024 local experts) */
} unifabEpDispatchResult_t;
/* Every field named, so that C++ with -Wextra (missing-field-initializers) takes it too. */
#define UNIFAB_EP_DISPATCH_RESULT_INIT \
  {sizeof(unifabEpDispatchResult_t), 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, {0}}

typedef struct {
  size_t size;                     /* sizeof(unifabEpCombineArgs_t) */
  const void* expertOutput;        /* BF16 rows laid out as the dispatch's recvX */
  int weighted;                    /* expert-major: 1 = sum of weight x output, 0 = plain sum */
  void* combinedX;                 /* [numTokens, hidden] BF16 */
  float* combinedWeights;          /* [numTokens, topk] or NULL */
  int numSms;
} unifabEpCombineArgs_t;
#define UNIFAB_EP_COMBINE_ARGS_INIT {sizeof(unifabEpCombineArgs_t), 0, 1, 0, 0, 0}

/* Sends tokens to their experts' ranks. `handle` receives a routing handle (new, or
 * args->cachedHandle itself) for combine and for cached re-dispatch. */
UNIFAB_API unifabResult_t unifabEpDispatch(unifabEpGroup_t group, const unifabEpDispatchArgs_t* args,
                                           cudaStream_t stream, unifabEpHandle_t* handle,
                                           unifabEpDispatchResult_t* result);

/* Returns expert outputs to their tokens' ranks and sums them in a fixed order: on each rank the
 * rows of a token are summed over its local experts in ascending top-k slot order (FP32,
 * optionally weighted), rounded once to BF16; the token's rank then sums those partials over
 * ranks in ascending rank order in FP32 and rounds once to BF16. The group's buffers hold the
 * latest dispatch only, so `handle` must be that dispatch's (unifabInvalidUsage otherwise). */
UNIFAB_API unifabResult_t unifabEpCombine(unifabEpGroup_t group, unifabEpHandle_t handle,
                                          const unifabEpCombineArgs_t* args, cudaStream_t stream);

/* The group's combine input on this rank: room for *maxRows BF16 rows of `hidden` values, in the
 * rank-major layout of the dispatch's recvX. Expert outputs written here (e.g. by the expert GEMM)
 * and passed to unifabEpCombine as expertOutput are read by the other ranks where they lie, over
 * NVLink, instead of being pushed by this rank: the link carries each row once and every SM of
 * the call sums tokens. Every rank must pass its combine input to the same combine, or none (a
 * mismatch times out, see unifabEpGetAsyncError). The buffer may be rewritten once that combine
 * has completed on the stream. It is the region where a pushing combine (expertOutput elsewhere)
 * receives the peers' partial sums: write it after the group's previous combine has completed.
 * Rank-major dispatches only; it adds nothing to unifabEpBufferSize. An expertOutput inside it
 * other than its start, and combinedX or combinedWeights anywhere in the group's buffers, are
 * refused. */
UNIFAB_API unifabResult_t unifabEpCombineInputBuffer(unifabEpGroup_t group, void** buffer, int* maxRows);

/* Frees a handle; it may outlive its group. A low-latency handle whose dispatch or combine was
 * sent and awaits its receive phase is refused (unifabInvalidUsage) while its group lives: the
 * group's later receive phases follow that one. A send is likewise refused while a sent combine
 * awaits its receive and the send would reuse that dispatch's buffer set. A handle destroyed
 * already is refused (unifabInvalidArgument), here and in every call that takes a handle. */
UNIFAB_API unifabResult_t unifabEpHandleDestroy(unifabEpHandle_t handle);

/* ---- Low-latency mode (a group created with mode = unifabEpLowLatency) -------------------------
 * Each token travels once to every rank that hosts one of its top-k experts, and the receiving
 * rank places it in a fixed region per local expert, so no call waits for a count exchange and
 * none synchronises the host: every call can be captured in a CUDA graph. A call can run both of
 * its phases, or only one: the send phase returns once its writes are issued, the caller's stream
 * may then run other work, and the receive phase (a later call with the same handle) completes it.
 * Receive phases complete sends in send order: a send-and-receive call is refused
 * (unifabInvalidUsage) while an earlier send of the same operation awaits its receive phase.
 * Two buffer sets are used alternately, so the results of the latest two dispatches stay valid;
 * a third dispatch reuses the first one's set. Every wait on a peer is bounded by
 * UNIFAB_EP_TIMEOUT_MS and reported through unifabEpGetAsyncError. */
typedef enum {
  unifabEpSendAndReceive = 0,
  unifabEpSendOnly = 1,    /* issue the writes and return a handle */
  unifabEpReceiveOnly = 2  /* complete the handle's send phase */
} unifabEpPhase_t;

typedef struct {
  size_t size;                     /* sizeof(unifabEpLowLatencyDispatchArgs_t) */
  int numTokens;                   /* 0..maxTokensPerRank */
  const void* x;                   /* [numTokens, hidden] BF16, 16-byte aligned */
  const void* topkIdx;             /* [numTokens, topk] global expert ids, -1 = none */
  unifabEpIndexType_t topkIdxType;
  const float* topkWeights;        /* [numTokens, topk], applied by combine; NULL = all 1 */
  unifabEpDtype_t dtype;           /* received as: FP8 e4m3 (cast in the kernel, one float scale per
                                      128 values: amax / 448) or BF16 (as sent) */
  int ue8m0Scales;                 /* FP8: scales rounded up to a power of two (UE8M0) */
  unifabEpPhase_t phase;
  int numSms;                      /* 0 = the group's choice */
} unifabEpLowLatencyDispatchArgs_t;
#define UNIFAB_EP_LL_DISPATCH_ARGS_INIT \
  {sizeof(unifabEpLowLatencyDispatchArgs_t), 0, 0, 0, unifabEpIndexInt64, 0, unifabEpFp8E4M3, 0, unifabEpSendAndReceive, 0}

/* Expert-major receive buffers of one dispatch (inside the group; valid until the dispatch after
 * next, whose send phase already reuses them when it is called apart). Local expert e owns rows
 * [e * expertStride, e * expertStride + recvCount[e]); each row is one (source token, local expert)
 * pair, in the order the tokens arrived (recvSource names them). */
typedef struct {
  size_t size;                     /* sizeof(unifabEpLowLatencyDispatchResult_t) */
  void* recvX;                     /* [numLocalExperts * expertStride, hidden] FP8 or BF16 */
  float* recvScales;               /* FP8: [numLocalExperts * expertStride, hidden/128]; else NULL */
  int* recvSource;                 /* [numLocalExperts * expertStride, 2] (source rank, source token) */
  int* recvCount;                  /* device [numLocalExperts], complete after the receive phase */
  int expertStride;                /* nRanks * maxTokensPerRank */
} unifabEpLowLatencyDispatchResult_t;
#define UNIFAB_EP_LL_DISPATCH_RESULT_INIT {sizeof(unifabEpLowLatencyDispatchResult_t), 0, 0, 0, 0, 0}

typedef struct {
  size_t size;                     /* sizeof(unifabEpLowLatencyCombineArgs_t) */
  const void* expertOutput;        /* BF16 [numLocalExperts * expertStride, hidden]: row for row of recvX */
  int weighted;                    /* 1: sum of top-k weight x output; 0: plain sum */
  void* combinedX;                 /* [numTokens, hidden] BF16 of the dispatch's tokens */
  unifabEpPhase_t phase;
  int numSms;
} unifabEpLowLatencyCombineArgs_t;
#define UNIFAB_EP_LL_COMBINE_ARGS_INIT \
  {sizeof(unifabEpLowLatencyCombineArgs_t), 0, 1, 0, unifabEpSendAndReceive, 0}

/* Send phase (or both): *handle receives a new handle and *result the buffers. Receive only:
 * *handle must be the handle of a send-only call on this group whose receive phase has not run;
 * result may then be NULL. */
UNIFAB_API unifabResult_t unifabEpLowLatencyDispatch(unifabEpGroup_t group, const unifabEpLowLatencyDispatchArgs_t* args,
                                                     cudaStream_t stream, unifabEpHandle_t* handle,
                                                     unifabEpLowLatencyDispatchResult_t* result);

/* Returns the expert outputs of `handle`'s dispatch to their tokens' ranks. Each rank first sums
 * a token's rows over its own experts in ascending top-k slot order (FP32, weighted or not) and
 * rounds once to BF16; the token's rank then sums those partials over ranks in ascending rank
 * order in FP32 and rounds once to BF16. A token with no expert gets zeros. The send phase needs
 * the dispatch's receive phase done; the receive phase completes the send phase of the same
 * handle. The handle's dispatch must be one of the group's latest two. */
UNIFAB_API unifabResult_t unifabEpLowLatencyCombine(unifabEpGroup_t group, unifabEpHandle_t handle,
                                                    const unifabEpLowLatencyCombineArgs_t* args, cudaStream_t stream);

/* A device-side failure of any earlier call on the group, or unifabSuccess: unifabTimeout when a
 * peer stopped answering within UNIFAB_EP_TIMEOUT_MS (the group is then unusable),
 * unifabInvalidUsage when ranks made different calls (a cached re-dispatch on some ranks only; the
 * group is then unusable), or unifabInvalidArgument when a top-k id was outside
 * -1..numExperts-1 (it was treated as -1). The error stays; later calls on the group return it.
 * Does not synchronise the stream. A high-throughput dispatch ends once every peer's rows for this
 * rank have landed, so a peer that fails after that is reported by this rank's next call that
 * waits on it, not by this one (whose results are complete). */
UNIFAB_API unifabResult_t unifabEpGetAsyncError(unifabEpGroup_t group);

/* ============================================================================================
 * Pipeline send/recv on an existing NCCL communicator, with no kernel of unifab's. Both ranks must
 * be LSA peers (one NVLink domain). A rank's sends to a peer match that peer's receives from it in
 * posting order, and matched sizes must be equal. Calls cannot be captured in a CUDA graph (their
 * numbers are counted on the host). A wait that lasts longer than UNIFAB_PP_TIMEOUT_MS is released
 * by the group's watchdog and reported by unifabPpGetAsyncError (the data of that transfer is lost).
 * Two engines (UNIFAB_PP_ENGINE):
 * - rendezvous (the default, between two ranks): one copy-engine copy between the two buffers, no
 *   SM on either GPU, made by whichever call is posted second; stream memory operations hand the
 *   transfer over. At least one of the two buffers must be mappable by the peer's process
 *   (cudaMalloc'd, through legacy CUDA IPC; or cuMem memory allowing POSIX descriptors that one
 *   mapping holds whole, such as ncclMemAlloc's, its handle passed over a Unix socket; not a
 *   stream-ordered pool): a call whose buffer is not waits on the host for the peer's call and
 *   makes the copy itself, so with two unmappable
 *   buffers both hosts wait until UNIFAB_PP_TIMEOUT_MS and return unifabTimeout. At most 64
 *   transfers per direction are in flight: the 65th waits on the host for the oldest to end. A
 *   peer's allocation stays mapped into this process until the group is destroyed (one mapping per
 *   allocation, so a caching allocator's buffers are mapped once): free memory that was passed to
 *   a transfer only after unifabPpDestroy (freeing an allocation another process still maps is
 *   undefined in CUDA).
 * - slots (UNIFAB_PP_ENGINE=slots, and a rank's transfers to itself): the sender's copy engine
 *   moves each chunk into a slot of the receiver's registered window, the receiver copies it out
 *   into its buffer (a same-GPU copy, which the CUDA driver runs on SMs), and stream memory
 *   operations announce chunks and release slots. One call takes at most 128 chunks (1 GiB with
 *   the default 8 MiB chunks); a larger one is refused with unifabInvalidArgument before anything
 *   is posted. A transfer larger than the peer's slots (chunksInFlight x chunkBytes) proceeds as
 *   the receiver drains them: post the matching receive on a stream that is not waiting behind the
 *   send.
 * ============================================================================================ */

typedef struct unifabPpGroup* unifabPpGroup_t;

typedef struct {
  size_t size;          /* sizeof(unifabPpConfig_t) */
  size_t chunkBytes;    /* bytes of one receive slot, a multiple of 16; 0 = 8 MiB */
  int chunksInFlight;   /* receive slots per peer (chunks in flight per direction); 0 = 4 */
} unifabPpConfig_t;
#define UNIFAB_PP_CONFIG_INIT {sizeof(unifabPpConfig_t), 0, 0}

/* Collective over `comm`: every rank calls it with the same configuration (and the same
 * UNIFAB_PP_ENGINE); ranks that differ, or any rank's invalid configuration, refuse every rank,
 * as for unifabEpCreate. */
UNIFAB_API unifabResult_t unifabPpCreate(ncclComm_t comm, const unifabPpConfig_t* config, unifabPpGroup_t* group);
/* Collective; waits for the group's outstanding transfers. */
UNIFAB_API unifabResult_t unifabPpDestroy(unifabPpGroup_t group);
/* Sends `bytes` from device memory `data` to rank `peer` on `stream`. */
UNIFAB_API unifabResult_t unifabPpSend(unifabPpGroup_t group, const void* data, size_t bytes, int peer,
                                       cudaStream_t stream);
/* Receives `bytes` from rank `peer` into device memory `data` on `stream`. */
UNIFAB_API unifabResult_t unifabPpRecv(unifabPpGroup_t group, void* data, size_t bytes, int peer, cudaStream_t stream);
/* unifabTimeout when the watchdog released a wait that exceeded UNIFAB_PP_TIMEOUT_MS, or the error
 * of a call that failed after it was paired with (or had posted part of its data for) its peer's
 * matching call, e.g. matched calls of different sizes: either way the group is then unusable and
 * later calls return that error. Else unifabSuccess. Does not synchronise. */
UNIFAB_API unifabResult_t unifabPpGetAsyncError(unifabPpGroup_t group);

/* ============================================================================================
 * Engram: a table of rows spread over the ranks of a communicator (rank r holds global rows
 * r * rowsPerRank .. (r + 1) * rowsPerRank - 1), read by global row id into a local buffer. Two
 * engines: the copy engine (no SM; needs the ids on the host, merges runs of adjacent ids into
 * one copy; best for large rows) and a gather kernel on a few SMs (ids on the device; best for
 * small rows). A fetch is issued on the table's own stream after the caller's stream's earlier
 * work, and joined back with unifabEngramWait, so the caller's stream runs on in between (and a
 * fetch cannot be captured in a CUDA graph in this version). All
 * ranks holding rows a fetch reads must be LSA peers of the reader (one NVLink domain).
 * ============================================================================================ */

typedef struct unifabEngramTable* unifabEngramTable_t;
typedef struct unifabEngramFetch* unifabEngramFetch_t;

typedef struct {
  size_t size;            /* sizeof(unifabEngramConfig_t) */
  size_t rowBytes;        /* bytes of one row (BF16, FP8 or raw), a multiple of 16, at most 1 MiB */
  int64_t rowsPerRank;    /* rows each rank holds */
  int rowScales;          /* 1: every row also carries one float (the scale of an FP8 row) */
} unifabEngramConfig_t;
#define UNIFAB_ENGRAM_CONFIG_INIT {sizeof(unifabEngramConfig_t), 0, 0, 0}

typedef enum {
  unifabEngramAuto = 0,        /* the copy engine for ids on the host, the gather kernel for ids on the
                                  device (large rows: host ids; small rows: device ids and a few SMs) */
  unifabEngramCopyEngine = 1,  /* no SM; needs hostRowIds = 1 */
  unifabEngramSmGather = 2     /* a gather kernel on at most maxSms SMs */
} unifabEngramEngine_t;

typedef struct {
  size_t size;                     /* sizeof(unifabEngramFetchArgs_t) */
  const void* rowIds;              /* [numRows] global row ids */
  unifabEpIndexType_t rowIdType;   /* int64 or int32 */
  int hostRowIds;                  /* 1: rowIds is host memory, read during the call */
  size_t numRows;
  void* out;                       /* [numRows, rowBytes] device memory, 16-byte aligned */
  float* outScales;                /* [numRows] when the table has row scales, else ignored */
  unifabEngramEngine_t engine;
  int maxSms;                      /* gather kernel: at most this many SMs; 0 = 4 */
} unifabEngramFetchArgs_t;
#define UNIFAB_ENGRAM_FETCH_ARGS_INIT \
  {sizeof(unifabEngramFetchArgs_t), 0, unifabEpIndexInt64, 0, 0, 0, 0, unifabEngramAuto, 0}

/* Collective over `comm`; the table starts zeroed. Every rank passes the same configuration;
 * ranks that differ, or any rank's invalid one, refuse every rank, as for unifabEpCreate. */
UNIFAB_API unifabResult_t unifabEngramCreate(ncclComm_t comm, const unifabEngramConfig_t* config,
                                             unifabEngramTable_t* table);
/* Collective; waits for the table's outstanding fetches. */
UNIFAB_API unifabResult_t unifabEngramDestroy(unifabEngramTable_t table);
/* Writes `numRows` rows (and their scales, with row scales) from device memory into this rank's
 * rows firstRow.. on `stream` (copy engine). Readers see them in fetches issued after `stream`'s
 * write completes. */
UNIFAB_API unifabResult_t unifabEngramWrite(unifabEngramTable_t table, int64_t firstRow, int64_t numRows,
                                            const void* rows, const float* scales, cudaStream_t stream);
/* Issues a fetch after the earlier work of `stream`; *fetch is to be waited for exactly once. */
UNIFAB_API unifabResult_t unifabEngramFetchIssue(unifabEngramTable_t table, const unifabEngramFetchArgs_t* args,
                                                 cudaStream_t stream, unifabEngramFetch_t* fetch);
/* Makes `stream` wait for the fetch's rows and releases the fetch. *smsUsed (may be NULL)
 * receives the SMs the fetch held: 0 for the copy engine. When the wait cannot be made (an invalid
 * stream), the error is returned and the fetch is kept, to be waited for again. A fetch waited
 * for already is refused (unifabInvalidArgument). */
UNIFAB_API unifabResult_t unifabEngramWait(unifabEngramFetch_t fetch, cudaStream_t stream, int* smsUsed);
/* unifabInvalidArgument when a gather kernel met a row id out of range (its row was zeroed), else
 * unifabSuccess. Does not synchronise. The error stays: from then on the table's writes and fetch
 * issues return it too (a caller's ids are wrong; rows fetched with them are not to be used). */
UNIFAB_API unifabResult_t unifabEngramGetAsyncError(unifabEngramTable_t table);

#ifdef __cplusplus
}
#endif

#endif /* UNIFAB_UNIFAB_H_ */
