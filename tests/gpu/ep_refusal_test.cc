// EP groups refused by the environment, on every rank, before anything is launched, with a
// message that says why (both modes):
//   --nccl-mismatch   the process runs an NCCL other than the one unifab was built against (the
//                     ctest entry puts another libnccl.so.2 first on LD_LIBRARY_PATH); exits 77
//                     (skipped) when the NCCL found is the build's own version.
//   --no-lsa          the ranks do not share an NVLink domain (the ctest entry gives each rank its
//                     own NCCL_HOSTID, so NCCL sees separate nodes): NCCL refuses the device
//                     communicator ("GIN not supported"), and the second group on the same
//                     communicator must be refused at once, without entering NCCL again.
//   --mismatch        every rank is fine alone but the ranks disagree (EP hidden, PP chunkBytes,
//                     Engram rowBytes with the same window size), or one rank's configuration is
//                     invalid or NULL: every rank is refused (the field named, or "another rank refused"),
//                     none hangs, and the communicator still makes an agreed group afterwards.
// The process leaves with _exit after its tally: tearing down a communicator that NCCL refused
// is not what is under test.
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <string>

#include <nccl.h>

#include "tests/common/check_tally.h"
#include "tests/common/ep_device.h"
#include "tests/common/nccl_session.h"
#include "unifab/unifab.h"

using namespace unifab::test;

