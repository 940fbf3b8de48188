#include "tests/common/rank_launcher.h"

#include "tests/common/test_util.h"

#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <thread>

namespace unifab::test {
namespace {

std::string substituteRank(const std::string& value, int rank) {
  std::string out;
  for (size_t i = 0; i < value.size(); ++i) {
    if (value[i] == '%' && i + 1 < value.size() && value[i + 1] == 'r') {
      out += std::to_string(rank);
      ++i;
    } else {
      out.push_back(value[i]);
    }
  }
  return out;
}

void stopAll(std::vector<pid_t>& pids) {
  for (pid_t pid : pids) {
    if (pid > 0) kill(pid, SIGTERM);
  }
  double deadline = nowSeconds() + 5;
  for (pid_t& pid : pids) {
    while (pid > 0) {
      int status;
      pid_t done = waitpid(pid, &status, WNOHANG);
      if (done == pid || done < 0) {
        pid = -1;
        break;
      }
      if (nowSeconds() > deadline) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
        pid = -1;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
}

// UNIFAB_RANK_CPUS: a comma-separated list of CPUs or CPU ranges ("3" or "0-7"); rank r runs on
// the list's r-th item (cycled). Processes of two tools timed against each other then run on the
// same CPUs, rank by rank; a range leaves a rank's own threads (NCCL's proxy, the CUDA runtime's)
// room beside its main thread.
struct CpuRange {
  int first, last;
};

bool rankCpus(std::vector<CpuRange>* cpus) {
  cpus->clear();
  const char* text = getenv("UNIFAB_RANK_CPUS");
  if (text == nullptr || *text == '\0') return true;
  for (const std::string& item : commaItems(text)) {
    char* end = nullptr;
    const long first = strtol(item.c_str(), &end, 10);
    long last = first;
    bool ok = !item.empty() && end != item.c_str();
    if (ok && *end == '-') {
      const char* second = end + 1;
      last = strtol(second, &end, 10);
      ok = end != second;
    }
    if (!ok || *end != '\0' || first < 0 || last < first || last >= CPU_SETSIZE) {
      fprintf(stderr, "UNIFAB_RANK_CPUS='%s': '%s' is not a CPU number or range (A-B, A <= B) in 0..%d\n", text,
              item.c_str(), CPU_SETSIZE - 1);
      return false;
    }
    cpus->push_back({static_cast<int>(first), static_cast<int>(last)});
  }
  return true;
}

}  // namespace

int launchRanks(const LaunchOptions& options, const std::vector<std::string>& argv) {
  std::vector<CpuRange> cpus;
  if (!rankCpus(&cpus)) return 2;
  char dirTemplate[] = "/tmp/unifab-ranks-XXXXXX";
  if (mkdtemp(dirTemplate) == nullptr) {
    perror("mkdtemp");
    return 1;
  }
  std::string uidFile = std::string(dirTemplate) + "/unique-id";
  std::vector<pid_t> pids(static_cast<size_t>(options.nRanks), -1);
  for (int rank = 0; rank < options.nRanks; ++rank) {
    pid_t pid = fork();
    if (pid < 0) {
      perror("fork");
      stopAll(pids);
      return 1;
    }
    if (pid == 0) {
      setenv("UNIFAB_RANK", std::to_string(rank).c_str(), 1);
      setenv("UNIFAB_NRANKS", std::to_string(options.nRanks).c_str(), 1);
      setenv("UNIFAB_LOCAL_RANK", std::to_string(rank).c_str(), 1);
      setenv("UNIFAB_UID_FILE", uidFile.c_str(), 1);
      for (const std::string& assignment : options.environment) {
        size_t eq = assignment.find('=');
        if (eq == std::string::npos) continue;
        setenv(assignment.substr(0, eq).c_str(), substituteRank(assignment.substr(eq + 1), rank).c_str(), 1);
      }
      if (!cpus.empty()) {
        cpu_set_t set;
        CPU_ZERO(&set);
        const CpuRange range = cpus[static_cast<size_t>(rank) % cpus.size()];
        for (int cpu = range.first; cpu <= range.last; ++cpu) CPU_SET(cpu, &set);
        if (sched_setaffinity(0, sizeof(set), &set) != 0) {
          fprintf(stderr, "rank %d: cannot run on CPUs %d-%d (UNIFAB_RANK_CPUS): %s\n", rank, range.first, range.last,
                  strerror(errno));
          _exit(126);
        }
      }
      std::vector<char*> args;
      for (const std::string& arg : argv) args.push_back(const_cast<char*>(arg.c_str()));
      args.push_back(nullptr);
      execvp(args[0], args.data());
      fprintf(stderr, "rank %d: cannot run %s: %s\n", rank, args[0], strerror(errno));
      _exit(127);
    }
    pids[static_cast<size_t>(rank)] = pid;
  }
  int firstFailure = 0;
  int running = options.nRanks;
  double deadline = nowSeconds() + options.timeoutSeconds;
  while (running > 0) {
    int status = 0;
    pid_t done = waitpid(-1, &status, WNOHANG);
    if (done > 0) {
      for (size_t rank = 0; rank < pids.size(); ++rank) {
        if (pids[rank] != done) continue;
        pids[rank] = -1;
        --running;
        int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        if (code != 0 && firstFailure == 0) {
          fprintf(stderr, "rank %zu failed with %s %d; stopping the other ranks\n", rank,
                  WIFEXITED(status) ? "exit code" : "signal", WIFEXITED(status) ? code : WTERMSIG(status));
          firstFailure = code;
          stopAll(pids);
          running = 0;
        }
      }
      continue;
    }
    if (nowSeconds() > deadline) {
      fprintf(stderr, "ranks still running after %.0f s; stopping them\n", options.timeoutSeconds);
      stopAll(pids);
      firstFailure = 124;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  unlink(uidFile.c_str());
  rmdir(dirTemplate);
  return firstFailure;
}

RankEnvironment rankEnvironment() {
  RankEnvironment env;
  const char* rank = getenv("UNIFAB_RANK");
  const char* nRanks = getenv("UNIFAB_NRANKS");
  const char* uid = getenv("UNIFAB_UID_FILE");
  if (rank == nullptr || nRanks == nullptr || uid == nullptr) return env;
  env.rank = atoi(rank);
  env.nRanks = atoi(nRanks);
  const char* local = getenv("UNIFAB_LOCAL_RANK");
  env.localRank = local != nullptr ? atoi(local) : env.rank;
  env.uidFile = uid;
  env.launched = true;
  return env;
}

bool shareBlob(const RankEnvironment& env, void* data, size_t bytes, double timeoutSeconds) {
  if (env.rank == 0) {
    std::string temporary = env.uidFile + ".tmp";
    FILE* file = fopen(temporary.c_str(), "wb");
    if (file == nullptr) return false;
    bool ok = fwrite(data, 1, bytes, file) == bytes;
    ok = (fclose(file) == 0) && ok;
    return ok && rename(temporary.c_str(), env.uidFile.c_str()) == 0;
  }
  double deadline = nowSeconds() + timeoutSeconds;
  while (nowSeconds() < deadline) {
    FILE* file = fopen(env.uidFile.c_str(), "rb");
    if (file != nullptr) {
      size_t got = fread(data, 1, bytes, file);
      fclose(file);
      if (got == bytes) return true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

}  // namespace unifab::test
