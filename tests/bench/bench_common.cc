#include "tests/bench/bench_common.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

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

}  // namespace unifab::bench
