// Eight BF16 values in one 16-byte vector, widened to FP32 and narrowed back (round to nearest
// even): the unit every EP kernel loads, sums and stores.
#pragma once

#include <cuda_bf16.h>

namespace unifab::kernels {

__device__ __forceinline__ void bf16x8ToFloat(const int4& v, float* f) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 p = __bfloat1622float2(h[i]);
    f[2 * i] = p.x;
    f[2 * i + 1] = p.y;
  }
}

__device__ __forceinline__ int4 floatToBf16x8(const float* f) {
  int4 v;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  return v;
}

}  // namespace unifab::kernels
