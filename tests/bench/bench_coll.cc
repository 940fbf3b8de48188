// unifab-bench coll: NCCL's collectives timed with CUDA events, one process per GPU, over
// unifab's net plugin (NET forced), NCCL's internal Socket transport (NET forced) or the
// machine's default paths. Bus bandwidth follows nccl-tests' definitions.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "tests/bench/bench_common.h"
#include "tests/common/nccl_session.h"

namespace unifab::bench {
namespace {

using test::Collective;

double busFactor(Collective collective, int nRanks) {
  double n = nRanks;
  if (collective == Collective::kBroadcast) return 1.0;
  return collective == Collective::kAllReduce ? 2 * (n - 1) / n : (n - 1) / n;
}

// A batched sample lasts about this long: short enough that the whole sweep stays minutes.
constexpr double kBatchTargetUs = 200;

struct RankRun {
  Collective collective;
  size_t minBytes, maxBytes;
  int warmup, iters;
  size_t factor;
  int spinUs;  // GPU busy this long before each start event: the host enqueues the op meanwhile
  // Up to this many calls per timed sample, as many as fill ~kBatchTargetUs, captured in one CUDA
  // graph (as nccl-tests -G): the two ranks' arrival skew (~1 us, per process) spreads over them,
  // and the host's enqueue, slower than a small call on the GPU, stays out of the time.
  int batch;
  std::string csv;
  std::string label;
};

bool runRank(const RankRun& run, const test::RankEnvironment& env) {
  // Captured calls would otherwise register the user's buffers where eager ones copy through
  // NCCL's: the graph is a timing device here, the data path must stay the eager one. Set here,
  // before NCCL reads it, so that it holds however the ranks were started (tune-sweep starts them).
  if (run.batch > 1 && setenv("NCCL_GRAPH_REGISTER", "0", /*overwrite=*/0) != 0) {
    fprintf(stderr, "unifab-bench coll: cannot set NCCL_GRAPH_REGISTER\n");
    return false;
  }
  test::NcclSession session;
  if (!session.init(env)) return false;
  size_t maxElements = run.maxBytes / sizeof(float) + 1;
  float *send = nullptr, *recv = nullptr;
  unsigned long long* wrong = nullptr;
  TEST_CUDA_CHECK(cudaMalloc(&send, maxElements * sizeof(float)));
  TEST_CUDA_CHECK(cudaMalloc(&recv, maxElements * sizeof(float)));
  TEST_CUDA_CHECK(cudaMalloc(&wrong, sizeof(unsigned long long)));
  cudaEvent_t start, stop;
  TEST_CUDA_CHECK(cudaEventCreate(&start));
  TEST_CUDA_CHECK(cudaEventCreate(&stop));
  FILE* csv = nullptr;
  if (env.rank == 0) {
    printf("# unifab-bench coll: %s, %d ranks, %s, median of %d after %d warm-up, time = slowest rank%s%s\n",
           test::collectiveName(run.collective), env.nRanks, run.label.c_str(), run.iters, run.warmup,
           run.spinUs > 0 ? ", host enqueue hidden behind a spin" : "",
           run.batch > 1 && run.warmup > 0 ? ", per call of up to --batch calls in one CUDA graph per sample" : "");
    printf("# %10s %12s %12s %12s %12s %8s\n", "size(B)", "time(us)", "p90(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong");
    if (!run.csv.empty()) {
      csv = fopen(run.csv.c_str(), "w");
      if (csv != nullptr) fprintf(csv, "collective,ranks,net,bytes,time_us,p90_us,algbw_gbs,busbw_gbs,wrong\n");
    }
  }
  for (size_t bytes = run.minBytes; bytes <= run.maxBytes; bytes *= run.factor) {
    size_t sendCount = 0, recvCount = 0;
    if (!test::bufferCounts(run.collective, bytes, env.nRanks, &sendCount, &recvCount)) continue;
    uint32_t seed = static_cast<uint32_t>(bytes);
    TEST_CUDA_CHECK(test::fillInput(send, sendCount, env.rank, seed, session.stream()));
    // Without the spin a sample includes NCCL's host-side enqueue (~3 us, and per process it
    // lands in one of two modes), which is the same for every algorithm and protocol.
    auto timeCalls = [&](int calls, test::GraphExec* graph, double* us) {
      if (run.spinUs > 0) TEST_CUDA_CHECK(test::spinOnDevice(run.spinUs * 1000LL, session.stream()));
      TEST_CUDA_CHECK(cudaEventRecord(start, session.stream()));
      if (graph != nullptr) {
        if (!graph->launch(session.stream())) return false;
      } else if (!session.run(run.collective, send, recv, sendCount, recvCount)) {
        return false;
      }
      TEST_CUDA_CHECK(cudaEventRecord(stop, session.stream()));
      TEST_CUDA_CHECK(cudaEventSynchronize(stop));
      float ms = 0;
      TEST_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
      *us = ms * 1000.0 / calls;
      return true;
    };
    double callUs = 0;  // the fastest warm-up: the first may include NCCL's connection setup
    for (int i = 0; i < run.warmup; ++i) {
      double us = 0;
      if (!timeCalls(1, nullptr, &us)) return false;
      callUs = i == 0 ? us : std::min(callUs, us);
    }
    // Both ranks must make the same calls: the slowest rank's warm-up sizes the batch.
    int calls = 1;
    if (run.batch > 1 && run.warmup > 0) {
      if (!session.maxOverRanks(&callUs)) return false;
      calls = callUs >= kBatchTargetUs ? 1
              : callUs <= 0           ? run.batch
                                      : std::min(run.batch, static_cast<int>(kBatchTargetUs / callUs) + 1);
    }
    test::GraphExec graph;
    if (calls > 1 && !session.captureRuns(run.collective, send, recv, sendCount, recvCount, calls, &graph)) {
      return false;
    }
    std::vector<double> samples;
    for (int i = 0; i < run.iters + (calls > 1 ? 1 : 0); ++i) {  // a graph's first launch uploads it
      double us = 0;
      if (!timeCalls(calls, calls > 1 ? &graph : nullptr, &us)) return false;
      if (calls == 1 || i > 0) samples.push_back(us);
    }
    // The check runs after timing, on fresh inputs and a poisoned output.
    TEST_CUDA_CHECK(test::poisonBuffer(recv, recvCount * sizeof(float), session.stream()));
    TEST_CUDA_CHECK(cudaMemsetAsync(wrong, 0, sizeof(*wrong), session.stream()));
    if (!session.run(run.collective, send, recv, sendCount, recvCount)) return false;
    TEST_CUDA_CHECK(test::countMismatches(run.collective, recv, recvCount, env.rank, env.nRanks, seed, wrong,
                                          session.stream()));
    double results[2] = {median(samples), percentile(samples, 0.9)};
    unsigned long long mismatches = 0;
    for (double& value : results) {
      if (!session.maxOverRanks(&value)) return false;
    }
    TEST_NCCL_CHECK(ncclAllReduce(wrong, wrong, 1, ncclUint64, ncclSum, session.comm(), session.stream()));
    TEST_CUDA_CHECK(cudaMemcpyAsync(&mismatches, wrong, sizeof(mismatches), cudaMemcpyDeviceToHost, session.stream()));
    TEST_CUDA_CHECK(cudaStreamSynchronize(session.stream()));
    if (env.rank == 0) {
      size_t reportBytes = std::max(sendCount, recvCount) * sizeof(float);
      double algbw = static_cast<double>(reportBytes) / (results[0] * 1e3);
      double busbw = algbw * busFactor(run.collective, env.nRanks);
      printf("  %10zu %12.1f %12.1f %12.2f %12.2f %8llu\n", reportBytes, results[0], results[1], algbw, busbw, mismatches);
      fflush(stdout);
      if (csv != nullptr) {
        fprintf(csv, "%s,%d,%s,%zu,%.2f,%.2f,%.3f,%.3f,%llu\n", test::collectiveName(run.collective), env.nRanks,
                run.label.c_str(), reportBytes, results[0], results[1], algbw, busbw, mismatches);
      }
    }
    if (mismatches != 0) {
      if (csv != nullptr) fclose(csv);
      return false;
    }
  }
  if (csv != nullptr) fclose(csv);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaFree(send);
  cudaFree(recv);
  cudaFree(wrong);
  return true;
}

}  // namespace

int runColl(Args& args, const char* self) {
  RankRun run;
  std::string op = args.value("--op", "all_reduce");
  if (!test::collectiveByName(op.c_str(), &run.collective)) {
    fprintf(stderr, "unifab-bench coll: unknown --op %s (all_reduce, all_gather, reduce_scatter, alltoall, broadcast)\n",
            op.c_str());
    return 2;
  }
  run.minBytes = parseBytes(args.value("--min", "8"));
  run.maxBytes = parseBytes(args.value("--max", "256M"));
  run.factor = parseBytes(args.value("--factor", "4"));
  run.warmup = atoi(args.value("--warmup", "5").c_str());
  run.iters = atoi(args.value("--iters", "30").c_str());
  run.csv = args.value("--csv", "");
  run.spinUs = atoi(args.value("--spin-us", "0").c_str());
  run.batch = atoi(args.value("--batch", "1").c_str());
  std::string net = args.value("--net", "nvlink");
  std::string tuner = args.value("--tuner", "");
  std::string ranksText = args.value("--nranks", "0");
  if (!args.leftovers().empty()) {
    fprintf(stderr, "unifab-bench coll: unknown argument '%s'\n", args.leftovers()[0].c_str());
    return 2;
  }
  if (run.minBytes == 0 || run.maxBytes < run.minBytes || run.factor < 2 || run.iters < 1 || run.warmup < 0 ||
      run.spinUs < 0 || run.spinUs > 100000 || run.batch < 1 || run.batch > 1000) {
    fprintf(stderr, "unifab-bench coll: need 0 < --min <= --max, --factor >= 2, --iters >= 1, --warmup >= 0, "
                    "0 <= --spin-us <= 100000, 1 <= --batch <= 1000\n");
    return 2;
  }
  run.label = "net=" + net + (tuner.empty() ? "" : "+tuner=" + tuner);

  test::RankEnvironment env = test::rankEnvironment();
  if (env.launched) return runRank(run, env) ? 0 : 1;

  // Not started by a launcher: start one process per GPU, each running this same command.
  std::vector<std::string> environment;
  if (net == "unifab") {
    std::string library = unifabLibraryPath();
    if (library.empty()) {
      fprintf(stderr, "unifab-bench coll: cannot locate libnccl-unifab.so\n");
      return 1;
    }
    environment = {"NCCL_NET_PLUGIN=" + library, "NCCL_NET=unifab", "NCCL_P2P_DISABLE=1", "NCCL_SHM_DISABLE=1"};
  } else if (net == "socket") {
    environment = {"NCCL_NET_PLUGIN=none", "NCCL_NET=Socket", "NCCL_P2P_DISABLE=1", "NCCL_SHM_DISABLE=1"};
  } else if (net != "nvlink") {
    fprintf(stderr, "unifab-bench coll: --net must be unifab, socket or nvlink\n");
    return 2;
  }
  if (tuner == "none") environment.push_back("NCCL_TUNER_PLUGIN=none");
  return relaunchPerGpu(self, "coll", args, atoi(ranksText.c_str()), environment);
}

}  // namespace unifab::bench
