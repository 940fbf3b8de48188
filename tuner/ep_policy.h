// How many SMs unifab's own expert-parallel kernels need: the fewest that keep the NVLink links
// busy, from per-SM rates measured on H200 (docs/benchmarks): an SM issuing 16-byte or bulk
// stores moves at most ~50 GB/s into a peer and ~63 GB/s into local memory, and a link direction
// carries ~78% of its nominal rate.
#pragma once

namespace unifab::tuner {

struct EpSmQuery {
  int nRanks = 1;
  int deviceSms = 0;            // SMs of the GPU
  double nvlinkGBps = 0;        // nominal per direction; 0 = unknown
};

// SMs for the high-throughput dispatch or combine payload kernels, at least 4 and at most 24
// (the budget DeepEP and its peers are measured with) and the device's count.
int epHighThroughputSms(const EpSmQuery& query);

enum class EpOp { kDispatch, kCombine };

// Of a call's `blocks` (one per SM), how many write the rows that cross NVLink; the others write
// this rank's own rows (dispatch) or reduce this rank's tokens (combine). 0 when every row is
// local (one rank); `blocks` when a single block must do both.
int epRemoteBlocks(EpOp op, int nRanks, int blocks);

// Blocks of `warpsPerBlock` warps for a low-latency phase of `warpItems` independent warp-sized
// items (message parts): one item per warp when the device has the SMs (latency, not bandwidth,
// decides at these sizes), at least 1 and at most `deviceSms`.
int epLowLatencyBlocks(int warpItems, int warpsPerBlock, int deviceSms);

}  // namespace unifab::tuner
