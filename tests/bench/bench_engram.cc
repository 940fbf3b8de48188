// unifab-bench engram: Engram fetches of random rows held by the other rank (peer -> local), for
// several row sizes, with each engine (the gather kernel on 1, 2 and 4 SMs; the copy engine with
// no SM) against a plain gather kernel (a warp per row, one vector at a time) on the same SMs.
// Time: CUDA events around issue + wait on the caller's stream after an L2 flush and a barrier,
// median over --iters, the slower rank; GB/s = fetched row bytes / time.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "tests/bench/bench_common.h"
#include "tests/bench/copy_batch.h"
#include "tests/bench/ep_timing.h"
#include "tests/bench/peer_buffer.h"
#include "tests/bench/plain_gather.h"
#include "tests/common/nccl_session.h"
#include "tests/common/test_util.h"
#include "unifab/unifab.h"

namespace unifab::bench {
namespace {

struct EngramRun {
  std::vector<size_t> rowSizes;
  size_t fetchBytes;  // bytes per fetch: rows = fetchBytes / row size
  int iters, warmup;
  std::string csv;
  std::string engines;  // comma-separated subset of gather,plain,copy,raw; empty: all
  bool threadCpu = false;  // each rank lists its threads' CPU time at the end
  int issuingRanks = 2;    // 1: rank 1 takes part in the barriers only (one process issuing copies)
  bool wants(const char* engine) const { return opSelected(engines, engine); }
};

struct EngramRow {
  size_t rowBytes;
  std::string engine;
  int sms;
  size_t rows;
  double us, backToBackUs, hostUs;
  double cpuReferenceUs;  // the host's speed right after: hostReferenceUs()
};

bool runEngramRank(const EngramRun& run, const test::RankEnvironment& env) {
  test::NcclSession session;
  if (!session.init(env)) return false;
  if (env.nRanks != 2) {
    fprintf(stderr, "unifab-bench engram: needs 2 ranks (got %d)\n", env.nRanks);
    return false;
  }
  Timer timer;
  TEST_CUDA_CHECK(cudaEventCreate(&timer.start));
  TEST_CUDA_CHECK(cudaEventCreate(&timer.stop));
  TEST_CUDA_CHECK(cudaMalloc(&timer.flush, timer.flushBytes));
  const int peer = 1 - env.rank;
  std::vector<EngramRow> results;
  for (size_t rowBytes : run.rowSizes) {
    const size_t rows = std::max<size_t>(run.fetchBytes / rowBytes, 1);
    const int64_t rowsPerRank = static_cast<int64_t>(std::max<size_t>(4 * rows, (size_t{512} << 20) / rowBytes));
    unifabEngramConfig_t config = UNIFAB_ENGRAM_CONFIG_INIT;
    config.rowBytes = rowBytes;
    config.rowsPerRank = rowsPerRank;
    unifabEngramTable_t table = nullptr;
    if (unifabEngramCreate(session.comm(), &config, &table) != unifabSuccess) {
      fprintf(stderr, "rank %d: %s\n", env.rank, unifabGetLastError());
      return false;
    }
    // The same rows in a plain IPC buffer for the baseline kernel.
    PeerBuffer plain;
    if (!plain.open(session, static_cast<size_t>(rowsPerRank) * rowBytes)) return false;
    // Random rows of the peer: global ids for Engram, the peer's row index for the baseline.
    std::mt19937_64 random(4711 + env.rank);
    std::vector<int64_t> global(rows), local(rows);
    for (size_t i = 0; i < rows; ++i) {
      local[i] = static_cast<int64_t>(random() % static_cast<uint64_t>(rowsPerRank));
      global[i] = static_cast<int64_t>(peer) * rowsPerRank + local[i];
    }
    int64_t *deviceGlobal = nullptr, *deviceLocal = nullptr;
    void* out = nullptr;
    TEST_CUDA_CHECK(cudaMalloc(&deviceGlobal, sizeof(int64_t) * rows));
    TEST_CUDA_CHECK(cudaMalloc(&deviceLocal, sizeof(int64_t) * rows));
    TEST_CUDA_CHECK(cudaMalloc(&out, rows * rowBytes));
    TEST_CUDA_CHECK(cudaMemcpy(deviceGlobal, global.data(), sizeof(int64_t) * rows, cudaMemcpyHostToDevice));
    TEST_CUDA_CHECK(cudaMemcpy(deviceLocal, local.data(), sizeof(int64_t) * rows, cudaMemcpyHostToDevice));
    auto fetch = [&](unifabEngramEngine_t engine, int sms) {
      return [&, engine, sms] {
        if (env.rank >= run.issuingRanks) return true;
        unifabEngramFetchArgs_t args = UNIFAB_ENGRAM_FETCH_ARGS_INIT;
        const bool copyEngine = engine == unifabEngramCopyEngine;
        args.rowIds = copyEngine ? static_cast<const void*>(global.data()) : static_cast<const void*>(deviceGlobal);
        args.hostRowIds = copyEngine ? 1 : 0;
        args.numRows = rows;
        args.out = out;
        args.engine = engine;
        args.maxSms = sms;
        unifabEngramFetch_t f = nullptr;
        return unifabEngramFetchIssue(table, &args, session.stream(), &f) == unifabSuccess &&
               unifabEngramWait(f, session.stream(), nullptr) == unifabSuccess;
      };
    };
    auto plainGather = [&](int sms) {
      return [&, sms] {
        return launchPlainGather(plain.peer(peer), deviceLocal, static_cast<int64_t>(rows),
                                 static_cast<int64_t>(rowBytes), static_cast<char*>(out), sms,
                                 session.stream()) == cudaSuccess;
      };
    };
    // The copy engine's own rate for the same row copies, with none of Engram's work: one
    // cudaMemcpyBatchAsync of every row (Engram issues them 64 to a call), with Engram's
    // attributes (stream order, overlap hint) and with the driver free to reorder.
    std::vector<void*> rowDsts(rows);
    std::vector<const void*> rowSrcs(rows);
    std::vector<size_t> rowSizes(rows, rowBytes);
    for (size_t i = 0; i < rows; ++i) {
      rowDsts[i] = static_cast<char*>(out) + i * rowBytes;
      rowSrcs[i] = plain.peer(peer) + static_cast<size_t>(local[i]) * rowBytes;
    }
    auto rawBatch = [&](cudaMemcpySrcAccessOrder order, unsigned flags) {
      return [&, order, flags] {
        if (env.rank >= run.issuingRanks) return true;
        return copyBatch(rowDsts.data(), rowSrcs.data(), rowSizes.data(), rows, order, flags, session.stream()) ==
               cudaSuccess;
      };
    };
    OpTimes t;
    auto record = [&](const char* engine, int sms) {
      results.push_back({rowBytes, engine, sms, rows, t.us, t.backToBackUs, t.hostUs, hostReferenceUs()});
    };
    for (int sms : {1, 2, 4}) {
      if (run.wants("gather")) {
        if (!timeOp(session, timer, run.iters, run.warmup, fetch(unifabEngramSmGather, sms), &t)) return false;
        record("gather kernel", sms);
      }
      if (run.wants("plain")) {
        if (!timeOp(session, timer, run.iters, run.warmup, plainGather(sms), &t)) return false;
        record("plain gather (baseline)", sms);
      }
    }
    if (run.wants("copy")) {
      if (!timeOp(session, timer, run.iters, run.warmup, fetch(unifabEngramCopyEngine, 0), &t)) return false;
      record("copy engine", 0);
    }
    if (run.wants("raw")) {
      if (!timeOp(session, timer, run.iters, run.warmup,
                  rawBatch(cudaMemcpySrcAccessOrderStream, cudaMemcpyFlagPreferOverlapWithCompute), &t)) {
        return false;
      }
      record("raw batch, one call", 0);
      if (!timeOp(session, timer, run.iters, run.warmup, rawBatch(cudaMemcpySrcAccessOrderAny, 0), &t)) return false;
      record("raw batch, any order", 0);
    }
    if (unifabEngramGetAsyncError(table) != unifabSuccess) {
      fprintf(stderr, "rank %d: %s\n", env.rank, unifabGetLastError());
      return false;
    }
    cudaFree(deviceGlobal);
    cudaFree(deviceLocal);
    cudaFree(out);
    if (!session.barrier(true)) return false;
    if (unifabEngramDestroy(table) != unifabSuccess) return false;
  }
  if (env.rank == 0) {
    printf("# unifab-bench engram: random rows of the peer GPU; median of %d after %d warm-up, L2 flushed, slower "
           "rank; GB/s = 1e9 B/s of rows fetched\n", run.iters, run.warmup);
    printf("# b2b = per fetch (issue + wait) of %d in a row with no flush or barrier between them (as nccl-tests times), "
           "median of %d runs\n", backToBackCalls(), kBackToBackRuns);
    printf("# cpu ref = a fixed integer chain timed on this thread right after the row (the host's own speed)\n");
    printf("# %9s %-26s %4s %8s %10s %10s %10s %10s %10s %10s %11s\n", "row B", "engine", "SMs", "rows", "time(us)",
           "Mrows/s", "GB/s", "b2b(us)", "GB/s", "host(us)", "cpu ref(us)");
    for (const EngramRow& r : results) {
      const double bytes = static_cast<double>(r.rows) * r.rowBytes;
      printf("  %9zu %-26s %4d %8zu %10.1f %10.2f %10.1f %10.1f %10.1f %10.1f %11.1f\n", r.rowBytes, r.engine.c_str(),
             r.sms, r.rows, r.us, r.rows / r.us, bytes / (r.us * 1e3), r.backToBackUs, bytes / (r.backToBackUs * 1e3),
             r.hostUs, r.cpuReferenceUs);
    }
    if (!run.csv.empty()) {
      FILE* f = fopen(run.csv.c_str(), "w");
      if (f != nullptr) {
        fprintf(f, "row_bytes,engine,sms,rows,time_us,mrows_per_s,gbs,b2b_us\n");
        for (const EngramRow& r : results) {
          fprintf(f, "%zu,%s,%d,%zu,%.2f,%.3f,%.2f,%.2f\n", r.rowBytes, r.engine.c_str(), r.sms, r.rows, r.us,
                  r.rows / r.us, static_cast<double>(r.rows) * r.rowBytes / (r.us * 1e3), r.backToBackUs);
        }
        fclose(f);
      }
    }
  }
  if (run.threadCpu) {
    const std::string who = "rank " + std::to_string(env.rank);
    printThreadCpu(who.c_str());
  }
  return true;
}

}  // namespace

int runEngram(Args& args, const char* self) {
  EngramRun run;
  for (const std::string& item : test::commaItems(args.value("--rows", "256,1K,4K,14K,64K"))) {
    run.rowSizes.push_back(parseBytes(item));
  }
  run.fetchBytes = parseBytes(args.value("--fetch", "64M"));
  run.iters = atoi(args.value("--iters", "20").c_str());
  run.warmup = atoi(args.value("--warmup", "3").c_str());
  run.csv = args.value("--csv", "");
  run.engines = args.value("--engines", "");
  run.threadCpu = args.flag("--thread-cpu");
  run.issuingRanks = atoi(args.value("--issuing-ranks", "2").c_str());
  if (run.issuingRanks < 1 || run.issuingRanks > 2) {
    fprintf(stderr, "unifab-bench engram: --issuing-ranks must be 1 or 2\n");
    return 2;
  }
  if (!listWithin(run.engines, "gather,plain,copy,raw", "engram", "--engines")) return 2;
  if (!parseBackToBack(args, "engram")) return 2;
  if (!args.leftovers().empty()) {
    fprintf(stderr, "unifab-bench engram: unknown argument '%s'\n", args.leftovers()[0].c_str());
    return 2;
  }
  for (size_t r : run.rowSizes) {
    if (r < 16 || r % 16 != 0) {
      fprintf(stderr, "unifab-bench engram: row sizes are multiples of 16 (got %zu)\n", r);
      return 2;
    }
  }
  test::RankEnvironment env = test::rankEnvironment();
  if (env.launched) return runEngramRank(run, env) ? 0 : 1;
  return relaunchPerGpu(self, "engram", args, 2, {});
}

}  // namespace unifab::bench
