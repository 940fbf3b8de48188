// Addresses of a symmetric window as this GPU sees it on every LSA peer, read once from NCCL's
// device-side window description so hot kernels work with plain pointers.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

namespace unifab::kernels {

// Writes the window base of LSA ranks 0..lsaSize-1 to out[] (device memory) and the value seen
// at offset `probeOffset` of each peer to probe[] (device memory), proving the peers are mapped.
cudaError_t queryPeerBases(ncclWindow_t window, int lsaSize, size_t probeOffset, char** out, int* probe,
                           cudaStream_t stream);

}  // namespace unifab::kernels
