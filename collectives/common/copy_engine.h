// Device-to-device copies meant for the copy engines, so that the zero-SM operations (pipeline
// send/recv, Engram's copy-engine fetches) leave the SMs to the caller's kernels. A copy whose
// source or destination is on a peer GPU runs on the copy engine; a copy between two buffers of
// one GPU runs as an SM kernel on the 580 driver whatever the flags (measured), and honours the
// hint passed here, cudaMemcpyFlagPreferOverlapWithCompute, from the CUDA 13.1 driver on (per
// public reports; see docs/benchmarks/pp-engram.md).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "plugin/check.h"

namespace unifab::collectives {

// Copies sizes[i] bytes from srcs[i] to dsts[i] for every i < count, in `stream`'s order (each
// source is read after the stream's earlier work). The legacy default stream, which the batch
// API refuses, gets one cudaMemcpyAsync per copy instead.
Result copyEngineBatch(void* const* dsts, const void* const* srcs, const size_t* sizes, size_t count,
                       cudaStream_t stream);

inline Result copyEngineCopy(void* dst, const void* src, size_t bytes, cudaStream_t stream) {
  return copyEngineBatch(&dst, &src, &bytes, 1, stream);
}

}  // namespace unifab::collectives
