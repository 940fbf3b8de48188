// The low-latency dispatch's FP8 (e4m3) block scale: s = max(amax, kMinAmax) / kFp8Max, optionally
// rounded up to a power of two (UE8M0), and the 1/s the values are multiplied by, both rounded to
// nearest as __fdiv_rn and __frcp_rn round them (so the CPU reference, which divides in IEEE
// single precision, matches bit for bit).
//
// __fdiv_rn and __frcp_rn each end in a branch to a slow path for operands at the edges of the
// exponent range; the compiler cannot schedule a warp's blocks across those branches, so a part's
// four scales were computed one after the other (0.8 us of a 1-token dispatch's path, measured:
// docs/benchmarks/ep-ll.md, twenty-fifth session). fp8ScaleFast is those functions' fast paths
// alone, correct on [kMinAmax, kFp8ScaleFastMax] (tests/gpu/fp8_scale_test.cu checks every float
// of that range against __fdiv_rn and __frcp_rn); a block outside it (an infinite value) takes
// fp8ScaleExact.
#pragma once

#include <cstdint>

namespace unifab::kernels::ep {

constexpr float kFp8Max = 448.0f;   // largest finite e4m3 value
constexpr float kMinAmax = 1e-4f;   // an all-zero block still gets a finite scale
constexpr float kFp8InverseMax = 1.0f / kFp8Max;  // rounded to nearest
constexpr float kFp8ScaleFastMax = 3.4028234663852886e38f;  // FLT_MAX: every finite amax

struct Fp8Scale {
  float scale;    // what the receiver multiplies the e4m3 values by
  float inverse;  // what the sender multiplies the values by before the cast
};

// The smallest power of two >= s (s positive and finite).
__device__ __forceinline__ float roundUpToPowerOfTwo(float s) {
  unsigned bits = __float_as_uint(s);
  if ((bits & 0x7fffffu) != 0) bits = (bits & 0xff800000u) + 0x800000u;
  return __uint_as_float(bits);
}

// For amax in [kMinAmax, kFp8ScaleFastMax] after the clamp (the caller checks the range): the
// quotient by one correcting FMA on the rounded reciprocal of 448, and 1/s by one Newton step on
// the hardware's approximate reciprocal, as the two functions' fast paths compute them.
__device__ __forceinline__ Fp8Scale fp8ScaleFast(float amax, bool ue8m0) {
  const float a = fmaxf(amax, kMinAmax);
  const float q = __fmul_rn(a, kFp8InverseMax);
  float s = __fmaf_rn(__fmaf_rn(-q, kFp8Max, a), kFp8InverseMax, q);
  if (ue8m0) s = roundUpToPowerOfTwo(s);
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(s));
  return {s, __fmaf_rn(r, __fmaf_rn(-s, r, 1.0f), r)};
}

__device__ __forceinline__ bool fp8ScaleFastApplies(float amax) { return fmaxf(amax, kMinAmax) <= kFp8ScaleFastMax; }

__device__ __forceinline__ Fp8Scale fp8ScaleExact(float amax, bool ue8m0) {
  float s = __fdiv_rn(fmaxf(amax, kMinAmax), kFp8Max);
  if (ue8m0) s = roundUpToPowerOfTwo(s);
  return {s, __frcp_rn(s)};
}

}  // namespace unifab::kernels::ep
