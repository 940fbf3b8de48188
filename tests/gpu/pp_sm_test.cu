// Proof that pipeline send/recv and Engram's copy-engine fetches leave the SMs to compute: on both
// GPUs a compute kernel holds every SM (as many blocks as fit) for ~50 ms on one stream, while
// rank 0 sends 2 GiB to rank 1 on another, and then while each rank fetches 256 MiB of the peer's
// Engram rows (64 KiB rows, shuffled) with the copy engine. The compute kernel must slow by less
// than 5 % against its time alone, the transfers and fetches must finish, correct, within the
// compute kernel's time, and the fetch must report 0 SMs held. For contrast, the same compute
// kernel next to a plain SM copy kernel (local copies launched just before it) is timed too: that
// copy takes SMs the compute kernel then waits for. (Which copy routes stay off the SMs at all:
// unifab-bench copy-routes.)
#include <cuda_runtime.h>

#include <algorithm>
#include <random>
#include <cstdio>
#include <string>
#include <vector>

#include "tests/common/check_tally.h"
#include "tests/common/device_data.h"
#include "tests/common/nccl_session.h"
#include "unifab/unifab.h"

using namespace unifab::test;

namespace {

constexpr size_t kTransferBytes = size_t{256} << 20;
constexpr int kTransfers = 8;
constexpr int kComputeThreads = 256;
constexpr size_t kRowBytes = size_t{64} << 10;
constexpr int64_t kRowsPerRank = 4096;  // 256 MiB of rows per rank
constexpr int kSmCopies = 10;           // plain SM copies of 2 GiB in the contrast (~12 ms)

__global__ void computeKernel(float* out, long long iterations) {
  float a = threadIdx.x * 1e-3f, b = 1.0001f;
  for (long long i = 0; i < iterations; ++i) a = fmaf(a, b, 1e-7f);
  if (a == 12345.0f) out[threadIdx.x] = a;  // never true: keeps the loop
}

__global__ void smCopyKernel(const int4* in, int4* out, size_t vectors) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < vectors;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    out[i] = in[i];
  }
}

// mismatches += rows of `out` that differ from row ids[i] of `table` (16-byte words compared).
__global__ void checkRowsKernel(const int4* out, const int4* table, const int64_t* ids, int rows, int64_t firstRow,
                                size_t rowVectors, unsigned long long* mismatches) {
  for (int row = blockIdx.x; row < rows; row += gridDim.x) {
    const int4* got = out + row * rowVectors;
    const int4* want = table + (ids[row] - firstRow) * rowVectors;
    int bad = 0;
    for (size_t v = threadIdx.x; v < rowVectors; v += blockDim.x) {
      const int4 a = got[v], b = want[v];
      bad |= a.x != b.x || a.y != b.y || a.z != b.z || a.w != b.w;
    }
    if (__syncthreads_or(bad) && threadIdx.x == 0) atomicAdd(mismatches, 1ULL);
  }
}

struct Timing {
  cudaEvent_t start = nullptr, stop = nullptr;
  Timing() {
    cudaEventCreate(&start);
    cudaEventCreate(&stop);
  }
  ~Timing() {
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
  }
  double ms() const {
    float value = 0;
    cudaEventElapsedTime(&value, start, stop);
    return value;
  }
};

