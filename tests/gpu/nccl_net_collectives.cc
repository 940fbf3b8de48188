// NCCL's own collectives crossing unifab's net plugin (run under unifab-launch, one process per
// GPU, with NET forced: NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_NET=unifab). For every
// collective and size from 8 B to 256 MiB (x2 steps), two rounds with fresh inputs and poisoned
// outputs are checked bit-exactly on the GPU; with --graph instead a few sizes are captured in a
// CUDA graph each and replayed, once or three times back to back per round. With --expect-plugin the rank then reads its NCCL
// debug file and requires the lines that show NCCL loaded and used unifab's net and tuner.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "tests/common/nccl_session.h"

using namespace unifab::test;

namespace {

struct Options {
  size_t minBytes = 8;
  size_t maxBytes = size_t{256} << 20;
  bool expectPlugin = false;
  int rounds = 2;
  bool graph = false;  // instead of the eager sweep: a few sizes captured in CUDA graphs, replayed
  std::string only;  // one collective, e.g. for NCCL_ALGO=Tree which only all_reduce has
};

bool parse(int argc, char** argv, Options* options) {
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--expect-plugin") {
      options->expectPlugin = true;
    } else if (arg == "--max-bytes" && i + 1 < argc) {
      options->maxBytes = strtoull(argv[++i], nullptr, 0);
    } else if (arg == "--graph") {
      options->graph = true;
    } else if (arg == "--rounds" && i + 1 < argc) {
      options->rounds = atoi(argv[++i]);
    } else if (arg == "--only" && i + 1 < argc) {
      options->only = argv[++i];
      Collective named;
      if (!collectiveByName(options->only.c_str(), &named)) {
        fprintf(stderr, "--only %s: not a collective (all_reduce, all_gather, reduce_scatter, alltoall, broadcast)\n",
                options->only.c_str());
        return false;
      }
    } else {
      fprintf(stderr, "usage: %s [--expect-plugin] [--max-bytes N] [--rounds N] [--only COLLECTIVE] [--graph]\n",
              argv[0]);
      return false;
    }
  }
  return true;
}

// Rounds of the collective on fresh inputs and a poisoned output, each checked; with `captured`
// the call is captured once into a CUDA graph and each round replays it (NCCL's proxy then drives
// unifab's net from a graph, as in training loops that capture their steps).
bool checkOne(NcclSession& session, Collective collective, size_t bytes, int rounds, bool captured, float* send,
              float* recv, unsigned long long* deviceMismatches, int* passed, int* failed) {
  size_t sendCount = 0;
  size_t recvCount = 0;
  if (!bufferCounts(collective, bytes, session.nRanks(), &sendCount, &recvCount)) return true;
  GraphExec graph;
  // An eager call first, as frameworks warm up before they capture: NCCL connects a size's
  // channels and protocols on first use.
  if (captured && (!session.run(collective, send, recv, sendCount, recvCount) ||
                   !session.captureRuns(collective, send, recv, sendCount, recvCount, 1, &graph))) {
    return false;
  }
  for (int round = 0; round < rounds; ++round) {
    uint32_t seed = static_cast<uint32_t>(bytes * 31 + round * 7 + static_cast<size_t>(collective) + (captured ? 5 : 0));
    TEST_CUDA_CHECK(fillInput(send, sendCount, session.rank(), seed, session.stream()));
    TEST_CUDA_CHECK(poisonBuffer(recv, recvCount * sizeof(float), session.stream()));
    TEST_CUDA_CHECK(cudaMemsetAsync(deviceMismatches, 0, sizeof(unsigned long long), session.stream()));
    // Odd rounds queue three replays back to back, as the sweep's samples and training loops do:
    // out of place, each writes the same result.
    const int launches = captured && round % 2 == 1 ? 3 : 1;
    for (int launch = 0; launch < launches; ++launch) {
      if (captured ? !graph.launch(session.stream()) : !session.run(collective, send, recv, sendCount, recvCount)) {
        return false;
      }
    }
    TEST_CUDA_CHECK(countMismatches(collective, recv, recvCount, session.rank(), session.nRanks(), seed,
                                    deviceMismatches, session.stream()));
    unsigned long long mismatches = 0;
    TEST_CUDA_CHECK(cudaMemcpyAsync(&mismatches, deviceMismatches, sizeof(mismatches), cudaMemcpyDeviceToHost,
                                    session.stream()));
    TEST_CUDA_CHECK(cudaStreamSynchronize(session.stream()));
    if (mismatches != 0) {
      printf("rank %d: FAIL %s %zu B round %d%s: %llu of %zu elements wrong\n", session.rank(),
             collectiveName(collective), bytes, round, captured ? " (graph replay)" : "", mismatches, recvCount);
      ++*failed;
    } else {
      ++*passed;
    }
  }
  return true;
}

