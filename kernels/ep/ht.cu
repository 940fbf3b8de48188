// High-throughput expert-parallel dispatch and combine over NVLink (every rank of the group is an
// LSA peer). Every received byte is written once by the sending GPU, straight into its final
// rank-major row on the receiver: the count exchange that precedes the payload tells each sender
// where its rows start at every destination, and the layout pass tells it the index of each of
// its tokens among those going to one destination. Token order is kept, so the output is
// deterministic. The expert-major layout is a local copy of those rows.
#include <cuda_bf16.h>

#include "kernels/common/device_sync.cuh"
#include "kernels/ep/ht_kernels.h"

namespace unifab::kernels::ep {
namespace {

constexpr int kLayoutThreads = 1024;
constexpr int kCopyThreads = 1024;
constexpr int kWarp = 32;
constexpr int kUnroll = 8;  // 16-byte vectors in flight per lane: 128 KB per 1024-thread block

__device__ __forceinline__ char* at(const GroupView& g, int rank, size_t offset) { return g.peerBase[rank] + offset; }

// After a timeout the group's peers are out of step: every later kernel does nothing.
__device__ __forceinline__ bool timedOut(const GroupView& g) {
  return (*reinterpret_cast<const volatile int*>(g.error) & kErrorTimeout) != 0;
}

__device__ __forceinline__ Control* control(const GroupView& g, int rank) {
  return reinterpret_cast<Control*>(at(g, rank, g.layout.control));
}

// Exclusive prefix sum of `value` over the block; `total` receives the block's sum.
template <int kThreads>
__device__ int blockExclusiveScan(int value, int* total) {
  __shared__ int warpSums[kThreads / kWarp];
  int lane = threadIdx.x % kWarp;
  int warp = threadIdx.x / kWarp;
  int inclusive = value;
  for (int d = 1; d < kWarp; d *= 2) {
    int other = __shfl_up_sync(0xffffffff, inclusive, d);
    if (lane >= d) inclusive += other;
  }
  if (lane == kWarp - 1) warpSums[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    int sum = lane < kThreads / kWarp ? warpSums[lane] : 0;
    for (int d = 1; d < kWarp; d *= 2) {
      int other = __shfl_up_sync(0xffffffff, sum, d);
      if (lane >= d) sum += other;
    }
    if (lane < kThreads / kWarp) warpSums[lane] = sum;  // inclusive warp prefixes
  }
  __syncthreads();
  int warpPrefix = warp > 0 ? warpSums[warp - 1] : 0;
  *total = warpSums[kThreads / kWarp - 1];
  __syncthreads();  // warpSums is reused by the next call
  return warpPrefix + inclusive - value;
}

// Kernels that hand out whole rows stride over all warps of the grid.
struct GridWarp {
  int lane;   // lane within the warp
  int warp;   // this warp's index in the grid
  int count;  // warps in the grid
};

__device__ __forceinline__ GridWarp gridWarp() {
  const int perBlock = blockDim.x / kWarp;
  return {static_cast<int>(threadIdx.x % kWarp), static_cast<int>(blockIdx.x * perBlock + threadIdx.x / kWarp),
          static_cast<int>(gridDim.x * perBlock)};
}

__device__ __forceinline__ int64_t loadExpert(const void* topkIdx, bool is32, size_t index) {
  return is32 ? static_cast<int64_t>(static_cast<const int32_t*>(topkIdx)[index])
              : static_cast<const int64_t*>(topkIdx)[index];
}

// Copies `bytes` (a multiple of 16) with every lane of the warp keeping kUnroll vectors in flight.
__device__ __forceinline__ void warpCopy(char* dst, const char* src, int bytes, int lane) {
  const int4* in = reinterpret_cast<const int4*>(src);
  int4* out = reinterpret_cast<int4*>(dst);
  int vectors = bytes / 16;
  int i = lane;
  for (; i + (kUnroll - 1) * kWarp < vectors; i += kUnroll * kWarp) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = __ldg(in + i + u * kWarp);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) out[i + u * kWarp] = v[u];
  }
  for (; i < vectors; i += kWarp) out[i] = __ldg(in + i);
}

// ---- layout ---------------------------------------------------------------------------------

