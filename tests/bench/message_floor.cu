#include "tests/bench/message_floor.h"

#include <algorithm>

#include "kernels/common/device_sync.cuh"
#include "kernels/common/flagged_lines.cuh"
#include "kernels/common/grid_dependency.cuh"

namespace unifab::bench {
namespace {

using unifab::kernels::kFlagPiece;
using unifab::kernels::kLineBytes;
using unifab::kernels::kLinePayloadBytes;
using unifab::kernels::kLinesPerGroup;

constexpr int kWarp = 32;
// 16-byte vectors (fenced) or line groups (lines) a lane holds at once: every load of a round is
// in flight before the first store, as the operations' kernels do (4 covers a 14336-byte row).
constexpr int kInFlight = 4;

__device__ __forceinline__ uint64_t now() { return unifab::kernels::globalTimerNs(); }

// Whether the wait that began at `start` has lasted past `timeoutNs`: lane 0 decides for the warp,
// so that every lane leaves a loop of full-warp shuffles together.
__device__ __forceinline__ bool expired(uint64_t start, uint64_t timeoutNs, int lane) {
  return __shfl_sync(0xffffffff, static_cast<int>(lane == 0 && now() - start > timeoutNs), 0) != 0;
}

// Bytes [begin, end) of the payload for warp w of kFloorWarps, in 16-byte vectors.
__device__ __forceinline__ void partOf(size_t bytes, int w, size_t* begin, size_t* end) {
  const size_t vectors = (bytes + 15) / 16, per = (vectors + kFloorWarps - 1) / kFloorWarps;
  *begin = min(vectors, per * w) * 16;
  *end = min(vectors, per * (w + 1)) * 16;
}

// Copies [begin, end) of `from` to `to`, kInFlight vectors per lane loaded before any is stored.
__device__ __forceinline__ void copyPart(const char* __restrict__ from, char* __restrict__ to, size_t begin, size_t end,
                                         int lane, bool bypassL1) {
  for (size_t round = begin; round < end; round += size_t{16} * kWarp * kInFlight) {
    int4 v[kInFlight];
#pragma unroll
    for (int i = 0; i < kInFlight; ++i) {
      const size_t at = round + (static_cast<size_t>(i) * kWarp + lane) * 16;
      if (at < end) {
        const int4* src = reinterpret_cast<const int4*>(from + at);
        v[i] = bypassL1 ? __ldcv(src) : *src;
      }
    }
#pragma unroll
    for (int i = 0; i < kInFlight; ++i) {
      const size_t at = round + (static_cast<size_t>(i) * kWarp + lane) * 16;
      if (at < end) *reinterpret_cast<int4*>(to + at) = v[i];
    }
  }
}

__global__ void __launch_bounds__(2 * kFloorWarps * kWarp) messageFloorKernel(
    const char* __restrict__ source, char* __restrict__ peerLanding, uint64_t* peerFlags,
    const char* __restrict__ landing, const uint64_t* flags, char* __restrict__ out, size_t payloadBytes,
    uint64_t epoch, bool lines, uint64_t timeoutNs, int* timedOut) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const bool sender = warp < kFloorWarps;
  const int w = sender ? warp : warp - kFloorWarps;
  const uint64_t start = now();
  if (!lines) {
    size_t begin, end;
    partOf(payloadBytes, w, &begin, &end);
    if (sender) {
      copyPart(source, peerLanding, begin, end, lane, false);
      __syncwarp();
      if (lane == 0) {
        unifab::kernels::fenceAcqRelSystem();
        unifab::kernels::storeRelaxed(peerFlags + w, epoch);
      }
      return;
    }
    while (__shfl_sync(0xffffffff, static_cast<int>(lane == 0 && unifab::kernels::loadAcquire(flags + w) == epoch), 0) == 0) {
      if (expired(start, timeoutNs, lane)) {
        if (lane == 0) atomicExch(timedOut, 1);
        return;
      }
    }
    __syncwarp();  // lane 0's acquire orders the whole warp's reads below
    copyPart(landing, out, begin, end, lane, true);
    return;
  }
  // Flagged lines: warp w moves lines [first, last), kLinesPerGroup per instruction (lane l: piece
  // l % 8 of line first + 4 g + l / 8), kInFlight groups a round.
  const int totalLines = static_cast<int>((payloadBytes + kLinePayloadBytes - 1) / kLinePayloadBytes);
  const int per = (totalLines + kFloorWarps - 1) / kFloorWarps;
  const int first = min(totalLines, per * w), last = min(totalLines, per * (w + 1));
  const int piece = lane % 8;
  for (int round = first; round < last; round += kLinesPerGroup * kInFlight) {
    uint64_t lo[kInFlight], hi[kInFlight];
    auto lineOf = [&](int g) { return round + g * kLinesPerGroup + lane / 8; };
    auto payloadAt = [&](int g) { return static_cast<size_t>(lineOf(g)) * kLinePayloadBytes + piece * 16; };
    if (sender) {
#pragma unroll
      for (int g = 0; g < kInFlight; ++g) {
        lo[g] = 0;
        hi[g] = piece == kFlagPiece ? epoch : 0;
        if (lineOf(g) < last && piece != kFlagPiece && payloadAt(g) < payloadBytes) {
          const uint64_t* at = reinterpret_cast<const uint64_t*>(source + payloadAt(g));
          lo[g] = at[0];
          hi[g] = at[1];
        }
      }
      __syncwarp();  // the eight lanes of a line store in one instruction
#pragma unroll
      for (int g = 0; g < kInFlight; ++g) {
        if (lineOf(g) < last) {
          unifab::kernels::storeLinePiece(peerLanding + static_cast<size_t>(lineOf(g)) * kLineBytes + piece * 16, lo[g], hi[g]);
        }
      }
      continue;
    }
    // Every group of the round loaded at once, then only the groups not yet flagged again.
    unsigned pending = 0;
#pragma unroll
    for (int g = 0; g < kInFlight; ++g) {
      lo[g] = hi[g] = 0;
      if (round + g * kLinesPerGroup < last) pending |= 1u << g;
    }
    while (pending != 0) {
      __syncwarp();  // the eight lanes of a line load in one instruction
#pragma unroll
      for (int g = 0; g < kInFlight; ++g) {
        if (((pending >> g) & 1u) != 0 && lineOf(g) < last) {
          unifab::kernels::loadLinePiece(landing + static_cast<size_t>(lineOf(g)) * kLineBytes + piece * 16, lo[g], hi[g]);
        }
      }
#pragma unroll
      for (int g = 0; g < kInFlight; ++g) {
        if (((pending >> g) & 1u) == 0) continue;
        // Every lane learns whether its line's flag piece carries the epoch.
        const bool flagOk = lineOf(g) >= last || piece != kFlagPiece || hi[g] == epoch;
        const bool lineOk = __shfl_sync(0xffffffff, static_cast<int>(flagOk), (lane & ~7) | kFlagPiece) != 0;
        if (__all_sync(0xffffffff, lineOk)) pending &= ~(1u << g);
      }
      if (pending != 0 && expired(start, timeoutNs, lane)) {
        if (lane == 0) atomicExch(timedOut, 1);
        return;
      }
    }
#pragma unroll
    for (int g = 0; g < kInFlight; ++g) {
      if (lineOf(g) < last && piece != kFlagPiece && payloadAt(g) < payloadBytes) {
        uint64_t* to = reinterpret_cast<uint64_t*>(out + payloadAt(g));
        to[0] = lo[g];
        to[1] = hi[g];
      }
    }
  }
}

__global__ void emptyGridKernel() {
  unifab::kernels::waitForPrerequisiteGrid();
  unifab::kernels::allowDependentLaunch();
}

}  // namespace

size_t floorLandingBytes(size_t payloadBytes) {
  const size_t lines = (payloadBytes + kLinePayloadBytes - 1) / kLinePayloadBytes;
  return std::max(lines * kLineBytes, (payloadBytes + 15) / 16 * 16);
}

cudaError_t launchMessageFloor(const char* source, char* peerLanding, uint64_t* peerFlags, const char* landing,
                               const uint64_t* flags, char* out, size_t payloadBytes, uint64_t epoch, bool lines,
                               uint64_t timeoutNs, int* timedOut, cudaStream_t stream) {
  messageFloorKernel<<<1, 2 * kFloorWarps * kWarp, 0, stream>>>(source, peerLanding, peerFlags, landing, flags, out,
                                                                 payloadBytes, epoch, lines, timeoutNs, timedOut);
  return cudaGetLastError();
}

cudaError_t launchEmptyGrid(int blocks, int threads, size_t sharedBytes, bool programmatic, cudaStream_t stream) {
  return kernels::launchMaybeDependent(emptyGridKernel, dim3(static_cast<unsigned>(blocks)), dim3(static_cast<unsigned>(threads)),
                                       sharedBytes, stream, programmatic);
}

}  // namespace unifab::bench
