#include "tests/bench/bench_common.h"

#include <dirent.h>
#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <sstream>

#include <cuda_runtime_api.h>

#include "tests/common/rank_launcher.h"
#include "tests/common/test_util.h"
#include "unifab/unifab.h"

namespace unifab::bench {

Args makeArgs(int argc, char** argv, int first) {
  Args args;
  for (int i = first; i < argc; ++i) args.items.emplace_back(argv[i]);
  args.used.assign(args.items.size(), false);
  return args;
}

std::string Args::value(const std::string& name, const std::string& fallback) {
  for (size_t i = 0; i + 1 < items.size(); ++i) {
    if (items[i] == name) {
      used[i] = used[i + 1] = true;
      return items[i + 1];
    }
  }
  return fallback;
}

bool Args::flag(const std::string& name) {
  for (size_t i = 0; i < items.size(); ++i) {
    if (items[i] == name) {
      used[i] = true;
      return true;
    }
  }
  return false;
}

std::vector<std::string> Args::leftovers() const {
  std::vector<std::string> rest;
  for (size_t i = 0; i < items.size(); ++i) {
    if (!used[i]) rest.push_back(items[i]);
  }
  return rest;
}

size_t parseBytes(const std::string& text) {
  char* end = nullptr;
  double value = strtod(text.c_str(), &end);
  switch (end != nullptr ? *end : '\0') {
    case 'K':
    case 'k':
      value *= 1024;
      break;
    case 'M':
    case 'm':
      value *= 1024 * 1024;
      break;
    case 'G':
    case 'g':
      value *= 1024.0 * 1024 * 1024;
      break;
    default:
      break;
  }
  return static_cast<size_t>(value);
}

namespace {
int backToBack = 20;
}  // namespace

int backToBackCalls() { return backToBack; }

bool parseBackToBack(Args& args, const char* command) {
  const std::string text = args.value("--b2b", "20");
  char* end = nullptr;
  const long value = strtol(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || value < 1 || value > 100000) {
    fprintf(stderr, "unifab-bench %s: --b2b is the calls per back-to-back run, 1..100000 (got '%s')\n", command,
            text.c_str());
    return false;
  }
  backToBack = static_cast<int>(value);
  return true;
}

bool opSelected(const std::string& ops, const char* op) {
  if (ops.empty()) return true;
  return ("," + ops + ",").find("," + std::string(op) + ",") != std::string::npos;
}

bool listWithin(const std::string& list, const char* allowed, const char* command, const char* option) {
  for (const std::string& item : test::commaItems(list)) {
    if (item.empty() || !opSelected(allowed, item.c_str())) {
      fprintf(stderr, "unifab-bench %s: %s is a list of %s (got '%s')\n", command, option, allowed, item.c_str());
      return false;
    }
  }
  return true;
}

std::string formatBytes(size_t bytes) {
  char text[32];
  if (bytes >= (size_t{1} << 30) && bytes % (size_t{1} << 30) == 0) {
    snprintf(text, sizeof(text), "%zuG", bytes >> 30);
  } else if (bytes >= (size_t{1} << 20) && bytes % (size_t{1} << 20) == 0) {
    snprintf(text, sizeof(text), "%zuM", bytes >> 20);
  } else if (bytes >= 1024 && bytes % 1024 == 0) {
    snprintf(text, sizeof(text), "%zuK", bytes >> 10);
  } else {
    snprintf(text, sizeof(text), "%zu", bytes);
  }
  return text;
}

double median(std::vector<double> values) { return percentile(std::move(values), 0.5); }

double percentile(std::vector<double> values, double fraction) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  size_t index = static_cast<size_t>(fraction * static_cast<double>(values.size() - 1) + 0.5);
  return values[std::min(index, values.size() - 1)];
}

std::string unifabLibraryPath() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&unifabGetVersion), &info) == 0 || info.dli_fname == nullptr) return "";
  return info.dli_fname;
}

int relaunchPerGpu(const char* self, const char* command, const Args& args, int nRanks,
                   const std::vector<std::string>& environment) {
  if (nRanks <= 0 && (cudaGetDeviceCount(&nRanks) != cudaSuccess || nRanks < 1)) {
    fprintf(stderr, "unifab-bench %s: no CUDA device\n", command);
    return 1;
  }
  test::LaunchOptions launch;
  launch.nRanks = nRanks;
  const char* nvls = getenv("NCCL_NVLS_ENABLE");
  launch.environment.push_back(std::string("NCCL_NVLS_ENABLE=") + (nvls != nullptr ? nvls : "0"));
  // All ranks run on this machine: NCCL's bootstrap and both socket transports stay on loopback.
  for (const char* variable : {"NCCL_SOCKET_IFNAME", "UNIFAB_SOCKET_IFNAME"}) {
    if (getenv(variable) == nullptr) launch.environment.push_back(std::string(variable) + "=lo");
  }
  launch.environment.insert(launch.environment.end(), environment.begin(), environment.end());
  std::vector<std::string> argv = {self, command};
  argv.insert(argv.end(), args.items.begin(), args.items.end());
  return test::launchRanks(launch, argv);
}

namespace {
volatile uint64_t hostReferenceSink = 0;
}  // namespace

double hostReferenceUs() {
  std::vector<double> samples;
  for (int run = 0; run < 5; ++run) {
    const auto start = std::chrono::steady_clock::now();
    uint64_t x = 0x9E3779B97F4A7C15ULL + static_cast<uint64_t>(run);
    for (int i = 0; i < (1 << 20); ++i) x = x * 6364136223846793005ULL + (x >> 29);
    hostReferenceSink = x;  // keeps the chain from being optimised away
    samples.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count());
  }
  return median(samples);
}

void printThreadCpu(const char* who) {
  DIR* tasks = opendir("/proc/self/task");
  if (tasks == nullptr) return;
  const double tick = 1000.0 / static_cast<double>(sysconf(_SC_CLK_TCK));
  while (const dirent* entry = readdir(tasks)) {
    if (entry->d_name[0] == '.') continue;
    const std::string dir = std::string("/proc/self/task/") + entry->d_name;
    std::ifstream statFile(dir + "/stat");
    std::string stat((std::istreambuf_iterator<char>(statFile)), std::istreambuf_iterator<char>());
    const size_t open = stat.find('('), close = stat.rfind(')');
    if (open == std::string::npos || close == std::string::npos) continue;
    // Fields after the name, from the state (field 3): utime is field 14, stime 15, processor 39.
    std::istringstream rest(stat.substr(close + 2));
    std::vector<std::string> fields{std::istream_iterator<std::string>(rest), std::istream_iterator<std::string>()};
    if (fields.size() < 37) continue;
    const double cpuMs = (std::stod(fields[11]) + std::stod(fields[12])) * tick;
    long voluntary = 0, forced = 0;
    std::ifstream status(dir + "/status");
    for (std::string line; std::getline(status, line);) {
      if (line.rfind("voluntary_ctxt_switches:", 0) == 0) voluntary = std::atol(line.c_str() + 24);
      if (line.rfind("nonvoluntary_ctxt_switches:", 0) == 0) forced = std::atol(line.c_str() + 27);
    }
    printf("# %s thread %s %-16s cpu %9.0f ms, last on CPU %s, switches %ld voluntary %ld forced\n", who,
           entry->d_name, stat.substr(open + 1, close - open - 1).c_str(), cpuMs, fields[36].c_str(), voluntary,
           forced);
  }
  closedir(tasks);
}

}  // namespace unifab::bench
