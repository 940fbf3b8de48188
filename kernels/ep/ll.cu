// Low-latency expert-parallel dispatch and combine (see ll_kernels.h for the protocol).
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "kernels/common/bf16x8.cuh"
#include "kernels/common/device_sync.cuh"
#include "kernels/ep/ll_kernels.h"

namespace unifab::kernels::ep {
namespace {

constexpr int kWarp = 32;
constexpr int kWarps = kLlWarpsPerBlock;
constexpr int kThreads = kWarps * kWarp;
constexpr int kVectorsPerLane = kLlPartValues / (kWarp * 8);  // 16-byte BF16 vectors of a part per lane
constexpr float kFp8Max = 448.0f;                             // largest finite e4m3 value
constexpr float kMinAmax = 1e-4f;                             // an all-zero block still gets a finite scale

__device__ __forceinline__ char* at(const LlView& g, int rank, size_t offset) { return g.peerBase[rank] + offset; }
__device__ __forceinline__ size_t setOffset(const LlView& g, int set) {
  return g.layout.setBase + static_cast<size_t>(set) * g.layout.setBytes;
}
__device__ __forceinline__ WaitBounds bounds(const LlView& g) { return {g.error, g.hostError, g.timeoutNs}; }
__device__ __forceinline__ bool timedOut(const LlView& g) { return kernels::timedOut(bounds(g), kErrorTimeout); }

template <bool kPause, typename Ready>
__device__ __forceinline__ bool waitUntil(const LlView& g, Ready ready) {
  return waitBounded<kPause>(bounds(g), kErrorTimeout, ready);
}

// A wait's outcome made the same in every lane (a lane may see the group's timeout a poll earlier),
// so that the warp leaves a loop of shuffles together.
__device__ __forceinline__ bool warpAll(bool ok) { return __all_sync(0xffffffff, ok) != 0; }

// Waits until the 64-bit word at `word` carries exactly `epoch`, then orders later reads after it.
__device__ __forceinline__ bool waitTag(const LlView& g, const uint64_t* word, uint64_t epoch) {
  if (!waitUntil<true>(g, [&] { return loadRelaxed(word) == epoch; })) return false;
  return loadAcquire(word) == epoch;
}

__device__ __forceinline__ char* messageAt(const LlView& g, int rank, int set, int source, int token) {
  return at(g, rank, setOffset(g, set) + g.layout.messages) +
         (static_cast<size_t>(source) * g.maxTokens + token) * g.layout.messageBytes;
}

// Lane k < topk: the token's k-th expert as validated (an id outside -1..numExperts-1 raises the
// error and counts as -1; an expert named again at a later slot counts once, at its first slot).
__device__ __forceinline__ int tokenExpert(const LlView& g, const LlDispatchInput& in, int t, int lane) {
  int id = -1;
  if (lane < g.topk) {
    const size_t index = static_cast<size_t>(t) * g.topk + lane;
    const int64_t raw = in.topkIdxIs32 ? static_cast<int64_t>(static_cast<const int32_t*>(in.topkIdx)[index])
                                       : static_cast<const int64_t*>(in.topkIdx)[index];
    if (raw < -1 || raw >= g.numExperts) {
      raiseError(g.error, g.hostError, kErrorBadExpertId);
    } else {
      id = static_cast<int>(raw);
    }
  }
  const unsigned same = __match_any_sync(0xffffffff, id);
  const unsigned below = (1u << lane) - 1;
  if (id >= 0 && (same & below) != 0) id = -1;
  return id;
}

// The ranks of the warp's token (every lane gets the mask).
__device__ __forceinline__ uint64_t ranksOf(const LlView& g, int id) {
  const uint64_t bit = id >= 0 ? 1ULL << (id / g.numLocalExperts) : 0;
  const unsigned lo = __reduce_or_sync(0xffffffff, static_cast<unsigned>(bit));
  const unsigned hi = __reduce_or_sync(0xffffffff, static_cast<unsigned>(bit >> 32));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

// e4m3 of 8 values with scale `inverse` applied (saturating, round to nearest even).
__device__ __forceinline__ uint2 toFp8x8(const float* v, float inverse) {
  uint32_t word[2] = {0, 0};
#pragma unroll
  for (int i = 0; i < 8; i += 2) {
    const __nv_fp8x2_storage_t pair =
        __nv_cvt_float2_to_fp8x2(make_float2(__fmul_rn(v[i], inverse), __fmul_rn(v[i + 1], inverse)), __NV_SATFINITE, __NV_E4M3);
    word[i / 4] |= static_cast<uint32_t>(pair) << (16 * ((i / 2) % 2));
  }
  return make_uint2(word[0], word[1]);
}

// Lanes of a warp, one per rank: until every rank has finished reading what this rank last wrote
// into `set` for `op` (0 dispatch, 1 combine). Per warp, just before its first write into a peer's
// set, so that the check overlaps the warp's own loads. The same answer in every lane.
__device__ bool warpSetFree(const LlView& g, int set, int op, uint64_t lastUse, int lane) {
  bool ok = true;
  const uint64_t* consumed = reinterpret_cast<const uint64_t*>(at(g, g.rank, g.layout.consumed)) +
                             (static_cast<size_t>(set) * 2 + op) * g.nRanks;
  for (int d = lane; d < g.nRanks && ok; d += kWarp) {
    ok = waitUntil<false>(g, [&] { return loadRelaxed(consumed + d) >= lastUse; });
  }
  return warpAll(ok);
}

// Tells every rank that this rank has read all it was sent in `set` for `op` up to `epoch`.
__device__ void releaseSet(const LlView& g, int set, int op, uint64_t epoch) {
  for (int d = threadIdx.x; d < g.nRanks; d += blockDim.x) {
    uint64_t* consumed = reinterpret_cast<uint64_t*>(at(g, d, g.layout.consumed)) + (static_cast<size_t>(set) * 2 + op) * g.nRanks;
    storeRelaxed(consumed + g.rank, epoch);
  }
}

// ---- dispatch ---------------------------------------------------------------------------------

__device__ void dispatchSend(const LlView& g, const LlDispatchInput& in, int set, uint64_t epoch, uint64_t lastUse) {
  const int lane = threadIdx.x % kWarp;
  const int warp = blockIdx.x * kWarps + threadIdx.x / kWarp;
  const int warps = gridDim.x * kWarps;
  bool setFree = false;
  auto mayWrite = [&] {
    if (!setFree) setFree = warpSetFree(g, set, 0, lastUse, lane);
    return setFree;
  };
  const LlSetLocal& local = g.sets[set];
  const size_t bitsOffset = setOffset(g, set) + g.layout.tokenBits;

  // What each rank should expect: one tagged bitmap word per 32 tokens (all of maxTokens, so
  // that a receiver need not know how many tokens this rank has).
  for (int c = warp; c < g.layout.bitWords; c += warps) {
    const int t = c * kWarp + lane;
    uint64_t mask = 0;
    if (t < in.numTokens) {
      // This lane's token alone: the warp-wide validation below runs per token.
      for (int k = 0; k < g.topk; ++k) {
        const size_t index = static_cast<size_t>(t) * g.topk + k;
        const int64_t raw = in.topkIdxIs32 ? static_cast<int64_t>(static_cast<const int32_t*>(in.topkIdx)[index])
                                           : static_cast<const int64_t*>(in.topkIdx)[index];
        if (raw >= 0 && raw < g.numExperts) mask |= 1ULL << (static_cast<int>(raw) / g.numLocalExperts);
      }
    }
    if (t < g.maxTokens) local.tokenRanks[t] = mask;
    if (!mayWrite()) return;
    for (int d = 0; d < g.nRanks; ++d) {
      const unsigned bits = __ballot_sync(0xffffffff, (mask >> d) & 1ULL);
      if (lane == d % kWarp) {
        uint64_t* word = reinterpret_cast<uint64_t*>(at(g, d, bitsOffset)) + static_cast<size_t>(g.rank) * g.layout.bitWords + c;
        storeRelaxed(word, countWord(epoch, static_cast<int>(bits)));
      }
    }
  }

  // Message parts: one warp per (token, part).
  const int parts = llParts(g.hidden);
  for (int item = warp; item < in.numTokens * parts; item += warps) {
    const int t = item / parts, p = item % parts;
    const int first = p * kLlPartValues;
    const int partValues = min(kLlPartValues, g.hidden - first);
    // The part's values first: their loads overlap the routing's.
    const int4* src = reinterpret_cast<const int4*>(static_cast<const __nv_bfloat16*>(in.x) + static_cast<size_t>(t) * g.hidden + first);
    int4 raw[kVectorsPerLane];
#pragma unroll
    for (int i = 0; i < kVectorsPerLane; ++i) {
      const bool valid = i * 256 + lane * 8 < partValues;
      raw[i] = valid ? __ldg(src + i * kWarp + lane) : int4{0, 0, 0, 0};
    }
    const int id = tokenExpert(g, in, t, lane);
    const float weight =
        lane < g.topk && in.topkWeights != nullptr ? in.topkWeights[static_cast<size_t>(t) * g.topk + lane] : 1.0f;
    const uint64_t ranks = ranksOf(g, id);
    if (ranks == 0) continue;
    uint2 quantized[kVectorsPerLane];
    float scale[kVectorsPerLane];
    if (in.fp8) {
#pragma unroll
      for (int i = 0; i < kVectorsPerLane; ++i) {
        float v[8];
        bf16x8ToFloat(raw[i], v);
        float amax = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fabsf(v[j]));
        // A scale block is 128 values: 16 lanes.
#pragma unroll
        for (int offset = 8; offset > 0; offset /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffff, amax, offset));
        float s = __fdiv_rn(fmaxf(amax, kMinAmax), kFp8Max);
        if (in.ue8m0) {
          unsigned bits = __float_as_uint(s);
          if ((bits & 0x7fffffu) != 0) bits = (bits & 0xff800000u) + 0x800000u;
          s = __uint_as_float(bits);
        }
        scale[i] = s;
        quantized[i] = toFp8x8(v, __frcp_rn(s));
      }
    }
    if (!mayWrite()) return;
    for (uint64_t m = ranks; m != 0; m &= m - 1) {
      const int d = __ffsll(static_cast<long long>(m)) - 1;
      char* msg = messageAt(g, d, set, g.rank, t);
#pragma unroll
      for (int i = 0; i < kVectorsPerLane; ++i) {
        const int value = first + i * 256 + lane * 8;
        if (i * 256 + lane * 8 >= partValues) continue;
        if (in.fp8) {
          *reinterpret_cast<uint2*>(msg + value) = quantized[i];
          if (lane % 16 == 0) reinterpret_cast<float*>(msg + g.layout.scalesOffset)[value / kScaleBlock] = scale[i];
        } else {
          *reinterpret_cast<int4*>(msg + static_cast<size_t>(value) * 2) = raw[i];
        }
      }
      if (p == 0 && lane < g.topk) {
        reinterpret_cast<int*>(msg + g.layout.idsOffset)[lane] = id;
        reinterpret_cast<float*>(msg + g.layout.weightsOffset)[lane] = weight;
      }
    }
    // Every lane's writes, then the parts' tags (system scope: the reader is another GPU).
    __syncwarp();
    __threadfence_system();
    if (lane == 0) {
      for (uint64_t m = ranks; m != 0; m &= m - 1) {
        const int d = __ffsll(static_cast<long long>(m)) - 1;
        storeRelaxed(reinterpret_cast<uint64_t*>(messageAt(g, d, set, g.rank, t) + g.layout.tagsOffset) + p, epoch);
      }
    }
  }
}

__device__ void dispatchReceive(const LlView& g, const LlDispatchInput& in, int set, uint64_t epoch) {
  const int lane = threadIdx.x % kWarp;
  const int warp = blockIdx.x * kWarps + threadIdx.x / kWarp;
  const int warps = gridDim.x * kWarps;
  const LlSetLocal& local = g.sets[set];
  const int parts = llParts(g.hidden);
  const int valueBytes = in.fp8 ? 1 : 2;
  const size_t rowBytes = static_cast<size_t>(g.hidden) * valueBytes;
  const int scalesPerRow = g.hidden / kScaleBlock;
  const uint64_t* tokenBits = reinterpret_cast<const uint64_t*>(at(g, g.rank, setOffset(g, set) + g.layout.tokenBits));
  const int firstExpert = g.rank * g.numLocalExperts;
  // Items in (source, token, part) order; a part other than 0 waits for its message's rows, which
  // the part-0 item (a lower item, so never waiting on this one) hands out.
  const int items = g.nRanks * g.maxTokens * parts;
  for (int item = warp; item < items; item += warps) {
    const int p = item % parts;
    const int slot = item / parts;
    const int s = slot / g.maxTokens, t = slot % g.maxTokens;
    const uint64_t* bitsWord = tokenBits + static_cast<size_t>(s) * g.layout.bitWords + t / kWarp;
    if (!warpAll(waitUntil<true>(g, [&] { return countWordIsFrom(loadRelaxed(bitsWord), epoch); }))) return;
    const unsigned bits = static_cast<unsigned>(countOf(loadRelaxed(bitsWord)));
    int* rowOf = local.rowOf + static_cast<size_t>(slot) * g.topk;
    if (((bits >> (t % kWarp)) & 1u) == 0) {
      if (p == 0 && lane < g.topk) rowOf[lane] = -1;  // no message: combine skips the slot
      continue;
    }
    const char* msg = messageAt(g, g.rank, set, s, t);
    if (!warpAll(waitTag(g, reinterpret_cast<const uint64_t*>(msg + g.layout.tagsOffset) + p, epoch))) return;
    // The part's bytes, loaded while the rows are handed out (part 0) or awaited (other parts).
    const int first = p * kLlPartValues;
    const int partValues = min(kLlPartValues, g.hidden - first);
    const int partVectors = partValues * valueBytes / 16;
    const int4* payload = reinterpret_cast<const int4*>(msg + static_cast<size_t>(first) * valueBytes);
    int4 v[kVectorsPerLane];
#pragma unroll
    for (int i = 0; i < kVectorsPerLane; ++i) {
      v[i] = i * kWarp + lane < partVectors ? __ldcv(payload + i * kWarp + lane) : int4{0, 0, 0, 0};
    }
    const int partScales = partValues / kScaleBlock;
    float scale = 0.0f;
    if (in.fp8 && lane < partScales) {
      scale = __ldcv(reinterpret_cast<const float*>(msg + g.layout.scalesOffset) + first / kScaleBlock + lane);
    }
    int row = -1;
    if (p == 0) {
      if (lane < g.topk) {
        const int id = __ldcv(reinterpret_cast<const int*>(msg + g.layout.idsOffset) + lane);
        const float weight = __ldcv(reinterpret_cast<const float*>(msg + g.layout.weightsOffset) + lane);
        if (id >= firstExpert && id < firstExpert + g.numLocalExperts) {
          const int e = id - firstExpert;
          row = e * g.expertStride + atomicAdd(local.rowCounter + e, 1);
          local.recvSource[static_cast<size_t>(row) * 2] = s;
          local.recvSource[static_cast<size_t>(row) * 2 + 1] = t;
        }
        rowOf[lane] = row;
        local.weightOf[static_cast<size_t>(slot) * g.topk + lane] = weight;
      }
      __syncwarp();
      __threadfence();
      if (lane == 0) *reinterpret_cast<volatile uint64_t*>(local.rowsReady + slot) = epoch;
    } else {
      const uint64_t* ready = local.rowsReady + slot;
      if (!warpAll(waitUntil<true>(g, [&] { return *reinterpret_cast<const volatile uint64_t*>(ready) == epoch; }))) return;
      __threadfence();
      if (lane < g.topk) row = __ldcg(rowOf + lane);
    }
    for (unsigned targets = __ballot_sync(0xffffffff, row >= 0); targets != 0; targets &= targets - 1) {
      const int k = __ffs(targets) - 1;
      const size_t to = static_cast<size_t>(__shfl_sync(0xffffffff, row, k));
      int4* out = reinterpret_cast<int4*>(local.recvX + to * rowBytes + static_cast<size_t>(first) * valueBytes);
#pragma unroll
      for (int i = 0; i < kVectorsPerLane; ++i) {
        if (i * kWarp + lane < partVectors) out[i * kWarp + lane] = v[i];
      }
      if (in.fp8 && lane < partScales) local.recvScales[to * scalesPerRow + first / kScaleBlock + lane] = scale;
    }
  }
}

// The phases of one operation in one kernel: epochs read once at the start; each phase's last
// block advances the phase's counter (and runs `received` after a receive phase).
template <typename Send, typename Receive, typename Received>
__device__ __forceinline__ void runPhases(const LlView& g, LlOpCounters* c, int set, bool send, bool receive,
                                          Send sendPhase, Receive receivePhase, Received received) {
  __shared__ uint64_t epochs[3];  // send, receive, the last send into `set`
  if (threadIdx.x == 0) {
    epochs[0] = c->send + 1;
    epochs[1] = c->receive + 1;
    epochs[2] = c->setUse[set];
  }
  __syncthreads();
  if (timedOut(g)) return;
  if (send) {
    sendPhase(epochs[0], epochs[2]);
    if (lastBlockToFinish<false>(&g.counters->finished[0]) && threadIdx.x == 0) {
      c->setUse[set] = epochs[0];
      c->send = epochs[0];
    }
  }
  if (receive) {
    receivePhase(epochs[1]);
    if (lastBlockToFinish<false>(&g.counters->finished[1])) {
      received(epochs[1]);
      if (threadIdx.x == 0) c->receive = epochs[1];
    }
  }
}

__global__ void __launch_bounds__(kThreads, 1) llDispatchKernel(LlView g, LlDispatchInput in, int set, bool send,
                                                                bool receive) {
  runPhases(
      g, &g.counters->dispatch, set, send, receive,
      [&](uint64_t epoch, uint64_t lastUse) { dispatchSend(g, in, set, epoch, lastUse); },
      [&](uint64_t epoch) { dispatchReceive(g, in, set, epoch); },
      [&](uint64_t epoch) {
        const LlSetLocal& local = g.sets[set];
        for (int e = threadIdx.x; e < g.numLocalExperts; e += blockDim.x) {
          local.recvCount[e] = __ldcg(local.rowCounter + e);
          local.rowCounter[e] = 0;
        }
        releaseSet(g, set, 0, epoch);
      });
}

// ---- combine ----------------------------------------------------------------------------------

// One warp's FP32 sum of a part (32 values per lane) of BF16 rows, added one row at a time in the
// caller's order: every row's vectors are loaded before any is added.
struct PartSum {
  float acc[kVectorsPerLane][8];
  int partVectors;  // 16-byte vectors in this part (the last part of a row may be short)
  int lane;