bool logShowsPlugin(int rank, int* passed, int* failed) {
  std::string path = ncclDebugFilePath();
  std::ifstream file(path);
  if (!file) {
    printf("rank %d: FAIL cannot read NCCL_DEBUG_FILE %s\n", rank, path.c_str());
    ++*failed;
    return true;
  }
  std::stringstream text;
  text << file.rdbuf();
  const char* required[] = {"NET/Plugin: Loaded net plugin unifab", "Using network unifab",
                            "TUNER/Plugin: Using unifab", "NET/unifab", "TUNER/unifab", "via NET/unifab"};
  for (const char* line : required) {
    if (text.str().find(line) == std::string::npos) {
      printf("rank %d: FAIL the NCCL log %s lacks \"%s\"\n", rank, path.c_str(), line);
      ++*failed;
    } else {
      ++*passed;
    }
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  if (!parse(argc, argv, &options)) return 2;
  RankEnvironment env = rankEnvironment();
  if (!env.launched) {
    fprintf(stderr, "run under unifab-launch (one process per rank)\n");
    return 2;
  }
  int passed = 0;
  int failed = 0;
  {
    NcclSession session;
    if (!session.init(env)) return session.skipped() ? kSkipExitCode : 1;
    float* send = nullptr;
    float* recv = nullptr;
    unsigned long long* mismatches = nullptr;
    size_t maxElements = options.maxBytes / sizeof(float) + 1;
    if (cudaMalloc(&send, maxElements * sizeof(float)) != cudaSuccess ||
        cudaMalloc(&recv, maxElements * sizeof(float)) != cudaSuccess ||
        cudaMalloc(&mismatches, sizeof(unsigned long long)) != cudaSuccess) {
      fprintf(stderr, "rank %d: cudaMalloc of %zu bytes failed\n", env.rank, options.maxBytes);
      return 1;
    }
    for (int c = 0; c < static_cast<int>(Collective::kCount); ++c) {
      if (!options.only.empty() && options.only != collectiveName(static_cast<Collective>(c))) continue;
      if (options.graph) {
        // One call of LL size, one of Simple size and the odd one, each captured once and replayed.
        for (size_t bytes : {size_t{4096}, size_t{1} << 20, size_t{3 * 1000 * 1000 + 12}}) {
          if (bytes > options.maxBytes) continue;
          if (!checkOne(session, static_cast<Collective>(c), bytes, options.rounds, true, send, recv, mismatches,
                        &passed, &failed)) {
            return 1;
          }
        }
        continue;
      }
      for (size_t bytes = options.minBytes; bytes <= options.maxBytes; bytes *= 2) {
        if (!checkOne(session, static_cast<Collective>(c), bytes, options.rounds, false, send, recv, mismatches,
                      &passed, &failed)) {
          return 1;
        }
      }
      // An odd size: a count that divides into no power of two.
      if (!checkOne(session, static_cast<Collective>(c), 3 * 1000 * 1000 + 12, 1, false, send, recv, mismatches,
                    &passed, &failed)) {
        return 1;
      }
    }
    cudaFree(send);
    cudaFree(recv);
    cudaFree(mismatches);
  }
  // The communicator is destroyed: NCCL has written everything it logs about it.
  if (options.expectPlugin) logShowsPlugin(env.rank, &passed, &failed);
  printf("rank %d: %d passed, %d failed\n", env.rank, passed, failed);
  return failed == 0 && passed > 0 ? 0 : 1;
}
