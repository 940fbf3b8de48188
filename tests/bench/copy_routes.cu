// unifab-bench copy-routes: which device-to-device copy routes stay off the SMs on this driver.
// Each route copies --bytes once alone and once next to a kernel that holds every SM of the
// issuing GPU for about --busy-ms; a route that waits for the SMs takes about that long next to
// it, one on a copy engine takes about its time alone. Single process; the peer routes need a
// second GPU. The zero-SM operations (pipeline send/recv, Engram's copy engine) choose their
// copies by what this prints. With two GPUs it then measures what bounds those operations from
// below: one peer copy against the same bytes in pieces (one batch call, or several streams), the
// copy engine's rate for row copies per issuing stream, and the latency of a zero-SM hand-over
// between the GPUs and of a whole zero-SM rendezvous transfer.
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <thread>
#include <functional>
#include <string>
#include <vector>

#include "tests/bench/bench_common.h"
#include "tests/bench/copy_batch.h"
#include "tests/common/nccl_session.h"  // TEST_CUDA_CHECK

namespace unifab::bench {
namespace {

__global__ void holdSms(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

struct Route {
  const char* name;
  std::function<cudaError_t(cudaStream_t)> copy;
};

struct Timer {
  cudaEvent_t start = nullptr, stop = nullptr;
  ~Timer() {
    if (start != nullptr) cudaEventDestroy(start);
    if (stop != nullptr) cudaEventDestroy(stop);
  }
};

cudaError_t batchCopy(void* dst, const void* src, size_t bytes, cudaMemcpySrcAccessOrder order, unsigned flags,
                      cudaStream_t stream) {
  return copyBatch(&dst, &src, &bytes, 1, order, flags, stream);
}

// A driver API function by name (CUDA 12.0's version of it), or null where the driver lacks it.
template <typename Function>
Function driverFunction(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return reinterpret_cast<Function>(fn);
}

// The two stream memory operations a zero-SM hand-over is made of, from the driver.
struct MemOps {
  using Op = CUresult(CUDAAPI*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
  Op wait = nullptr, write = nullptr;
  bool resolve() {
    wait = driverFunction<Op>("cuStreamWaitValue64");
    write = driverFunction<Op>("cuStreamWriteValue64");
    return wait != nullptr && write != nullptr;
  }
};

#define MEMOP_CHECK(call)                                                      \
  do {                                                                         \
    const CUresult r_ = (call);                                                \
    if (r_ != CUDA_SUCCESS) {                                                  \
      fprintf(stderr, "%s:%d: %s failed: CUresult %d\n", __FILE__, __LINE__, #call, static_cast<int>(r_)); \
      return false;                                                            \
    }                                                                          \
  } while (0)

// One fetch of 64 KiB rows as cudaMemcpyBatchAsync takes it: row i of `dst` from row order[i] of
// `src` (what an Engram copy-engine fetch of single rows issues).
constexpr size_t kFetchRowBytes = size_t{64} << 10;
struct RowFetch {
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<size_t> sizes;
  void point(char* dst, const char* src, const std::vector<size_t>& order) {
    dsts.resize(order.size());
    srcs.resize(order.size());
    sizes.assign(order.size(), kFetchRowBytes);
    for (size_t i = 0; i < order.size(); ++i) {
      dsts[i] = dst + i * kFetchRowBytes;
      srcs[i] = src + order[i] * kFetchRowBytes;
    }
  }
  // Copies [first, first + count) in one call, with Engram's attributes unless told otherwise.
  cudaError_t batch(size_t first, size_t count, cudaStream_t stream,
                    cudaMemcpySrcAccessOrder order = cudaMemcpySrcAccessOrderStream,
                    unsigned flags = cudaMemcpyFlagPreferOverlapWithCompute) const {
    return copyBatch(dsts.data() + first, srcs.data() + first, sizes.data() + first, count, order, flags, stream);
  }
};

// Row indices 0..rows-1 in an order drawn from `state` (a Fisher-Yates shuffle).
std::vector<size_t> shuffledRows(size_t rows, uint64_t& state) {
  std::vector<size_t> order(rows);
  for (size_t i = 0; i < rows; ++i) order[i] = i;
  for (size_t i = rows - 1; i > 0; --i) {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    std::swap(order[i], order[(state >> 33) % (i + 1)]);
  }
  return order;
}

// Row indices 0..rows-1 spread by a fixed prime stride (a permutation for any rows below 7919).
std::vector<size_t> stridedRows(size_t rows) {
  std::vector<size_t> order(rows);
  for (size_t i = 0; i < rows; ++i) order[i] = (i * 7919) % rows;
  return order;
}

// What a zero-SM transfer between two GPUs cannot go below: the time a stream memory write on one
// GPU takes to release a stream memory wait on the other (flag ping-pong, half the round trip),
// and the rendezvous a pipeline transfer is made of, without any of unifab's host work: the
// receiver's stream says "my buffer is ready" to the sender's, whose copy engine copies into it
// and says "done" back. Both GPUs in this process, flags in the waiting GPU's memory.
bool measureHandOver(char* local, char* peer, size_t maxBytes) {
  MemOps ops;
  if (!ops.resolve()) {
    printf("# hand-over: the driver has no 64-bit stream memory operations; skipped\n");
    return true;
  }
  uint64_t *flag0 = nullptr, *flag1 = nullptr;  // on GPU 0 and on GPU 1
  cudaStream_t s0 = nullptr, s1 = nullptr;
  TEST_CUDA_CHECK(cudaSetDevice(1));
  const cudaError_t back = cudaDeviceEnablePeerAccess(0, 0);
  if (back != cudaSuccess && back != cudaErrorPeerAccessAlreadyEnabled) TEST_CUDA_CHECK(back);
  (void)cudaGetLastError();
  constexpr size_t kFlushBytes = size_t{256} << 20;  // both L2s flushed before a transfer timed alone
  char *flush0 = nullptr, *flush1 = nullptr;
  TEST_CUDA_CHECK(cudaMalloc(&flush1, kFlushBytes));
  TEST_CUDA_CHECK(cudaMalloc(&flag1, 2 * sizeof(uint64_t)));
  TEST_CUDA_CHECK(cudaMemset(flag1, 0, 2 * sizeof(uint64_t)));
  TEST_CUDA_CHECK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  cudaEvent_t start1 = nullptr, stop1 = nullptr;
  TEST_CUDA_CHECK(cudaEventCreate(&start1));
  TEST_CUDA_CHECK(cudaEventCreate(&stop1));
  TEST_CUDA_CHECK(cudaDeviceSynchronize());
  TEST_CUDA_CHECK(cudaSetDevice(0));
  TEST_CUDA_CHECK(cudaMalloc(&flush0, kFlushBytes));
  TEST_CUDA_CHECK(cudaMalloc(&flag0, 2 * sizeof(uint64_t)));
  TEST_CUDA_CHECK(cudaMemset(flag0, 0, 2 * sizeof(uint64_t)));
  TEST_CUDA_CHECK(cudaStreamCreateWithFlags(&s0, cudaStreamNonBlocking));
  TEST_CUDA_CHECK(cudaDeviceSynchronize());
  auto dev = [](const uint64_t* p) { return reinterpret_cast<CUdeviceptr>(p); };
  uint64_t value = 0;

  // Ping-pong: GPU 0 writes GPU 1's flag and waits for its own; GPU 1 answers.
  constexpr int kRounds = 200;
  cudaEvent_t start0 = nullptr, stop0 = nullptr;
  TEST_CUDA_CHECK(cudaEventCreate(&start0));
  TEST_CUDA_CHECK(cudaEventCreate(&stop0));
  TEST_CUDA_CHECK(cudaEventRecord(start0, s0));
  for (int i = 0; i < kRounds; ++i) {
    ++value;
    MEMOP_CHECK(ops.write(reinterpret_cast<CUstream>(s0), dev(flag1), value, CU_STREAM_WRITE_VALUE_DEFAULT));
    MEMOP_CHECK(ops.wait(reinterpret_cast<CUstream>(s0), dev(flag0), value, CU_STREAM_WAIT_VALUE_GEQ));
    MEMOP_CHECK(ops.wait(reinterpret_cast<CUstream>(s1), dev(flag1), value, CU_STREAM_WAIT_VALUE_GEQ));
    MEMOP_CHECK(ops.write(reinterpret_cast<CUstream>(s1), dev(flag0), value, CU_STREAM_WRITE_VALUE_DEFAULT));
  }
  TEST_CUDA_CHECK(cudaEventRecord(stop0, s0));
  TEST_CUDA_CHECK(cudaEventSynchronize(stop0));
  float ms = 0;
  TEST_CUDA_CHECK(cudaEventElapsedTime(&ms, start0, stop0));
  printf("# hand-over by stream memory operations between the GPUs: %.2f us one way (ping-pong of %d rounds)\n",
         ms * 1e3 / kRounds / 2, kRounds);

  // The rendezvous: receiver (GPU 1) says ready, sender (GPU 0) copies into GPU 1 and says done.
  // Timed on the receiver's stream from before its ready to after its done wait: one transfer at
  // a time after both L2s are flushed (the sender's operations enqueued first), median of 30, as
  // unifab-bench pp times; and 30 back to back with no flush, as nccl-tests times.
  printf("# %-44s %10s %12s %12s\n", "zero-SM rendezvous, GPU 0 -> GPU 1", "copy(us)", "one(us)", "b2b(us)");
  for (size_t bytes = size_t{64} << 10; bytes <= maxBytes && bytes <= (size_t{64} << 20); bytes *= 4) {
    auto transfer = [&](bool timedAlone, std::vector<double>* samples) {
      ++value;
      if (timedAlone) {
        TEST_CUDA_CHECK(cudaMemsetAsync(flush0, static_cast<int>(value & 0xff), kFlushBytes, s0));
        TEST_CUDA_CHECK(cudaSetDevice(1));
        TEST_CUDA_CHECK(cudaMemsetAsync(flush1, static_cast<int>(value & 0xff), kFlushBytes, s1));
        TEST_CUDA_CHECK(cudaSetDevice(0));
      }
      MEMOP_CHECK(ops.wait(reinterpret_cast<CUstream>(s0), dev(flag0 + 1), value, CU_STREAM_WAIT_VALUE_GEQ));
      TEST_CUDA_CHECK(cudaMemcpyAsync(peer, local, bytes, cudaMemcpyDeviceToDevice, s0));
      MEMOP_CHECK(ops.write(reinterpret_cast<CUstream>(s0), dev(flag1 + 1), value, CU_STREAM_WRITE_VALUE_DEFAULT));
      if (timedAlone) TEST_CUDA_CHECK(cudaEventRecord(start1, s1));
      MEMOP_CHECK(ops.write(reinterpret_cast<CUstream>(s1), dev(flag0 + 1), value, CU_STREAM_WRITE_VALUE_DEFAULT));
      MEMOP_CHECK(ops.wait(reinterpret_cast<CUstream>(s1), dev(flag1 + 1), value, CU_STREAM_WAIT_VALUE_GEQ));
      if (timedAlone) {
        TEST_CUDA_CHECK(cudaEventRecord(stop1, s1));
        TEST_CUDA_CHECK(cudaEventSynchronize(stop1));
        float t = 0;
        TEST_CUDA_CHECK(cudaEventElapsedTime(&t, start1, stop1));
        samples->push_back(t * 1e3);
      }
      return true;
    };
    std::vector<double> alone, copy;
    for (int i = 0; i < 35; ++i) {
      if (!transfer(true, &alone)) return false;
      TEST_CUDA_CHECK(cudaEventRecord(start0, s0));
      TEST_CUDA_CHECK(cudaMemcpyAsync(peer, local, bytes, cudaMemcpyDeviceToDevice, s0));
      TEST_CUDA_CHECK(cudaEventRecord(stop0, s0));
      TEST_CUDA_CHECK(cudaEventSynchronize(stop0));
      float t = 0;
      TEST_CUDA_CHECK(cudaEventElapsedTime(&t, start0, stop0));
      copy.push_back(t * 1e3);
    }
    alone.erase(alone.begin(), alone.begin() + 5);  // warm-up
    copy.erase(copy.begin(), copy.begin() + 5);
    TEST_CUDA_CHECK(cudaEventRecord(start1, s1));
    constexpr int kInRow = 30;
    for (int i = 0; i < kInRow; ++i) {
      if (!transfer(false, nullptr)) return false;
    }
    TEST_CUDA_CHECK(cudaEventRecord(stop1, s1));
    TEST_CUDA_CHECK(cudaEventSynchronize(stop1));
    TEST_CUDA_CHECK(cudaEventElapsedTime(&ms, start1, stop1));
    printf("  %-44s %10.1f %12.1f %12.1f\n", formatBytes(bytes).c_str(), median(copy), median(alone), ms * 1e3 / kInRow);
  }
  TEST_CUDA_CHECK(cudaDeviceSynchronize());
  TEST_CUDA_CHECK(cudaSetDevice(1));
  TEST_CUDA_CHECK(cudaDeviceSynchronize());
  cudaStreamDestroy(s1);
  cudaEventDestroy(start1);
  cudaEventDestroy(stop1);
  cudaFree(flag1);
  cudaFree(flush1);
  TEST_CUDA_CHECK(cudaSetDevice(0));
  cudaStreamDestroy(s0);
  cudaEventDestroy(start0);
  cudaEventDestroy(stop0);
  cudaFree(flag0);
  cudaFree(flush0);
  return true;
}

// One peer copy (GPU 0 -> GPU 1) against the same bytes cut into pieces: in one batch call
// (cudaMemcpyBatchAsync, as the PP engine issues its one copy), and on 2 or 4 streams of their own
// forked from and joined back into the timing stream with events: whether several copy-engine
// channels move one transfer faster than one does (issue 5 asks 351 GB/s at 16 MiB, above what one
// copy reached). Timed alone after GPU 0's L2 is flushed (median of 20) and 20 back to back.
bool measureSplitPeerCopy(char* local, char* peer, size_t maxBytes) {
  constexpr int kMaxPieces = 4;
  constexpr size_t kFlushBytes = size_t{256} << 20;
  constexpr size_t kAlign = size_t{64} << 10;
  cudaStream_t timing = nullptr;
  cudaStream_t helpers[kMaxPieces] = {};
  cudaEvent_t start = nullptr, stop = nullptr, fork = nullptr;
  cudaEvent_t joins[kMaxPieces] = {};
  char* flush = nullptr;
  TEST_CUDA_CHECK(cudaMalloc(&flush, kFlushBytes));
  TEST_CUDA_CHECK(cudaStreamCreateWithFlags(&timing, cudaStreamNonBlocking));
  TEST_CUDA_CHECK(cudaEventCreate(&start));
  TEST_CUDA_CHECK(cudaEventCreate(&stop));
  TEST_CUDA_CHECK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  for (int k = 0; k < kMaxPieces; ++k) {
    TEST_CUDA_CHECK(cudaStreamCreateWithFlags(&helpers[k], cudaStreamNonBlocking));
    TEST_CUDA_CHECK(cudaEventCreateWithFlags(&joins[k], cudaEventDisableTiming));
  }
  struct Way {
    const char* name;
    int pieces;
    bool batch;  // one cudaMemcpyBatchAsync on the timing stream; else a stream per piece (1: plain copy)
  };
  const Way ways[] = {{"1 copy", 1, false}, {"1 copy, batch call", 1, true}, {"4 pieces, one batch call", 4, true},
                      {"2 pieces, 2 streams", 2, false}, {"4 pieces, 4 streams", 4, false}};
  // The copy of `bytes` the way `way` says, issued into `timing`'s order.
  auto transfer = [&](size_t bytes, const Way& way) -> cudaError_t {
    const size_t piece = (bytes / way.pieces + kAlign - 1) / kAlign * kAlign;
    void* dsts[kMaxPieces];
    const void* srcs[kMaxPieces];
    size_t sizes[kMaxPieces];
    int count = 0;
    for (int k = 0; k < way.pieces; ++k) {
      const size_t first = std::min(bytes, k * piece), size = std::min(bytes - first, piece);
      if (size == 0) continue;
      dsts[count] = peer + first;
      srcs[count] = local + first;
      sizes[count++] = size;
    }
    if (way.batch) {
      return copyBatch(dsts, srcs, sizes, count, cudaMemcpySrcAccessOrderStream, cudaMemcpyFlagPreferOverlapWithCompute,
                       timing);
    }
    if (count == 1) return cudaMemcpyAsync(dsts[0], srcs[0], sizes[0], cudaMemcpyDeviceToDevice, timing);
    cudaError_t e = cudaEventRecord(fork, timing);
    for (int k = 0; k < count && e == cudaSuccess; ++k) {
      e = cudaStreamWaitEvent(helpers[k], fork, 0);
      if (e == cudaSuccess) e = cudaMemcpyAsync(dsts[k], srcs[k], sizes[k], cudaMemcpyDeviceToDevice, helpers[k]);
      if (e == cudaSuccess) e = cudaEventRecord(joins[k], helpers[k]);
      if (e == cudaSuccess) e = cudaStreamWaitEvent(timing, joins[k], 0);
    }
    return e;
  };
  printf("# %-44s %10s %9s %10s\n", "peer write GPU 0 -> GPU 1, one transfer", "alone(us)", "GB/s", "b2b(us)");
  for (size_t bytes = size_t{1} << 20; bytes <= maxBytes && bytes <= (size_t{256} << 20); bytes *= 4) {
    for (const Way& way : ways) {
      std::vector<double> samples;
      for (int i = 0; i < 25; ++i) {
        TEST_CUDA_CHECK(cudaMemsetAsync(flush, i & 0xff, kFlushBytes, timing));
        TEST_CUDA_CHECK(cudaEventRecord(start, timing));
        TEST_CUDA_CHECK(transfer(bytes, way));
        TEST_CUDA_CHECK(cudaEventRecord(stop, timing));
        TEST_CUDA_CHECK(cudaEventSynchronize(stop));
        float ms = 0;
        TEST_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
        if (i >= 5) samples.push_back(ms * 1e3);
      }
      constexpr int kInRow = 20;
      TEST_CUDA_CHECK(cudaEventRecord(start, timing));
      for (int i = 0; i < kInRow; ++i) TEST_CUDA_CHECK(transfer(bytes, way));
      TEST_CUDA_CHECK(cudaEventRecord(stop, timing));
      TEST_CUDA_CHECK(cudaEventSynchronize(stop));
      float ms = 0;
      TEST_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
      const double us = median(samples);
      const std::string name = formatBytes(bytes) + ", " + way.name;
      printf("  %-44s %10.1f %9.1f %10.1f\n", name.c_str(), us, static_cast<double>(bytes) / (us * 1e3), ms * 1e3 / kInRow);
    }
  }
  TEST_CUDA_CHECK(cudaDeviceSynchronize());
  for (int k = 0; k < kMaxPieces; ++k) {
    cudaStreamDestroy(helpers[k]);
    cudaEventDestroy(joins[k]);
  }
  cudaEventDestroy(fork);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaStreamDestroy(timing);
  cudaFree(flush);
  return true;
}

// Row copies out of the peer GPU (what an Engram copy-engine fetch is): 64 KiB rows in a random
// order, one cudaMemcpyBatchAsync per fetch, timed on the stream that issues it. Issued from one
// stream, then another, then the first again, then both at once (half the rows each): whether the
// copy engine's rate belongs to the process, to a stream or to the first stream that copied.
bool measureRowCopyStreams(char* local, char* peer, size_t bytes) {
  const size_t rows = bytes / kFetchRowBytes;
  if (rows < 2) return true;
  uint64_t state = 4711;
  RowFetch fetch;
  fetch.point(local, peer, shuffledRows(rows, state));
  cudaStream_t streams[2] = {nullptr, nullptr};
  cudaEvent_t starts[2] = {nullptr, nullptr}, stops[2] = {nullptr, nullptr};
  for (int k = 0; k < 2; ++k) {
    TEST_CUDA_CHECK(cudaStreamCreateWithFlags(&streams[k], cudaStreamNonBlocking));
    TEST_CUDA_CHECK(cudaEventCreate(&starts[k]));
    TEST_CUDA_CHECK(cudaEventCreate(&stops[k]));
  }
  auto batch = [&](int k, size_t first, size_t count) { return fetch.batch(first, count, streams[k]); };
  printf("# %zu random 64 KiB rows out of the peer, one batch per fetch (median of 9 fetches)\n", rows);
  const char* names[] = {"stream A", "stream B", "stream A again", "streams A and B at once (half each)"};
  for (int phase = 0; phase < 4; ++phase) {
    std::vector<double> samples;
    for (int i = 0; i < 10; ++i) {
      TEST_CUDA_CHECK(cudaDeviceSynchronize());
      const bool both = phase == 3;
      const int k = phase == 1 ? 1 : 0;
      if (both) {
        TEST_CUDA_CHECK(cudaEventRecord(starts[0], streams[0]));
        TEST_CUDA_CHECK(cudaStreamWaitEvent(streams[1], starts[0], 0));
        TEST_CUDA_CHECK(batch(0, 0, rows / 2));
        TEST_CUDA_CHECK(batch(1, rows / 2, rows - rows / 2));
        TEST_CUDA_CHECK(cudaEventRecord(stops[1], streams[1]));
        TEST_CUDA_CHECK(cudaStreamWaitEvent(streams[0], stops[1], 0));
        TEST_CUDA_CHECK(cudaEventRecord(stops[0], streams[0]));
      } else {
        TEST_CUDA_CHECK(cudaEventRecord(starts[0], streams[k]));
        TEST_CUDA_CHECK(batch(k, 0, rows));
        TEST_CUDA_CHECK(cudaEventRecord(stops[0], streams[k]));
      }
      TEST_CUDA_CHECK(cudaEventSynchronize(stops[0]));
      float ms = 0;
      TEST_CUDA_CHECK(cudaEventElapsedTime(&ms, starts[0], stops[0]));
      if (i > 0) samples.push_back(ms * 1e3);
    }
    const double us = median(samples);
    printf("  %-44s %10.1f us %8.1f GB/s %6.2f M copies/s\n", names[phase], us, rows * kFetchRowBytes / (us * 1e3),
           rows / us);
  }
  TEST_CUDA_CHECK(cudaDeviceSynchronize());
  for (int k = 0; k < 2; ++k) {
    cudaStreamDestroy(streams[k]);
    cudaEventDestroy(starts[k]);
    cudaEventDestroy(stops[k]);
  }
  return true;
}

// What one process with a thread per GPU (nccl-tests' -t 2) does to the copy engine's host side:
// each thread issues one cudaMemcpyBatchAsync of 64 KiB rows out of the other GPU to its own GPU,
// first alone, then both threads at once. The host time of the call is what bounds a copy-engine
// fetch issued back to back.
bool measureBatchIssueThreads(char* local0, char* peer1, char* local1, char* peer0, size_t bytes) {
  const size_t rows = bytes / kFetchRowBytes;
  if (rows < 2) return true;
  struct Side {
    int device = 0;
    char* dst = nullptr;
    const char* src = nullptr;
    cudaStream_t stream = nullptr;
    RowFetch fetch;
    std::vector<double> hostUs;
    cudaError_t status = cudaSuccess;
  };
  Side sides[2];
  sides[0].device = 0, sides[0].dst = local0, sides[0].src = peer1;
  sides[1].device = 1, sides[1].dst = local1, sides[1].src = peer0;
  TEST_CUDA_CHECK(cudaSetDevice(1));
  const cudaError_t enabled = cudaDeviceEnablePeerAccess(0, 0);
  if (enabled != cudaSuccess && enabled != cudaErrorPeerAccessAlreadyEnabled) TEST_CUDA_CHECK(enabled);
  (void)cudaGetLastError();
  for (Side& side : sides) {
    TEST_CUDA_CHECK(cudaSetDevice(side.device));
    TEST_CUDA_CHECK(cudaStreamCreateWithFlags(&side.stream, cudaStreamNonBlocking));
    side.fetch.point(side.dst, side.src, stridedRows(rows));
  }
  TEST_CUDA_CHECK(cudaSetDevice(0));
  auto issue = [](Side* side) {
    if (cudaSetDevice(side->device) != cudaSuccess) return;
    const auto start = std::chrono::steady_clock::now();
    side->status = side->fetch.batch(0, side->fetch.dsts.size(), side->stream);
    side->hostUs.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count());
    if (side->status == cudaSuccess) side->status = cudaStreamSynchronize(side->stream);
  };
  printf("# host time of one cudaMemcpyBatchAsync of %zu rows of 64 KiB, per issuing thread (median of 9)\n", rows);
  for (int both = 0; both < 2; ++both) {
    for (Side& side : sides) side.hostUs.clear();
    for (int i = 0; i < 10; ++i) {
      if (both) {
        std::thread other(issue, &sides[1]);
        issue(&sides[0]);
        other.join();
      } else {
        issue(&sides[0]);
      }
      for (Side& side : sides) TEST_CUDA_CHECK(side.status);
    }
    for (int k = 0; k < (both ? 2 : 1); ++k) {
      sides[k].hostUs.erase(sides[k].hostUs.begin());  // warm-up
      printf("  %-44s %10.1f us (%.2f us per copy)\n",
             both ? (k == 0 ? "thread of GPU 0, both threads at once" : "thread of GPU 1, both threads at once")
                  : "thread of GPU 0 alone",
             median(sides[k].hostUs), median(sides[k].hostUs) / rows);
    }
  }
  for (Side& side : sides) {
    TEST_CUDA_CHECK(cudaSetDevice(side.device));
    cudaStreamDestroy(side.stream);
  }
  TEST_CUDA_CHECK(cudaSetDevice(0));
  return true;
}

// The copy engine's rate for the same row fetch (1024 random 64 KiB rows out of `src`, one batch)
// on each of several streams made one after another, the last two at the highest priority: whether
// the rate belongs to the stream (the copy engine the driver gave it), which would explain the
// processes whose every copy-engine fetch runs at about half the rate of others. Median of 5
// fetches a stream, each timed alone.
bool measureStreamCopyRates(char* dst, const char* src, size_t bytes, Timer& timer) {
  const size_t rows = std::min<size_t>(bytes / kFetchRowBytes, 1024);
  if (rows < 4) return true;
  RowFetch fetch;
  fetch.point(dst, src, stridedRows(rows));
  int leastPriority = 0, greatestPriority = 0;
  TEST_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&leastPriority, &greatestPriority));
  constexpr int kStreams = 10;
  printf("# %zu random 64 KiB rows of the peer, one batch, on each of %d streams made in turn (median of 5, us):\n#",
         rows, kStreams);
  std::vector<cudaStream_t> streams(kStreams, nullptr);
  for (int k = 0; k < kStreams; ++k) {
    const int priority = k >= kStreams - 2 ? greatestPriority : leastPriority;
    TEST_CUDA_CHECK(cudaStreamCreateWithPriority(&streams[k], cudaStreamNonBlocking, priority));
    std::vector<double> samples;
    for (int i = 0; i < 6; ++i) {
      TEST_CUDA_CHECK(cudaEventRecord(timer.start, streams[k]));
      TEST_CUDA_CHECK(fetch.batch(0, rows, streams[k]));
      TEST_CUDA_CHECK(cudaEventRecord(timer.stop, streams[k]));
      TEST_CUDA_CHECK(cudaEventSynchronize(timer.stop));
      float ms = 0;
      TEST_CUDA_CHECK(cudaEventElapsedTime(&ms, timer.start, timer.stop));
      if (i > 0) samples.push_back(ms * 1e3);
    }
    printf(" %s%.0f", k >= kStreams - 2 ? "high:" : "", median(samples));
  }
  printf("\n");
  for (cudaStream_t stream : streams) cudaStreamDestroy(stream);
  return true;
}

// Memory of GPU `owner` mapped by the driver's virtual memory API (as NCCL maps its symmetric
// windows, which Engram's copies read), readable and writable by GPUs 0 and 1; null when the
// driver lacks the API. The batch call's host cost per copy may depend on how memory was made.
char* vmmAlloc(int owner, size_t bytes, int gpus) {
  using Granularity = CUresult(CUDAAPI*)(size_t*, const CUmemAllocationProp*, CUmemAllocationGranularity_flags);
  using Create = CUresult(CUDAAPI*)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*, unsigned long long);
  using Reserve = CUresult(CUDAAPI*)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long);
  using Map = CUresult(CUDAAPI*)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
  using SetAccess = CUresult(CUDAAPI*)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t);
  auto granularity = driverFunction<Granularity>("cuMemGetAllocationGranularity");
  auto create = driverFunction<Create>("cuMemCreate");
  auto reserve = driverFunction<Reserve>("cuMemAddressReserve");
  auto map = driverFunction<Map>("cuMemMap");
  auto setAccess = driverFunction<SetAccess>("cuMemSetAccess");
  if (granularity == nullptr || create == nullptr || reserve == nullptr || map == nullptr || setAccess == nullptr) {
    return nullptr;
  }
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = owner;
  size_t unit = 0;
  if (granularity(&unit, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED) != CUDA_SUCCESS || unit == 0) return nullptr;
  const size_t size = (bytes + unit - 1) / unit * unit;
  CUmemGenericAllocationHandle handle = 0;
  CUdeviceptr at = 0;
  if (create(&handle, size, &prop, 0) != CUDA_SUCCESS || reserve(&at, size, unit, 0, 0) != CUDA_SUCCESS ||
      map(at, size, 0, handle, 0) != CUDA_SUCCESS) {
    return nullptr;
  }
  std::vector<CUmemAccessDesc> access(gpus);
  for (int g = 0; g < gpus; ++g) {
    access[g].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access[g].location.id = g;
    access[g].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  }
  if (setAccess(at, size, access.data(), access.size()) != CUDA_SUCCESS) return nullptr;
  return reinterpret_cast<char*>(at);  // left mapped until the process ends: a benchmark's one buffer
}

