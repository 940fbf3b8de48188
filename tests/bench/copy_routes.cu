// unifab-bench copy-routes: which device-to-device copy routes stay off the SMs on this driver.
// Each route copies --bytes once alone and once next to a kernel that holds every SM of the
// issuing GPU for about --busy-ms; a route that waits for the SMs takes about that long next to
// it, one on a copy engine takes about its time alone. Single process; the peer routes need a
// second GPU. The zero-SM operations (pipeline send/recv, Engram's copy engine) choose their
// copies by what this prints.
#include <cuda_runtime.h>

#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "tests/bench/bench_common.h"
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
  cudaMemcpyAttributes attributes{};
  attributes.srcAccessOrder = order;
  attributes.flags = flags;
  size_t attributeIndex = 0;
  return cudaMemcpyBatchAsync(&dst, &src, &bytes, 1, &attributes, &attributeIndex, 1, stream);
}

bool run(size_t bytes, double busyMs) {
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
  if (!args.leftovers().empty() || bytes < 4096 || bytes % 4096 != 0 || busyMs <= 0) {
    fprintf(stderr, "copy-routes: --bytes must be a positive multiple of 4096, --busy-ms positive\n");
    return 2;
  }
  return run(bytes, busyMs) ? 0 : 1;
}

}  // namespace unifab::bench
