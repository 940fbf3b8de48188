// Logger bridge: every message unifab emits goes through NCCL's logger, so NCCL_DEBUG,
// NCCL_DEBUG_SUBSYS and NCCL_DEBUG_FILE govern it like NCCL's own output. NCCL hands us its
// logger in the net and tuner init calls; before that (an application calling an extension op
// with no plugin loaded, or a unit test) a fallback honours the same variables on stderr.
#pragma once

namespace unifab {

enum class LogLevel : int { kWarn = 2, kInfo = 3, kTrace = 5 };

// Who speaks: selects the message prefix and the default NCCL subsystem bits.
enum class LogComponent : int { kNet, kTuner, kExt };

// NCCL's subsystem bits (ncclDebugLogSubSys): flags on INFO/TRACE, and the names
// NCCL_DEBUG_SUBSYS is parsed against while NCCL's logger is not there yet.
enum LogSubsys : unsigned long {
  kLogInit = 1,
  kLogColl = 2,
  kLogP2p = 4,
  kLogShm = 8,
  kLogNet = 16,
  kLogGraph = 32,
  kLogTuning = 64,
  kLogEnv = 128,
  kLogAlloc = 256,
  kLogCall = 512,
  kLogProxy = 1024,
  kLogNvls = 2048,
  kLogBootstrap = 4096,
  kLogReg = 8192,
  kLogAll = ~0UL,
};

// Same shape as ncclDebugLogger_t (the level enum is passed as int).
using NcclLogFunction = void (*)(int level, unsigned long flags, const char* file, int line,
                                 const char* fmt, ...);

// Install NCCL's logger. Each NCCL init passes the same function; a later different non-null
// pointer replaces the earlier one (a reloaded libnccl). Passing nullptr restores the fallback.
void logSetNcclLogger(NcclLogFunction fn);

void logMessage(LogLevel level, LogComponent component, unsigned long extraFlags, const char* file,
                int line, const char* fmt, ...) __attribute__((format(__printf__, 6, 7)));

// The calling thread's last failure message, for unifabGetLastError().
void setLastErrorMessage(const char* message);
const char* lastErrorMessage();

}  // namespace unifab

#define UF_WARN(component, fmt, ...)                                                          \
  ::unifab::logMessage(::unifab::LogLevel::kWarn, ::unifab::LogComponent::component, 0,      \
                       __FILE__, __LINE__, fmt, ##__VA_ARGS__)
#define UF_INFO(component, flags, fmt, ...)                                                   \
  ::unifab::logMessage(::unifab::LogLevel::kInfo, ::unifab::LogComponent::component, flags,  \
                       __FILE__, __LINE__, fmt, ##__VA_ARGS__)
#ifdef UNIFAB_ENABLE_TRACE
#define UF_TRACE(component, flags, fmt, ...)                                                  \
  ::unifab::logMessage(::unifab::LogLevel::kTrace, ::unifab::LogComponent::component, flags, \
                       __FILE__, __LINE__, fmt, ##__VA_ARGS__)
#else
#define UF_TRACE(component, flags, fmt, ...) \
  do {                                       \
  } while (0)
#endif
