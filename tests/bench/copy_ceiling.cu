#include "tests/bench/copy_ceiling.h"

#include <algorithm>
#include <vector>

#include "tests/bench/bench_common.h"
#include "tests/bench/peer_buffer.h"

namespace unifab::bench {
namespace {

constexpr int kThreads = 1024;
constexpr int kUnroll = 8;

// Copies rows of `rowVectors` 16-byte vectors, one warp per row, kUnroll vectors in flight per lane.
// Predicated: the last round is a full one with its missing vectors masked off, instead of a
// vector at a time (whose load and store may serialise on the compiler's aliasing assumption).
__device__ __forceinline__ void copyRow(const int4* in, int4* out, int rowVectors, int lane, bool predicated) {
  if (predicated) {
    for (int i = lane; i < rowVectors; i += kUnroll * 32) {
      int4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (i + u * 32 < rowVectors) v[u] = __ldg(in + i + u * 32);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (i + u * 32 < rowVectors) out[i + u * 32] = v[u];
      }
    }
    return;
  }
  int i = lane;
  for (; i + (kUnroll - 1) * 32 < rowVectors; i += kUnroll * 32) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = __ldg(in + i + u * 32);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) out[i + u * 32] = v[u];
  }
  for (; i < rowVectors; i += 32) out[i] = __ldg(in + i);
}

// Rows [0, remoteRows) go to the peer and [0, localRows) to the local buffer. Interleaved: every
// warp alternates a remote and a local row, as a dispatch warp does. Split: the first
// `remoteBlocks` blocks take the remote rows, the others the local ones.
__global__ void __launch_bounds__(kThreads) copyRowsKernel(const int4* src, int4* peerDst, int4* localDst,
                                                           long remoteRows, long localRows, int rowVectors,
                                                           int remoteBlocks, bool predicated) {
  const int lane = threadIdx.x % 32;
  const int perBlock = kThreads / 32;
  if (remoteBlocks > 0) {
    const bool remote = static_cast<int>(blockIdx.x) < remoteBlocks;
    const int blocks = remote ? remoteBlocks : static_cast<int>(gridDim.x) - remoteBlocks;
    const long first = static_cast<long>(remote ? blockIdx.x : blockIdx.x - remoteBlocks) * perBlock + threadIdx.x / 32;
    const long rows = remote ? remoteRows : localRows;
    int4* dst = remote ? peerDst : localDst;
    for (long j = first; j < rows; j += static_cast<long>(blocks) * perBlock) {
      copyRow(src + j * rowVectors, dst + j * rowVectors, rowVectors, lane, predicated);
    }
    return;
  }
  const long warps = static_cast<long>(gridDim.x) * perBlock;
  const long warp = static_cast<long>(blockIdx.x) * perBlock + threadIdx.x / 32;
  const long paired = 2 * (remoteRows < localRows ? remoteRows : localRows);
  for (long j = warp; j < remoteRows + localRows; j += warps) {
    bool remote;
    long row;
    if (j < paired) {
      remote = (j & 1) == 0;
      row = j / 2;
    } else {
      remote = remoteRows > localRows;
      row = j - paired / 2;
    }
    copyRow(src + row * rowVectors, (remote ? peerDst : localDst) + row * rowVectors, rowVectors, lane, predicated);
  }
}

// Buffers of one rank: a source, a local destination, and a receive area that peers write into
// (nRanks slots of remoteBytes: slot s is written by rank s).
struct Buffers {
  char* src = nullptr;
  char* local = nullptr;
  PeerBuffer recv;
  ~Buffers() {
    cudaFree(src);
    cudaFree(local);
  }
};

}  // namespace

