// Helpers for the C entry points of the library (NCCL's tables and the unifab* API): C++
// exceptions never cross them, and unifab's results map onto NCCL's.
#pragma once

#include <exception>
#include <new>

#include "plugin/check.h"
#include "unifab/nccl/common.h"

namespace unifab {

// Runs `body`, which returns a Result; an escaping exception becomes an error with a message.
template <typename Body>
Result guarded(LogComponent component, const char* entryPoint, Body&& body) noexcept {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    return fail(unifabSystemError, component, __FILE__, __LINE__, "%s: out of host memory", entryPoint);
  } catch (const std::exception& error) {
    return fail(unifabInternalError, component, __FILE__, __LINE__, "%s: unexpected exception: %s", entryPoint,
                error.what());
  } catch (...) {
    return fail(unifabInternalError, component, __FILE__, __LINE__, "%s: unexpected exception", entryPoint);
  }
}

inline ncclResult_t toNccl(Result result) {
  static_assert(static_cast<int>(unifabRemoteError) == static_cast<int>(ncclRemoteError), "codes must agree");
  static_assert(static_cast<int>(unifabInProgress) == static_cast<int>(ncclInProgress), "codes must agree");
  if (result == unifabTimeout) return ncclRemoteError;  // NCCL has no timeout code: a stalled peer
  if (result < unifabSuccess || result > unifabInProgress) return ncclInternalError;
  return static_cast<ncclResult_t>(result);
}

}  // namespace unifab