// The whole measurement; false on any failed call (each has said why).
bool run(const RankEnvironment& env, NcclSession& session) {
  if (env.nRanks != 2) {
    fprintf(stderr, "needs 2 ranks\n");
    return false;
  }
  int device = 0, sms = 0, blocksPerSm = 0;
  TEST_CUDA_CHECK(cudaGetDevice(&device));
  TEST_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  TEST_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocksPerSm, computeKernel, kComputeThreads, 0));
  const int computeBlocks = sms * blocksPerSm;
  float* sink = nullptr;
  TEST_CUDA_CHECK(cudaMalloc(&sink, sizeof(float) * kComputeThreads));
  cudaStream_t computeStream = nullptr, copyStream = nullptr;
  TEST_CUDA_CHECK(cudaStreamCreateWithFlags(&computeStream, cudaStreamNonBlocking));
  TEST_CUDA_CHECK(cudaStreamCreateWithFlags(&copyStream, cudaStreamNonBlocking));

  // Calibrate the compute kernel to ~50 ms alone.
  long long iterations = 1 << 16;
  Timing compute, transfer;
  double aloneMs = 0;
  for (;;) {
    TEST_CUDA_CHECK(cudaEventRecord(compute.start, computeStream));
    computeKernel<<<computeBlocks, kComputeThreads, 0, computeStream>>>(sink, iterations);
    TEST_CUDA_CHECK(cudaEventRecord(compute.stop, computeStream));
    TEST_CUDA_CHECK(cudaEventSynchronize(compute.stop));
    aloneMs = compute.ms();
    if (aloneMs > 40 || iterations > (1LL << 40)) break;
    iterations = static_cast<long long>(iterations * std::max(1.5, 50.0 / std::max(aloneMs, 0.01)));
  }
  // Both ranks use the same count, so that both GPUs compute for the same time.
  double shared = static_cast<double>(iterations);
  if (!session.maxOverRanks(&shared)) return false;
  iterations = static_cast<long long>(shared);

  unifabPpConfig_t config = UNIFAB_PP_CONFIG_INIT;
  unifabPpGroup_t group = nullptr;
  if (unifabPpCreate(session.comm(), &config, &group) != unifabSuccess) {
    fprintf(stderr, "rank %d: %s\n", env.rank, unifabGetLastError());
    return false;
  }
  void *data = nullptr, *copy = nullptr;
  TEST_CUDA_CHECK(cudaMalloc(&data, kTransferBytes * kTransfers));
  TEST_CUDA_CHECK(cudaMalloc(&copy, kTransferBytes * kTransfers));
  const uint64_t seed = 4242;
  if (env.rank == 0) TEST_CUDA_CHECK(fillBytes(data, kTransferBytes * kTransfers, seed, copyStream));
  TEST_CUDA_CHECK(cudaStreamSynchronize(copyStream));

  auto timeCompute = [&](double* ms) {
    if (!session.barrier(true)) return false;
    TEST_CUDA_CHECK(cudaEventRecord(compute.start, computeStream));
    computeKernel<<<computeBlocks, kComputeThreads, 0, computeStream>>>(sink, iterations);
    TEST_CUDA_CHECK(cudaEventRecord(compute.stop, computeStream));
    TEST_CUDA_CHECK(cudaEventSynchronize(compute.stop));
    *ms = compute.ms();
    return true;
  };
  std::vector<double> alone(3);
  for (double& ms : alone) {
    if (!timeCompute(&ms)) return false;
  }
  std::sort(alone.begin(), alone.end());
  aloneMs = alone[1];

  // Compute next to the pipeline transfers.
  if (!session.barrier(true)) return false;
  TEST_CUDA_CHECK(cudaEventRecord(compute.start, computeStream));
  computeKernel<<<computeBlocks, kComputeThreads, 0, computeStream>>>(sink, iterations);
  TEST_CUDA_CHECK(cudaEventRecord(compute.stop, computeStream));
  TEST_CUDA_CHECK(cudaEventRecord(transfer.start, copyStream));
  for (int i = 0; i < kTransfers; ++i) {
    char* part = static_cast<char*>(data) + kTransferBytes * i;
    const unifabResult_t r = env.rank == 0 ? unifabPpSend(group, part, kTransferBytes, 1, copyStream)
                                           : unifabPpRecv(group, part, kTransferBytes, 0, copyStream);
    if (r != unifabSuccess) {
      fprintf(stderr, "rank %d: %s\n", env.rank, unifabGetLastError());
      return false;
    }
  }
  TEST_CUDA_CHECK(cudaEventRecord(transfer.stop, copyStream));
  TEST_CUDA_CHECK(cudaEventSynchronize(compute.stop));
  TEST_CUDA_CHECK(cudaEventSynchronize(transfer.stop));
  const double withPpMs = compute.ms(), ppMs = transfer.ms();
  check(unifabPpGetAsyncError(group) == unifabSuccess, "no pipeline timeout");
  if (env.rank == 1) {
    unsigned long long* bad = nullptr;
    TEST_CUDA_CHECK(cudaMalloc(&bad, sizeof(*bad)));
    TEST_CUDA_CHECK(cudaMemset(bad, 0, sizeof(*bad)));
    TEST_CUDA_CHECK(countByteMismatches(data, kTransferBytes * kTransfers, seed, bad, nullptr));
    unsigned long long wrong = 0;
    TEST_CUDA_CHECK(cudaMemcpy(&wrong, bad, sizeof(wrong), cudaMemcpyDeviceToHost));
    check(wrong == 0, std::to_string(wrong) + " received bytes differ");
    cudaFree(bad);
  }

  // Compute next to zero-SM Engram fetches: every rank reads all of the next rank's rows,
  // shuffled (so nearly every row is a copy of its own), with the copy engine.
  const int peer = (env.rank + 1) % env.nRanks;
  unifabEngramConfig_t tableConfig = UNIFAB_ENGRAM_CONFIG_INIT;
  tableConfig.rowBytes = kRowBytes;
  tableConfig.rowsPerRank = kRowsPerRank;
  unifabEngramTable_t table = nullptr;
  if (unifabEngramCreate(session.comm(), &tableConfig, &table) != unifabSuccess) {
    fprintf(stderr, "rank %d: %s\n", env.rank, unifabGetLastError());
    return false;
  }
  const size_t tableBytes = kRowBytes * kRowsPerRank;
  char* expected = static_cast<char*>(copy);  // the peer's rows, made here from the peer's seed
  char* fetched = expected + tableBytes;
  TEST_CUDA_CHECK(fillBytes(data, tableBytes, 777 + env.rank, copyStream));
  TEST_UNIFAB_CHECK(unifabEngramWrite(table, 0, kRowsPerRank, data, nullptr, copyStream));
  TEST_CUDA_CHECK(fillBytes(expected, tableBytes, 777 + peer, copyStream));
  TEST_CUDA_CHECK(cudaStreamSynchronize(copyStream));
  std::vector<int64_t> ids(kRowsPerRank);
  for (int64_t i = 0; i < kRowsPerRank; ++i) ids[i] = peer * kRowsPerRank + i;
  std::mt19937 shuffle(99 + env.rank);
  std::shuffle(ids.begin(), ids.end(), shuffle);
  int64_t* deviceIds = nullptr;
  TEST_CUDA_CHECK(cudaMalloc(&deviceIds, sizeof(int64_t) * kRowsPerRank));
  TEST_CUDA_CHECK(cudaMemcpy(deviceIds, ids.data(), sizeof(int64_t) * kRowsPerRank, cudaMemcpyHostToDevice));
  unifabEngramFetchArgs_t args = UNIFAB_ENGRAM_FETCH_ARGS_INIT;
  args.rowIds = ids.data();
  args.hostRowIds = 1;
  args.numRows = kRowsPerRank;
  args.out = fetched;
  args.engine = unifabEngramCopyEngine;
  auto fetchRows = [&](int* smsUsed) {
    unifabEngramFetch_t fetch = nullptr;
    TEST_UNIFAB_CHECK(unifabEngramFetchIssue(table, &args, copyStream, &fetch));
    TEST_UNIFAB_CHECK(unifabEngramWait(fetch, copyStream, smsUsed));
    return true;
  };
  // Alone first (the copy engine's own time), then next to the compute kernel.
  int smsUsed = -1;
  if (!session.barrier(true)) return false;
  TEST_CUDA_CHECK(cudaEventRecord(transfer.start, copyStream));
  if (!fetchRows(&smsUsed)) return false;
  TEST_CUDA_CHECK(cudaEventRecord(transfer.stop, copyStream));
  TEST_CUDA_CHECK(cudaEventSynchronize(transfer.stop));
  const double fetchAloneMs = transfer.ms();
  TEST_CUDA_CHECK(cudaMemset(fetched, 0, tableBytes));
  if (!session.barrier(true)) return false;
  TEST_CUDA_CHECK(cudaEventRecord(compute.start, computeStream));
  computeKernel<<<computeBlocks, kComputeThreads, 0, computeStream>>>(sink, iterations);
  TEST_CUDA_CHECK(cudaEventRecord(compute.stop, computeStream));
  TEST_CUDA_CHECK(cudaEventRecord(transfer.start, copyStream));
  if (!fetchRows(&smsUsed)) return false;
  TEST_CUDA_CHECK(cudaEventRecord(transfer.stop, copyStream));
  TEST_CUDA_CHECK(cudaEventSynchronize(compute.stop));
  TEST_CUDA_CHECK(cudaEventSynchronize(transfer.stop));
  const double withFetchMs = compute.ms(), fetchMs = transfer.ms();
  {
    unsigned long long* bad = nullptr;
    TEST_CUDA_CHECK(cudaMalloc(&bad, sizeof(*bad)));
    TEST_CUDA_CHECK(cudaMemset(bad, 0, sizeof(*bad)));
    checkRowsKernel<<<1024, 256>>>(reinterpret_cast<const int4*>(fetched), reinterpret_cast<const int4*>(expected),
                                   deviceIds, static_cast<int>(kRowsPerRank), peer * kRowsPerRank, kRowBytes / 16, bad);
    TEST_CUDA_CHECK(cudaGetLastError());
    unsigned long long wrong = 0;
    TEST_CUDA_CHECK(cudaMemcpy(&wrong, bad, sizeof(wrong), cudaMemcpyDeviceToHost));
    check(wrong == 0, std::to_string(wrong) + " fetched rows differ from the peer's");
    cudaFree(bad);
  }
  check(unifabEngramGetAsyncError(table) == unifabSuccess, "no Engram error");

  // Contrast: plain SM copies launched just before the compute kernel.
  if (!session.barrier(true)) return false;
  TEST_CUDA_CHECK(cudaEventRecord(transfer.start, copyStream));
  for (int i = 0; i < kSmCopies; ++i) {
    smCopyKernel<<<sms, 1024, 0, copyStream>>>(static_cast<const int4*>(data), static_cast<int4*>(copy),
                                               kTransferBytes * kTransfers / 16);
  }
  TEST_CUDA_CHECK(cudaEventRecord(transfer.stop, copyStream));
  TEST_CUDA_CHECK(cudaEventRecord(compute.start, computeStream));
  computeKernel<<<computeBlocks, kComputeThreads, 0, computeStream>>>(sink, iterations);
  TEST_CUDA_CHECK(cudaEventRecord(compute.stop, computeStream));
  TEST_CUDA_CHECK(cudaEventSynchronize(compute.stop));
  TEST_CUDA_CHECK(cudaEventSynchronize(transfer.stop));
  const double withSmCopyMs = compute.ms(), smCopyMs = transfer.ms();

  const double slowdown = withPpMs / aloneMs - 1.0, fetchSlowdown = withFetchMs / aloneMs - 1.0;
  printf("rank %d: compute alone %.2f ms on %d SMs x %d blocks; next to %d x %zu MiB pipeline transfers %.2f ms "
         "(%+.1f %%, transfers took %.2f ms); next to %lld zero-SM Engram fetches of 64 KiB rows %.2f ms (%+.1f %%, "
         "fetch took %.2f ms, %.2f ms alone, %d SMs held); next to %d plain SM copies of %zu MiB %.2f ms (%+.1f %%, "
         "copies took %.2f ms)\n",
         env.rank, aloneMs, sms, blocksPerSm, kTransfers, kTransferBytes >> 20, withPpMs, 100 * slowdown, ppMs,
         static_cast<long long>(kRowsPerRank), withFetchMs, 100 * fetchSlowdown, fetchMs, fetchAloneMs, smsUsed,
         kSmCopies, (kTransferBytes * kTransfers) >> 20, withSmCopyMs, 100 * (withSmCopyMs / aloneMs - 1.0), smCopyMs);
  check(slowdown < 0.05, "the compute kernel slows by less than 5 % next to pipeline transfers (" +
                             std::to_string(100 * slowdown) + " %)");
  check(ppMs < withPpMs * 1.05, "the transfers finish while the compute kernel runs");
  check(fetchSlowdown < 0.05, "the compute kernel slows by less than 5 % next to Engram copy-engine fetches (" +
                                  std::to_string(100 * fetchSlowdown) + " %)");
  check(fetchMs < withFetchMs * 1.05, "the fetches finish while the compute kernel runs");
  check(smsUsed == 0, "the copy-engine fetch reports 0 SMs held (" + std::to_string(smsUsed) + ")");
  cudaFree(deviceIds);
  cudaFree(data);
  cudaFree(copy);
  cudaFree(sink);
  return unifabEngramDestroy(table) == unifabSuccess && unifabPpDestroy(group) == unifabSuccess;
}

}  // namespace

int main() {
  RankEnvironment env = rankEnvironment();
  tally().rank = env.rank;
  NcclSession session;
  if (!session.init(env)) return session.skipped() ? kSkipExitCode : 1;
  if (!run(env, session)) {
    abandonRank("");
  }
  return finishChecks();
}
