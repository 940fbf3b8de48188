#include "tests/net/net_harness.h"

#include <dlfcn.h>

#include <chrono>
#include <climits>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

namespace unifab::test {
namespace {

std::mutex g_logMutex;
std::vector<std::string> g_warnings;

unsigned char patternByte(uint64_t seed, size_t offset) {
  return static_cast<unsigned char>(mix64(seed * 0x100000001b3ULL + (offset >> 3)) >> (8 * (offset & 7)));
}

}  // namespace

NetPlugin::~NetPlugin() { unload(); }

bool NetPlugin::load(const std::string& path, std::string* error) {
  unload();
  library_ = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (library_ == nullptr) {
    *error = dlerror();
    return false;
  }
  table_ = static_cast<const ncclNet_v11_t*>(dlsym(library_, "ncclNetPlugin_v11"));
  if (table_ == nullptr) {
    *error = "ncclNetPlugin_v11 not exported by " + path;
    unload();
    return false;
  }
  return true;
}

void NetPlugin::unload() {
#if defined(__SANITIZE_THREAD__)
  // ThreadSanitizer's atexit interceptor keeps the handler nvcc's fatbin registration installs
  // with atexit(), even once dlclose unmapped it, and calls it at exit (a SEGV after every test
  // passed). Under TSan the library stays loaded; the other builds unload it as NCCL does.
  const bool unloadable = false;
#else
  const bool unloadable = true;
#endif
  if (library_ != nullptr && unloadable) dlclose(library_);
  library_ = nullptr;
  table_ = nullptr;
}

void captureLogger(ncclDebugLogLevel level, unsigned long flags, const char* file, int line, const char* fmt, ...) {
  char text[2048];
  va_list args;
  va_start(args, fmt);
  vsnprintf(text, sizeof(text), fmt, args);
  va_end(args);
  std::lock_guard<std::mutex> lock(g_logMutex);
  if (level == NCCL_LOG_WARN) g_warnings.emplace_back(text);
  if (getenv("UNIFAB_TEST_VERBOSE") != nullptr) {
    fprintf(stderr, "[plugin %s] %s\n", level == NCCL_LOG_WARN ? "WARN" : level == NCCL_LOG_INFO ? "INFO" : "TRACE",
            text);
  }
}

std::vector<std::string> capturedWarnings() {
  std::lock_guard<std::mutex> lock(g_logMutex);
  return g_warnings;
}

void clearCapturedWarnings() {
  std::lock_guard<std::mutex> lock(g_logMutex);
  g_warnings.clear();
}

ncclResult_t connectPair(const ncclNet_v11_t* net, void* sendCtx, void* recvCtx, int dev, void** sendComm,
                         void** recvComm, double timeoutSeconds) {
  char handle[NCCL_NET_HANDLE_MAXSIZE] = {};
  void* listenComm = nullptr;
  ncclResult_t result = net->listen(recvCtx, dev, handle, &listenComm);
  if (result != ncclSuccess) return result;
  *sendComm = nullptr;
  *recvComm = nullptr;
  double deadline = nowSeconds() + timeoutSeconds;
  while ((*sendComm == nullptr || *recvComm == nullptr) && result == ncclSuccess) {
    if (*sendComm == nullptr) result = net->connect(sendCtx, dev, handle, sendComm, nullptr);
    if (result == ncclSuccess && *recvComm == nullptr) result = net->accept(listenComm, recvComm, nullptr);
    if (nowSeconds() > deadline) result = ncclSystemError;
  }
  net->closeListen(listenComm);
  return result;
}

ncclResult_t acceptOne(const ncclNet_v11_t* net, void* listenComm, void** recvComm, double timeoutSeconds) {
  *recvComm = nullptr;
  double deadline = nowSeconds() + timeoutSeconds;
  ncclResult_t result = ncclSuccess;
  while (*recvComm == nullptr && result == ncclSuccess) {
    result = net->accept(listenComm, recvComm, nullptr);
    if (*recvComm == nullptr) {
      if (nowSeconds() > deadline) return ncclSystemError;
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
  return result;
}

ncclResult_t connectOne(const ncclNet_v11_t* net, void* ctx, int dev, void* handle, void** sendComm,
                        double timeoutSeconds) {
  *sendComm = nullptr;
  double deadline = nowSeconds() + timeoutSeconds;
  ncclResult_t result = ncclSuccess;
  while (*sendComm == nullptr && result == ncclSuccess) {
    result = net->connect(ctx, dev, handle, sendComm, nullptr);
    if (*sendComm == nullptr) {
      if (nowSeconds() > deadline) return ncclSystemError;
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
  return result;
}

WaitOutcome waitRequest(const ncclNet_v11_t* net, void* request, int* sizes, double timeoutSeconds,
                        ncclResult_t* result) {
  double deadline = nowSeconds() + timeoutSeconds;
  for (;;) {
    int done = 0;
    ncclResult_t status = net->test(request, &done, sizes);
    if (result != nullptr) *result = status;
    if (status != ncclSuccess) return WaitOutcome::kError;
    if (done) return WaitOutcome::kDone;
    if (nowSeconds() > deadline) return WaitOutcome::kTimeout;
  }
}

void fillPattern(void* buffer, size_t bytes, uint64_t seed) {
  auto* out = static_cast<unsigned char*>(buffer);
  size_t words = bytes / 8;
  for (size_t w = 0; w < words; ++w) {
    uint64_t value = mix64(seed * 0x100000001b3ULL + w);
    memcpy(out + 8 * w, &value, 8);
  }
  for (size_t i = words * 8; i < bytes; ++i) out[i] = patternByte(seed, i);
}

size_t firstMismatch(const void* buffer, size_t bytes, uint64_t seed) {
  const auto* in = static_cast<const unsigned char*>(buffer);
  size_t words = bytes / 8;
  for (size_t w = 0; w < words; ++w) {
    uint64_t expected = mix64(seed * 0x100000001b3ULL + w);
    if (memcmp(in + 8 * w, &expected, 8) != 0) {
      for (size_t i = 8 * w;; ++i) {
        if (in[i] != patternByte(seed, i)) return i;
      }
    }
  }
  for (size_t i = words * 8; i < bytes; ++i) {
    if (in[i] != patternByte(seed, i)) return i;
  }
  return SIZE_MAX;
}

size_t firstNotEqual(const void* buffer, size_t bytes, unsigned char value) {
  const auto* in = static_cast<const unsigned char*>(buffer);
  for (size_t i = 0; i < bytes; ++i) {
    if (in[i] != value) return i;
  }
  return SIZE_MAX;
}

std::string toHex(const void* data, size_t bytes) {
  static const char kDigits[] = "0123456789abcdef";
  std::string text;
  const auto* in = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < bytes; ++i) {
    text.push_back(kDigits[in[i] >> 4]);
    text.push_back(kDigits[in[i] & 15]);
  }
  return text;
}

bool fromHex(const std::string& text, void* data, size_t bytes) {
  if (text.size() != 2 * bytes) return false;
  auto* out = static_cast<unsigned char*>(data);
  for (size_t i = 0; i < bytes; ++i) {
    unsigned value = 0;
    if (sscanf(text.c_str() + 2 * i, "%2x", &value) != 1) return false;
    out[i] = static_cast<unsigned char>(value);
  }
  return true;
}

}  // namespace unifab::test
