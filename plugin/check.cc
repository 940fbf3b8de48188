#include "plugin/check.h"

#include <cstdarg>
#include <cstdio>

namespace unifab {

Result fail(Result code, LogComponent component, const char* file, int line, const char* fmt, ...) {
  char message[1024];
  va_list args;
  va_start(args, fmt);
  vsnprintf(message, sizeof(message), fmt, args);
  va_end(args);
  logMessage(LogLevel::kWarn, component, 0, file, line, "%s (%s)", message, resultName(code));
  setLastErrorMessage(message);
  return code;
}

const char* resultName(Result result) {
  switch (result) {
    case unifabSuccess:
      return "success";
    case unifabUnhandledCudaError:
      return "unhandled CUDA error";
    case unifabSystemError:
      return "system error";
    case unifabInternalError:
      return "internal error";
    case unifabInvalidArgument:
      return "invalid argument";
    case unifabInvalidUsage:
      return "invalid usage";
    case unifabRemoteError:
      return "remote error";
    case unifabInProgress:
      return "in progress";
    case unifabTimeout:
      return "timeout";
    case unifabNumResults:
      break;
  }
  return "unknown result code";
}

}  // namespace unifab
