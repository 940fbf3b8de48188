#include "tests/bench/copy_ceiling.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <vector>

#include "kernels/common/bulk_copy.cuh"
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

// The rows of one side (remote or local) of a split grid, cut into pieces: unit u is piece
// u % pieces of row u / pieces. Blocks [0, remoteBlocks) copy to the peer, the rest locally.
struct SplitUnits {
  bool remote;
  long first, stride, units;
  int pieces, pieceVectors;
};

__device__ __forceinline__ SplitUnits splitUnits(long remoteRows, long localRows, int rowVectors, int remoteBlocks,
                                                 int warpsPerBlock, int maxPieceVectors) {
  SplitUnits s;
  s.remote = static_cast<int>(blockIdx.x) < remoteBlocks;
  const int blocks = s.remote ? remoteBlocks : static_cast<int>(gridDim.x) - remoteBlocks;
  const int index = s.remote ? blockIdx.x : blockIdx.x - remoteBlocks;
  s.pieces = (rowVectors + maxPieceVectors - 1) / maxPieceVectors;
  s.pieceVectors = (rowVectors + s.pieces - 1) / s.pieces;
  s.first = static_cast<long>(index) * warpsPerBlock + threadIdx.x / 32;
  s.stride = static_cast<long>(blocks) * warpsPerBlock;
  s.units = (s.remote ? remoteRows : localRows) * s.pieces;
  return s;
}

// A whole piece of a row in registers: up to kRegVectors 16-byte vectors per lane, every load
// issued before any store (512 threads leave 128 registers a thread).
constexpr int kRegThreads = 512;
constexpr int kRegVectors = 16;

__global__ void __launch_bounds__(kRegThreads, 1) copyRowsRegsKernel(const int4* src, int4* peerDst, int4* localDst,
                                                                     long remoteRows, long localRows, int rowVectors,
                                                                     int remoteBlocks) {
  const int lane = threadIdx.x % 32;
  const SplitUnits s = splitUnits(remoteRows, localRows, rowVectors, remoteBlocks, kRegThreads / 32, kRegVectors * 32);
  int4* dst = s.remote ? peerDst : localDst;
  for (long u = s.first; u < s.units; u += s.stride) {
    const long row = u / s.pieces;
    const int begin = static_cast<int>(u % s.pieces) * s.pieceVectors;
    const int end = min(begin + s.pieceVectors, rowVectors);
    const int4* in = src + row * rowVectors;
    int4* out = dst + row * rowVectors;
    int4 v[kRegVectors];
#pragma unroll
    for (int k = 0; k < kRegVectors; ++k) {
      const int i = begin + lane + k * 32;
      if (i < end) v[k] = __ldg(in + i);
    }
#pragma unroll
    for (int k = 0; k < kRegVectors; ++k) {
      const int i = begin + lane + k * 32;
      if (i < end) out[i] = v[k];
    }
  }
}

// Pieces through shared memory with the bulk-copy engine: lane 0 of each of `stagedWarps` warps
// keeps a ring of `stages` pieces, loading ahead while earlier pieces are stored.
constexpr int kBulkThreads = 1024;
constexpr int kBulkMaxPieceBytes = 7424;  // an FP8 row of hidden 7168 with its scales
constexpr int kBulkMaxStages = 4;         // barriers per warp
constexpr size_t kBulkMaxSharedBytes = 30 * kBulkMaxPieceBytes;  // 217.5 KiB of the SM's 227

