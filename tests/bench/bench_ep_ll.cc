// unifab-bench ep --mode ll: low-latency dispatch and combine for decoding-sized batches, one
// process per GPU. For each token count: both phases in one call, the send and the receive phase
// timed apart (the receive after a flush and a barrier, as when compute overlaps the transfer),
// dispatch + combine back to back, and NCCL's grouped send/recv moving the same rows. Bandwidth
// per (token, expert) selection, as DeepEP counts its low-latency kernels: FP8 dispatch
// hidden + hidden/128 * 4 + 16 bytes, BF16 combine hidden * 2 bytes.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "tests/bench/bench_common.h"
#include "tests/bench/ep_timing.h"
#include "tests/bench/message_floor.h"
#include "tests/bench/peer_buffer.h"
#include "tests/common/ep_device.h"
#include "tests/common/ep_reference.h"
#include "tests/common/nccl_session.h"
#include "tests/common/test_util.h"
#include "unifab/unifab.h"

namespace unifab::bench {
namespace {

struct LlRun {
  std::vector<int> tokens;
  int hidden, topk, experts, sms, iters, warmup;
  int maxTokens;  // the group's maxTokensPerRank (0: the largest of `tokens`)
  size_t flushBytes;  // written before each timed call (0: caches left warm, the calls still aligned)
  bool fp8;
  bool programmatic;  // unifabEpConfig_t::programmaticLaunch
  bool kernelTimes;  // a second pass per op timing its kernels alone (CUPTI)
  std::string csv;
  std::string ops;  // comma-separated subset of dispatch,phases,combine,pair,nccl (empty: all), and floor
  bool wants(const char* op) const { return opSelected(ops, op); }
};

struct LlRow {
  std::string op;
  int tokens;
  OpTimes t;
  double bytes;  // per-selection bytes the op moves (0: none reported)
};

bool runLlRank(const LlRun& run, const test::RankEnvironment& env) {
  test::NcclSession session;
  if (!session.init(env)) return false;
  const int largest = *std::max_element(run.tokens.begin(), run.tokens.end());
  const test::ep::Shape shape = test::ep::makeShape(env.nRanks, run.experts, run.hidden, run.topk,
                                                    run.maxTokens > 0 ? run.maxTokens : largest);
  unifabEpConfig_t config = test::ep::groupConfig(shape);
  config.mode = unifabEpLowLatency;
  config.programmaticLaunch = run.programmatic ? 1 : 0;
  unifabEpGroup_t group = nullptr;
  TEST_UNIFAB_CHECK(unifabEpCreate(session.comm(), &config, &group));
  // Uniform routing, no masked entries, BF16 activations.
  test::ep::RankInput input = test::ep::makeInput(shape, env.rank, 777, false, 0, shape.maxTokens);
  test::ep::DeviceInput device;
  if (!device.allocate(shape) || !device.upload(input, false, session.stream())) return false;
  const size_t expertRows = static_cast<size_t>(shape.localExperts()) * shape.nRanks * shape.maxTokens;
  void *expertOut = nullptr, *combined = nullptr;
  TEST_CUDA_CHECK(cudaMalloc(&expertOut, expertRows * run.hidden * 2));
  TEST_CUDA_CHECK(cudaMemset(expertOut, 0, expertRows * run.hidden * 2));
  TEST_CUDA_CHECK(cudaMalloc(&combined, static_cast<size_t>(shape.maxTokens) * run.hidden * 2));
  Timer timer;
  TEST_CUDA_CHECK(cudaEventCreate(&timer.start));
  TEST_CUDA_CHECK(cudaEventCreate(&timer.stop));
  timer.flushBytes = run.flushBytes;
  TEST_CUDA_CHECK(cudaMalloc(&timer.flush, std::max<size_t>(timer.flushBytes, 1)));

  const double dispatchRowBytes = run.fp8 ? run.hidden + run.hidden / 128.0 * 4 + 16 : run.hidden * 2.0;
  const double combineRowBytes = run.hidden * 2.0;
  std::vector<LlRow> rows;
  struct DeepEpRow {
    int tokens;
    BackToBackKernelTimes t;
  };
  std::vector<DeepEpRow> deepEpRows;
  // Pass 0 times every op with events; pass 1 (kernel times) runs the same ops again with CUPTI
  // recording their kernels, after every event-timed measurement (CUPTI slows later launches), and
  // fills the rows of pass 0 in the same order.
  size_t nextRow = 0;
  // The message floor (only when --ops names "floor"; two ranks): one FP8 token (payload and
  // scales) and one BF16 row handed to the peer by a kernel of one block per GPU, with fenced flags
  // or flagged lines (tests/bench/message_floor.h).
  const bool floor = !run.ops.empty() && run.wants("floor") && env.nRanks == 2;
  const bool launchFloor = !run.ops.empty() && run.wants("launch");
  int gpu = 0, deviceSms = 0;
  TEST_CUDA_CHECK(cudaGetDevice(&gpu));
  TEST_CUDA_CHECK(cudaDeviceGetAttribute(&deviceSms, cudaDevAttrMultiProcessorCount, gpu));
  const size_t floorPayloads[2] = {static_cast<size_t>(run.hidden) + run.hidden / 128 * 4, static_cast<size_t>(run.hidden) * 2};
  const size_t floorLanding = floorLandingBytes(floorPayloads[1]);
  // Two areas, [lines landing | fenced landing | flags] each, taken by the launch's epoch parity: a
  // rank's kernel ends once it has the peer's message, possibly before the peer has read its own,
  // so the next launch (one at most: the one after needs the peer's next) writes the other area.
  const size_t floorArea = (2 * floorLanding + sizeof(uint64_t) * kFloorWarps + 255) / 256 * 256;  // lines: 128-aligned
  PeerBuffer floorAreas;
  char* floorOut = nullptr;
  int* floorTimedOut = nullptr;
  uint64_t floorEpoch = 0;
  if (floor) {
    if (!floorAreas.open(session, 2 * floorArea)) return false;
    TEST_CUDA_CHECK(cudaMemsetAsync(floorAreas.local(), 0, 2 * floorArea, session.stream()));
    TEST_CUDA_CHECK(cudaMalloc(&floorOut, floorLanding));
    TEST_CUDA_CHECK(cudaMalloc(&floorTimedOut, sizeof(int)));
    TEST_CUDA_CHECK(cudaMemsetAsync(floorTimedOut, 0, sizeof(int), session.stream()));
    TEST_CUDA_CHECK(cudaStreamSynchronize(session.stream()));
    if (!session.barrier(true)) return false;  // both ranks' areas zeroed before either writes
  }
  for (int pass = 0; pass < (run.kernelTimes ? 2 : 1); ++pass) {
    timer.kernelsOnly = pass == 1;
    for (int which = 0; floor && which < 4; ++which) {
      const bool lines = which % 2 == 1;
      const size_t payload = floorPayloads[which / 2];
      auto send = [&] {
        const uint64_t epoch = ++floorEpoch;
        const size_t area = (epoch & 1) * floorArea, landingAt = area + (lines ? 0 : floorLanding);
        const size_t flagsAt = area + 2 * floorLanding;
        char* peer = floorAreas.peer(1 - env.rank);
        return launchMessageFloor(static_cast<const char*>(device.x), peer + landingAt,
                                  reinterpret_cast<uint64_t*>(peer + flagsAt), floorAreas.local() + landingAt,
                                  reinterpret_cast<const uint64_t*>(floorAreas.local() + flagsAt), floorOut, payload,
                                  epoch, lines, uint64_t{1000000000}, floorTimedOut, session.stream()) == cudaSuccess;
      };
      OpTimes t;
      if (!timeOp(session, timer, run.iters, run.warmup, send, &t)) return false;
      int timedOut = 0;
      TEST_CUDA_CHECK(cudaMemcpy(&timedOut, floorTimedOut, sizeof(int), cudaMemcpyDeviceToHost));
      double anyTimedOut = timedOut;
      if (!session.maxOverRanks(&anyTimedOut)) return false;
      if (anyTimedOut != 0) {
        fprintf(stderr, "rank %d: the message floor's kernel timed out waiting for the peer's message%s\n", env.rank,
                timedOut != 0 ? "" : " (on the other rank)");
        return false;
      }
      const char* names[4] = {"floor: FP8 token, fenced flags", "floor: FP8 token, flagged lines",
                              "floor: BF16 row, fenced flags", "floor: BF16 row, flagged lines"};
      if (pass == 0) {
        rows.push_back({names[which], 1, t, 0});
      } else if (nextRow < rows.size()) {
        rows[nextRow].t.kernelUs = t.kernelUs;
        rows[nextRow].t.kernelP99Us = t.kernelP99Us;
        ++nextRow;
      }
    }
    // The launch floor (only when --ops names "launch"): an empty grid of one block, and one as
    // large as the LL kernels' largest (a block of 16 warps and ~30 KB of shared memory on every
    // SM), launched as they are (tests/bench/message_floor.h): what a kernel time holds before work.
    for (int which = 0; launchFloor && which < 2; ++which) {
      const int blocks = which == 0 ? 1 : deviceSms;
      auto launch = [&] { return launchEmptyGrid(blocks, 512, 30 * 1024, run.programmatic, session.stream()) == cudaSuccess; };
      OpTimes t;
      if (!timeOp(session, timer, run.iters, run.warmup, launch, &t)) return false;
      if (pass == 0) {
        rows.push_back({which == 0 ? "launch: empty grid, 1 block" : "launch: empty grid, every SM", 0, t, 0});
      } else if (nextRow < rows.size()) {
        rows[nextRow].t.kernelUs = t.kernelUs;
        rows[nextRow].t.kernelP99Us = t.kernelP99Us;
        ++nextRow;
      }
    }
    for (int tokens : run.tokens) {
      unifabEpLowLatencyDispatchArgs_t args = UNIFAB_EP_LL_DISPATCH_ARGS_INIT;
      args.numTokens = tokens;
      args.x = device.x;
      args.topkIdx = device.topk;
      args.topkWeights = device.weights;
      args.dtype = run.fp8 ? unifabEpFp8E4M3 : unifabEpBf16;
      args.numSms = run.sms;
      unifabEpLowLatencyCombineArgs_t cargs = UNIFAB_EP_LL_COMBINE_ARGS_INIT;
      cargs.expertOutput = expertOut;
      cargs.combinedX = combined;
      cargs.numSms = run.sms;
      unifabEpHandle_t handle = nullptr;
      unifabEpLowLatencyDispatchResult_t result;
      result.size = sizeof(result);
      auto dispatch = [&](unifabEpPhase_t phase) {
        args.phase = phase;
        return unifabEpLowLatencyDispatch(group, &args, session.stream(), &handle, &result) == unifabSuccess;
      };
      auto combine = [&](unifabEpPhase_t phase) {
        cargs.phase = phase;
        return unifabEpLowLatencyCombine(group, handle, &cargs, session.stream()) == unifabSuccess;
      };
      auto release = [&] {
        const bool ok = unifabEpHandleDestroy(handle) == unifabSuccess;
        handle = nullptr;
        return ok;
      };
      auto nothing = [] { return true; };
      auto both = [&] { return dispatch(unifabEpSendAndReceive); };
      auto sendOnly = [&] { return dispatch(unifabEpSendOnly); };
      auto receiveOnly = [&] { return dispatch(unifabEpReceiveOnly); };
      auto combineBoth = [&] { return combine(unifabEpSendAndReceive); };
      auto combineSend = [&] { return combine(unifabEpSendOnly); };
      auto combineReceive = [&] { return combine(unifabEpReceiveOnly); };
      const double selections = static_cast<double>(tokens) * run.topk;
      OpTimes t;
      auto add = [&](const char* op, double rowBytes) {
        if (pass == 0) {
          rows.push_back({op, tokens, t, selections * rowBytes});
        } else if (nextRow < rows.size()) {
          rows[nextRow].t.kernelUs = t.kernelUs;
          rows[nextRow].t.kernelP99Us = t.kernelP99Us;
          ++nextRow;
        }
        t = OpTimes{};
      };
      const int iters = run.iters, warmup = run.warmup;
      if (run.wants("dispatch")) {
        if (!timeOp(session, timer, iters, warmup, nothing, both, release, true, &t)) return false;
        add("dispatch", dispatchRowBytes);
      }
      if (run.wants("phases")) {
        if (!timeOp(session, timer, iters, warmup, nothing, sendOnly, [&] { return receiveOnly() && release(); }, false, &t)) return false;
        add("  send phase", dispatchRowBytes);
        if (!timeOp(session, timer, iters, warmup, sendOnly, receiveOnly, release, false, &t)) return false;
        add("  receive phase", 0);
      }
      if (run.wants("combine")) {
        if (!timeOp(session, timer, iters, warmup, both, combineBoth, release, false, &t)) return false;
        add("combine", combineRowBytes);
      }
      if (run.wants("phases")) {
        if (!timeOp(session, timer, iters, warmup, both, combineSend, [&] { return combineReceive() && release(); }, false, &t)) return false;
        add("  send phase", combineRowBytes);
        if (!timeOp(session, timer, iters, warmup, [&] { return both() && combineSend(); }, combineReceive, release, false, &t)) return false;
        add("  receive phase", 0);
      }
      if (run.wants("pair")) {
        if (!timeOp(session, timer, iters, warmup, nothing, [&] { return both() && combineBoth(); }, release, true, &t)) return false;
        add("dispatch + combine", 0);
        if (pass == 1) {
          // DeepEP's way: pairs back to back, nothing flushed or aligned between them.
          BackToBackKernelTimes b2b;
          if (!timeKernelsBackToBack(session, iters, {both, combineBoth}, release, &b2b)) return false;
          if (b2b.measured) deepEpRows.push_back({tokens, b2b});
        }
      }
      if (!run.wants("nccl")) continue;

      // NCCL's grouped send/recv of the rows unifab moves: one per (token, destination rank).
      const int local = run.experts / env.nRanks;
      const size_t dispatchBytes = static_cast<size_t>(run.hidden) * (run.fp8 ? 1 : 2) + (run.fp8 ? run.hidden / 128 * 4 : 0);
      // Every rank's routing is known here (the inputs are generated from (seed, rank)), so each
      // receive matches its peer's send exactly.
      std::vector<std::vector<size_t>> rowsTo(env.nRanks, std::vector<size_t>(env.nRanks, 0));
      for (int r = 0; r < env.nRanks; ++r) {
        const test::ep::RankInput other = r == env.rank ? input : test::ep::makeInput(shape, r, 777, false, 0, shape.maxTokens);
        for (int tok = 0; tok < tokens; ++tok) {
          uint64_t mask = 0;
          for (int k = 0; k < run.topk; ++k) {
            const int64_t e = other.topk[static_cast<size_t>(tok) * run.topk + k];
            if (e >= 0) mask |= 1ULL << (e / local);
          }
          for (int d = 0; d < env.nRanks; ++d) rowsTo[r][d] += (mask >> d) & 1ULL;
        }
      }
      char *a2aSend = nullptr, *a2aRecv = nullptr;
      const size_t stride = static_cast<size_t>(tokens) * run.hidden * 2;
      TEST_CUDA_CHECK(cudaMalloc(&a2aSend, stride * env.nRanks));
      TEST_CUDA_CHECK(cudaMalloc(&a2aRecv, stride * env.nRanks));
      const size_t ncclRowBytes[2] = {dispatchBytes, static_cast<size_t>(run.hidden) * 2};
      for (int which = 0; which < 2; ++which) {
        std::vector<size_t> sendBytes(env.nRanks), recvBytes(env.nRanks);
        for (int d = 0; d < env.nRanks; ++d) {
          sendBytes[d] = rowsTo[env.rank][d] * ncclRowBytes[which];
          recvBytes[d] = rowsTo[d][env.rank] * ncclRowBytes[which];
        }
        auto alltoall = [&] { return session.exchange(a2aSend, a2aRecv, stride, sendBytes.data(), recvBytes.data()); };
        if (!timeOp(session, timer, iters, warmup, alltoall, &t)) return false;
        add(which == 0 ? "nccl send/recv, dispatch rows" : "nccl send/recv, combine rows",
            which == 0 ? dispatchRowBytes : combineRowBytes);
      }
      TEST_CUDA_CHECK(cudaFree(a2aSend));
      TEST_CUDA_CHECK(cudaFree(a2aRecv));
    }
  }
  TEST_UNIFAB_CHECK(unifabEpGetAsyncError(group));

  if (env.rank == 0) {
    printf("# unifab-bench ep ll: %d ranks, hidden %d, top-%d, %d experts, %s dispatch, BF16 combine, SMs %s, %s\n",
           env.nRanks, run.hidden, run.topk, run.experts, run.fp8 ? "FP8" : "BF16",
           run.sms > 0 ? std::to_string(run.sms).c_str() : "auto",
           run.programmatic ? "programmatic dependent launches" : "plain stream order (--programmatic 0)");
    const std::string flushed = run.flushBytes > 0 ? "L2 flushed (" + std::to_string(run.flushBytes >> 20) + " MiB written)"
                                                   : "nothing flushed (--flush-mib 0)";
    printf("# median and p99 of %d after %d warm-up, %s, slowest rank; GB/s per (token, expert) selection;"
           " b2b = per call of %d in a row (median of %d runs)\n", run.iters, run.warmup, flushed.c_str(), backToBackCalls(),
           kBackToBackRuns);
    if (!run.kernelTimes) {
      printf("# kernel times not measured (--kernel-times 0)\n");
    } else if (KernelTimer::available()) {
      printf("# kernel = GPU time of the call's kernels alone (CUPTI: first start to last end), median and p99 of a\n"
             "# second pass of %d such calls after every event-timed one: what DeepEP's kineto times report\n"
             "# ('-' where a rank recorded no kernels for some call; its stderr says why)\n", run.iters);
    } else {
      printf("# kernel times not measured: %s\n", KernelTimer::unavailableReason().c_str());
    }
    printf("# %6s %-32s %10s %10s %10s %10s %10s %10s %10s\n", "tokens", "op", "time(us)", "p99(us)", "GB/s", "b2b(us)",
           "host(us)", "kernel(us)", "kp99(us)");
    auto column = [](double value) {
      char text[32] = "-";
      if (value > 0) snprintf(text, sizeof text, "%.1f", value);
      return std::string(text);
    };
    for (const LlRow& row : rows) {
      const std::string rate = row.bytes > 0 ? std::to_string(row.bytes / (row.t.us * 1e3)).substr(0, 6) : "-";
      printf("  %6d %-32s %10.1f %10.1f %10s %10s %10.1f %10s %10s\n", row.tokens, row.op.c_str(), row.t.us, row.t.p99Us,
             rate.c_str(), column(row.t.backToBackUs).c_str(), row.t.hostUs, column(row.t.kernelUs).c_str(),
             column(row.t.kernelP99Us).c_str());
    }
    if (!deepEpRows.empty()) {
      printf("# kernel times as DeepEP's bench_kineto takes them: %d dispatch + combine pairs back to back after one\n"
             "# barrier, no L2 flush between them (CUPTI); mean (what DeepEP prints) and median, slowest rank\n",
             run.iters);
      printf("# %6s %-32s %10s %10s %10s %10s %10s\n", "tokens", "op", "d mean", "d median", "c mean", "c median",
             "sum means");
      for (const DeepEpRow& row : deepEpRows) {
        printf("  %6d %-32s %10.1f %10.1f %10.1f %10.1f %10.1f\n", row.tokens, "kernels b2b, no flush (DeepEP)",
               row.t.meanUs[0], row.t.medianUs[0], row.t.meanUs[1], row.t.medianUs[1], row.t.sumMeanUs);
      }
    }
    if (!run.csv.empty()) {
      FILE* f = fopen(run.csv.c_str(), "w");
      if (f != nullptr) {
        fprintf(f, "op,ranks,tokens,hidden,topk,experts,dtype,sms,time_us,p99_us,selection_gbs,host_us,kernel_us,kernel_p99_us,b2b_us\n");
        for (const LlRow& row : rows) {
          fprintf(f, "%s,%d,%d,%d,%d,%d,%s,%d,%.2f,%.2f,%.2f,%.2f,%.2f,%.2f,%.2f\n", row.op.c_str(), env.nRanks, row.tokens,
                  run.hidden, run.topk, run.experts, run.fp8 ? "fp8" : "bf16", run.sms, row.t.us, row.t.p99Us,
                  row.bytes > 0 ? row.bytes / (row.t.us * 1e3) : 0.0, row.t.hostUs, row.t.kernelUs, row.t.kernelP99Us,
                  row.t.backToBackUs);
        }
        fclose(f);
      }
    }
  }
  cudaFree(expertOut);
  cudaFree(combined);
  cudaFree(floorOut);
  cudaFree(floorTimedOut);
  TEST_UNIFAB_CHECK(unifabEpDestroy(group));
  return true;
}

}  // namespace

int runEpLowLatency(Args& args, const char* self) {
  LlRun run;
  for (const std::string& item : test::commaItems(args.value("--tokens", "1,32,128"))) {
    run.tokens.push_back(atoi(item.c_str()));
  }
  run.hidden = atoi(args.value("--hidden", "7168").c_str());
  run.topk = atoi(args.value("--topk", "8").c_str());
  run.experts = atoi(args.value("--experts", "256").c_str());
  run.sms = atoi(args.value("--sms", "0").c_str());
  run.maxTokens = atoi(args.value("--max-tokens", "0").c_str());
  run.iters = atoi(args.value("--iters", "50").c_str());
  run.warmup = atoi(args.value("--warmup", "10").c_str());
  const long flushMib = atol(args.value("--flush-mib", "256").c_str());
  const std::string dtype = args.value("--dtype", "fp8");
  run.fp8 = dtype == "fp8";
  run.csv = args.value("--csv", "");
  run.ops = args.value("--ops", "");
  // Options that are 0 or 1: false, naming the option, for anything else.
  auto zeroOrOne = [&](const char* option, bool* value) {
    const std::string text = args.value(option, "1");
    *value = text == "1";
    if (text == "0" || text == "1") return true;
    fprintf(stderr, "unifab-bench ep --mode ll: %s is 0 or 1 (got %s)\n", option, text.c_str());
    return false;
  };
  if (!zeroOrOne("--kernel-times", &run.kernelTimes) || !zeroOrOne("--programmatic", &run.programmatic)) return 2;
  std::string ranksText = args.value("--nranks", "0");
  if (!parseBackToBack(args, "ep --mode ll")) return 2;
  if (!args.leftovers().empty()) {
    fprintf(stderr, "unifab-bench ep --mode ll: unknown argument '%s'\n", args.leftovers()[0].c_str());
    return 2;
  }
  const int tokenCap = run.maxTokens > 0 ? run.maxTokens : 1024;
  bool tokensOk = !run.tokens.empty() && run.maxTokens >= 0 && run.maxTokens <= 1024;
  // 0 tokens: a rank with nothing to send this step still calls, and waits for the others' words.
  for (int t : run.tokens) tokensOk = tokensOk && t >= 0 && t <= tokenCap;
  tokensOk = tokensOk && (run.maxTokens > 0 || *std::max_element(run.tokens.begin(), run.tokens.end()) > 0);
  if ((dtype != "bf16" && dtype != "fp8") || !tokensOk || flushMib < 0 || flushMib > 4096) {
    fprintf(stderr,
            "unifab-bench ep --mode ll: --dtype is bf16 or fp8 (got %s); --max-tokens is in 0..1024 and --tokens a list"
            " in 0..--max-tokens (1024 when 0; not all 0 without it); --flush-mib is in 0..4096 (got %ld)\n",
            dtype.c_str(), flushMib);
    return 2;
  }
  run.flushBytes = static_cast<size_t>(flushMib) << 20;
  test::RankEnvironment env = test::rankEnvironment();
  if (env.launched) return runLlRank(run, env) ? 0 : 1;
  return relaunchPerGpu(self, "ep", args, atoi(ranksText.c_str()), {});
}

}  // namespace unifab::bench
