// One rank's NCCL session for GPU tests and benchmarks: device selection, ncclUniqueId through
// the launcher's file, communicator init and teardown, and the collectives under test.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdio>
#include <string>

#include "tests/common/device_data.h"
#include "tests/common/rank_launcher.h"
#include "tests/common/test_util.h"

#define TEST_CUDA_CHECK(call)                                                                       \
  do {                                                                                              \
    cudaError_t err_ = (call);                                                                      \
    if (err_ != cudaSuccess) {                                                                      \
      fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(err_)); \
      return false;                                                                                 \
    }                                                                                               \
  } while (0)

#define TEST_NCCL_CHECK(call)                                                                       \
  do {                                                                                              \
    ncclResult_t res_ = (call);                                                                     \
    if (res_ != ncclSuccess) {                                                                      \
      fprintf(stderr, "%s:%d: %s failed: %s (%s)\n", __FILE__, __LINE__, #call, ncclGetErrorString(res_), \
              ncclGetLastError(nullptr));                                                           \
      return false;                                                                                 \
    }                                                                                               \
  } while (0)

namespace unifab::test {

// An instantiated CUDA graph, destroyed with this object.
class GraphExec {
 public:
  GraphExec() = default;
  ~GraphExec();
  GraphExec(const GraphExec&) = delete;
  GraphExec& operator=(const GraphExec&) = delete;

  cudaGraphExec_t get() const { return exec_; }
  bool launch(cudaStream_t stream);

 private:
  friend class NcclSession;
  cudaGraphExec_t exec_ = nullptr;
};

class NcclSession {
 public:
  NcclSession() = default;
  ~NcclSession();
  NcclSession(const NcclSession&) = delete;
  NcclSession& operator=(const NcclSession&) = delete;

  // Selects the GPU (local rank modulo the visible count) and joins the communicator. False, with
  // skipped() true and a message, where the ranks outnumber the visible GPUs and NCCL_HOSTID does
  // not make them separate hosts: NCCL refuses two ranks of one host on one GPU.
  bool init(const RankEnvironment& env);
  bool skipped() const { return skipped_; }
  bool run(Collective collective, const void* send, void* recv, size_t sendCount, size_t recvCount);
  // `calls` runs of the collective captured on this session's stream into one graph (as training
  // loops capture them); `graph` must be empty.
  bool captureRuns(Collective collective, const void* send, void* recv, size_t sendCount, size_t recvCount,
                   int calls, GraphExec* graph);
  // Grouped send/recv with every peer (the all-to-all users write by hand): sendBytes[p] bytes
  // from send + p * stride to peer p, and recvBytes[p] from peer p into recv + p * stride.
  bool exchange(const char* send, char* recv, size_t stride, const size_t* sendBytes, const size_t* recvBytes);
  // All ranks' streams meet here; with hostWait the host also waits until they have.
  bool barrier(bool hostWait);
  // Replaces *value by its maximum over all ranks (the slowest rank's time).
  bool maxOverRanks(double* value);

  ncclComm_t comm() const { return comm_; }
  cudaStream_t stream() const { return stream_; }
  int rank() const { return env_.rank; }
  int nRanks() const { return env_.nRanks; }

 private:
  RankEnvironment env_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  double* scratch_ = nullptr;  // device word for barrier and maxOverRanks
  bool skipped_ = false;
};

// The NCCL debug file this process writes, from NCCL_DEBUG_FILE's %h and %p; "" if unset.
std::string ncclDebugFilePath();

}  // namespace unifab::test