__global__ void __launch_bounds__(kLayoutThreads) layoutKernel(GroupView g, DispatchInput input, Routing r) {
  __shared__ int destCount[kMaxRanks];
  __shared__ int expertCount[kMaxExperts];
  for (int i = threadIdx.x; i < kMaxRanks; i += blockDim.x) destCount[i] = 0;
  for (int i = threadIdx.x; i < g.numExperts; i += blockDim.x) expertCount[i] = 0;
  __syncthreads();
  for (int base = 0; base < input.numTokens; base += kLayoutThreads) {
    int t = base + static_cast<int>(threadIdx.x);
    uint64_t mask = 0;
    if (t < input.numTokens) {
      for (int k = 0; k < g.topk; ++k) {
        const size_t at = static_cast<size_t>(t) * g.topk + k;
        int64_t id = loadExpert(input.topkIdx, input.topkIdxIs32, at);
        if (id < -1 || id >= g.numExperts) {
          raiseError(g.error, g.hostError, kErrorBadExpertId);  // treated as masked so the exchange still completes
          id = -1;
        }
        r.topkIds[at] = static_cast<int>(id);
        r.topkWeights[at] = input.topkWeights != nullptr ? input.topkWeights[at] : 1.0f;
        if (id < 0) continue;
        mask |= 1ULL << (id / g.numLocalExperts);
        // An expert named twice by one token receives it once.
        bool repeated = false;
        for (int q = 0; q < k && !repeated; ++q) repeated = r.topkIds[static_cast<size_t>(t) * g.topk + q] == id;
        if (!repeated) atomicAdd(&expertCount[id], 1);
      }
      r.tokenRanks[t] = mask;
    }
    for (int d = 0; d < g.nRanks; ++d) {
      int bit = static_cast<int>((mask >> d) & 1ULL);
      int total = 0;
      int prefix = blockExclusiveScan<kLayoutThreads>(bit, &total);
      if (t < input.numTokens) r.tokenSlot[static_cast<size_t>(t) * g.nRanks + d] = bit ? destCount[d] + prefix : -1;
      __syncthreads();
      if (threadIdx.x == 0) destCount[d] += total;
      __syncthreads();
    }
  }
  for (int d = threadIdx.x; d < g.nRanks; d += blockDim.x) r.sendCounts[d] = destCount[d];
  for (int e = threadIdx.x; e < g.numExperts; e += blockDim.x) r.sendExpertCounts[e] = expertCount[e];
}

// ---- count exchange -------------------------------------------------------------------------

__global__ void __launch_bounds__(256) countExchangeKernel(GroupView g, Routing r) {
  __shared__ uint64_t epoch;
  if (threadIdx.x == 0) epoch = g.epochs->counts + 1;
  __syncthreads();
  if (timedOut(g)) return;
  const int rowInts = g.layout.countRowInts;
  // This rank's row: tokens for every destination, then selections of every global expert.
  for (int p = 0; p < g.nRanks; ++p) {
    int* row = reinterpret_cast<int*>(at(g, p, g.layout.countRows)) + static_cast<size_t>(g.rank) * rowInts;
    for (int i = threadIdx.x; i < rowInts; i += blockDim.x) {
      row[i] = i < g.nRanks ? r.sendCounts[i] : r.sendExpertCounts[i - g.nRanks];
    }
  }
  __syncthreads();
  if (threadIdx.x < static_cast<unsigned>(g.nRanks)) {
    __threadfence_system();
    storeRelease(&control(g, threadIdx.x)->countsReady[g.rank], epoch);
  }
  if (threadIdx.x < static_cast<unsigned>(g.nRanks)) {
    waitEpoch(&control(g, g.rank)->countsReady[threadIdx.x], epoch, g.timeoutNs, g.error, g.hostError, kErrorTimeout);
  }
  __syncthreads();
  if (timedOut(g)) return;
  const int* rows = reinterpret_cast<const int*>(at(g, g.rank, g.layout.countRows));
  if (threadIdx.x == 0) {
    int offset = 0;
    for (int s = 0; s < g.nRanks; ++s) {
      int rowsFromS = rows[static_cast<size_t>(s) * rowInts + g.rank];
      r.recvRowsPerRank[s] = rowsFromS;
      offset += rowsFromS;
    }
    *r.numRecvRows = offset;
    int expertOffset = 0;
    for (int e = 0; e < g.numLocalExperts; ++e) {
      int count = 0;
      for (int s = 0; s < g.nRanks; ++s) count += rows[static_cast<size_t>(s) * rowInts + g.nRanks + g.rank * g.numLocalExperts + e];
      r.recvRowsPerExpert[e] = count;
      r.expertOffsets[e] = expertOffset;
      expertOffset += (count + r.expertAlignment - 1) / r.expertAlignment * r.expertAlignment;
    }
    r.expertOffsets[g.numLocalExperts] = expertOffset;
    *r.numExpertRows = expertOffset;
    g.epochs->counts = epoch;
  }
  for (int d = threadIdx.x; d < g.nRanks; d += blockDim.x) {
    int before = 0;
    for (int s = 0; s < g.rank; ++s) before += rows[static_cast<size_t>(s) * rowInts + d];
    r.sendOffset[d] = before;
  }
}