// What the host spends to hand a fetch of random 64 KiB row copies (1024 at most) to the copy
// engine, and how fast the engine then runs them, by the way they are issued: one
// cudaMemcpyBatchAsync of every row, batches of 256 down to 32 rows, a cudaMemcpyAsync per row, or
// a CUDA graph of a memcpy node per row built once and re-pointed at each fetch's rows. Engram's
// zero-SM fetch of 64 KiB rows is bound by the host's ~0.5-1 us per copy inside the batch call
// (docs/benchmarks/pp-engram.md). Per path: host time of one fetch's issue and its stream time
// alone (medians of 9), 10 fetches back to back, and its stream time next to a kernel holding
// every SM (a path that waits for the SMs is not zero-SM).
// `stream` issues the copies, `busy` runs the SM-holding kernel (blocks x 1024 threads, `cycles`).
bool measureRowIssuePaths(const char* label, char* dst, const char* src, size_t bytes, cudaStream_t stream,
                          cudaStream_t busy, Timer& timer, int blocks, long long cycles) {
  constexpr size_t kRow = kFetchRowBytes;
  const size_t rows = std::min<size_t>(bytes / kRow, 1024);
  if (rows < 4) return true;
  uint64_t state = 1234567;
  std::vector<size_t> order;
  RowFetch fetch;
  auto nextFetch = [&]() {
    order = shuffledRows(rows, state);
    fetch.point(dst, src, order);
  };
  std::vector<void*>& dsts = fetch.dsts;
  std::vector<const void*>& srcs = fetch.srcs;
  // Each source row starts with its own index, so that the check at the end can fail.
  for (size_t r = 0; r < rows; ++r) {
    const uint64_t head[2] = {r, ~r};
    TEST_CUDA_CHECK(cudaMemcpy(const_cast<char*>(src) + r * kRow, head, sizeof(head), cudaMemcpyHostToDevice));
  }
  nextFetch();

  // A graph of one memcpy node per row in two chains, built once; each fetch re-points its nodes
  // (cudaGraphExecMemcpyNodeSetParams1D) before the launch.
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t graphExec = nullptr;
  std::vector<cudaGraphNode_t> nodes(rows);
  TEST_CUDA_CHECK(cudaGraphCreate(&graph, 0));
  for (size_t i = 0; i < rows; ++i) {
    const bool linked = i >= 2;
    TEST_CUDA_CHECK(cudaGraphAddMemcpyNode1D(&nodes[i], graph, linked ? &nodes[i - 2] : nullptr, linked ? 1 : 0,
                                             dsts[i], srcs[i], kRow, cudaMemcpyDeviceToDevice));
  }
  TEST_CUDA_CHECK(cudaGraphInstantiate(&graphExec, graph, 0));
  auto pointGraph = [&]() -> cudaError_t {
    for (size_t i = 0; i < rows; ++i) {
      const cudaError_t e =
          cudaGraphExecMemcpyNodeSetParams1D(graphExec, nodes[i], dsts[i], srcs[i], kRow, cudaMemcpyDeviceToDevice);
      if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
  };
  auto batches = [&](size_t per, cudaMemcpySrcAccessOrder access, unsigned flags) -> cudaError_t {
    for (size_t first = 0; first < rows; first += per) {
      const cudaError_t e = fetch.batch(first, std::min(per, rows - first), stream, access, flags);
      if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
  };
  struct Path {
    std::string name;
    std::function<cudaError_t()> issue;
  };
  std::vector<Path> paths;
  for (size_t per : {rows, size_t{256}, size_t{128}, size_t{64}, size_t{32}}) {
    paths.push_back({per == rows ? std::string("one cudaMemcpyBatchAsync (Engram's)")
                                 : "cudaMemcpyBatchAsync of " + std::to_string(per) + " rows at a time",
                     [&, per] { return batches(per, cudaMemcpySrcAccessOrderStream, cudaMemcpyFlagPreferOverlapWithCompute); }});
  }
  paths.push_back({"one batch, any source order, no hint",
                   [&] { return batches(rows, cudaMemcpySrcAccessOrderAny, cudaMemcpyFlagDefault); }});
  paths.push_back({"a cudaMemcpyAsync per row", [&] {
                     for (size_t i = 0; i < rows; ++i) {
                       const cudaError_t e = cudaMemcpyAsync(dsts[i], srcs[i], kRow, cudaMemcpyDeviceToDevice, stream);
                       if (e != cudaSuccess) return e;
                     }
                     return cudaSuccess;
                   }});
  paths.push_back({"graph of a node per row, nodes re-pointed", [&] {
                     const cudaError_t e = pointGraph();
                     return e != cudaSuccess ? e : cudaGraphLaunch(graphExec, stream);
                   }});

  printf("# %s: %zu random 64 KiB rows a fetch; host = time of the issue calls, alone = stream time (median of 9),\n"
         "# b2b = 10 fetches issued back to back, busy = stream time next to a kernel on every SM\n",
         label, rows);
  printf("# %-44s %10s %10s %10s %10s %9s\n", "issue path", "host(us)", "alone(us)", "b2b(us)", "busy(us)", "GB/s b2b");
  for (const Path& path : paths) {
    std::vector<double> host, alone;
    for (int i = 0; i < 10; ++i) {
      nextFetch();
      TEST_CUDA_CHECK(cudaStreamSynchronize(stream));
      TEST_CUDA_CHECK(cudaEventRecord(timer.start, stream));
      const auto t0 = std::chrono::steady_clock::now();
      TEST_CUDA_CHECK(path.issue());
      const auto t1 = std::chrono::steady_clock::now();
      TEST_CUDA_CHECK(cudaEventRecord(timer.stop, stream));
      TEST_CUDA_CHECK(cudaEventSynchronize(timer.stop));
      float ms = 0;
      TEST_CUDA_CHECK(cudaEventElapsedTime(&ms, timer.start, timer.stop));
      if (i == 0) continue;  // warm-up
      host.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
      alone.push_back(ms * 1e3);
    }
    // Back to back: the next fetch's rows are set up between issues, as a caller's loop would.
    TEST_CUDA_CHECK(cudaStreamSynchronize(stream));
    const auto b0 = std::chrono::steady_clock::now();
    constexpr int kInRow = 10;
    for (int i = 0; i < kInRow; ++i) {
      nextFetch();
      TEST_CUDA_CHECK(path.issue());
    }
    TEST_CUDA_CHECK(cudaStreamSynchronize(stream));
    const double b2b = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - b0).count() / kInRow;
    TEST_CUDA_CHECK(cudaDeviceSynchronize());
    holdSms<<<blocks, 1024, 0, busy>>>(cycles);
    TEST_CUDA_CHECK(cudaGetLastError());
    TEST_CUDA_CHECK(cudaEventRecord(timer.start, stream));
    TEST_CUDA_CHECK(path.issue());
    TEST_CUDA_CHECK(cudaEventRecord(timer.stop, stream));
    TEST_CUDA_CHECK(cudaEventSynchronize(timer.stop));
    float busyMs = 0;
    TEST_CUDA_CHECK(cudaEventElapsedTime(&busyMs, timer.start, timer.stop));
    TEST_CUDA_CHECK(cudaDeviceSynchronize());
    printf("  %-44s %10.1f %10.1f %10.1f %10.1f %9.1f\n", path.name.c_str(), median(host), median(alone), b2b, busyMs * 1e3,
           rows * kRow / (b2b * 1e3));
  }
  // The rows a re-pointed graph copies are the rows asked for.
  nextFetch();
  TEST_CUDA_CHECK(cudaMemsetAsync(dst, 0, rows * kRow, stream));
  TEST_CUDA_CHECK(pointGraph());
  TEST_CUDA_CHECK(cudaGraphLaunch(graphExec, stream));
  TEST_CUDA_CHECK(cudaStreamSynchronize(stream));
  size_t wrong = 0;
  for (size_t i = 0; i < rows; i += 37) {
    uint64_t got[2] = {0, 0};
    TEST_CUDA_CHECK(cudaMemcpy(got, dsts[i], sizeof(got), cudaMemcpyDeviceToHost));
    wrong += got[0] != order[i] || got[1] != ~static_cast<uint64_t>(order[i]);
  }
  printf("# re-pointed graph check: %zu of %zu sampled rows wrong\n", wrong, (rows + 36) / 37);
  cudaGraphExecDestroy(graphExec);
  cudaGraphDestroy(graph);
  return wrong == 0;
}

bool run(size_t bytes, double busyMs, bool issuePathsOnly) {
  int gpus = 0, sms = 0, clockKhz = 0;
  TEST_CUDA_CHECK(cudaGetDeviceCount(&gpus));
  TEST_CUDA_CHECK(cudaSetDevice(0));
  TEST_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  TEST_CUDA_CHECK(cudaDeviceGetAttribute(&clockKhz, cudaDevAttrClockRate, 0));
  int driver = 0;
  TEST_CUDA_CHECK(cudaDriverGetVersion(&driver));
  char *a = nullptr, *b = nullptr, *host = nullptr, *peer = nullptr;
  TEST_CUDA_CHECK(cudaMalloc(&a, bytes));
  TEST_CUDA_CHECK(cudaMalloc(&b, bytes));
  TEST_CUDA_CHECK(cudaMallocHost(&host, bytes));
  TEST_CUDA_CHECK(cudaMemset(a, 1, bytes));
  if (gpus > 1) {
    TEST_CUDA_CHECK(cudaSetDevice(1));
    TEST_CUDA_CHECK(cudaMalloc(&peer, bytes));
    TEST_CUDA_CHECK(cudaSetDevice(0));
    const cudaError_t enabled = cudaDeviceEnablePeerAccess(1, 0);
    if (enabled != cudaSuccess && enabled != cudaErrorPeerAccessAlreadyEnabled) TEST_CUDA_CHECK(enabled);
    (void)cudaGetLastError();
  }
  cudaStream_t busy = nullptr, copies = nullptr;
  TEST_CUDA_CHECK(cudaStreamCreateWithFlags(&busy, cudaStreamNonBlocking));
  TEST_CUDA_CHECK(cudaStreamCreateWithFlags(&copies, cudaStreamNonBlocking));
  Timer timer;
  TEST_CUDA_CHECK(cudaEventCreate(&timer.start));
  TEST_CUDA_CHECK(cudaEventCreate(&timer.stop));
  const long long cycles = static_cast<long long>(busyMs * clockKhz);
  const int blocks = sms * 2;  // two 1024-thread blocks fill an SM's 2048 threads

  std::vector<Route> routes = {
      {"local cudaMemcpyAsync", [&](cudaStream_t s) { return cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, s); }},
      {"local cudaMemcpy2DAsync (4 KiB rows)",
       [&](cudaStream_t s) { return cudaMemcpy2DAsync(b, 4096, a, 4096, 4096, bytes / 4096, cudaMemcpyDeviceToDevice, s); }},
      {"local batch, stream order, overlap hint",
       [&](cudaStream_t s) { return batchCopy(b, a, bytes, cudaMemcpySrcAccessOrderStream, cudaMemcpyFlagPreferOverlapWithCompute, s); }},
      {"local batch, any order, overlap hint",
       [&](cudaStream_t s) { return batchCopy(b, a, bytes, cudaMemcpySrcAccessOrderAny, cudaMemcpyFlagPreferOverlapWithCompute, s); }},
      {"device to pinned host", [&](cudaStream_t s) { return cudaMemcpyAsync(host, a, bytes, cudaMemcpyDeviceToHost, s); }},
  };
  if (peer != nullptr) {
    routes.push_back({"peer write (GPU 0 -> GPU 1)", [&](cudaStream_t s) { return cudaMemcpyAsync(peer, a, bytes, cudaMemcpyDeviceToDevice, s); }});
    routes.push_back({"peer read (GPU 1 -> GPU 0)", [&](cudaStream_t s) { return cudaMemcpyAsync(b, peer, bytes, cudaMemcpyDeviceToDevice, s); }});
  }
  if (!issuePathsOnly) {
    printf("# unifab-bench copy-routes: %s per copy, CUDA driver %d, GPU 0 held by %d blocks x 1024 threads for ~%.0f ms\n",
           formatBytes(bytes).c_str(), driver, blocks, busyMs);
    printf("# %-44s %10s %12s %s\n", "route", "alone(ms)", "busy(ms)", "verdict");
    for (const Route& route : routes) {
      double ms[2] = {0, 0};
      for (int busyRun = 0; busyRun < 2; ++busyRun) {
        TEST_CUDA_CHECK(cudaDeviceSynchronize());
        if (busyRun == 1) {
          holdSms<<<blocks, 1024, 0, busy>>>(cycles);
          TEST_CUDA_CHECK(cudaGetLastError());
        }
        TEST_CUDA_CHECK(cudaEventRecord(timer.start, copies));
        TEST_CUDA_CHECK(route.copy(copies));
        TEST_CUDA_CHECK(cudaEventRecord(timer.stop, copies));
        TEST_CUDA_CHECK(cudaEventSynchronize(timer.stop));
        float elapsed = 0;
        TEST_CUDA_CHECK(cudaEventElapsedTime(&elapsed, timer.start, timer.stop));
        ms[busyRun] = elapsed;
      }
      const bool waited = ms[1] > ms[0] + 0.5 * busyMs;
      printf("  %-44s %10.3f %12.3f %s\n", route.name, ms[0], ms[1], waited ? "waits for SMs" : "copy engine (no SM)");
    }
    TEST_CUDA_CHECK(cudaDeviceSynchronize());
    if (peer != nullptr && !measureSplitPeerCopy(a, peer, bytes)) return false;
    if (peer != nullptr && !measureRowCopyStreams(b, peer, bytes)) return false;
    if (peer != nullptr) {
      // GPU 1's own buffers for the two-thread case: it pulls GPU 0's `a` into `peerLocal`.
      char* peerLocal = nullptr;
      TEST_CUDA_CHECK(cudaSetDevice(1));
      TEST_CUDA_CHECK(cudaMalloc(&peerLocal, bytes));
      TEST_CUDA_CHECK(cudaSetDevice(0));
      const bool measured = measureBatchIssueThreads(b, peer, peerLocal, a, bytes);
      TEST_CUDA_CHECK(cudaSetDevice(1));
      cudaFree(peerLocal);
      TEST_CUDA_CHECK(cudaSetDevice(0));
      if (!measured) return false;
    }
    if (peer != nullptr && !measureHandOver(a, peer, bytes)) return false;
  }
  if (!measureRowIssuePaths("local rows", b, a, bytes, copies, busy, timer, blocks, cycles)) return false;
  if (peer != nullptr) {
    if (!measureRowIssuePaths("rows of the peer GPU", b, peer, bytes, copies, busy, timer, blocks, cycles)) return false;
    if (!measureStreamCopyRates(b, peer, bytes, timer)) return false;
    char* mapped = vmmAlloc(1, bytes, gpus);
    if (mapped == nullptr) {
      printf("# rows of the peer GPU mapped by cuMemMap: the driver's virtual memory API failed; skipped\n");
    } else if (!measureRowIssuePaths("rows of the peer GPU mapped by cuMemMap", b, mapped, bytes, copies, busy, timer,
                                         blocks, cycles)) {
      return false;
    }
  }
  cudaStreamDestroy(busy);
  cudaStreamDestroy(copies);
  cudaFree(a);
  cudaFree(b);
  cudaFreeHost(host);
  if (peer != nullptr) cudaFree(peer);
  return true;
}

}  // namespace

int runCopyRoutes(Args& args) {
  const size_t bytes = parseBytes(args.value("--bytes", "256M"));
  const double busyMs = std::stod(args.value("--busy-ms", "40"));
  const bool issuePathsOnly = args.flag("--issue-paths-only");
  if (!args.leftovers().empty() || bytes < 4096 || bytes % 4096 != 0 || busyMs <= 0) {
    fprintf(stderr, "copy-routes: --bytes must be a positive multiple of 4096, --busy-ms positive\n");
    return 2;
  }
  return run(bytes, busyMs, issuePathsOnly) ? 0 : 1;
}

}  // namespace unifab::bench
