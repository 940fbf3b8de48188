#include "tests/common/nccl_session.h"

#include <unistd.h>

#include <cstdlib>

namespace unifab::test {

NcclSession::~NcclSession() {
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
  device_ = env.localRank % devices;
  TEST_CUDA_CHECK(cudaSetDevice(device_));
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
      TEST_NCCL_CHECK(ncclReduceScatter(send, recv, recvCount, ncclFloat, ncclSum, comm_, stream_));
      return true;
    case Collective::kAllToAll: {
      // The grouped send/recv all-to-all users write by hand (and nccl-tests' alltoall_perf runs).
      size_t chunk = sendCount / static_cast<size_t>(env_.nRanks);
      TEST_NCCL_CHECK(ncclGroupStart());
      for (int peer = 0; peer < env_.nRanks; ++peer) {
        TEST_NCCL_CHECK(ncclSend(static_cast<const float*>(send) + peer * chunk, chunk, ncclFloat, peer, comm_, stream_));
        TEST_NCCL_CHECK(ncclRecv(static_cast<float*>(recv) + peer * chunk, chunk, ncclFloat, peer, comm_, stream_));
      }
      TEST_NCCL_CHECK(ncclGroupEnd());
      return true;
    }
    default:
      return false;
  }
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
