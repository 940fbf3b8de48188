#include "tests/bench/message_floor.h"

#include <algorithm>

#include "kernels/common/device_sync.cuh"
#include "kernels/common/flagged_lines.cuh"

namespace unifab::bench {
namespace {

using unifab::kernels::kLineBytes;
using unifab::kernels::kLinePayloadBytes;
using unifab::kernels::kLinesPerGroup;
using unifab::kernels::kFlagPiece;

constexpr int kWarp = 32;

__device__ __forceinline__ uint64_t now() { return unifab::kernels::globalTimerNs(); }

// Bytes [begin, end) of the payload for warp w of kFloorWarps, in 16-byte vectors.
__device__ __forceinline__ void partOf(size_t bytes, int w, size_t* begin, size_t* end) {
  const size_t vectors = (bytes + 15) / 16, per = (vectors + kFloorWarps - 1) / kFloorWarps;
  *begin = min(vectors, per * w) * 16;
  *end = min(vectors, per * (w + 1)) * 16;
}

__global__ void __launch_bounds__(2 * kFloorWarps * kWarp) messageFloorKernel(
    const char* source, char* peerLanding, uint64_t* peerFlags, const char* landing, const uint64_t* flags, char* out,
    size_t payloadBytes, uint64_t epoch, bool lines, uint64_t timeoutNs, int* timedOut) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const bool sender = warp < kFloorWarps;
  const int w = sender ? warp : warp - kFloorWarps;
  const uint64_t start = now();
  if (!lines) {
    size_t begin, end;
    partOf(payloadBytes, w, &begin, &end);
    if (sender) {
      for (size_t at = begin + 16 * lane; at < end; at += 16 * kWarp) {
        *reinterpret_cast<int4*>(peerLanding + at) = *reinterpret_cast<const int4*>(source + at);
      }
      __syncwarp();
      if (lane == 0) {
        unifab::kernels::fenceAcqRelSystem();
        unifab::kernels::storeRelaxed(peerFlags + w, epoch);
      }
      return;
    }
    bool arrived = true;
    if (lane == 0) {
      while (unifab::kernels::loadAcquire(flags + w) != epoch) {
        if (now() - start > timeoutNs) {
          arrived = false;
          atomicExch(timedOut, 1);
          break;
        }
      }
    }
    if (__shfl_sync(0xffffffff, static_cast<int>(arrived), 0) == 0) return;
    __syncwarp();
    for (size_t at = begin + 16 * lane; at < end; at += 16 * kWarp) {
      *reinterpret_cast<int4*>(out + at) = __ldcv(reinterpret_cast<const int4*>(landing + at));
    }
    return;
  }
  // Flagged lines: warp w moves lines [first, last), four per instruction (lane l: piece l % 8 of
  // line first + 4 g + l / 8).
  const int totalLines = static_cast<int>((payloadBytes + kLinePayloadBytes - 1) / kLinePayloadBytes);
  const int per = (totalLines + kFloorWarps - 1) / kFloorWarps;
  const int first = min(totalLines, per * w), last = min(totalLines, per * (w + 1));
  const int piece = lane % 8;
  for (int base = first; base < last; base += kLinesPerGroup) {
    const int line = base + lane / 8;
    const bool mine = line < last;
    const size_t payloadAt = static_cast<size_t>(line) * kLinePayloadBytes + piece * 16;
    if (sender) {
      uint64_t lo = 0, hi = piece == kFlagPiece ? epoch : 0;
      if (mine && piece != kFlagPiece && payloadAt < payloadBytes) {
        const uint64_t* at = reinterpret_cast<const uint64_t*>(source + payloadAt);
        lo = at[0];
        hi = at[1];
      }
      if (mine) unifab::kernels::storeLinePiece(peerLanding + static_cast<size_t>(line) * kLineBytes + piece * 16, lo, hi);
      continue;
    }
    uint64_t lo = 0, hi = 0;
    for (;;) {
      if (mine) unifab::kernels::loadLinePiece(landing + static_cast<size_t>(line) * kLineBytes + piece * 16, lo, hi);
      // Every lane learns whether its line's flag piece carries the epoch.
      const bool flagOk = !mine || piece != kFlagPiece || hi == epoch;
      const bool lineOk = __shfl_sync(0xffffffff, static_cast<int>(flagOk), (lane & ~7) | kFlagPiece) != 0;
      if (__all_sync(0xffffffff, lineOk)) break;
      if (now() - start > timeoutNs) {
        if (lane == 0) atomicExch(timedOut, 1);
        return;
      }
    }
    if (mine && piece != kFlagPiece && payloadAt < payloadBytes) {
      uint64_t* to = reinterpret_cast<uint64_t*>(out + payloadAt);
      to[0] = lo;
      to[1] = hi;
    }
  }
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

}  // namespace unifab::bench
