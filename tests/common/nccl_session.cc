#include "tests/common/nccl_session.h"

#include <unistd.h>

#include <cstdlib>
#include <vector>

namespace unifab::test {

NcclSession::~NcclSession() {
  if (scratch_ != nullptr) cudaFree(scratch_);
  if (comm_ != nullptr) ncclCommDestroy(comm_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

bool NcclSession::init(const RankEnvironment& env) {
  env_ = env;
  int devices = 0;
  TEST_CUDA_CHECK(cudaGetDeviceCount(&devices));
  if (devices < 1) {
    fprintf(stderr, "rank %d: no CUDA device\n", env.rank);
    return false;
  }
  if (env.nRanks > devices && std::getenv("NCCL_HOSTID") == nullptr) {
    fprintf(stderr, "rank %d: %d ranks on %d visible GPU(s) of one host, which NCCL refuses: skipped (this test needs a GPU a rank)\n",
            env.rank, env.nRanks, devices);
    skipped_ = true;
    return false;
  }
  TEST_CUDA_CHECK(cudaSetDevice(env.localRank % devices));
  TEST_CUDA_CHECK(cudaMalloc(&scratch_, sizeof(double)));
  TEST_CUDA_CHECK(cudaMemset(scratch_, 0, sizeof(double)));
  TEST_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  ncclUniqueId id;
  if (env.rank == 0) TEST_NCCL_CHECK(ncclGetUniqueId(&id));
  if (env.nRanks > 1 && !shareBlob(env, &id, sizeof(id))) {
    fprintf(stderr, "rank %d: no ncclUniqueId in %s\n", env.rank, env.uidFile.c_str());
    return false;
  }
  TEST_NCCL_CHECK(ncclCommInitRank(&comm_, env.nRanks, id, env.rank));
  return true;
}

bool NcclSession::run(Collective collective, const void* send, void* recv, size_t sendCount, size_t recvCount) {
  switch (collective) {
    case Collective::kAllReduce:
      TEST_NCCL_CHECK(ncclAllReduce(send, recv, sendCount, ncclFloat, ncclSum, comm_, stream_));
      return true;
    case Collective::kAllGather:
      TEST_NCCL_CHECK(ncclAllGather(send, recv, sendCount, ncclFloat, comm_, stream_));
      return true;
    case Collective::kReduceScatter:
      TEST_NCCL_CHECK(ncclReduceScatter(send, recv, ncclCallCount(collective, sendCount, recvCount), ncclFloat,
                                        ncclSum, comm_, stream_));
      return true;
    case Collective::kBroadcast:
      TEST_NCCL_CHECK(ncclBroadcast(send, recv, sendCount, ncclFloat, 0, comm_, stream_));
      return true;
    case Collective::kAllToAll: {
      // As nccl-tests' alltoall_perf: equal chunks through grouped send/recv.
      const size_t chunkBytes = sendCount / static_cast<size_t>(env_.nRanks) * sizeof(float);
      std::vector<size_t> bytes(static_cast<size_t>(env_.nRanks), chunkBytes);
      return exchange(static_cast<const char*>(send), static_cast<char*>(recv), chunkBytes, bytes.data(), bytes.data());
    }
    default:
      return false;
  }
}

GraphExec::~GraphExec() {
  if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
}

bool GraphExec::launch(cudaStream_t stream) {
  if (exec_ == nullptr) {
    fprintf(stderr, "GraphExec::launch: nothing captured\n");
    return false;
  }
  TEST_CUDA_CHECK(cudaGraphLaunch(exec_, stream));
  return true;
}

bool NcclSession::captureRuns(Collective collective, const void* send, void* recv, size_t sendCount,
                              size_t recvCount, int calls, GraphExec* graph) {
  if (graph->exec_ != nullptr || calls < 1) {
    fprintf(stderr, "NcclSession::captureRuns: needs an empty graph and calls >= 1 (got %d)\n", calls);
    return false;
  }
  TEST_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal));
  bool recorded = true;
  for (int i = 0; i < calls && recorded; ++i) recorded = run(collective, send, recv, sendCount, recvCount);
  cudaGraph_t captured = nullptr;
  // Capture ends after a failed call too, or the stream would stay capturing.
  const cudaError_t ended = cudaStreamEndCapture(stream_, &captured);
  if (!recorded) {
    if (captured != nullptr) cudaGraphDestroy(captured);
    return false;
  }
  TEST_CUDA_CHECK(ended);
  const cudaError_t instantiated = cudaGraphInstantiate(&graph->exec_, captured, 0);
  cudaGraphDestroy(captured);
  TEST_CUDA_CHECK(instantiated);
  return true;
}

bool NcclSession::exchange(const char* send, char* recv, size_t stride, const size_t* sendBytes,
                           const size_t* recvBytes) {
  TEST_NCCL_CHECK(ncclGroupStart());
  for (int peer = 0; peer < env_.nRanks; ++peer) {
    TEST_NCCL_CHECK(ncclSend(send + peer * stride, sendBytes[peer], ncclChar, peer, comm_, stream_));
    TEST_NCCL_CHECK(ncclRecv(recv + peer * stride, recvBytes[peer], ncclChar, peer, comm_, stream_));
  }
  TEST_NCCL_CHECK(ncclGroupEnd());
  return true;
}

bool NcclSession::barrier(bool hostWait) {
  TEST_NCCL_CHECK(ncclAllReduce(scratch_, scratch_, 1, ncclFloat64, ncclMax, comm_, stream_));
  if (hostWait) TEST_CUDA_CHECK(cudaStreamSynchronize(stream_));
  return true;
}

bool NcclSession::maxOverRanks(double* value) {
  TEST_CUDA_CHECK(cudaMemcpyAsync(scratch_, value, sizeof(double), cudaMemcpyHostToDevice, stream_));
  TEST_NCCL_CHECK(ncclAllReduce(scratch_, scratch_, 1, ncclFloat64, ncclMax, comm_, stream_));
  TEST_CUDA_CHECK(cudaMemcpyAsync(value, scratch_, sizeof(double), cudaMemcpyDeviceToHost, stream_));
  TEST_CUDA_CHECK(cudaStreamSynchronize(stream_));
  return true;
}

std::string ncclDebugFilePath() {
  const char* pattern = getenv("NCCL_DEBUG_FILE");
  if (pattern == nullptr) return std::string();
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  // NCCL cuts the host name at the first '.'.
  for (char* c = host; *c; ++c) {
    if (*c == '.') *c = '\0';
  }
  std::string path;
  for (const char* c = pattern; *c; ++c) {
    if (c[0] == '%' && c[1] == 'h') {
      path += host;
      ++c;
    } else if (c[0] == '%' && c[1] == 'p') {
      path += std::to_string(getpid());
      ++c;
    } else {
      path.push_back(*c);
    }
  }
  return path;
}

}  // namespace unifab::test
