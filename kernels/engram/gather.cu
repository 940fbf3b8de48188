#include "kernels/common/device_sync.cuh"
#include "kernels/common/warp_copy.cuh"
#include "kernels/engram/gather.h"

namespace unifab::kernels::engram {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarp = 32;

__device__ __forceinline__ void zeroRow(char* dst, int64_t bytes, int lane) {
  int4* out = reinterpret_cast<int4*>(dst);
  for (int64_t i = lane; i < bytes / 16; i += kWarp) out[i] = int4{0, 0, 0, 0};
}

__global__ void __launch_bounds__(kThreads) gatherKernel(TableView t, GatherArgs a) {
  const int lane = threadIdx.x % kWarp;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kThreads / kWarp);
  const int64_t first = static_cast<int64_t>(blockIdx.x) * (kThreads / kWarp) + threadIdx.x / kWarp;
  const int64_t tableRows = static_cast<int64_t>(t.peers) * t.rowsPerRank;
  // 32 rows at a time per warp: lane k looks up row k's source first.
  for (int64_t i0 = first; i0 < a.numRows; i0 += warps * kWarp) {
    const int64_t mine = i0 + lane * warps;
    int peer = -1;
    int64_t row = 0;
    if (mine < a.numRows) {
      const int64_t id = a.rowIdsAre32 ? static_cast<int64_t>(static_cast<const int32_t*>(a.rowIds)[mine])
                                       : static_cast<const int64_t*>(a.rowIds)[mine];
      const int64_t local = id - static_cast<int64_t>(t.firstRank) * t.rowsPerRank;
      if (local >= 0 && local < tableRows) {
        peer = static_cast<int>(local / t.rowsPerRank);
        row = local % t.rowsPerRank;
      } else {
        raiseError(t.error, t.hostError, kErrorRowId);
      }
    }
    for (int k = 0; k < kWarp; ++k) {
      const int64_t i = i0 + k * warps;
      if (i >= a.numRows) break;
      const int p = __shfl_sync(0xffffffff, peer, k);
      const int64_t r = __shfl_sync(0xffffffff, row, k);
      char* dst = a.out + i * t.rowBytes;
      if (p < 0) {
        zeroRow(dst, t.rowBytes, lane);
        if (lane == 0 && a.outScales != nullptr) a.outScales[i] = 0.0f;
        continue;
      }
      warpCopy(dst, t.rows[p] + r * t.rowBytes, static_cast<int>(t.rowBytes), lane);  // rows <= 1 MiB
      if (lane == 0 && a.outScales != nullptr) a.outScales[i] = t.scales[p][r];
    }
  }
}

}  // namespace

cudaError_t launchGather(const TableView& table, const GatherArgs& args, int numBlocks, cudaStream_t stream) {
  gatherKernel<<<numBlocks, kThreads, 0, stream>>>(table, args);
  return cudaGetLastError();
}

}  // namespace unifab::kernels::engram
