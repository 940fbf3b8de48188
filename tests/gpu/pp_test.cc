// Pipeline send/recv against byte patterns, one process per GPU under unifab-launch (1 rank sends
// to itself). Every round, each rank posts a batch of sends to the next rank on one stream and
// the matching receives from the previous rank alternately on two others, with random delays
// (a busy kernel) before some of them; the receives are then waited for in reverse order and
// every received byte is checked. Sizes cross the chunk boundaries (1 B up to 64 MiB + 7, and
// 1 GiB with --large); a small-slot configuration makes transfers rotate through the slots many
// times. The last receive buffer of each batch is stream-ordered pool memory (receive buffers of
// any allocator); with --vmm every buffer comes from ncclMemAlloc (cuMem). Also: the calls the
// group refuses.
#include <cuda_runtime.h>
#include <nccl.h>
#include <cstring>
#include <cstdint>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "tests/common/check_tally.h"
#include "tests/common/device_data.h"
#include "tests/common/ep_device.h"
#include "tests/common/nccl_session.h"
#include "tests/common/test_util.h"
#include "unifab/unifab.h"

using namespace unifab::test;

namespace {

uint64_t patternSeed(int rank, int round, int index) {
  return (static_cast<uint64_t>(rank) << 40) ^ (static_cast<uint64_t>(round) << 20) ^ static_cast<uint64_t>(index);
}

struct Streams {
  cudaStream_t send = nullptr;
  cudaStream_t recv[2] = {nullptr, nullptr};
  ~Streams() {
    cudaStreamDestroy(send);
    for (cudaStream_t s : recv) cudaStreamDestroy(s);
  }
};

bool slotsEngine() {
  const char* engine = getenv("UNIFAB_PP_ENGINE");
  return engine != nullptr && std::string(engine) == "slots";
}

// Whether `data` is virtual memory (cuMem): legacy CUDA IPC refuses to export it.
bool virtualMemory(void* data) {
  cudaIpcMemHandle_t handle;
  const bool legacy = cudaIpcGetMemHandle(&handle, data) == cudaSuccess;
  (void)cudaGetLastError();
  return !legacy;
}

// vmm: every buffer from ncclMemAlloc (cuMem with shareable POSIX descriptors, as nccl-tests and
// PyTorch's expandable segments allocate), which legacy CUDA IPC cannot map in another process.
bool runRounds(NcclSession& session, unifabPpGroup_t group, const std::vector<size_t>& sizes, int rounds, int batch,
               const std::string& what, bool vmm = false) {
  const int n = session.nRanks(), me = session.rank();
  const int next = (me + 1) % n, prev = (me + n - 1) % n;
  size_t largest = 0;
  for (size_t s : sizes) largest = std::max(largest, s);
  std::vector<void*> sendBuf(batch, nullptr), recvBuf(batch, nullptr);
  // The last receive buffer of a batch comes from the stream-ordered pool, which CUDA IPC cannot
  // map: the rendezvous engine then has the receiving side move the data.
  const bool poolBuffer = batch > 1 && !vmm;
  for (int i = 0; i < batch; ++i) {
    if (vmm) {
      TEST_NCCL_CHECK(ncclMemAlloc(&sendBuf[i], std::max<size_t>(largest, 1)));
      TEST_NCCL_CHECK(ncclMemAlloc(&recvBuf[i], std::max<size_t>(largest, 1)));
      check(virtualMemory(sendBuf[i]) && virtualMemory(recvBuf[i]), what + ": ncclMemAlloc gave virtual memory");
      continue;
    }
    TEST_CUDA_CHECK(cudaMalloc(&sendBuf[i], std::max<size_t>(largest, 1)));
    if (i == batch - 1 && poolBuffer) {
      TEST_CUDA_CHECK(cudaMallocAsync(&recvBuf[i], std::max<size_t>(largest, 1), nullptr));
      TEST_CUDA_CHECK(cudaStreamSynchronize(nullptr));
    } else {
      TEST_CUDA_CHECK(cudaMalloc(&recvBuf[i], std::max<size_t>(largest, 1)));
    }
  }
  unsigned long long* mismatches = nullptr;
  TEST_CUDA_CHECK(cudaMalloc(&mismatches, sizeof(unsigned long long) * batch));
  Streams streams;
  TEST_CUDA_CHECK(cudaStreamCreateWithFlags(&streams.send, cudaStreamNonBlocking));
  for (cudaStream_t& s : streams.recv) TEST_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  std::mt19937 random(1234 + me);  // delays differ per rank; sizes must not
  bool ok = true;
  for (int round = 0; round < rounds && ok; ++round) {
    std::vector<size_t> size(batch);
    for (int i = 0; i < batch; ++i) size[i] = sizes[(static_cast<size_t>(round) * batch + i) % sizes.size()];
    for (int i = 0; i < batch; ++i) {
      TEST_CUDA_CHECK(fillBytes(sendBuf[i], size[i], patternSeed(me, round, i), streams.send));
      if (random() % 3 == 0) TEST_CUDA_CHECK(spinOnDevice(20000 + random() % 200000, streams.send));
      TEST_UNIFAB_CHECK(unifabPpSend(group, sendBuf[i], size[i], next, streams.send));
      cudaStream_t r = streams.recv[i % 2];
      // Poison: the complement of the first expected byte, everywhere.
      const uint64_t expected = patternSeed(prev, round, i);
      const int poison = static_cast<uint8_t>(~mix64(expected * 0x9e3779b97f4a7c15ULL));
      TEST_CUDA_CHECK(cudaMemsetAsync(recvBuf[i], poison, size[i], r));
      if (random() % 3 == 0) TEST_CUDA_CHECK(spinOnDevice(20000 + random() % 200000, r));
      TEST_UNIFAB_CHECK(unifabPpRecv(group, recvBuf[i], size[i], prev, r));
    }
    // Out of order: the later stream first.
    TEST_CUDA_CHECK(cudaStreamSynchronize(streams.recv[1]));
    TEST_CUDA_CHECK(cudaStreamSynchronize(streams.recv[0]));
    TEST_CUDA_CHECK(cudaStreamSynchronize(streams.send));
    TEST_CUDA_CHECK(cudaMemset(mismatches, 0, sizeof(unsigned long long) * batch));
    for (int i = 0; i < batch; ++i) {
      TEST_CUDA_CHECK(countByteMismatches(recvBuf[i], size[i], patternSeed(prev, round, i), mismatches + i, nullptr));
    }
    std::vector<unsigned long long> bad(batch);
    TEST_CUDA_CHECK(cudaMemcpy(bad.data(), mismatches, sizeof(unsigned long long) * batch, cudaMemcpyDeviceToHost));
    for (int i = 0; i < batch; ++i) {
      check(bad[i] == 0, what + " round " + std::to_string(round) + " transfer " + std::to_string(i) + " (" +
                             std::to_string(size[i]) + " B): " + std::to_string(bad[i]) + " bytes differ");
    }
    check(unifabPpGetAsyncError(group) == unifabSuccess, what + " round " + std::to_string(round) + ": no timeout");
    ok = session.barrier(true);
  }
  TEST_CUDA_CHECK(cudaDeviceSynchronize());
  for (int i = 0; i < batch; ++i) {
    if (vmm) {
      ncclMemFree(sendBuf[i]);
      ncclMemFree(recvBuf[i]);
      continue;
    }
    cudaFree(sendBuf[i]);
    if (i == batch - 1 && poolBuffer) {
      cudaFreeAsync(recvBuf[i], nullptr);
    } else {
      cudaFree(recvBuf[i]);
    }
  }
  cudaFree(mismatches);
  return ok;
}

bool runRefusals(NcclSession& session, unifabPpGroup_t group, size_t chunk) {
  cudaStream_t stream = session.stream();
  // More chunks than a call through the slots may post: refused before anything is posted (the
  // pointer is never read). The rendezvous engine takes the slots for a rank's transfers to itself.
  if (slotsEngine() || session.nRanks() == 1) {
    check(unifabPpSend(group, reinterpret_cast<void*>(16), 128 * chunk + 1, 0, stream) == unifabInvalidArgument,
          "a transfer of more than 128 chunks is refused");
  }
  check(unifabPpSend(group, nullptr, 16, 0, stream) == unifabInvalidArgument, "data=NULL with bytes is refused");
  check(unifabPpSend(group, nullptr, 0, session.nRanks(), stream) == unifabInvalidArgument,
        "a peer outside the communicator is refused");
  check(unifabPpRecv(group, nullptr, 0, -1, stream) == unifabInvalidArgument, "a negative peer is refused");
  // A size whose chunk count would wrap, host memory, and a range past its allocation: refused
  // before anything is posted or paired, naming the argument (the peer posts nothing to match).
  check(unifabPpSend(group, reinterpret_cast<void*>(16), SIZE_MAX, session.rank(), stream) == unifabInvalidArgument,
        "SIZE_MAX bytes to itself (the slots) is refused");
  std::vector<char> host(64);
  check(unifabPpSend(group, host.data(), host.size(), 0, stream) == unifabInvalidArgument &&
            strstr(unifabGetLastError(), "data") != nullptr,
        "host memory is refused, naming data");
  void* small = nullptr;
  TEST_CUDA_CHECK(cudaMalloc(&small, 4096));
  check(unifabPpSend(group, static_cast<char*>(small) + 4080, 32, 0, stream) == unifabInvalidArgument &&
            strstr(unifabGetLastError(), "past the end") != nullptr,
        "a range past the end of its allocation is refused");
  // Once the allocation has passed whole (a transfer to itself, through the slots), a range inside
  // it is not asked of the driver again, but one running past its end still is.
  void* received = nullptr;
  TEST_CUDA_CHECK(cudaMalloc(&received, 4096));
  TEST_UNIFAB_CHECK(unifabPpSend(group, small, 4096, session.rank(), stream));
  TEST_UNIFAB_CHECK(unifabPpRecv(group, received, 4096, session.rank(), stream));
  TEST_CUDA_CHECK(cudaStreamSynchronize(stream));
  check(unifabPpSend(group, static_cast<char*>(small) + 4080, 32, 0, stream) == unifabInvalidArgument &&
            strstr(unifabGetLastError(), "past the end") != nullptr,
        "a range past the end of an allocation that passed before is still refused");
  TEST_CUDA_CHECK(cudaFree(received));
  TEST_CUDA_CHECK(cudaFree(small));
  cudaStream_t capturing = nullptr;
  TEST_CUDA_CHECK(cudaStreamCreateWithFlags(&capturing, cudaStreamNonBlocking));
  cudaGraph_t graph = nullptr;
  TEST_CUDA_CHECK(cudaStreamBeginCapture(capturing, cudaStreamCaptureModeThreadLocal));
  const unifabResult_t captured = unifabPpSend(group, nullptr, 0, 0, capturing);
  TEST_CUDA_CHECK(cudaStreamEndCapture(capturing, &graph));
  check(captured == unifabInvalidUsage, "a capturing stream is refused");
  if (graph != nullptr) cudaGraphDestroy(graph);
  cudaStreamDestroy(capturing);
  unifabPpConfig_t bad = UNIFAB_PP_CONFIG_INIT;
  bad.chunkBytes = 1000;
  unifabPpGroup_t none = nullptr;
  check(unifabPpCreate(session.comm(), &bad, &none) == unifabInvalidArgument && none == nullptr,
        "chunkBytes not a multiple of 16 is refused on every rank");
  return true;
}

// A send nobody receives (either engine): its stream is released by the watchdog after UNIFAB_PP_TIMEOUT_MS (the
// ctest entry sets 2000), the group then reports the timeout and refuses further calls.
bool runWatchdog(NcclSession& session, unifabPpGroup_t group) {
  if (session.rank() == 0 && session.nRanks() > 1) {
    void* data = nullptr;
    const size_t bytes = size_t{4} << 16;  // slots: 4 chunks through 2, the third waits for a receive
    TEST_CUDA_CHECK(cudaMalloc(&data, bytes));
    const double start = nowSeconds();
    TEST_UNIFAB_CHECK(unifabPpSend(group, data, bytes, 1, session.stream()));
    TEST_CUDA_CHECK(cudaStreamSynchronize(session.stream()));
    const double waited = nowSeconds() - start;
    check(waited > 1.5 && waited < 30, "the unmatched send was released after the timeout (" +
                                           std::to_string(waited) + " s)");
    check(unifabPpGetAsyncError(group) == unifabTimeout, "the group reports the timeout");
    check(unifabPpSend(group, data, 16, 1, session.stream()) == unifabTimeout, "and refuses the next call");
    cudaFree(data);
  }
  return session.barrier(true);
}

// Matched calls of different sizes (rendezvous): the call posted second refuses the pair, and its
// group stays unusable with that error (the calls are out of step); the first call's stream is
// released by the watchdog and its group reports the timeout.
bool runSizeMismatch(NcclSession& session, const unifabPpConfig_t& config) {
  if (slotsEngine() || session.nRanks() < 2) return session.barrier(true);
  unifabPpGroup_t group = nullptr;  // collective: every rank creates it, ranks 0 and 1 use it
  TEST_UNIFAB_CHECK(unifabPpCreate(session.comm(), &config, &group));
  if (session.rank() <= 1) {
    void* data = nullptr;
    TEST_CUDA_CHECK(cudaMalloc(&data, 128));
    const unifabResult_t got = session.rank() == 0 ? unifabPpSend(group, data, 64, 1, session.stream())
                                                   : unifabPpRecv(group, data, 128, 0, session.stream());
    TEST_CUDA_CHECK(cudaStreamSynchronize(session.stream()));
    const unifabResult_t after = unifabPpGetAsyncError(group);
    if (got != unifabSuccess) {
      check(got == unifabInvalidUsage && after == unifabInvalidUsage,
            "the call that found the sizes differ refuses the pair, and its group stays unusable");
    } else {
      check(after == unifabTimeout, "the other call's stream is released by the watchdog");
    }
    cudaFree(data);
  }
  const bool synced = session.barrier(true);
  TEST_UNIFAB_CHECK(unifabPpDestroy(group));
  return synced;
}

}  // namespace

