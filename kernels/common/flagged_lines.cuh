// Flagged lines: data and its readiness flag in one 128-byte store, so that a GPU sending a small
// message over NVLink needs no fence between the data and a separate flag, and the receiver can use
// each line as soon as it lands.
//
// A line is written by eight consecutive lanes of one warp store instruction (16 bytes each, the
// line 128-byte aligned) and read the same way; the last 8 bytes carry the flag. Hopper's NVLink and
// L2 move such a line whole (NCCL's LL128 protocol relies on the same property on sm_90), so a reader
// that sees the line's flag also sees the rest of the line. A warp moves four lines per instruction:
// a "group". Lane l holds piece l % 8 of line 4 * group + l / 8.
//
// Line L of a run carries payload bytes [112 L, 112 L + 112) in its pieces 0-6 (16 bytes each, so a
// piece lands 16-byte aligned in a row); the lower half of piece 7 is spare
// (LineRun::setSpare).
#pragma once

#include <cstdint>

#include "kernels/common/device_sync.cuh"
#include "kernels/common/flagged_lines.h"

namespace unifab::kernels {

constexpr int kLinesPerGroup = 4;  // lines a warp moves per instruction
constexpr int kFlagPiece = 7;      // the piece whose upper 8 bytes are the flag

// The line (of its run) that `lane` moves in group `group`, and the payload offset of its piece.
__device__ __forceinline__ int lineOf(int group, int lane) { return group * kLinesPerGroup + lane / 8; }
__device__ __forceinline__ int pieceOffset(int group, int lane) {
  return lineOf(group, lane) * kLinePayloadBytes + (lane % 8) * 16;
}

__device__ __forceinline__ void storeLinePiece(char* piece, uint64_t lo, uint64_t hi) {
  asm volatile("st.volatile.global.v2.u64 [%0], {%1, %2};" ::"l"(piece), "l"(lo), "l"(hi) : "memory");
}

__device__ __forceinline__ void loadLinePiece(const char* piece, uint64_t& lo, uint64_t& hi) {
  asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];" : "=l"(lo), "=l"(hi) : "l"(piece) : "memory");
}

// A line piece loaded only where `predicate` holds; elsewhere `to` holds no meaningful value. As
// the compiler sees `to` written either way, a run of these loads goes out back to back, where a
// conditional load that keeps the old value would be staged through a temporary register.
__device__ __forceinline__ void loadPieceIf(bool predicate, const int4* from, int4& to) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %4, 0;\n @p ld.volatile.global.v4.s32 {%0, %1, %2, %3}, [%5];\n}"
      : "=r"(to.x), "=r"(to.y), "=r"(to.z), "=r"(to.w)
      : "r"(static_cast<int>(predicate)), "l"(from)
      : "memory");
}

// Up to kGroups groups (4 kGroups lines) of one warp: on the sending side filled from a stream
// staged in shared memory and stored to any number of destinations; on the receiving side loaded
// until every line carries the flag.
template <int kGroups>
struct LineRun {
  uint64_t lo[kGroups], hi[kGroups];

  // The lines of `payloadBytes` bytes staged in shared memory (16-byte aligned), each flag lane's
  // upper half set to `flag`; pieces past the payload are zero.
  __device__ void stage(const char* payload, int payloadBytes, uint64_t flag, int lane) {
#pragma unroll
    for (int i = 0; i < kGroups; ++i) {
      lo[i] = 0;
      hi[i] = lane % 8 == kFlagPiece ? flag : 0;
      if (lane % 8 != kFlagPiece && pieceOffset(i, lane) < payloadBytes) {
        const uint64_t* at = reinterpret_cast<const uint64_t*>(payload + pieceOffset(i, lane));
        lo[i] = at[0];
        hi[i] = at[1];
      }
    }
  }

  // Lines [first, end) of the run to consecutive lines at `to` (128-byte aligned). The whole warp
  // calls this together: the eight lanes of a line must store in one instruction.
  __device__ void storeLines(char* to, int first, int end, int lane) const {
    __syncwarp();
#pragma unroll
    for (int i = 0; i < kGroups; ++i) {
      const int line = lineOf(i, lane);
      if (line >= first && line < end) storeLinePiece(to + (line - first) * kLineBytes + (lane % 8) * 16, lo[i], hi[i]);
    }
  }
  __device__ void store(char* run, int lines, int lane) const { storeLines(run, 0, lines, lane); }

  // Puts `spareOf(line)` into the unused lower half of each staged line's flag piece.
  template <typename SpareOf>
  __device__ void setSpare(SpareOf spareOf, int lane) {
#pragma unroll
    for (int i = 0; i < kGroups; ++i) {
      if (lane % 8 == kFlagPiece) lo[i] = spareOf(lineOf(i, lane));
    }
  }

  // Loads the lines of up to kGroups groups until every one carries `flag`. `groupAt(i, lines)`
  // gives group i's first line and sets how many of its lines (0-4) to load; group 0 has at least
  // one. The whole warp calls this together; false in every lane once the wait has lasted longer
  // than `bounds.timeoutNs` (raising `timeoutCode`) or another wait of the group timed out.
  //
  // Every poll loads every group, each straight into its registers, and the wait ends at the first
  // poll that finds all lines flagged (a flagged line stays so for the call). Loading only the lines
  // not yet flagged made each load conditional, which keeps the old value when skipped: the compiler
  // then staged them through one or two temporary registers, so a poll's loads went one or two at a
  // time (the LL combine's 8 groups in 4 round trips; docs/benchmarks/ep-ll.md, nineteenth session).
  template <typename GroupAt>
  __device__ bool load(GroupAt groupAt, uint64_t flag, int lane, const WaitBounds& bounds, int timeoutCode) {
    unsigned inRun = 0;  // groups whose line of this lane is in the run
    int lines = 0;
#pragma unroll
    for (int i = 0; i < kGroups; ++i) {
      groupAt(i, lines);
      inRun |= static_cast<unsigned>(lane / 8 < lines) << i;
    }
    // Addresses are worked out again at each poll: kept, they would take 2 kGroups registers.
    auto pieceOf = [&](int i) {
      int unused = 0;
      return (inRun >> i) & 1u ? groupAt(i, unused) + lane * 16 : groupAt(0, unused) + (lane % 8) * 16;
    };
    WarpDeadline deadline;
    for (unsigned polls = 0;; ++polls) {
#pragma unroll
      for (int i = 0; i < kGroups; ++i) loadLinePiece(pieceOf(i), lo[i], hi[i]);
      unsigned unflagged = 0;
#pragma unroll
      for (int i = 0; i < kGroups; ++i) unflagged |= static_cast<unsigned>(hi[i] != flag) << i;
      // The line's flag lane decides for its eight lanes.
      const unsigned pending = __shfl_sync(0xffffffff, unflagged, lane | kFlagPiece) & inRun;
      if (__all_sync(0xffffffff, pending == 0)) return true;
      if (deadline.expired(bounds, timeoutCode, polls, lane)) return false;
    }
  }
};

}  // namespace unifab::kernels