__global__ void __launch_bounds__(kBulkThreads) copyRowsBulkKernel(const char* src, char* peerDst, char* localDst,
                                                                   long remoteRows, long localRows, int rowVectors,
                                                                   int remoteBlocks, int stagedWarps, int stages,
                                                                   int stageBytes) {
  extern __shared__ __align__(128) char staging[];
  __shared__ uint64_t barriers[kBulkThreads / 32 * kBulkMaxStages];
  const int warp = threadIdx.x / 32;
  if (warp >= stagedWarps || threadIdx.x % 32 != 0) return;
  const SplitUnits s = splitUnits(remoteRows, localRows, rowVectors, remoteBlocks, stagedWarps, stageBytes / 16);
  char* dst = s.remote ? peerDst : localDst;
  char* ring = staging + static_cast<size_t>(warp) * stages * stageBytes;
  uint64_t* bars = barriers + warp * kBulkMaxStages;
  for (int k = 0; k < stages; ++k) kernels::barrierInit(bars + k);
  kernels::barrierInitFence();
  const size_t rowBytes = static_cast<size_t>(rowVectors) * 16;
  auto pieceOf = [&](long u, size_t* offset, uint32_t* bytes) {
    const long row = u / s.pieces;
    const size_t begin = static_cast<size_t>(u % s.pieces) * s.pieceVectors * 16;
    *offset = row * rowBytes + begin;
    *bytes = static_cast<uint32_t>(min(static_cast<size_t>(s.pieceVectors) * 16, rowBytes - begin));
  };
  auto load = [&](long u, int stage) {
    size_t offset;
    uint32_t bytes;
    pieceOf(u, &offset, &bytes);
    kernels::barrierExpect(bars + stage, bytes);
    kernels::bulkLoad(ring + stage * stageBytes, src + offset, bytes, bars + stage);
  };
  long next = s.first;
  for (int k = 0; k < stages && next < s.units; ++k, next += s.stride) load(next, k);
  uint32_t phases = 0;
  int k = 0;
  for (long u = s.first; u < s.units; u += s.stride, k = (k + 1) % stages) {
    kernels::barrierWait(bars + k, (phases >> k) & 1);
    phases ^= 1u << k;
    size_t offset;
    uint32_t bytes;
    pieceOf(u, &offset, &bytes);
    kernels::bulkStore(dst + offset, ring + k * stageBytes, bytes);
    if (next < s.units) {
      kernels::bulkStoresRead();  // this stage is loaded again next
      load(next, k);
      next += s.stride;
    }
  }
  kernels::bulkStoresDone();
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
  // Rank s writes its rows into every peer's slot s: slots as large as the most any rank sends.
  double largestRemote = static_cast<double>(remoteBytes);
  if (!session.maxOverRanks(&largestRemote)) return false;
  const size_t slotBytes = static_cast<size_t>(largestRemote);
  if (!b.recv.open(session, slotBytes * n)) return false;
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
      TEST_CUDA_CHECK(cudaMemcpyAsync(b.recv.peer(p) + slotBytes * me, b.src, remoteBytes, cudaMemcpyDeviceToDevice, stream));
    }
    TEST_CUDA_CHECK(cudaMemcpyAsync(b.local, b.src, localBytes, cudaMemcpyDeviceToDevice, stream));
    return true;
  };
  // The SM kernel covers the two-rank case (one peer), which is what the EP benchmark compares.
  auto smCopy = [&](long remoteRows, long localRows, int remoteBlocks, bool predicated = false) {
    return [&, remoteRows, localRows, remoteBlocks, predicated]() {
      const int peer = (me + 1) % n;
      copyRowsKernel<<<sms, kThreads, 0, stream>>>(
          reinterpret_cast<const int4*>(b.src), reinterpret_cast<int4*>(b.recv.peer(peer) + slotBytes * me),
          reinterpret_cast<int4*>(b.local), remoteRows, localRows, static_cast<int>(rowBytes / 16), remoteBlocks,
          predicated);
      TEST_CUDA_CHECK(cudaGetLastError());
      return true;
    };
  };
  auto regsCopy = [&](int grid, long remoteRows, long localRows, int remoteBlocks) {
    return [&, grid, remoteRows, localRows, remoteBlocks]() {
      const int peer = (me + 1) % n;
      copyRowsRegsKernel<<<grid, kRegThreads, 0, stream>>>(
          reinterpret_cast<const int4*>(b.src), reinterpret_cast<int4*>(b.recv.peer(peer) + slotBytes * me),
          reinterpret_cast<int4*>(b.local), remoteRows, localRows, static_cast<int>(rowBytes / 16), remoteBlocks);
      TEST_CUDA_CHECK(cudaGetLastError());
      return true;
    };
  };
  auto bulkCopy = [&](int grid, long remoteRows, long localRows, int remoteBlocks, int warps, int stages) {
    return [&, grid, remoteRows, localRows, remoteBlocks, warps, stages]() {
      const int peer = (me + 1) % n;
      const int pieces = static_cast<int>((rowBytes + kBulkMaxPieceBytes - 1) / kBulkMaxPieceBytes);
      const int stageBytes = static_cast<int>((rowBytes / 16 + pieces - 1) / pieces * 16);
      const size_t smem = static_cast<size_t>(warps) * stages * stageBytes;
      if (warps > kBulkThreads / 32 || stages > kBulkMaxStages || smem > kBulkMaxSharedBytes) {
        fprintf(stderr, "copy ceiling: bulk copy of %d warps x %d stages of %d bytes is past its limits\n", warps,
                stages, stageBytes);
        return false;
      }
      copyRowsBulkKernel<<<grid, kBulkThreads, smem, stream>>>(b.src, b.recv.peer(peer) + slotBytes * me, b.local,
                                                               remoteRows, localRows, static_cast<int>(rowBytes / 16),
                                                               remoteBlocks, warps, stages, stageBytes);
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
    // Once, outside the timed calls: the most dynamic shared memory a bulk variant may ask for.
    TEST_CUDA_CHECK(cudaFuncSetAttribute(copyRowsBulkKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(kBulkMaxSharedBytes)));
    out->variants.clear();
    auto variant = [&](const char* name, auto op) {
      double us = 0;
      if (ok) ok = timeIt(op, &us);
      out->variants.push_back({name, std::strstr(name, "remote only") != nullptr, us});
    };
    variant("regs, remote only", regsCopy(sms, remoteRows, 0, sms));
    variant("regs, remote only, 8 SMs", regsCopy(8, remoteRows, 0, 8));
    if (sms > 8) variant("regs, split 8", regsCopy(sms, remoteRows, localRows, 8));
    variant("bulk 30x1, remote only", bulkCopy(sms, remoteRows, 0, sms, 30, 1));
    variant("bulk 14x2, remote only", bulkCopy(sms, remoteRows, 0, sms, 14, 2));
    variant("bulk 7x4, remote only", bulkCopy(sms, remoteRows, 0, sms, 7, 4));
    variant("bulk 30x1, remote only, 8 SMs", bulkCopy(8, remoteRows, 0, 8, 30, 1));
    variant("bulk 14x2, remote only, 8 SMs", bulkCopy(8, remoteRows, 0, 8, 14, 2));
    if (sms > 8) variant("bulk 14x2, split 8", bulkCopy(sms, remoteRows, localRows, 8, 14, 2));
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