  __device__ PartSum(int vectors, int laneIndex) : partVectors(vectors), lane(laneIndex) {
#pragma unroll
    for (int i = 0; i < kVectorsPerLane; ++i) {
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[i][j] = 0.0f;
    }
  }

  template <bool kPeerWritten>
  __device__ void load(const int4* row, int4* loaded) const {
#pragma unroll
    for (int i = 0; i < kVectorsPerLane; ++i) {
      const bool valid = i * kWarp + lane < partVectors;
      loaded[i] = !valid ? int4{0, 0, 0, 0} : kPeerWritten ? __ldcv(row + i * kWarp + lane) : __ldg(row + i * kWarp + lane);
    }
  }

  __device__ void accumulate(const int4* loaded, bool weighted, float weight) {
#pragma unroll
    for (int i = 0; i < kVectorsPerLane; ++i) {
      float f[8];
      bf16x8ToFloat(loaded[i], f);
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[i][j] = weighted ? __fmaf_rn(weight, f[j], acc[i][j]) : __fadd_rn(acc[i][j], f[j]);
    }
  }

  // acc = fma(weight, row, acc) when weighted, acc + row otherwise. kPeerWritten: the row was
  // written by another GPU (read past this SM's L1).
  template <bool kPeerWritten>
  __device__ void add(const int4* row, bool weighted, float weight) {
    int4 loaded[kVectorsPerLane];
    load<kPeerWritten>(row, loaded);
    accumulate(loaded, weighted, weight);
  }

