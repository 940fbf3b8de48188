#include "tests/bench/peer_buffer.h"

#include <cuda_runtime.h>

#include <algorithm>

namespace unifab::bench {

PeerBuffer::~PeerBuffer() {
  for (char* p : peers_) {
    if (p != nullptr) cudaIpcCloseMemHandle(p);
  }
  cudaFree(local_);
}

bool PeerBuffer::open(test::NcclSession& session, size_t bytes) {
  const int n = session.nRanks(), me = session.rank();
  cudaStream_t stream = session.stream();
  TEST_CUDA_CHECK(cudaMalloc(&local_, std::max<size_t>(bytes, 256)));
  cudaIpcMemHandle_t mine;
  TEST_CUDA_CHECK(cudaIpcGetMemHandle(&mine, local_));
  char* handles = nullptr;
  TEST_CUDA_CHECK(cudaMalloc(&handles, sizeof(mine) * n));
  TEST_CUDA_CHECK(cudaMemcpy(handles + sizeof(mine) * me, &mine, sizeof(mine), cudaMemcpyHostToDevice));
  TEST_NCCL_CHECK(ncclAllGather(handles + sizeof(mine) * me, handles, sizeof(mine), ncclChar, session.comm(), stream));
  std::vector<cudaIpcMemHandle_t> all(n);
  TEST_CUDA_CHECK(cudaMemcpyAsync(all.data(), handles, sizeof(mine) * n, cudaMemcpyDeviceToHost, stream));
  TEST_CUDA_CHECK(cudaStreamSynchronize(stream));
  TEST_CUDA_CHECK(cudaFree(handles));
  peers_.assign(n, nullptr);
  for (int p = 0; p < n; ++p) {
    if (p == me) continue;
    void* opened = nullptr;
    TEST_CUDA_CHECK(cudaIpcOpenMemHandle(&opened, all[p], cudaIpcMemLazyEnablePeerAccess));
    peers_[p] = static_cast<char*>(opened);
  }
  return true;
}

}  // namespace unifab::bench