int main(int argc, char** argv) {
  bool large = false, smallSlots = false, watchdog = false, vmm = false;
  int rounds = 6;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--large") large = true;            // adds 1 GiB transfers
    else if (arg == "--small-slots") smallSlots = true;  // 64 KiB x 2 slots: many rotations
    else if (arg == "--watchdog") watchdog = true;       // an unmatched send, released by the watchdog
    else if (arg == "--vmm") vmm = true;                 // every buffer from ncclMemAlloc (cuMem)
    else if (arg == "--rounds" && i + 1 < argc) rounds = atoi(argv[++i]);
    else {
      fprintf(stderr, "usage: %s [--large] [--small-slots] [--watchdog] [--vmm] [--rounds N]\n", argv[0]);
      return 2;
    }
  }
  RankEnvironment env = rankEnvironment();
  tally().rank = env.rank;
  NcclSession session;
  if (!session.init(env)) return session.skipped() ? kSkipExitCode : 1;
  unifabPpConfig_t config = UNIFAB_PP_CONFIG_INIT;
  if (smallSlots || watchdog) {
    config.chunkBytes = 64 << 10;
    config.chunksInFlight = 2;
  }
  unifabPpGroup_t group = nullptr;
  if (unifabPpCreate(session.comm(), &config, &group) != unifabSuccess) {
    fprintf(stderr, "rank %d: unifabPpCreate failed: %s\n", env.rank, unifabGetLastError());
    return 1;
  }
  bool ok = true;
  if (watchdog) {
    ok = runWatchdog(session, group) && runSizeMismatch(session, config);
  } else {
    const size_t chunk = smallSlots ? size_t{64} << 10 : size_t{8} << 20;
    // The largest transfer a call takes (kMaxChunksPerCall chunks), or 64 MiB + 7 when that is less.
    const size_t largest = std::min((size_t{64} << 20) + 7, 128 * chunk);
    std::vector<size_t> sizes = {1, 15, 4096, (size_t{1} << 20) + 3, chunk, chunk + 1, 3 * chunk + 5, largest, 0};
    if (vmm) {
      ok = runRounds(session, group, sizes, rounds, 4, "ncclMemAlloc buffers", true);
    } else {
      ok = runRefusals(session, group, chunk) &&
           runRounds(session, group, sizes, rounds, 4, smallSlots ? "small slots" : "default");
    }
    if (ok && large) ok = runRounds(session, group, {size_t{1} << 30}, 2, 1, "1 GiB");
  }
  if (!ok) {
    abandonRank("");
  }
  if (unifabPpDestroy(group) != unifabSuccess) return 1;
  return finishChecks();
}
