// unifab-bench: benchmarks of unifab's operations and of its NCCL plugin.
//   unifab-bench                 the main demo for this machine: ep over all local GPUs, net loopback without GPUs
//   unifab-bench net  [...]      ncclNet table over loopback, no NCCL, no GPU
//   unifab-bench coll [...]      NCCL collectives, one process per GPU, over unifab or NCCL's nets
//   unifab-bench ep   [...]      expert-parallel dispatch/combine, one process per GPU
//   unifab-bench pp   [...]      pipeline send/recv between two GPUs
//   unifab-bench engram [...]    Engram row fetches from the peer GPU
//   unifab-bench tune-sweep [...] every NCCL algorithm x protocol x channel count against the tuner
//   unifab-bench copy-routes [...] which device-to-device copy routes stay off the SMs
//   unifab-bench memrates        this GPU's memory latencies and per-warp rates (one process)
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstring>
#include <string>

#include "tests/bench/bench_common.h"

namespace {

void usage() {
  printf(
      "usage: unifab-bench [net|coll|ep|pp|engram|tune-sweep|copy-routes|memrates] [options]\n"
      "  (no command: ep over all local GPUs, or net where there is no GPU)\n"
      "  net   --min BYTES --max BYTES --window N --seconds S\n"
      "        bandwidth and latency of the ncclNet table over loopback (two comms, two threads)\n"
      "  coll  --op all_reduce|all_gather|reduce_scatter|alltoall|broadcast --min BYTES --max BYTES --factor F --iters N\n"
      "        --warmup N --nranks N --net unifab|socket|nvlink [--tuner none] [--csv FILE] [--spin-us N]\n"
      "        [--batch N]: NCCL collectives, one process per GPU; --net unifab and socket force NCCL's NET path\n"
      "        (P2P and SHM off) over unifab's plugin or NCCL's internal Socket transport; --spin-us: the\n"
      "        GPU spins N us before each start event, so the time leaves out NCCL's host enqueue;\n"
      "        --batch: up to N calls (~200 us) per timed sample, in one CUDA graph; time per call\n"
      "  ep    --mode ht --tokens N --hidden H --topk K --experts E --dtype bf16|fp8 --layout rank|expert\n"
      "        --sms N --iters N --warmup N [--csv FILE] [--ops dispatch,empty,cached,combine,combine-input,nccl,ceiling]\n"
      "        expert-parallel dispatch and combine, one process per GPU, with NCCL's all-to-all\n"
      "  ep    --mode ll --tokens LIST --hidden H --topk K --experts E --dtype fp8|bf16 --sms N --iters N\n"
      "        [--ops dispatch,phases,combine,pair,nccl,floor,launch] [--kernel-times 0|1]: low-latency dispatch and combine, phases apart,\n"
      "        with NCCL's send/recv; kernel times (default 1): a second pass timing the calls' kernels alone with CUPTI;\n"
      "        floor (named only): one token handed to the peer by a one-block kernel per GPU, the protocol's floor;\n"
      "        launch (named only): empty grids of one block and of every SM, launched as the LL kernels are;\n"
      "        --flush-mib N (default 256, 0: none): bytes written before each timed call to evict L2;\n"
      "        --programmatic 0|1 (default 1): the group's programmaticLaunch (unifabEpConfig_t);\n"
      "        --max-tokens N: the group's maxTokensPerRank (default: the largest of --tokens)\n"
      "  pp    --min BYTES --max BYTES --factor F --chunk BYTES --inflight N --iters N [--csv FILE]\n"
      "        [--engines unifab,nccl,copy]\n"
      "        pipeline send/recv rank 0 -> 1 (no SM), with ncclSend/ncclRecv and the copy engine\n"
      "  engram --rows LIST --fetch BYTES --iters N [--csv FILE] [--engines gather,plain,copy,raw] [--thread-cpu] [--issuing-ranks 1|2]\n"
      "        Engram fetches of random peer rows per engine and SM count, against a plain gather kernel\n"
      "  tune-sweep --ops LIST --channels LIST --protocols LIST --min B --max B --factor F --iters N\n"
      "        --reps N --net nvlink|unifab --force tuner|env --out DIR [--log-tuning] [--spin-us N] [--batch N (NVLink 20, else 1)]\n"
      "        [--from-logs --nranks N] [--rep-stat median|min]: every forced NCCL\n"
      "        configuration (through unifab's tuner, or NCCL_ALGO/NCCL_PROTO), NCCL's default\n"
      "        and unifab's tuner (also with the most channels built), interleaved N times; per size the\n"
      "        best configuration and the gaps, medians (or the fastest) over the repetitions (DIR/summary.csv); unifab:\n"
      "        NET forced, a node per rank (--socket-speed-mbps M: the sockets' port speed where sysfs\n"
      "        has none); --log-tuning: the choices the tuner and NCCL log; --max-gap P: exit 3 when\n"
      "        the tuner is more than P %% behind the best configuration (same channels built, or\n"
      "        at NCCL's default build on as many channels as it built); --max-slowdown P: exit 3 when,\n"
      "        choosing otherwise than NCCL's default, the tuner is more than P %% slower than it;\n"
      "        --from-logs: analyse the CSVs and logs a finished sweep left in DIR again, running nothing\n"
      "  ep, pp, engram: --b2b N calls per back-to-back run (default 20, nccl-tests' -n)\n"
      "  copy-routes --bytes BYTES --busy-ms MS [--issue-paths-only]\n"
      "        each device-to-device copy route alone and next to a kernel holding every SM (one process)\n"
      "  memrates\n"
      "        L2 load and atomic latencies, a word's round trip between SMs, one warp's and one SM's load and\n"
      "        store rates, first touches of 2 MB pages (one process, clock64 in the kernels)\n");
}

}  // namespace