// ---- payload --------------------------------------------------------------------------------

__global__ void __launch_bounds__(kCopyThreads) dispatchPayloadKernel(GroupView g, DispatchInput input, Routing r) {
  if (timedOut(g)) return;
  const GridWarp gw = gridWarp();
  const int lane = gw.lane, warp = gw.warp, warps = gw.count;
  const int payloadBytes = g.hidden * payloadBytesPerValue(input.dtype);
  const int scalesPerRow = g.hidden / kScaleBlock;
  const WindowLayout& L = g.layout;
  for (int t = warp; t < input.numTokens; t += warps) {
    uint64_t mask = r.tokenRanks[t];
    int64_t id = -1;
    float weight = 0.0f;
    if (lane < g.topk) {
      // The routing's copy: a cached re-dispatch has no top-k input of its own.
      id = r.topkIds[static_cast<size_t>(t) * g.topk + lane];
      weight = r.topkWeights[static_cast<size_t>(t) * g.topk + lane];
    }
    const char* src = static_cast<const char*>(input.x) + static_cast<size_t>(t) * payloadBytes;
    while (mask != 0) {
      int d = __ffsll(static_cast<long long>(mask)) - 1;
      mask &= mask - 1;
      size_t row = static_cast<size_t>(r.sendOffset[d] + r.tokenSlot[static_cast<size_t>(t) * g.nRanks + d]);
      // Rows are packed at the payload's own size: FP8 rows take half of a BF16 row.
      warpCopy(at(g, d, L.recvX) + row * payloadBytes, src, payloadBytes, lane);
      if (input.dtype == Payload::kFp8) {
        float* scales = reinterpret_cast<float*>(at(g, d, L.recvScales)) + row * scalesPerRow;
        const float* in = input.scales + static_cast<size_t>(t) * scalesPerRow;
        for (int i = lane; i < scalesPerRow; i += kWarp) scales[i] = in[i];
      }
      if (lane < g.topk) {
        int64_t first = static_cast<int64_t>(d) * g.numLocalExperts;
        bool local = id >= first && id < first + g.numLocalExperts;
        reinterpret_cast<int*>(at(g, d, L.recvTopk))[row * g.topk + lane] = local ? static_cast<int>(id - first) : -1;
        reinterpret_cast<float*>(at(g, d, L.recvWeights))[row * g.topk + lane] = local ? weight : 0.0f;
      }
      if (lane == 0) {
        int* source = reinterpret_cast<int*>(at(g, d, L.recvSource)) + row * 2;
        source[0] = g.rank;
        source[1] = t;
      }
    }
  }
  // No fence here: this kernel's stores are complete when it retires, before the barrier kernel
  // that follows in the stream publishes them with a system-scope release.
}

// ---- phase barrier --------------------------------------------------------------------------

__global__ void phaseBarrierKernel(GroupView g, Phase phase) {
  __shared__ uint64_t epoch;
  uint64_t* counter = phase == Phase::kDispatch ? &g.epochs->dispatch : &g.epochs->combine;
  if (threadIdx.x == 0) epoch = *counter + 1;
  __syncthreads();
  if (timedOut(g)) return;
  if (threadIdx.x < static_cast<unsigned>(g.nRanks)) {
    Control* peer = control(g, threadIdx.x);
    uint64_t* word = phase == Phase::kDispatch ? &peer->dispatchDone[g.rank] : &peer->combineDone[g.rank];
    __threadfence_system();
    storeRelease(word, epoch);
    Control* mine = control(g, g.rank);
    const uint64_t* flag = phase == Phase::kDispatch ? &mine->dispatchDone[threadIdx.x] : &mine->combineDone[threadIdx.x];
    waitEpoch(flag, epoch, g.timeoutNs, g.error, g.hostError, kErrorTimeout);
  }
  __syncthreads();
  if (threadIdx.x == 0) *counter = epoch;
}

// ---- expert-major expansion -----------------------------------------------------------------

