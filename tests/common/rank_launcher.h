// Starts one process per rank, as users start NCCL programs without MPI: every child gets
// UNIFAB_RANK, UNIFAB_NRANKS, UNIFAB_LOCAL_RANK and UNIFAB_UID_FILE (a fresh file through which
// rank 0 hands out the ncclUniqueId). If a rank fails or the deadline passes, the others are
// stopped, so a broken rank never leaves its peers hanging in NCCL. UNIFAB_RANK_CPUS (CPUs or CPU
// ranges A-B, comma-separated) pins rank r to the list's r-th item (cycled).
#pragma once

#include <string>
#include <vector>

namespace unifab::test {

struct LaunchOptions {
  int nRanks = 2;
  double timeoutSeconds = 600;
  // NAME=VALUE pairs set in every child; "%r" in VALUE becomes the rank.
  std::vector<std::string> environment;
};

// Runs `argv` nRanks times; returns 0 when every rank exits 0, else the first failure's code.
int launchRanks(const LaunchOptions& options, const std::vector<std::string>& argv);

struct RankEnvironment {
  int rank = 0;
  int nRanks = 1;
  int localRank = 0;
  std::string uidFile;
  bool launched = false;  // false when the process was not started by launchRanks
};

RankEnvironment rankEnvironment();

// Rank 0 writes `bytes` of `data` to `path` atomically; other ranks wait for the file (bounded).
bool shareBlob(const RankEnvironment& env, void* data, size_t bytes, double timeoutSeconds = 120);

}  // namespace unifab::test