namespace {

// unifabEpCreate in `mode` fails with `expected` and a message containing `mentions`, and leaves
// no group behind.
void expectRefused(NcclSession& session, unifabEpMode_t mode, unifabResult_t expected, const char* mentions,
                   const std::string& what) {
  const ep::Shape shape = ep::makeShape(session.nRanks(), 16, 2048, 4, 64);
  unifabEpConfig_t config = ep::groupConfig(shape);
  config.mode = mode;
  unifabEpGroup_t group = nullptr;
  const unifabResult_t got = unifabEpCreate(session.comm(), &config, &group);
  const char* message = unifabGetLastError();
  check(got == expected, what + ": returns " + unifabGetErrorString(expected) + " (got " + unifabGetErrorString(got) + ")");
  check(message != nullptr && strstr(message, mentions) != nullptr,
        what + ": message names '" + mentions + "' (got '" + (message ? message : "") + "')");
  check(group == nullptr, what + ": no group is returned");
  if (group != nullptr) unifabEpDestroy(group);
}

// unifab's last error mentions `text`.
bool lastErrorMentions(const char* text) {
  const char* message = unifabGetLastError();
  return message != nullptr && strstr(message, text) != nullptr;
}

std::string got(unifabResult_t result) {
  const char* message = unifabGetLastError();
  return std::string(unifabGetErrorString(result)) + ": " + (message != nullptr ? message : "");
}

void checkMismatches(NcclSession& session) {
  const int rank = session.rank();
  const ep::Shape shape = ep::makeShape(session.nRanks(), 16, 2048, 4, 64);
  for (unifabEpMode_t m : {unifabEpHighThroughput, unifabEpLowLatency}) {
    const std::string what = m == unifabEpLowLatency ? "low-latency EP" : "high-throughput EP";
    unifabEpConfig_t config = ep::groupConfig(shape);
    config.mode = m;
    unifabEpGroup_t group = nullptr;
    // The ranks disagree on hidden: each is valid alone.
    unifabEpConfig_t differing = config;
    if (rank == 1) differing.hidden = 4096;
    unifabResult_t result = unifabEpCreate(session.comm(), &differing, &group);
    check(result == unifabInvalidUsage && lastErrorMentions("hidden") && group == nullptr,
          what + ", ranks disagree on hidden: refused naming it (" + got(result) + ")");
    // Rank 1's own configuration is invalid: it says why, the others that it refused.
    unifabEpConfig_t invalid = config;
    if (rank == 1) invalid.topk = 0;
    result = unifabEpCreate(session.comm(), &invalid, &group);
    const bool refusedRight = rank == 1 ? result == unifabInvalidArgument && lastErrorMentions("topk")
                                        : result == unifabInvalidUsage && lastErrorMentions("another rank refused");
    check(refusedRight && group == nullptr, what + ", rank 1's top-k invalid: every rank refused (" + got(result) + ")");
    // Rank 1 passes no configuration at all: it still takes part in the agreement, so that rank 0
    // is refused rather than left waiting in NCCL.
    result = unifabEpCreate(session.comm(), rank == 1 ? nullptr : &config, &group);
    const bool refusedNull = rank == 1 ? result == unifabInvalidArgument && lastErrorMentions("config=")
                                       : result == unifabInvalidUsage && lastErrorMentions("another rank refused");
    check(refusedNull && group == nullptr, what + ", rank 1's config NULL: every rank refused (" + got(result) + ")");
    // Agreed again: the communicator works and the group is made.
    result = unifabEpCreate(session.comm(), &config, &group);
    check(result == unifabSuccess && group != nullptr, what + ", agreed afterwards: created (" + got(result) + ")");
    if (group != nullptr) check(unifabEpDestroy(group) == unifabSuccess, what + ": destroyed");
  }
  unifabPpConfig_t pp = UNIFAB_PP_CONFIG_INIT;
  pp.chunkBytes = rank == 1 ? (2 << 20) : (1 << 20);
  unifabPpGroup_t ppGroup = nullptr;
  unifabResult_t result = unifabPpCreate(session.comm(), &pp, &ppGroup);
  check(result == unifabInvalidUsage && lastErrorMentions("chunkBytes") && ppGroup == nullptr,
        "PP, ranks disagree on chunkBytes: refused naming it (" + got(result) + ")");
  result = unifabPpCreate(session.comm(), &pp, rank == 1 ? nullptr : &ppGroup);
  check(rank == 1 ? result == unifabInvalidArgument && lastErrorMentions("group=")
                  : result == unifabInvalidUsage && lastErrorMentions("another rank refused"),
        "PP, rank 1's group pointer NULL: every rank refused (" + got(result) + ")");
  // Engram windows of the same size from different shapes would pass every other check.
  unifabEngramConfig_t engram = UNIFAB_ENGRAM_CONFIG_INIT;
  engram.rowBytes = rank == 1 ? 128 : 64;
  engram.rowsPerRank = rank == 1 ? 500 : 1000;
  unifabEngramTable_t table = nullptr;
  result = unifabEngramCreate(session.comm(), &engram, &table);
  check(result == unifabInvalidUsage && lastErrorMentions("rowBytes") && table == nullptr,
        "Engram, 64 x 1000 against 128 x 500: refused naming rowBytes (" + got(result) + ")");
  result = unifabEngramCreate(session.comm(), rank == 1 ? nullptr : &engram, &table);
  check(rank == 1 ? result == unifabInvalidArgument && lastErrorMentions("config=")
                  : result == unifabInvalidUsage && lastErrorMentions("another rank refused"),
        "Engram, rank 1's config NULL: every rank refused (" + got(result) + ")");
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode != "--nccl-mismatch" && mode != "--no-lsa" && mode != "--mismatch") {
    fprintf(stderr, "usage: %s --nccl-mismatch | --no-lsa | --mismatch\n", argv[0]);
    return 2;
  }
  setvbuf(stdout, nullptr, _IOLBF, 0);  // every line survives a launcher timeout
  RankEnvironment env = rankEnvironment();
  tally().rank = env.rank;
  int runtime = 0;
  if (ncclGetVersion(&runtime) != ncclSuccess) return 1;
  if (mode == "--nccl-mismatch" && runtime == NCCL_VERSION_CODE) {
    printf("rank %d: the NCCL found is %d, the build's own: nothing to refuse (skipped)\n", env.rank, runtime);
    return kSkipExitCode;
  }
  NcclSession& session = *new NcclSession();  // never destroyed: see _exit below
  if (!session.init(env)) return session.skipped() ? kSkipExitCode : 1;
  if (mode == "--mismatch") {
    checkMismatches(session);
    const int status = finishChecks();
    fflush(stdout);
    _exit(status);
  }
  for (unifabEpMode_t m : {unifabEpHighThroughput, unifabEpLowLatency}) {
    const std::string what = std::string(m == unifabEpLowLatency ? "low-latency" : "high-throughput") + " group, " +
                             (mode == "--no-lsa" ? "ranks on separate nodes" : "NCCL " + std::to_string(runtime));
    if (mode == "--nccl-mismatch") {
      expectRefused(session, m, unifabInvalidUsage, "differs from the headers", what);
    } else {
      expectRefused(session, m, unifabInvalidUsage, "NVLink", what);
    }
  }
  const int status = finishChecks();
  fflush(stdout);
  _exit(status);
}
