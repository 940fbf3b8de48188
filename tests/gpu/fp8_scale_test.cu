// Every float amax from kMinAmax to kFp8ScaleFastMax, with and without UE8M0 rounding: the LL
// dispatch's branch-free scale (fp8ScaleFast) must give the very scale and inverse that __fdiv_rn
// and __frcp_rn give (fp8ScaleExact), bit for bit; and the values past the range (infinity) must
// be sent to fp8ScaleExact. One GPU, no NCCL; ~2.4e9 cases take well under a second.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstring>

#include "kernels/ep/fp8_scale.cuh"

namespace {

using unifab::kernels::ep::Fp8Scale;
using unifab::kernels::ep::fp8ScaleExact;
using unifab::kernels::ep::fp8ScaleFast;
using unifab::kernels::ep::fp8ScaleFastApplies;
using unifab::kernels::ep::kFp8ScaleFastMax;
using unifab::kernels::ep::kMinAmax;

struct Mismatches {
  unsigned long long count;
  unsigned firstBits;  // the smallest amax (as bits) that disagreed, ~0u if none
  int firstUe8m0;
};

__global__ void compareScales(uint32_t firstBits, uint32_t lastBits, Mismatches* out) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  unsigned long long bad = 0;
  for (uint64_t b = firstBits + static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; b <= lastBits; b += stride) {
    const float amax = __uint_as_float(static_cast<uint32_t>(b));
    for (int ue8m0 = 0; ue8m0 < 2; ++ue8m0) {
      const Fp8Scale fast = fp8ScaleFast(amax, ue8m0 != 0), exact = fp8ScaleExact(amax, ue8m0 != 0);
      const bool applies = fp8ScaleFastApplies(amax);
      if (!applies || __float_as_uint(fast.scale) != __float_as_uint(exact.scale) ||
          __float_as_uint(fast.inverse) != __float_as_uint(exact.inverse)) {
        ++bad;
        atomicMin(&out->firstBits, static_cast<uint32_t>(b));
        out->firstUe8m0 = ue8m0;
      }
    }
  }
  if (bad != 0) atomicAdd(&out->count, bad);
}

// Past the range the fast path must not be chosen.
__global__ void checkOutOfRange(int* wrong) {
  const float past[] = {__int_as_float(0x7f800000), __uint_as_float(0x7f7fffffu) * 2.0f};
  for (float amax : past) {
    if (fp8ScaleFastApplies(amax)) atomicAdd(wrong, 1);
  }
}

bool check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fprintf(stderr, "fp8_scale_test: %s: %s\n", what, cudaGetErrorString(e));
  return e == cudaSuccess;
}

}  // namespace

int main() {
  Mismatches* mismatches = nullptr;
  int* wrong = nullptr;
  if (!check(cudaMalloc(&mismatches, sizeof(Mismatches)), "cudaMalloc") || !check(cudaMalloc(&wrong, sizeof(int)), "cudaMalloc")) return 1;
  const Mismatches none{0, ~0u, -1};
  if (!check(cudaMemcpy(mismatches, &none, sizeof(none), cudaMemcpyHostToDevice), "cudaMemcpy") ||
      !check(cudaMemset(wrong, 0, sizeof(int)), "cudaMemset")) {
    return 1;
  }
  uint32_t firstBits = 0, lastBits = 0;
  std::memcpy(&firstBits, &kMinAmax, sizeof(float));
  std::memcpy(&lastBits, &kFp8ScaleFastMax, sizeof(float));
  // Below kMinAmax every amax clamps to kMinAmax: a few of them, zero and the smallest included.
  compareScales<<<1, 64>>>(0, 63, mismatches);
  compareScales<<<1, 64>>>(firstBits - 4096, firstBits, mismatches);
  compareScales<<<4096, 256>>>(firstBits, lastBits, mismatches);
  checkOutOfRange<<<1, 1>>>(wrong);
  if (!check(cudaGetLastError(), "launch") || !check(cudaDeviceSynchronize(), "kernels")) return 1;
  Mismatches result{};
  int outOfRange = 0;
  if (!check(cudaMemcpy(&result, mismatches, sizeof(result), cudaMemcpyDeviceToHost), "cudaMemcpy") ||
      !check(cudaMemcpy(&outOfRange, wrong, sizeof(int), cudaMemcpyDeviceToHost), "cudaMemcpy")) {
    return 1;
  }
  const unsigned long long cases = 2ull * (lastBits - firstBits + 1 + 64 + 4097);
  printf("fp8 scale: %llu cases, %llu mismatches", cases, result.count);
  if (result.count != 0) {
    float amax = 0;
    std::memcpy(&amax, &result.firstBits, sizeof(float));
    printf(" (first at amax %.9g = 0x%08x, ue8m0 %d)", amax, result.firstBits, result.firstUe8m0);
  }
  printf("; out-of-range amax taken by the fast path: %d\n", outOfRange);
  cudaFree(mismatches);
  cudaFree(wrong);
  return result.count == 0 && outOfRange == 0 ? 0 : 1;
}
