// Drives libnccl-unifab's ncclNet table the way NCCL does, without NCCL: dlopen with NCCL's flags,
// non-blocking connect/accept loops, request polling with deadlines, and payload patterns that
// let every byte be checked. Shared by the net tests, their peer process and unifab-bench.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "tests/common/test_util.h"
#include "unifab/nccl/net_v11.h"

namespace unifab::test {

// The library under test, opened as NCCL opens plugins (RTLD_NOW | RTLD_LOCAL).
class NetPlugin {
 public:
  NetPlugin() = default;
  ~NetPlugin();
  NetPlugin(const NetPlugin&) = delete;
  NetPlugin& operator=(const NetPlugin&) = delete;

  bool load(const std::string& path, std::string* error);
  void unload();
  const ncclNet_v11_t* table() const { return table_; }

 private:
  void* library_ = nullptr;
  const ncclNet_v11_t* table_ = nullptr;
};

// Logger handed to the plugin: keeps WARN lines for assertions and echoes every line to stderr
// when UNIFAB_TEST_VERBOSE is set.
void captureLogger(ncclDebugLogLevel level, unsigned long flags, const char* file, int line, const char* fmt, ...);
std::vector<std::string> capturedWarnings();
void clearCapturedWarnings();

// Connects a send comm of `sendCtx` to a receive comm of `recvCtx` on device `dev`, calling
// connect and accept alternately from this thread, as NCCL's proxy would.
ncclResult_t connectPair(const ncclNet_v11_t* net, void* sendCtx, void* recvCtx, int dev, void** sendComm,
                         void** recvComm, double timeoutSeconds = 30.0);

// Accept side alone, for a connect happening in another process.
ncclResult_t acceptOne(const ncclNet_v11_t* net, void* listenComm, void** recvComm, double timeoutSeconds = 30.0);
// Connect side alone.
ncclResult_t connectOne(const ncclNet_v11_t* net, void* ctx, int dev, void* handle, void** sendComm,
                        double timeoutSeconds = 30.0);

enum class WaitOutcome { kDone, kError, kTimeout };
// Polls test() until the request completes, fails or the deadline passes.
WaitOutcome waitRequest(const ncclNet_v11_t* net, void* request, int* sizes, double timeoutSeconds = 30.0,
                        ncclResult_t* result = nullptr);

// Deterministic bytes for (seed, offset), so any process can check any message.
void fillPattern(void* buffer, size_t bytes, uint64_t seed);
// Index of the first byte that differs from the pattern, or SIZE_MAX.
size_t firstMismatch(const void* buffer, size_t bytes, uint64_t seed);
// Index of the first byte that is not `value`, or SIZE_MAX.
size_t firstNotEqual(const void* buffer, size_t bytes, unsigned char value);

std::string toHex(const void* data, size_t bytes);
bool fromHex(const std::string& text, void* data, size_t bytes);

}  // namespace unifab::test
