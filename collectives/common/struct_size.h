// Every struct of the extension API starts with its size (versioned ABI): one older than this
// build's, or never initialised, is refused before any other field is read.
#pragma once

#include <cstddef>

#include "plugin/check.h"

namespace unifab::collectives {

// unifabInvalidArgument naming `name` (as the caller wrote it: "args", "config", "result") unless
// value.size covers this build's T; `remedy` says how to set it (the INIT macro to use).
template <typename T>
Result requireStructSize(const T& value, const char* name, const char* remedy) {
  if (value.size >= sizeof(T)) return unifabSuccess;
  return UF_ERROR(unifabInvalidArgument, kExt, "%s->size=%zu, expected %zu: %s", name, value.size, sizeof(T), remedy);
}

}  // namespace unifab::collectives
