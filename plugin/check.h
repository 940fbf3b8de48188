// The one error-handling idiom of unifab: functions return unifabResult_t; a failure is created
// once, where it is detected, by UF_ERROR (which logs a WARN naming the argument and its bound and
// records the message for unifabGetLastError), and is passed up unchanged by UF_CHECK. RAII owns
// every resource, so an early return never leaks. No exceptions cross module boundaries.
#pragma once

#include <cerrno>
#include <cstring>

#include "plugin/log.h"
#include "unifab/unifab.h"

namespace unifab {

using Result = unifabResult_t;

// Logs `fmt` as a WARN of `component`, stores it as the thread's last error, returns `code`.
Result fail(Result code, LogComponent component, const char* file, int line, const char* fmt, ...)
    __attribute__((format(__printf__, 5, 6)));

const char* resultName(Result result);

}  // namespace unifab

// return UF_ERROR(unifabInvalidArgument, kNet, "n=%d exceeds maxRecvs=%d", n, kMaxRecvs);
#define UF_ERROR(code, component, fmt, ...) \
  ::unifab::fail(code, ::unifab::LogComponent::component, __FILE__, __LINE__, fmt, ##__VA_ARGS__)

// Propagates a failed Result unchanged (its message was logged where it was created).
#define UF_CHECK(expr)                         \
  do {                                         \
    ::unifab::Result uf_result_ = (expr);      \
    if (uf_result_ != unifabSuccess) return uf_result_; \
  } while (0)

// For POSIX calls that return -1 and set errno.
#define UF_SYSCHECK(call, component, what)                                                        \
  do {                                                                                          \
    if ((call) == -1) {                                                                         \
      int uf_errno_ = errno;                                                                    \
      return UF_ERROR(unifabSystemError, component, "%s failed: %s (errno %d)", what,            \
                      ::strerror(uf_errno_), uf_errno_);                                        \
    }                                                                                           \
  } while (0)
