// A warp copying a row of 16-byte vectors with kWarpCopyUnroll vectors in flight per lane (loads
// before stores): 128 KB in flight per 1024-thread block, what a row read across NVLink needs.
// (A masked full last round instead of the vector-at-a-time tail measured no faster in a plain
// copy, and in the EP kernels it spills: they run at their register limits.)
#pragma once

namespace unifab::kernels {

constexpr int kWarpCopyUnroll = 8;

// `bytes` a multiple of 16; the source is not written while the kernel runs.
__device__ __forceinline__ void warpCopy(char* dst, const char* src, int bytes, int lane) {
  constexpr int kWarp = 32;
  const int4* in = reinterpret_cast<const int4*>(src);
  int4* out = reinterpret_cast<int4*>(dst);
  const int vectors = bytes / 16;
  int i = lane;
  for (; i + (kWarpCopyUnroll - 1) * kWarp < vectors; i += kWarpCopyUnroll * kWarp) {
    int4 v[kWarpCopyUnroll];
#pragma unroll
    for (int u = 0; u < kWarpCopyUnroll; ++u) v[u] = __ldg(in + i + u * kWarp);
#pragma unroll
    for (int u = 0; u < kWarpCopyUnroll; ++u) out[i + u * kWarp] = v[u];
  }
  for (; i < vectors; i += kWarp) out[i] = __ldg(in + i);
}

}  // namespace unifab::kernels
