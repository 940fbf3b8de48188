// EP groups refused by the environment, on every rank, before anything is launched, with a
// message that says why (both modes):
//   --nccl-mismatch   the process runs an NCCL other than the one unifab was built against (the
//                     ctest entry puts another libnccl.so.2 first on LD_LIBRARY_PATH); exits 77
//                     (skipped) when the NCCL found is the build's own version.
//   --no-lsa          the ranks do not share an NVLink domain (the ctest entry gives each rank its
//                     own NCCL_HOSTID, so NCCL sees separate nodes): NCCL refuses the device
//                     communicator ("GIN not supported"), and the second group on the same
//                     communicator must be refused at once, without entering NCCL again.
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

constexpr int kSkipped = 77;

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

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode != "--nccl-mismatch" && mode != "--no-lsa") {
    fprintf(stderr, "usage: %s --nccl-mismatch | --no-lsa\n", argv[0]);
    return 2;
  }
  setvbuf(stdout, nullptr, _IOLBF, 0);  // every line survives a launcher timeout
  RankEnvironment env = rankEnvironment();
  tally().rank = env.rank;
  int runtime = 0;
  if (ncclGetVersion(&runtime) != ncclSuccess) return 1;
  if (mode == "--nccl-mismatch" && runtime == NCCL_VERSION_CODE) {
    printf("rank %d: the NCCL found is %d, the build's own: nothing to refuse (skipped)\n", env.rank, runtime);
    return kSkipped;
  }
  NcclSession& session = *new NcclSession();  // never destroyed: see _exit below
  if (!session.init(env)) return 1;
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
