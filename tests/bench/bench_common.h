// Shared pieces of unifab-bench's subcommands: argument parsing helpers and result tables.
#pragma once

#include <cstddef>
#include <cstdio>
#include <string>
#include <vector>

namespace unifab::bench {

struct Args {
  std::vector<std::string> items;
  // Value of "--name VALUE" (or default); marks the pair as consumed.
  std::string value(const std::string& name, const std::string& fallback);
  bool flag(const std::string& name);
  // Leftover arguments that no option consumed, for the usage check.
  std::vector<std::string> leftovers() const;
  std::vector<bool> used;
};

Args makeArgs(int argc, char** argv, int first);
size_t parseBytes(const std::string& text);  // 4096, 64K, 1M, 1G
std::string formatBytes(size_t bytes);

// Whether `op` is in the comma-separated `ops` of an --ops option (empty: every op).
bool opSelected(const std::string& ops, const char* op);
// Whether every item of the comma-separated `list` given to `command`'s `option` is one of
// `allowed` (comma-separated); if not, says so on stderr, naming the allowed ones.
bool listWithin(const std::string& list, const char* allowed, const char* command, const char* option);
// Calls per back-to-back run of the ep, pp and engram benchmarks (20 unless --b2b set it).
int backToBackCalls();
// Reads `--b2b N` (1..100000) into backToBackCalls(); false, with a message naming the option and
// its bounds, for anything else.
bool parseBackToBack(Args& args, const char* command);
double median(std::vector<double> values);
double percentile(std::vector<double> values, double fraction);

// One line per thread of this process on stdout, prefixed by `who`: its name, CPU time (user +
// system, ms), the CPU it last ran on, and its voluntary and forced context switches. Says which
// threads a host-bound benchmark competes with for its cores.
void printThreadCpu(const char* who);

// Microseconds this thread takes for a fixed chain of dependent integer operations (median of 5,
// ~1 ms each on an unloaded core): the host's own speed at that moment, next to host-bound
// results on virtual machines whose CPU time comes and goes.
double hostReferenceUs();

// Path of the loaded libnccl-unifab.so (for NCCL_NET_PLUGIN), "" if unknown.
std::string unifabLibraryPath();

// Runs `self command args...` once per rank (nRanks <= 0: one per visible GPU) under the rank
// launcher, with NVLS off unless the caller set NCCL_NVLS_ENABLE, NCCL's and unifab's sockets on
// loopback unless the caller chose interfaces, and `environment` (NAME=VALUE) on top.
int relaunchPerGpu(const char* self, const char* command, const Args& args, int nRanks,
                   const std::vector<std::string>& environment);

int runNet(Args& args);
int runColl(Args& args, const char* self);
int runEp(Args& args, const char* self);
int runPp(Args& args, const char* self);
int runEngram(Args& args, const char* self);
int runTuneSweep(Args& args, const char* self);
int runCopyRoutes(Args& args);
int runMemRates(Args& args);

}  // namespace unifab::bench
