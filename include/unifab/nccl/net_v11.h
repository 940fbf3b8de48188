/*
 * unifab's declaration of NCCL's network plugin interface, version 11 (NCCL 2.28; NCCL 2.30 still
 * loads it). Written from the documented ABI: member order, types and constants are the contract.
 */
#ifndef UNIFAB_NCCL_NET_V11_H_
#define UNIFAB_NCCL_NET_V11_H_

#include "unifab/nccl/common.h"

#ifdef __cplusplus
extern "C" {
#endif

#define NCCL_NET_HANDLE_MAXSIZE 128          /* bytes of a listen handle NCCL ships to the peer */
#define NCCL_MAX_NET_SIZE_BYTES (1ULL << 40) /* upper bound for maxP2pBytes / maxCollBytes */
#define NCCL_NET_OPTIONAL_RECV_COMPLETION 0x1 /* value NCCL may pre-store in *request of irecv */

#define NCCL_PTR_HOST 0x1
#define NCCL_PTR_CUDA 0x2
#define NCCL_PTR_DMABUF 0x4

#define NCCL_NET_MAX_REQUESTS 32 /* outstanding requests each comm must sustain */
#define NCCL_NET_MAX_DEVS_PER_NIC_V11 4
#define NCCL_NET_TRAFFIC_CLASS_UNDEF (-1)
#define NCCL_NET_DEVICE_INVALID_VERSION 0x0

typedef enum {
  NCCL_NET_DEVICE_HOST = 0,      /* the CPU drives the transfers: what unifab's transports are */
  NCCL_NET_DEVICE_UNPACK = 1,    /* device-side unpack offload (GPUDirect TCPX) */
  NCCL_NET_DEVICE_GIN_PROXY = 2, /* GIN table only */
  NCCL_NET_DEVICE_GIN_GDAKI = 3  /* GIN table only */
} ncclNetDeviceType;

typedef struct {
  ncclNetDeviceType netDeviceType;
  int netDeviceVersion;
  void* handle;
  size_t size;
  int needsProxyProgress;
} ncclNetDeviceHandle_v11_t;

typedef struct {
  int ndevs;
  int devs[NCCL_NET_MAX_DEVS_PER_NIC_V11];
} ncclNetVDeviceProps_v11_t;

typedef struct {
  int trafficClass; /* NCCL_NET_TRAFFIC_CLASS_UNDEF when the user set none */
} ncclNetCommConfig_v11_t;

typedef struct {
  char* name;                      /* for logs */
  char* pciPath;                   /* sysfs path of the PCI device; NULL places the NIC at the CPU */
  uint64_t guid;                   /* same guid = same physical port */
  int ptrSupport;                  /* NCCL_PTR_* bits the transport can send from / receive into */
  int regIsGlobal;                 /* registrations outlive the comm they were made on */
  int forceFlush;                  /* ask NCCL to call iflush after every receive */
  int speed;                       /* Mbit/s */
  int port;
  float latency;                   /* microseconds; 0 keeps NCCL's default */
  int maxComms;
  int maxRecvs;                    /* buffers one grouped irecv may carry */
  ncclNetDeviceType netDeviceType;
  int netDeviceVersion;
  ncclNetVDeviceProps_v11_t vProps;
  size_t maxP2pBytes;              /* largest single transfer; NCCL splits larger ones */
  size_t maxCollBytes;
  int maxMultiRequestSize;
} ncclNetProperties_v11_t;

typedef struct {
  int32_t maxConcurrentPeers;
  int32_t minConcurrentPeers;
  int32_t maxFlowsPerPeer;
  int32_t minFlowsPerPeer;
} ncclNetCommAttr_v11_t;

typedef struct {
  ncclNetCommAttr_v11_t sendCommAttr;
  ncclNetCommAttr_v11_t recvCommAttr;
  uint32_t op;
  uint32_t algo;
  uint32_t proto;
} ncclNetAttr_v11_t;

typedef struct {
  const char* name;
  ncclResult_t (*init)(void** ctx, uint64_t commId, ncclNetCommConfig_v11_t* config,
                       ncclDebugLogger_t logFunction, ncclProfilerCallback_t profFunction);
  ncclResult_t (*devices)(int* ndev);
  ncclResult_t (*getProperties)(int dev, ncclNetProperties_v11_t* props);
  ncclResult_t (*listen)(void* ctx, int dev, void* handle, void** listenComm);
  /* connect and accept never block: success with a NULL comm means "call again". */
  ncclResult_t (*connect)(void* ctx, int dev, void* handle, void** sendComm,
                          ncclNetDeviceHandle_v11_t** sendDevComm);
  ncclResult_t (*accept)(void* listenComm, void** recvComm, ncclNetDeviceHandle_v11_t** recvDevComm);
  ncclResult_t (*regMr)(void* comm, void* data, size_t size, int type, void** mhandle);
  ncclResult_t (*regMrDmaBuf)(void* comm, void* data, size_t size, int type, uint64_t offset, int fd,
                              void** mhandle);
  ncclResult_t (*deregMr)(void* comm, void* mhandle);
  /* isend / irecv return a NULL request when the transport cannot take more work yet. */
  ncclResult_t (*isend)(void* sendComm, void* data, size_t size, int tag, void* mhandle,
                        void* phandle, void** request);
  ncclResult_t (*irecv)(void* recvComm, int n, void** data, size_t* sizes, int* tags,
                        void** mhandles, void** phandles, void** request);
  ncclResult_t (*iflush)(void* recvComm, int n, void** data, int* sizes, void** mhandles,
                         void** request);
  ncclResult_t (*test)(void* request, int* done, int* sizes);
  ncclResult_t (*closeSend)(void* sendComm);
  ncclResult_t (*closeRecv)(void* recvComm);
  ncclResult_t (*closeListen)(void* listenComm);
  ncclResult_t (*getDeviceMr)(void* comm, void* mhandle, void** dptrMhandle);
  ncclResult_t (*irecvConsumed)(void* recvComm, int n, void* request);
  ncclResult_t (*makeVDevice)(int* d, ncclNetVDeviceProps_v11_t* props);
  ncclResult_t (*finalize)(void* ctx);
  ncclResult_t (*setNetAttr)(void* ctx, ncclNetAttr_v11_t* netAttr);
} ncclNet_v11_t;

#ifdef __cplusplus
}
#endif

#endif /* UNIFAB_NCCL_NET_V11_H_ */
