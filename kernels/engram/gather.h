// The Engram gather kernel: rows of a table spread over LSA peers, read by global row id into a
// local buffer by warps of a few SMs (a warp per row, eight 16-byte vectors in flight per lane).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace unifab::kernels::engram {

constexpr int kMaxPeers = 64;
constexpr int kErrorRowId = 1 << 1;  // a row id outside the table (or on a rank that is not a peer)

struct TableView {
  char* rows[kMaxPeers];    // every LSA peer's rows as this GPU addresses them
  float* scales[kMaxPeers]; // their row scales, or null
  int firstRank;            // global rank of LSA peer 0
  int peers;
  int64_t rowsPerRank;
  int64_t rowBytes;
  int* error;               // device word of error bits
  int* hostError;           // host-mapped mirror, written once per kind
};

struct GatherArgs {
  const void* rowIds;
  bool rowIdsAre32;
  int64_t numRows;
  char* out;
  float* outScales;  // or null
};

cudaError_t launchGather(const TableView& table, const GatherArgs& args, int numBlocks, cudaStream_t stream);

}  // namespace unifab::kernels::engram