// One block per local expert: its rows in rank-major order, compacted by a block scan.
__global__ void __launch_bounds__(kCopyThreads) expandKernel(GroupView g, Routing r, Payload dtype, ExpertMajorRows out) {
  if (timedOut(g)) return;
  __shared__ int rowIndex[kCopyThreads];
  const int expert = blockIdx.x;
  const int rows = *r.numRecvRows;
  const int base = r.expertOffsets[expert];
  const WindowLayout& L = g.layout;
  const int* recvTopk = reinterpret_cast<const int*>(at(g, g.rank, L.recvTopk));
  const int payloadBytes = g.hidden * payloadBytesPerValue(dtype);
  const int scalesPerRow = g.hidden / kScaleBlock;
  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  int placed = 0;
  for (int chunk = 0; chunk < rows; chunk += kCopyThreads) {
    int j = chunk + static_cast<int>(threadIdx.x);
    int k = -1;
    if (j < rows) {
      for (int q = 0; q < g.topk && k < 0; ++q) {
        if (recvTopk[static_cast<size_t>(j) * g.topk + q] == expert) k = q;
      }
    }
    int total = 0;
    int prefix = blockExclusiveScan<kCopyThreads>(k >= 0 ? 1 : 0, &total);
    if (k >= 0) {
      rowIndex[prefix] = j;
      r.expertSlot[static_cast<size_t>(j) * g.topk + k] = base + placed + prefix;
    }
    __syncthreads();
    for (int i = warp; i < total; i += kCopyThreads / kWarp) {
      size_t from = static_cast<size_t>(rowIndex[i]);
      size_t to = static_cast<size_t>(base + placed + i);
      warpCopy(out.x + to * payloadBytes, at(g, g.rank, L.recvX) + from * payloadBytes, payloadBytes, lane);
      if (dtype == Payload::kFp8) {
        const float* s = reinterpret_cast<const float*>(at(g, g.rank, L.recvScales)) + from * scalesPerRow;
        for (int q = lane; q < scalesPerRow; q += kWarp) out.scales[to * scalesPerRow + q] = s[q];
      }
      if (lane < g.topk) {
        out.topk[to * g.topk + lane] = recvTopk[from * g.topk + lane];
        out.weights[to * g.topk + lane] = reinterpret_cast<const float*>(at(g, g.rank, L.recvWeights))[from * g.topk + lane];
      }
      if (lane < 2) out.source[to * 2 + lane] = reinterpret_cast<const int*>(at(g, g.rank, L.recvSource))[from * 2 + lane];
    }
    placed += total;
    __syncthreads();
  }
}

// ---- combine --------------------------------------------------------------------------------

__device__ __forceinline__ void bf16x8ToFloat(const int4& v, float* f) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 p = __bfloat1622float2(h[i]);
    f[2 * i] = p.x;
    f[2 * i + 1] = p.y;
  }
}

__device__ __forceinline__ int4 floatToBf16x8(const float* f) {
  int4 v;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  return v;
}

// Warp per received row: its rank's partial sum goes to the token's rank.
__global__ void __launch_bounds__(kCopyThreads) combineSendKernel(GroupView g, Routing r, CombineInput in,
                                                                  ExpertMajorRows expertRows) {
  if (timedOut(g)) return;
  const GridWarp gw = gridWarp();
  const int lane = gw.lane, warp = gw.warp, warps = gw.count;
  const WindowLayout& L = g.layout;
  const int rows = *r.numRecvRows;
  const int rowBytes = g.hidden * 2;
  const int vectors = rowBytes / 16;
  const int* source = reinterpret_cast<const int*>(at(g, g.rank, L.recvSource));
  const float* weights = reinterpret_cast<const float*>(at(g, g.rank, L.recvWeights));
  for (int j = warp; j < rows; j += warps) {
    int s = source[static_cast<size_t>(j) * 2];
    int t = source[static_cast<size_t>(j) * 2 + 1];
    char* dst = at(g, s, L.combineX) + (static_cast<size_t>(g.rank) * g.maxTokensPerRank + t) * rowBytes;
    if (!in.expertMajor) {
      warpCopy(dst, static_cast<const char*>(in.expertOutput) + static_cast<size_t>(j) * rowBytes, rowBytes, lane);
    } else {
      const int4* y = static_cast<const int4*>(in.expertOutput);
      for (int v = lane; v < vectors; v += kWarp) {
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int k = 0; k < g.topk; ++k) {
          int slot = r.expertSlot[static_cast<size_t>(j) * g.topk + k];
          if (slot < 0) continue;
          float f[8];
          bf16x8ToFloat(__ldg(y + static_cast<size_t>(slot) * vectors + v), f);
          if (in.weighted) {
            float w = weights[static_cast<size_t>(j) * g.topk + k];
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[i] = __fmaf_rn(w, f[i], acc[i]);
          } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[i] = __fadd_rn(acc[i], f[i]);
          }
        }
        reinterpret_cast<int4*>(dst)[v] = floatToBf16x8(acc);
      }
    }
    if (lane < g.topk) {
      float* w = reinterpret_cast<float*>(at(g, s, L.combineWeights)) +
                 (static_cast<size_t>(g.rank) * g.maxTokensPerRank + t) * g.topk;
      w[lane] = weights[static_cast<size_t>(j) * g.topk + lane];
    }
  }
}

