// Proof that pipeline send/recv leaves the SMs to compute: on both GPUs a compute kernel holds
// every SM (as many blocks as fit) for ~50 ms on one stream, while rank 0 sends 2 GiB to rank 1
// on another. The compute kernel must slow by less than 5 % against its time alone, and the
// transfer must finish, correct, within the compute kernel's time. For contrast, the same compute
// kernel next to a plain SM copy kernel (a local 2 GiB copy launched just before it) is timed too
// and printed: that copy takes SMs the compute kernel then has to wait for.
#include <cuda_runtime.h>

#include <unistd.h>

#include <algorithm>
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

  // Contrast: a plain SM copy launched just before the compute kernel.
  if (!session.barrier(true)) return false;
  TEST_CUDA_CHECK(cudaEventRecord(transfer.start, copyStream));
  smCopyKernel<<<sms, 1024, 0, copyStream>>>(static_cast<const int4*>(data), static_cast<int4*>(copy),
                                             kTransferBytes * kTransfers / 16);
  TEST_CUDA_CHECK(cudaEventRecord(transfer.stop, copyStream));
  TEST_CUDA_CHECK(cudaEventRecord(compute.start, computeStream));
  computeKernel<<<computeBlocks, kComputeThreads, 0, computeStream>>>(sink, iterations);
  TEST_CUDA_CHECK(cudaEventRecord(compute.stop, computeStream));
  TEST_CUDA_CHECK(cudaEventSynchronize(compute.stop));
  TEST_CUDA_CHECK(cudaEventSynchronize(transfer.stop));
  const double withSmCopyMs = compute.ms(), smCopyMs = transfer.ms();

  const double slowdown = withPpMs / aloneMs - 1.0;
  printf("rank %d: compute alone %.2f ms on %d SMs x %d blocks; next to %d x %zu MiB pipeline transfers %.2f ms "
         "(%+.1f %%, transfers took %.2f ms); next to a plain SM copy of the same bytes %.2f ms (%+.1f %%, copy "
         "took %.2f ms)\n",
         env.rank, aloneMs, sms, blocksPerSm, kTransfers, kTransferBytes >> 20, withPpMs, 100 * slowdown, ppMs,
         withSmCopyMs, 100 * (withSmCopyMs / aloneMs - 1.0), smCopyMs);
  check(slowdown < 0.05, "the compute kernel slows by less than 5 % next to pipeline transfers (" +
                             std::to_string(100 * slowdown) + " %)");
  check(ppMs < withPpMs * 1.05, "the transfers finish while the compute kernel runs");
  cudaFree(data);
  cudaFree(copy);
  cudaFree(sink);
  return unifabPpDestroy(group) == unifabSuccess;
}

}  // namespace

int main() {
  RankEnvironment env = rankEnvironment();
  tally().rank = env.rank;
  NcclSession session;
  if (!session.init(env)) return 1;
  if (!run(env, session)) {
    // Leave at once: the peer may wait in a collective step this rank will never reach.
    printf("rank %d: aborted\n", env.rank);
    fflush(stdout);
    _exit(1);
  }
  return finishChecks();
}
