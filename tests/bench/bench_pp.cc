// unifab-bench pp: pipeline send/recv from rank 0 to rank 1 (one process per GPU), against NCCL's
// ncclSend/ncclRecv of the same bytes and the copy engine's contiguous peer copy, in the same run.
// Time: CUDA events around the transfer on both ranks after a barrier, median over --iters, the
// slower rank; bandwidth = bytes / time. unifab's transfer uses no SM.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "tests/bench/bench_common.h"
#include "tests/bench/copy_ceiling.h"
#include "tests/bench/ep_timing.h"
#include "tests/common/nccl_session.h"
#include "tests/common/test_util.h"
#include "unifab/unifab.h"

namespace unifab::bench {
namespace {

struct PpRun {
  size_t minBytes, maxBytes;
  int factor, iters, warmup;
  size_t chunkBytes;
  int chunksInFlight;
  std::string csv;
  std::string engines;  // comma-separated subset of unifab,nccl,copy; empty: all
  bool wants(const char* engine) const { return opSelected(engines, engine); }
};

// A time column and its bandwidth, or dashes for an engine not run (NaN).
std::string timeAndRate(double us, size_t bytes, int width) {
  char text[64];
  if (std::isnan(us)) {
    snprintf(text, sizeof(text), " %*s %10s", width, "-", "-");
  } else {
    snprintf(text, sizeof(text), " %*.1f %10.1f", width, us, static_cast<double>(bytes) / (us * 1e3));
  }
  return text;
}

// A CSV field: empty for an engine not run.
std::string csvField(double value) {
  if (std::isnan(value)) return "";
  char text[32];
  snprintf(text, sizeof(text), "%.2f", value);
  return text;
}

bool runPpRank(const PpRun& run, const test::RankEnvironment& env) {
  test::NcclSession session;
  if (!session.init(env)) return false;
  if (env.nRanks != 2) {
    fprintf(stderr, "unifab-bench pp: needs 2 ranks (got %d)\n", env.nRanks);
    return false;
  }
  unifabPpConfig_t config = UNIFAB_PP_CONFIG_INIT;
  config.chunkBytes = run.chunkBytes;
  config.chunksInFlight = run.chunksInFlight;
  unifabPpGroup_t group = nullptr;
  if (unifabPpCreate(session.comm(), &config, &group) != unifabSuccess) {
    fprintf(stderr, "rank %d: unifabPpCreate failed: %s\n", env.rank, unifabGetLastError());
    return false;
  }
  void* buffer = nullptr;
  TEST_CUDA_CHECK(cudaMalloc(&buffer, run.maxBytes));
  TEST_CUDA_CHECK(cudaMemset(buffer, 1, run.maxBytes));
  Timer timer;
  TEST_CUDA_CHECK(cudaEventCreate(&timer.start));
  TEST_CUDA_CHECK(cudaEventCreate(&timer.stop));
  TEST_CUDA_CHECK(cudaMalloc(&timer.flush, timer.flushBytes));
  const bool sender = env.rank == 0;
  struct Row {
    size_t bytes;
    OpTimes unifab, nccl;
    double copyEngineUs;
  };
  std::vector<Row> rows;
  for (size_t bytes = run.minBytes; bytes <= run.maxBytes; bytes *= run.factor) {
    OpTimes notRun;
    notRun.us = notRun.backToBackUs = std::nan("");
    Row row{bytes, notRun, notRun, std::nan("")};
    auto pp = [&] {
      const unifabResult_t r = sender ? unifabPpSend(group, buffer, bytes, 1, session.stream())
                                      : unifabPpRecv(group, buffer, bytes, 0, session.stream());
      return r == unifabSuccess;
    };
    auto nccl = [&] {
      const ncclResult_t r = sender ? ncclSend(buffer, bytes, ncclChar, 1, session.comm(), session.stream())
                                    : ncclRecv(buffer, bytes, ncclChar, 0, session.comm(), session.stream());
      return r == ncclSuccess;
    };
    if (run.wants("unifab") && !timeOp(session, timer, run.iters, run.warmup, pp, &row.unifab)) return false;
    if (run.wants("nccl") && !timeOp(session, timer, run.iters, run.warmup, nccl, &row.nccl)) return false;
    if (run.wants("copy")) {
      // The copy engine's contiguous peer copy of the same bytes (both ranks push at once).
      CopyCeiling ceiling;
      if (!measureCopyCeiling(session, bytes, 0, std::max<size_t>(bytes, 16), 0, run.iters, timer.flush,
                              timer.flushBytes, &ceiling)) {
        return false;
      }
      row.copyEngineUs = ceiling.copyEngineUs;
    }
    rows.push_back(row);
  }
  if (unifabPpGetAsyncError(group) != unifabSuccess) {
    fprintf(stderr, "rank %d: %s\n", env.rank, unifabGetLastError());
    return false;
  }
  if (env.rank == 0) {
    const char* engine = getenv("UNIFAB_PP_ENGINE");
    printf("# unifab-bench pp: rank 0 -> rank 1, %s engine (slots: chunks of %zu KiB x %d in flight); median of %d "
           "after %d warm-up, L2 flushed, slower rank; GB/s = 1e9 B/s\n", engine != nullptr ? engine : "rendezvous",
           (run.chunkBytes ? run.chunkBytes : size_t{8} << 20) >> 10, run.chunksInFlight ? run.chunksInFlight : 4,
           run.iters, run.warmup);
    printf("# b2b = per call of %d calls in a row with no flush or barrier between them (as nccl-tests times), median "
           "of %d runs\n", backToBackCalls(), kBackToBackRuns);
    printf("# %12s %12s %10s %12s %10s %12s %10s %12s %10s %12s %10s\n", "bytes", "unifab(us)", "GB/s", "nccl(us)",
           "GB/s", "copy eng(us)", "GB/s", "unifab b2b", "GB/s", "nccl b2b", "GB/s");
    for (const Row& r : rows) {
      printf("  %12zu%s%s%s%s%s\n", r.bytes, timeAndRate(r.unifab.us, r.bytes, 12).c_str(),
             timeAndRate(r.nccl.us, r.bytes, 12).c_str(), timeAndRate(r.copyEngineUs, r.bytes, 12).c_str(),
             timeAndRate(r.unifab.backToBackUs, r.bytes, 12).c_str(),
             timeAndRate(r.nccl.backToBackUs, r.bytes, 12).c_str());
    }
    if (!run.csv.empty()) {
      FILE* f = fopen(run.csv.c_str(), "w");
      if (f != nullptr) {
        fprintf(f, "bytes,unifab_us,unifab_gbs,nccl_us,nccl_gbs,copy_engine_us,copy_engine_gbs,unifab_b2b_us,nccl_b2b_us\n");
        for (const Row& r : rows) {
          const double b = static_cast<double>(r.bytes);
          fprintf(f, "%zu,%s,%s,%s,%s,%s,%s,%s,%s\n", r.bytes, csvField(r.unifab.us).c_str(),
                  csvField(b / (r.unifab.us * 1e3)).c_str(), csvField(r.nccl.us).c_str(),
                  csvField(b / (r.nccl.us * 1e3)).c_str(), csvField(r.copyEngineUs).c_str(),
                  csvField(b / (r.copyEngineUs * 1e3)).c_str(), csvField(r.unifab.backToBackUs).c_str(),
                  csvField(r.nccl.backToBackUs).c_str());
        }
        fclose(f);
      }
    }
  }
  cudaFree(buffer);
  if (unifabPpDestroy(group) != unifabSuccess) return false;
  return true;
}

}  // namespace

int runPp(Args& args, const char* self) {
  PpRun run;
  run.minBytes = parseBytes(args.value("--min", "4K"));
  run.maxBytes = parseBytes(args.value("--max", "1G"));
  run.factor = atoi(args.value("--factor", "4").c_str());
  run.iters = atoi(args.value("--iters", "30").c_str());
  run.warmup = atoi(args.value("--warmup", "5").c_str());
  run.chunkBytes = parseBytes(args.value("--chunk", "0"));
  run.chunksInFlight = atoi(args.value("--inflight", "0").c_str());
  run.csv = args.value("--csv", "");
  run.engines = args.value("--engines", "");
  if (!listWithin(run.engines, "unifab,nccl,copy", "pp", "--engines")) return 2;
  if (!parseBackToBack(args, "pp")) return 2;
  if (!args.leftovers().empty()) {
    fprintf(stderr, "unifab-bench pp: unknown argument '%s'\n", args.leftovers()[0].c_str());
    return 2;
  }
  if (run.minBytes < 1 || run.maxBytes < run.minBytes || run.factor < 2) {
    fprintf(stderr, "unifab-bench pp: needs 1 <= --min <= --max and --factor >= 2\n");
    return 2;
  }
  test::RankEnvironment env = test::rankEnvironment();
  if (env.launched) return runPpRank(run, env) ? 0 : 1;
  return relaunchPerGpu(self, "pp", args, 2, {});
}

}  // namespace unifab::bench