bool measureCopyCeiling(test::NcclSession& session, size_t remoteBytes, size_t localBytes, size_t rowBytes, int sms,
                        int iters, void* flush, size_t flushBytes, CopyCeiling* out) {
  const int n = session.nRanks(), me = session.rank();
  cudaStream_t stream = session.stream();
  rowBytes = rowBytes / 16 * 16;
  remoteBytes = remoteBytes / rowBytes * rowBytes;
  localBytes = localBytes / rowBytes * rowBytes;
  Buffers b;
  const size_t srcBytes = std::max(remoteBytes, localBytes);
  TEST_CUDA_CHECK(cudaMalloc(&b.src, srcBytes));
  TEST_CUDA_CHECK(cudaMalloc(&b.local, localBytes));
  TEST_CUDA_CHECK(cudaMemset(b.src, 0x3c, srcBytes));
  if (!b.recv.open(session, remoteBytes * n)) return false;
  cudaEvent_t start, stop;
  TEST_CUDA_CHECK(cudaEventCreate(&start));
  TEST_CUDA_CHECK(cudaEventCreate(&stop));
  auto timeIt = [&](auto op, double* medianUs) {
    std::vector<double> samples;
    for (int i = -3; i < iters; ++i) {  // three untimed warm-up runs
      TEST_CUDA_CHECK(cudaMemsetAsync(flush, i & 0xff, flushBytes, stream));
      if (!session.barrier(false)) return false;
      TEST_CUDA_CHECK(cudaEventRecord(start, stream));
      if (!op()) return false;
      TEST_CUDA_CHECK(cudaEventRecord(stop, stream));
      TEST_CUDA_CHECK(cudaEventSynchronize(stop));
      float ms = 0;
      TEST_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
      if (i >= 0) samples.push_back(ms * 1000.0);
    }
    *medianUs = median(samples);
    return session.maxOverRanks(medianUs);
  };
  auto copyEngine = [&]() {
    for (int p = 0; p < n; ++p) {
      if (p == me) continue;
      TEST_CUDA_CHECK(cudaMemcpyAsync(b.recv.peer(p) + remoteBytes * me, b.src, remoteBytes, cudaMemcpyDeviceToDevice, stream));
    }
    TEST_CUDA_CHECK(cudaMemcpyAsync(b.local, b.src, localBytes, cudaMemcpyDeviceToDevice, stream));
    return true;
  };
  // The SM kernel covers the two-rank case (one peer), which is what the EP benchmark compares.
  auto smCopy = [&](long remoteRows, long localRows, int remoteBlocks, bool predicated = false) {
    return [&, remoteRows, localRows, remoteBlocks, predicated]() {
      const int peer = (me + 1) % n;
      copyRowsKernel<<<sms, kThreads, 0, stream>>>(
          reinterpret_cast<const int4*>(b.src), reinterpret_cast<int4*>(b.recv.peer(peer) + remoteBytes * me),
          reinterpret_cast<int4*>(b.local), remoteRows, localRows, static_cast<int>(rowBytes / 16), remoteBlocks,
          predicated);
      TEST_CUDA_CHECK(cudaGetLastError());
      return true;
    };
  };
  const long remoteRows = static_cast<long>(remoteBytes / rowBytes), localRows = static_cast<long>(localBytes / rowBytes);
  bool ok = timeIt(copyEngine, &out->copyEngineUs);
  if (ok && n == 2 && sms > 0) {  // sms = 0: the copy engines alone
    ok = timeIt(smCopy(remoteRows, localRows, 0), &out->smUs) && timeIt(smCopy(remoteRows, 0, 0), &out->smRemoteOnlyUs) &&
         timeIt(smCopy(0, localRows, 0), &out->smLocalOnlyUs) &&
         timeIt(smCopy(remoteRows, 0, 0, true), &out->smRemoteOnlyPredicatedUs) &&
         (sms <= 8 || timeIt(smCopy(remoteRows, localRows, 8, true), &out->smSplit8PredicatedUs));
    out->splits.clear();
    for (int remoteBlocks = 4; ok && remoteBlocks < sms; remoteBlocks += 4) {
      double us = 0;
      ok = timeIt(smCopy(remoteRows, localRows, remoteBlocks), &us);
      out->splits.push_back({remoteBlocks, us});
    }
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return ok;
}

}  // namespace unifab::bench
