// GPU side of the expert-parallel tests: expert outputs generated in place from the dispatch's
// own row metadata (so a captured graph can hold dispatch, "experts" and combine).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace unifab::test::ep {

// Row p of `out` (hidden BF16 values) gets expertOutputBits(seed, rank, source of p, expert of p);
// expert-major padding rows get NaN, which combine must never read.
cudaError_t fillExpertOutputs(uint16_t* out, int hidden, const int* source, const int* numRows, bool expertMajor,
                              const int* expertOffsets, const int* rowsPerExpert, int localExperts, int rank,
                              uint64_t seed, int maxRows, cudaStream_t stream);

}  // namespace unifab::test::ep
