// unifab-bench memrates: the memory system's latencies and per-warp rates on this GPU, the numbers
// the low-latency kernels' designs rest on (docs/benchmarks/ep-ll.md, twenty-sixth session):
//   - dependent 8-byte loads (L2 hits) by flavour, and atomics that return;
//   - a word stored by one SM and polled by another, round trip;
//   - one warp's 16-byte-a-lane loads, n in flight: where a warp's own rate ends;
//   - a block of w warps, each loading a 7 KB message and storing it into r rows: an SM's rates;
//   - loads from 2 MB pages nothing has touched (TLB and L2 misses), from other lines of them (L2
//     misses), and again (hits).
// Times come from clock64 inside the kernels (cycles at the SM clock the run reports), minima over
// repetitions, so they are latencies of an idle GPU, not of a busy one.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "kernels/common/device_sync.cuh"
#include "kernels/common/flagged_lines.cuh"
#include "tests/bench/bench_common.h"
#include "tests/common/nccl_session.h"  // TEST_CUDA_CHECK

namespace unifab::bench {
namespace {

// The kernels' own loads (kernels/common: the relaxed system-scope word, the acquire, a flagged
// line's piece) and, to compare, two they do not use.
enum LoadFlavour { kRelaxedSys, kRelaxedGpu, kCacheGlobal, kAcquireGpu, kFlavours };

template <int kFlavour>
__device__ __forceinline__ uint64_t load8(const uint64_t* p) {
  if (kFlavour == kRelaxedSys) return unifab::kernels::loadRelaxed(p);
  if (kFlavour == kAcquireGpu) return unifab::kernels::loadAcquireGpu(p);
  uint64_t v;
  if (kFlavour == kRelaxedGpu) asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  if (kFlavour == kCacheGlobal) asm volatile("ld.global.cg.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// kRelaxedSys: a flagged line's piece as the LL receivers poll it (loadPieceIf).
template <int kFlavour>
__device__ __forceinline__ void load16(const int4* p, int4& v) {
  if (kFlavour == kRelaxedSys) {
    unifab::kernels::loadPieceIf(true, p, v);
  } else {
    asm volatile("ld.global.cg.v4.s32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  }
}

// The SM clock, read once `value` is known: a branch on it comes first (a register operand the
// clock read itself does not use would not order it, and the loads behind an unused value would be
// dropped), and a value that happens to be the marker goes to `sink`.
__device__ __forceinline__ long long clockAfter(int value, int* sink) {
  if (value == 0x5eed5eed) *sink = value;
  return clock64();
}

// One thread: `n` loads (or returning atomics, kFlavours + 0/1) of one word, each address depending
// on the value before; cycles a step.
template <int kOp>
__global__ void dependentChain(uint64_t* word, int n, long long* cycles) {
  uint64_t acc = 0;
  uint64_t* p = word;
  const long long start = clock64();
  for (int i = 0; i < n; ++i) {
    uint64_t v;
    if (kOp < kFlavours) {
      v = load8<kOp>(p);
    } else if (kOp == kFlavours) {
      v = atomicAdd(reinterpret_cast<unsigned long long*>(p), 0ULL);
    } else {
      v = static_cast<uint64_t>(atomicAdd(reinterpret_cast<int*>(p), 0));
    }
    acc += v;
    p = word + ((acc >> 63) << 4);  // always `word`, but the compiler cannot tell
  }
  *cycles = (clock64() - start) / n;
  if (acc == 42) *word = acc;
}

// Blocks 0 and 1 pass a counter back and forth through two words (relaxed system-scope stores and
// loads), `n` times; cycles a round trip, and the two SMs.
__global__ void pingPong(uint64_t* a, uint64_t* b, int n, long long* cycles, int* sms) {
  if (threadIdx.x != 0 || blockIdx.x > 1) return;
  int sm;
  asm("mov.u32 %0, %%smid;" : "=r"(sm));
  sms[blockIdx.x] = sm;
  const long long start = clock64();
  for (uint64_t k = 1; k <= static_cast<uint64_t>(n); ++k) {
    uint64_t* mine = blockIdx.x == 0 ? a : b;
    const uint64_t* theirs = blockIdx.x == 0 ? b : a;
    if (blockIdx.x == 0) unifab::kernels::storeRelaxed(mine, k);
    while (unifab::kernels::loadRelaxed(theirs) != k) {
    }
    if (blockIdx.x == 1) unifab::kernels::storeRelaxed(mine, k);
  }
  if (blockIdx.x == 0) *cycles = (clock64() - start) / n;
}

// One warp, `kLoads` 16-byte loads a lane in flight (a 512-byte run each), then all used; the
// fewest cycles over `reps` (each on other lines, all in L2 after the first 64).
template <int kFlavour, int kLoads>
__global__ void warpLoads(const int4* buffer, int reps, long long* cycles, int* sink) {
  const int lane = threadIdx.x;
  long long best = 1LL << 60;
  for (int r = 0; r < reps; ++r) {
    __syncwarp();
    const long long start = clock64();
    // The addresses depend on the start (the clock never reaches 2^62), so that no load is issued
    // before it: ptxas moved weak loads above a plain clock read.
    const int4* base = buffer + (r % 64) * 4096 + lane + (start >> 62);
    int4 v[kLoads];
#pragma unroll
    for (int i = 0; i < kLoads; ++i) load16<kFlavour>(base + i * 32, v[i]);
    int x = 0;
#pragma unroll
    for (int i = 0; i < kLoads; ++i) x ^= v[i].x ^ v[i].y ^ v[i].z ^ v[i].w;
    x = __reduce_xor_sync(0xffffffff, x);
    const long long took = clockAfter(x, sink) - start;
    if (r >= 64 && took < best) best = took;
  }
  if (lane == 0) *cycles = best;
}

constexpr int kMessageVectors = 448;  // 7 KB of 16-byte vectors: an FP8 row of hidden 7168
constexpr int kMessageLoads = kMessageVectors / 32;

// Each warp of one block: loads a 7 KB message (when `load`), then stores it into `rows` rows
// (when rows > 0); the slowest warp's fewest cycles to issue its accesses and to have them
// performed (a fence after them).
__global__ void blockMessages(const int4* source, int4* rowsOut, bool load, int rows, int reps, long long* issued,
                              long long* performed) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __shared__ long long issuedBy[32], performedBy[32];
  long long bestIssued = 1LL << 60, bestPerformed = 1LL << 60;
  for (int r = 0; r < reps; ++r) {
    const int4* from = source + ((r % 16) * 32 + warp) * kMessageVectors + lane;
    int4* to = rowsOut + ((r % 16) * 32 + warp) * (kMessageVectors * 8) + lane;
    int4 v[kMessageLoads];
    __syncthreads();
    const long long start = clock64();
#pragma unroll
    for (int i = 0; i < kMessageLoads; ++i) {
      if (load) {
        load16<kRelaxedSys>(from + i * 32, v[i]);
      } else {
        v[i] = make_int4(r, i, lane, warp);
      }
    }
    // (With no rows the loaded values go unused: the pieces' ld.volatile is issued all the same.)
    for (int row = 0; row < rows; ++row) {
#pragma unroll
      for (int i = 0; i < kMessageLoads; ++i) to[row * kMessageVectors + i * 32] = v[i];
    }
    const long long issuedAt = clock64() - start;
    __threadfence();
    const long long performedAt = clock64() - start;
    if (r >= 16) {
      bestIssued = min(bestIssued, issuedAt);
      bestPerformed = min(bestPerformed, performedAt);
    }
  }
  if (lane == 0) {
    issuedBy[warp] = bestIssued;
    performedBy[warp] = bestPerformed;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    long long i = 0, p = 0;
    for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) {
      i = max(i, issuedBy[w]);
      p = max(p, performedBy[w]);
    }
    *issued = i;
    *performed = p;
  }
}

// One thread: a load from each of `n` pages `stride` bytes apart, each address depending on the
// value before; cycles a load.
__global__ void pageChain(const char* base, size_t stride, int n, long long* cycles) {
  uint64_t acc = 0;
  const long long start = clock64();
  for (int i = 0; i < n; ++i) {
    acc += load8<kCacheGlobal>(reinterpret_cast<const uint64_t*>(base + i * stride + ((acc >> 63) << 4)));
  }
  *cycles = (clock64() - start) / n;
  if (acc == 42) *cycles = 0;
}

// Device memory of one run, freed however the run ends.
template <typename T>
class DeviceArray {
 public:
  DeviceArray() = default;
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  ~DeviceArray() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  cudaError_t allocate(size_t count) { return cudaMalloc(&ptr_, count * sizeof(T)); }
  T* get() const { return ptr_; }

 private:
  T* ptr_ = nullptr;
};

struct Device {
  double ghz = 0;
  long long* cycles = nullptr;
  long long* cycles2 = nullptr;
  int* sms = nullptr;
  int* sink = nullptr;  // where a loaded value that happens to be clockAfter's marker goes
};

bool readCycles(const long long* from, long long* to) {
  TEST_CUDA_CHECK(cudaDeviceSynchronize());
  TEST_CUDA_CHECK(cudaMemcpy(to, from, sizeof(long long), cudaMemcpyDeviceToHost));
  return true;
}

template <int kOp>
bool chainRow(const Device& d, uint64_t* word, const char* name) {
  dependentChain<kOp><<<1, 1>>>(word, 16, d.cycles);  // warm
  dependentChain<kOp><<<1, 1>>>(word, 2000, d.cycles);
  TEST_CUDA_CHECK(cudaGetLastError());
  long long c = 0;
  if (!readCycles(d.cycles, &c)) return false;
  printf("  %-28s %5lld cycles  %5.0f ns\n", name, c, c / d.ghz);
  return true;
}

template <int kFlavour, int kLoads>
bool warpLoadRow(const Device& d, const int4* buffer, const char* name) {
  warpLoads<kFlavour, kLoads><<<1, 32>>>(buffer, 256, d.cycles, d.sink);
  TEST_CUDA_CHECK(cudaGetLastError());
  long long c = 0;
  if (!readCycles(d.cycles, &c)) return false;
  printf("  %-14s %2d x 16 B a lane (%5d B): %5.0f ns, %5.1f GB/s\n", name, kLoads, kLoads * 512, c / d.ghz,
         kLoads * 512 / (c / d.ghz));
  return true;
}

template <int kFlavour>
bool warpLoadRows(const Device& d, const int4* buffer, const char* name) {
  return warpLoadRow<kFlavour, 1>(d, buffer, name) && warpLoadRow<kFlavour, 2>(d, buffer, name) &&
         warpLoadRow<kFlavour, 4>(d, buffer, name) && warpLoadRow<kFlavour, 8>(d, buffer, name) &&
         warpLoadRow<kFlavour, 14>(d, buffer, name) && warpLoadRow<kFlavour, 16>(d, buffer, name);
}

bool run() {
  int device = 0, clockKhz = 0, smCount = 0;
  TEST_CUDA_CHECK(cudaGetDevice(&device));
  TEST_CUDA_CHECK(cudaDeviceGetAttribute(&clockKhz, cudaDevAttrClockRate, device));
  TEST_CUDA_CHECK(cudaDeviceGetAttribute(&smCount, cudaDevAttrMultiProcessorCount, device));
  cudaDeviceProp prop{};
  TEST_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  Device d;
  d.ghz = clockKhz / 1e6;
  printf("# memrates on %s, %d SMs, cycles at %d MHz (the SM clock's maximum; the run keeps it there)\n", prop.name, smCount,
         clockKhz / 1000);
  constexpr size_t kBig = size_t(1) << 30;  // words, then loads from 1 MB, rows from 512 MB
  DeviceArray<char> bigArray, untouchedArray;
  DeviceArray<long long> cycles, cycles2;
  DeviceArray<int> sms, sink;
  TEST_CUDA_CHECK(bigArray.allocate(kBig));
  TEST_CUDA_CHECK(untouchedArray.allocate(size_t(800) << 20));  // 400 pages of 2 MB for the page rows
  TEST_CUDA_CHECK(cycles.allocate(1));
  TEST_CUDA_CHECK(cycles2.allocate(1));
  TEST_CUDA_CHECK(sms.allocate(2));
  TEST_CUDA_CHECK(sink.allocate(1));
  d.cycles = cycles.get();
  d.cycles2 = cycles2.get();
  d.sms = sms.get();
  d.sink = sink.get();
  char* big = bigArray.get();
  bool ok = cudaMemset(big, 1, kBig) == cudaSuccess;
  uint64_t* words = reinterpret_cast<uint64_t*>(big);
  const int4* loads = reinterpret_cast<const int4*>(big + (size_t(1) << 20));
  int4* rows = reinterpret_cast<int4*>(big + (size_t(1) << 29));

  printf("== dependent accesses of one word (L2 hits), one thread\n");
  ok = ok && chainRow<kRelaxedSys>(d, words, "ld.relaxed.sys (loadRelaxed)") && chainRow<kRelaxedGpu>(d, words, "ld.relaxed.gpu") &&
       chainRow<kCacheGlobal>(d, words, "ld.global.cg") && chainRow<kAcquireGpu>(d, words, "ld.acquire.gpu") &&
       chainRow<kFlavours>(d, words, "atomicAdd u64, returning") && chainRow<kFlavours + 1>(d, words, "atomicAdd u32, returning");
  if (ok) {
    printf("== a word stored by one SM, polled by another, and back (relaxed, system scope)\n");
    for (int trial = 0; ok && trial < 3; ++trial) {
      uint64_t* a = words + 1024 + trial * 64;
      uint64_t* b = words + 2048 + trial * 64;
      ok = cudaMemset(a, 0, 8) == cudaSuccess && cudaMemset(b, 0, 8) == cudaSuccess;
      pingPong<<<2 + 30 * trial, 32>>>(a, b, 10000, d.cycles, d.sms);
      long long c = 0;
      int sms[2] = {0, 0};
      ok = ok && cudaGetLastError() == cudaSuccess && readCycles(d.cycles, &c) &&
           cudaMemcpy(sms, d.sms, sizeof(sms), cudaMemcpyDeviceToHost) == cudaSuccess;
      if (ok) printf("  SMs %3d and %3d: round trip %5.0f ns\n", sms[0], sms[1], c / d.ghz);
    }
  }
  if (ok) {
    printf("== one warp's 16-byte loads a lane, all in flight (L2 hits)\n");
    ok = warpLoadRows<kRelaxedSys>(d, loads, "loadPieceIf") && warpLoadRows<kCacheGlobal>(d, loads, "ld.global.cg");
  }
  if (ok) {
    printf("== one block (one SM): each warp loads a 7 KB message and/or stores it into rows (slowest warp)\n");
    for (int mode = 0; ok && mode < 3; ++mode) {
      for (int warps : {1, 2, 4, 8, 16}) {
        for (int rowCount : {1, 2, 4}) {
          if (mode == 0 && rowCount > 1) continue;
          const bool load = mode != 1;
          const int stored = mode == 0 ? 0 : rowCount;
          blockMessages<<<1, 32 * warps>>>(loads, rows, load, stored, 64, d.cycles, d.cycles2);
          long long issued = 0, performed = 0;
          ok = cudaGetLastError() == cudaSuccess && readCycles(d.cycles, &issued) && readCycles(d.cycles2, &performed);
          if (!ok) break;
          const double kb = warps * 7.0 * ((load ? 1 : 0) + stored);
          printf("  %-16s warps %2d rows %d: issued %5.0f ns, performed %5.0f ns: %6.1f KB, %5.1f GB/s\n",
                 mode == 0 ? "load" : mode == 1 ? "store" : "load and store", warps, stored, issued / d.ghz,
                 performed / d.ghz, kb, kb * 1024 / (performed / d.ghz));
        }
      }
    }
  }
  if (ok) {
    // Pages nothing has touched since cudaMalloc (their first translation and their lines' first
    // loads), then other lines of the same pages (translated, lines still in DRAM), then the first
    // lines again (L2 hits): the first two differ by a TLB miss, the last two by an L2 miss.
    printf("== 2 MB pages, dependent loads a page apart, one thread\n");
    const size_t page = size_t(2) << 20;
    char* untouched = untouchedArray.get();
    size_t used = 0;
    for (int pages : {16, 128, 256}) {
      if (!ok) break;
      long long first = 0, otherLines = 0, again = 0;
      char* region = untouched + used;
      used += pages * page;
      pageChain<<<1, 1>>>(region, page, pages, d.cycles);
      ok = cudaGetLastError() == cudaSuccess && readCycles(d.cycles, &first);
      pageChain<<<1, 1>>>(region + (size_t(1) << 20), page, pages, d.cycles);
      ok = ok && cudaGetLastError() == cudaSuccess && readCycles(d.cycles, &otherLines);
      pageChain<<<1, 1>>>(region, page, pages, d.cycles);
      ok = ok && cudaGetLastError() == cudaSuccess && readCycles(d.cycles, &again);
      if (ok) {
        printf("  %3d pages: untouched %5.0f ns a load, other lines of them %5.0f ns, the first lines again %5.0f ns\n", pages,
               first / d.ghz, otherLines / d.ghz, again / d.ghz);
      }
    }
  }
  if (!ok) fprintf(stderr, "memrates: a CUDA call failed: %s\n", cudaGetErrorString(cudaGetLastError()));
  return ok;
}

}  // namespace

int runMemRates(Args& args) {
  if (!args.leftovers().empty()) {
    fprintf(stderr, "memrates: takes no options\n");
    return 2;
  }
  return run() ? 0 : 1;
}

}  // namespace unifab::bench