int main(int argc, char** argv) {
  std::string command = argc > 1 ? argv[1] : "";
  if (command == "-h" || command == "--help") {
    usage();
    return 0;
  }
  if (command.empty()) {
    // The demo is the main job where it can run: MoE dispatch/combine across every local GPU.
    int gpus = 0;
    if (cudaGetDeviceCount(&gpus) != cudaSuccess) gpus = 0;
    unifab::bench::Args args = unifab::bench::makeArgs(argc, argv, 1);
    if (gpus > 0) return unifab::bench::runEp(args, argv[0]);
    printf("# no CUDA device: demo of the net plugin over loopback instead of expert-parallel dispatch\n");
    return unifab::bench::runNet(args);
  }
  if (command == "net") {
    unifab::bench::Args args = unifab::bench::makeArgs(argc, argv, 2);
    return unifab::bench::runNet(args);
  }
  if (command == "coll") {
    unifab::bench::Args args = unifab::bench::makeArgs(argc, argv, 2);
    return unifab::bench::runColl(args, argv[0]);
  }
  if (command == "tune-sweep") {
    unifab::bench::Args args = unifab::bench::makeArgs(argc, argv, 2);
    return unifab::bench::runTuneSweep(args, argv[0]);
  }
  if (command == "engram") {
    unifab::bench::Args args = unifab::bench::makeArgs(argc, argv, 2);
    return unifab::bench::runEngram(args, argv[0]);
  }
  if (command == "copy-routes") {
    unifab::bench::Args args = unifab::bench::makeArgs(argc, argv, 2);
    return unifab::bench::runCopyRoutes(args);
  }
  if (command == "memrates") {
    unifab::bench::Args args = unifab::bench::makeArgs(argc, argv, 2);
    return unifab::bench::runMemRates(args);
  }
  if (command == "pp") {
    unifab::bench::Args args = unifab::bench::makeArgs(argc, argv, 2);
    return unifab::bench::runPp(args, argv[0]);
  }
  if (command == "ep") {
    unifab::bench::Args args = unifab::bench::makeArgs(argc, argv, 2);
    return unifab::bench::runEp(args, argv[0]);
  }
  fprintf(stderr, "unifab-bench: unknown command '%s'\n", command.c_str());
  usage();
  return 2;
}