// Warp per token of this rank: partials summed over ranks in ascending order.
__global__ void __launch_bounds__(kCopyThreads) combineReduceKernel(GroupView g, Routing r, CombineInput in) {
  if (timedOut(g)) return;
  const GridWarp gw = gridWarp();
  const int lane = gw.lane, warp = gw.warp, warps = gw.count;
  const WindowLayout& L = g.layout;
  const int rowBytes = g.hidden * 2;
  const int vectors = rowBytes / 16;
  const int4* partials = reinterpret_cast<const int4*>(at(g, g.rank, L.combineX));
  const float* partialWeights = reinterpret_cast<const float*>(at(g, g.rank, L.combineWeights));
  for (int t = warp; t < r.numTokens; t += warps) {
    uint64_t mask = r.tokenRanks[t];
    for (int v = lane; v < vectors; v += kWarp) {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (uint64_t m = mask; m != 0; m &= m - 1) {
        int s = __ffsll(static_cast<long long>(m)) - 1;
        float f[8];
        bf16x8ToFloat(partials[(static_cast<size_t>(s) * g.maxTokensPerRank + t) * vectors + v], f);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] = __fadd_rn(acc[i], f[i]);
      }
      reinterpret_cast<int4*>(in.combinedX)[static_cast<size_t>(t) * vectors + v] = floatToBf16x8(acc);
    }
    if (in.combinedWeights != nullptr && lane < g.topk) {
      float sum = 0.0f;
      for (uint64_t m = mask; m != 0; m &= m - 1) {
        int s = __ffsll(static_cast<long long>(m)) - 1;
        sum = __fadd_rn(sum, partialWeights[(static_cast<size_t>(s) * g.maxTokensPerRank + t) * g.topk + lane]);
      }
      in.combinedWeights[static_cast<size_t>(t) * g.topk + lane] = sum;
    }
  }
}

}  // namespace

cudaError_t launchLayout(const GroupView& group, const DispatchInput& input, const Routing& routing,
                         cudaStream_t stream) {
  layoutKernel<<<1, kLayoutThreads, 0, stream>>>(group, input, routing);
  return cudaGetLastError();
}

cudaError_t launchCountExchange(const GroupView& group, const Routing& routing, cudaStream_t stream) {
  countExchangeKernel<<<1, 256, 0, stream>>>(group, routing);
  return cudaGetLastError();
}

cudaError_t launchDispatchPayload(const GroupView& group, const DispatchInput& input, const Routing& routing,
                                  int numBlocks, cudaStream_t stream) {
  dispatchPayloadKernel<<<numBlocks, kCopyThreads, 0, stream>>>(group, input, routing);
  return cudaGetLastError();
}

cudaError_t launchPhaseBarrier(const GroupView& group, Phase phase, cudaStream_t stream) {
  phaseBarrierKernel<<<1, kMaxRanks, 0, stream>>>(group, phase);
  return cudaGetLastError();
}

cudaError_t launchExpand(const GroupView& group, const Routing& routing, Payload dtype, const ExpertMajorRows& rows,
                         cudaStream_t stream) {
  expandKernel<<<group.numLocalExperts, kCopyThreads, 0, stream>>>(group, routing, dtype, rows);
  return cudaGetLastError();
}

cudaError_t launchCombineSend(const GroupView& group, const Routing& routing, const CombineInput& input,
                              const ExpertMajorRows& rows, int numBlocks, cudaStream_t stream) {
  combineSendKernel<<<numBlocks, kCopyThreads, 0, stream>>>(group, routing, input, rows);
  return cudaGetLastError();
}

cudaError_t launchCombineReduce(const GroupView& group, const Routing& routing, const CombineInput& input,
                                int numBlocks, cudaStream_t stream) {
  combineReduceKernel<<<numBlocks, kCopyThreads, 0, stream>>>(group, routing, input);
  return cudaGetLastError();
}

}  // namespace unifab::kernels::ep