  // The same for two rows, first then second, with both rows' loads in flight together.
  template <bool kPeerWritten>
  __device__ void add2(const int4* first, float firstWeight, const int4* second, float secondWeight, bool weighted) {
    int4 a[kVectorsPerLane], b[kVectorsPerLane];
    load<kPeerWritten>(first, a);
    load<kPeerWritten>(second, b);
    accumulate(a, weighted, firstWeight);
    accumulate(b, weighted, secondWeight);
  }

  __device__ void store(int4* out) const {
#pragma unroll
    for (int i = 0; i < kVectorsPerLane; ++i) {
      if (i * kWarp + lane < partVectors) out[i * kWarp + lane] = floatToBf16x8(acc[i]);
    }
  }
};

__device__ void combineSend(const LlView& g, const LlCombineInput& in, int set, uint64_t epoch, uint64_t lastUse) {
  const int lane = threadIdx.x % kWarp;
  const int warp = blockIdx.x * kWarps + threadIdx.x / kWarp;
  const int warps = gridDim.x * kWarps;
  bool setFree = false;
  const LlSetLocal& local = g.sets[set];
  const int parts = llParts(g.hidden);
  const int vectors = g.hidden / 8;
  const int items = g.nRanks * g.maxTokens * parts;
  for (int item = warp; item < items; item += warps) {
    const int p = item % parts;
    const int slot = item / parts;
    const int s = slot / g.maxTokens, t = slot % g.maxTokens;
    int row = -1;
    float weight = 0.0f;
    if (lane < g.topk) {
      row = __ldcg(local.rowOf + static_cast<size_t>(slot) * g.topk + lane);
      weight = in.weighted ? __ldcg(local.weightOf + static_cast<size_t>(slot) * g.topk + lane) : 1.0f;
    }
    const unsigned rows = __ballot_sync(0xffffffff, row >= 0);
    if (rows == 0) continue;
    const int firstVector = p * kLlPartValues / 8;
    PartSum sum(min(kLlPartValues, g.hidden - p * kLlPartValues) / 8, lane);
    // Top-k slot order: the sum's order is fixed. Two rows' loads at a time.
    const int4* outputs = static_cast<const int4*>(in.expertOutput) + firstVector;
    for (unsigned m = rows; m != 0;) {
      const int k = __ffs(m) - 1;
      m &= m - 1;
      const size_t r = static_cast<size_t>(__shfl_sync(0xffffffff, row, k));
      const float w = __shfl_sync(0xffffffff, weight, k);
      if (m == 0) {
        sum.add<false>(outputs + r * vectors, in.weighted, w);
        break;
      }
      const int k2 = __ffs(m) - 1;
      m &= m - 1;
      const size_t r2 = static_cast<size_t>(__shfl_sync(0xffffffff, row, k2));
      const float w2 = __shfl_sync(0xffffffff, weight, k2);
      sum.add2<false>(outputs + r * vectors, w, outputs + r2 * vectors, w2, in.weighted);
    }
    if (!setFree && !(setFree = warpSetFree(g, set, 1, lastUse, lane))) return;
    char* partials = at(g, s, setOffset(g, set) + g.layout.partials);
    sum.store(reinterpret_cast<int4*>(partials) + (static_cast<size_t>(g.rank) * g.maxTokens + t) * vectors + firstVector);
    __syncwarp();
    __threadfence_system();
    if (lane == 0) {
      uint64_t* tags = reinterpret_cast<uint64_t*>(at(g, s, setOffset(g, set) + g.layout.partialTags));
      storeRelaxed(tags + (static_cast<size_t>(g.rank) * g.maxTokens + t) * parts + p, epoch);
    }
  }
}

__device__ void combineReceive(const LlView& g, const LlCombineInput& in, int set, uint64_t epoch) {
  const int lane = threadIdx.x % kWarp;
  const int warp = blockIdx.x * kWarps + threadIdx.x / kWarp;
  const int warps = gridDim.x * kWarps;
  const LlSetLocal& local = g.sets[set];
  const int parts = llParts(g.hidden);
  const int vectors = g.hidden / 8;
  const int4* partials = reinterpret_cast<const int4*>(at(g, g.rank, setOffset(g, set) + g.layout.partials));
  const uint64_t* tags = reinterpret_cast<const uint64_t*>(at(g, g.rank, setOffset(g, set) + g.layout.partialTags));
  for (int item = warp; item < in.numTokens * parts; item += warps) {
    const int p = item % parts;
    const int t = item / parts;
    const uint64_t ranks = __ldcg(local.tokenRanks + t);
    const int firstVector = p * kLlPartValues / 8;
    PartSum sum(min(kLlPartValues, g.hidden - p * kLlPartValues) / 8, lane);
    // Ascending rank order: the sum's order is fixed. Two ranks' partials at a time.
    for (uint64_t m = ranks; m != 0;) {
      const size_t from = static_cast<size_t>(__ffsll(static_cast<long long>(m)) - 1) * g.maxTokens + t;
      m &= m - 1;
      if (!warpAll(waitTag(g, tags + from * parts + p, epoch))) return;
      if (m == 0) {
        sum.add<true>(partials + from * vectors + firstVector, false, 1.0f);
        break;
      }
      const size_t from2 = static_cast<size_t>(__ffsll(static_cast<long long>(m)) - 1) * g.maxTokens + t;
      m &= m - 1;
      if (!warpAll(waitTag(g, tags + from2 * parts + p, epoch))) return;
      sum.add2<true>(partials + from * vectors + firstVector, 1.0f, partials + from2 * vectors + firstVector, 1.0f, false);
    }
    sum.store(static_cast<int4*>(in.combinedX) + static_cast<size_t>(t) * vectors + firstVector);
  }
}

__global__ void __launch_bounds__(kThreads, 1) llCombineKernel(LlView g, LlCombineInput in, int set, bool send,
                                                               bool receive) {
  runPhases(
      g, &g.counters->combine, set, send, receive,
      [&](uint64_t epoch, uint64_t lastUse) { combineSend(g, in, set, epoch, lastUse); },
      [&](uint64_t epoch) { combineReceive(g, in, set, epoch); },
      [&](uint64_t epoch) { releaseSet(g, set, 1, epoch); });
}

}  // namespace

cudaError_t launchLlDispatch(const LlView& view, const LlDispatchInput& input, int set, bool send, bool receive,
                             int numBlocks, cudaStream_t stream) {
  llDispatchKernel<<<numBlocks, kThreads, 0, stream>>>(view, input, set, send, receive);
  return cudaGetLastError();
}

cudaError_t launchLlCombine(const LlView& view, const LlCombineInput& input, int set, bool send, bool receive,
                            int numBlocks, cudaStream_t stream) {
  llCombineKernel<<<numBlocks, kThreads, 0, stream>>>(view, input, set, send, receive);
  return cudaGetLastError();
}

}  // namespace unifab::kernels::ep
