#include "plugin/log.h"

#include <strings.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace unifab {
namespace {

std::atomic<NcclLogFunction> g_ncclLogger{nullptr};

const char* componentPrefix(LogComponent component) {
  switch (component) {
    case LogComponent::kNet:
      return "NET/unifab";
    case LogComponent::kTuner:
      return "TUNER/unifab";
    case LogComponent::kExt:
      return "EXT/unifab";
  }
  return "unifab";
}

unsigned long componentFlags(LogComponent component) {
  switch (component) {
    case LogComponent::kNet:
      return kLogNet;
    case LogComponent::kTuner:
      return kLogTuning;
    case LogComponent::kExt:
      return kLogColl;
  }
  return kLogInit;
}

// The fallback reads NCCL's own variables so that users see one consistent behaviour whether
// or not NCCL has handed us its logger yet.
struct FallbackFilter {
  int level = static_cast<int>(LogLevel::kWarn);
  unsigned long subsysMask = kLogInit | kLogEnv | kLogBootstrap;  // NCCL's default
};

unsigned long subsysBit(const char* name, size_t len) {
  static const struct {
    const char* name;
    unsigned long bit;
  } kNames[] = {{"INIT", kLogInit},   {"COLL", kLogColl},   {"P2P", kLogP2p},         {"SHM", kLogShm},
                {"NET", kLogNet},     {"GRAPH", kLogGraph}, {"TUNING", kLogTuning},   {"ENV", kLogEnv},
                {"ALLOC", kLogAlloc}, {"CALL", kLogCall},   {"PROXY", kLogProxy},     {"NVLS", kLogNvls},
                {"BOOTSTRAP", kLogBootstrap}, {"REG", kLogReg}, {"ALL", kLogAll}};
  for (const auto& entry : kNames) {
    if (strlen(entry.name) == len && strncasecmp(entry.name, name, len) == 0) return entry.bit;
  }
  return 0;
}

FallbackFilter readFallbackFilter() {
  FallbackFilter filter;
  const char* level = getenv("NCCL_DEBUG");
  if (level == nullptr || strcasecmp(level, "WARN") == 0 || strcasecmp(level, "VERSION") == 0) {
    filter.level = static_cast<int>(LogLevel::kWarn);
  } else if (strcasecmp(level, "INFO") == 0) {
    filter.level = static_cast<int>(LogLevel::kInfo);
  } else if (strcasecmp(level, "TRACE") == 0) {
    filter.level = static_cast<int>(LogLevel::kTrace);
  } else if (strcasecmp(level, "NONE") == 0) {
    filter.level = 0;
  }
  const char* subsys = getenv("NCCL_DEBUG_SUBSYS");
  if (subsys != nullptr && *subsys != '\0') {
    bool invert = subsys[0] == '^';
    if (invert) ++subsys;
    unsigned long mask = 0;
    while (*subsys != '\0') {
      size_t len = strcspn(subsys, ",");
      mask |= subsysBit(subsys, len);
      subsys += len;
      if (*subsys == ',') ++subsys;
    }
    filter.subsysMask = invert ? ~mask : mask;
  }
  return filter;
}

const FallbackFilter& fallbackFilter() {
  static const FallbackFilter filter = readFallbackFilter();
  return filter;
}

void fallbackLog(LogLevel level, unsigned long flags, const char* file, int line, const char* text) {
  const FallbackFilter& filter = fallbackFilter();
  if (static_cast<int>(level) > filter.level) return;
  if (level != LogLevel::kWarn && (flags & filter.subsysMask) == 0) return;
  char host[64] = "?";
  gethostname(host, sizeof(host) - 1);
  const char* levelName = level == LogLevel::kWarn ? "WARN" : level == LogLevel::kInfo ? "INFO" : "TRACE";
  char buffer[2048];
  int n = snprintf(buffer, sizeof(buffer), "%s:%d:%ld unifab %s %s\n", host, static_cast<int>(getpid()),
                   static_cast<long>(syscall(SYS_gettid)), levelName, text);
  if (n <= 0) return;
  size_t length = static_cast<size_t>(n) < sizeof(buffer) ? static_cast<size_t>(n) : sizeof(buffer) - 1;
  if (level == LogLevel::kTrace) {
    // TRACE lines carry their origin as NCCL's do.
    char traced[2300];
    int m = snprintf(traced, sizeof(traced), "%s:%d %s", file, line, buffer);
    if (m > 0) fwrite(traced, 1, strnlen(traced, sizeof(traced)), stderr);
    return;
  }
  // One write per line keeps lines from concurrent threads whole.
  fwrite(buffer, 1, length, stderr);
}

// A plain array: a thread_local with a destructor would keep the library mapped after NCCL's
// dlclose until the thread exits.
thread_local char t_lastError[1024];

}  // namespace

void logSetNcclLogger(NcclLogFunction fn) { g_ncclLogger.store(fn, std::memory_order_release); }

void logMessage(LogLevel level, LogComponent component, unsigned long extraFlags, const char* file,
                int line, const char* fmt, ...) {
  char text[1536];
  int prefixLen = snprintf(text, sizeof(text), "%s ", componentPrefix(component));
  if (prefixLen < 0) prefixLen = 0;
  va_list args;
  va_start(args, fmt);
  vsnprintf(text + prefixLen, sizeof(text) - static_cast<size_t>(prefixLen), fmt, args);
  va_end(args);

  unsigned long flags = level == LogLevel::kWarn ? ~0UL : (componentFlags(component) | extraFlags);
  NcclLogFunction nccl = g_ncclLogger.load(std::memory_order_acquire);
  if (nccl != nullptr) {
    nccl(static_cast<int>(level), flags, file, line, "%s", text);
  } else {
    fallbackLog(level, flags, file, line, text);
  }
}

void setLastErrorMessage(const char* message) {
  snprintf(t_lastError, sizeof(t_lastError), "%s", message != nullptr ? message : "");
}

const char* lastErrorMessage() { return t_lastError; }

}  // namespace unifab
