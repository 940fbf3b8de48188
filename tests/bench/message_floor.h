// The least a kernel per GPU takes to hand one message to the other GPU, as the low-latency
// dispatch and combine hand over a token: the sending warps load the payload and store it into the
// peer's memory, the receiving warps wait for it and copy it into an output; every GPU does both at
// once, one kernel of one block. What the operations add to that (routing, rows handed out, scales,
// sums, the set's reuse) is theirs; what the floor takes is the link's and the protocol's. Two
// protocols: payload then a fenced flag per warp (the dispatch's), and flagged lines (the
// combine's: each 128-byte line carries its flag, no fence).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace unifab::bench {

constexpr int kFloorWarps = 8;  // sending warps, and as many receiving warps

// Bytes of the peer's landing area `payloadBytes` needs in each protocol (lines: 128 per 112).
size_t floorLandingBytes(size_t payloadBytes);

// One kernel: sends `payloadBytes` of `source` into `peerLanding` (the peer's landing area, its
// flags `peerFlags` [kFloorWarps]), and receives the peer's from `landing` (flags `flags`) into
// `out`, tagged `epoch` (a new value per launch). `lines` picks flagged lines. A wait past
// `timeoutNs` sets *timedOut and gives up.
cudaError_t launchMessageFloor(const char* source, char* peerLanding, uint64_t* peerFlags, const char* landing,
                               const uint64_t* flags, char* out, size_t payloadBytes, uint64_t epoch, bool lines,
                               uint64_t timeoutNs, int* timedOut, cudaStream_t stream);

// The least any kernel takes: a grid of `blocks` x `threads` with `sharedBytes` (at most 48 KiB) of
// dynamic shared memory that waits for the stream's previous kernel (as a programmatic dependent launch when
// `programmatic`, like the operations' kernels) and ends. Its kernel time is what a profiler counts
// for launching and retiring such a grid, before any work.
cudaError_t launchEmptyGrid(int blocks, int threads, size_t sharedBytes, bool programmatic, cudaStream_t stream);

}  // namespace unifab::bench
