#include <nccl_device.h>

#include "kernels/common/window.h"

namespace unifab::kernels {
namespace {

__global__ void peerBasesKernel(ncclWindow_t window, int lsaSize, size_t probeOffset, char** out, int* probe) {
  int peer = threadIdx.x;
  if (peer >= lsaSize) return;
  char* base = static_cast<char*>(ncclGetLsaPointer(window, 0, peer));
  out[peer] = base;
  probe[peer] = *reinterpret_cast<volatile int*>(base + probeOffset);
}

}  // namespace

cudaError_t queryPeerBases(ncclWindow_t window, int lsaSize, size_t probeOffset, char** out, int* probe,
                           cudaStream_t stream) {
  peerBasesKernel<<<1, lsaSize, 0, stream>>>(window, lsaSize, probeOffset, out, probe);
  return cudaGetLastError();
}

}  // namespace unifab::kernels
