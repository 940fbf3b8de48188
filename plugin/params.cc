#include "plugin/params.h"

#include <strings.h>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "plugin/log.h"

namespace unifab {
namespace {

struct ParamEntry {
  ParamInfo info;
  int64_t min;
  int64_t max;
  const char* choices;  // comma-separated, for kChoice
  // Stores the parsed value of this parameter into `params`.
  void (*apply)(Params& params, int64_t integer, double real, const std::string& text);
  bool zeroMeansOff = false;  // 0 is accepted below `min` (documented as "0 or min..max")
  double realMin = 0;         // kFloat: the least value besides 0 with zeroMeansOff (`min` is an integer)
};

constexpr int64_t kKiB = 1024;
constexpr int64_t kGiB = 1024 * 1024 * 1024;

const std::vector<ParamEntry>& entries() {
  static const std::vector<ParamEntry> table = {
      {{"UNIFAB_NET_TRANSPORT", ParamType::kChoice, "socket", "socket",
        "Transport behind the ncclNet table"},
       0, 0, "socket",
       [](Params& p, int64_t, double, const std::string& s) { p.netTransport = s; }},
      {{"UNIFAB_NET_DISABLE", ParamType::kBool, "0", "0 or 1",
        "Report no network devices, so NCCL uses its internal transports; the tuner stays active"},
       0, 1, nullptr, [](Params& p, int64_t v, double, const std::string&) { p.netDisable = v != 0; }},
      {{"UNIFAB_SOCKET_IFNAME", ParamType::kString, "", "NCCL_SOCKET_IFNAME syntax",
        "Interfaces to use: comma-separated name prefixes, '^' excludes, '=' matches exactly; "
        "empty selects every up interface except loopback and docker, or loopback if none"},
       0, 0, nullptr, [](Params& p, int64_t, double, const std::string& s) { p.socketIfname = s; }},
      {{"UNIFAB_SOCKET_FAMILY", ParamType::kChoice, "any", "any, ipv4, ipv6",
        "Address family of the interfaces used"},
       0, 0, "any,ipv4,ipv6",
       [](Params& p, int64_t, double, const std::string& s) {
         p.socketFamily = s == "ipv4" ? SocketFamily::kIpv4 : s == "ipv6" ? SocketFamily::kIpv6 : SocketFamily::kAny;
       }},
      {{"UNIFAB_SOCKET_NSTREAMS", ParamType::kInt, "4", "1..16",
        "TCP streams per connection; large messages are striped over them"},
       1, 16, nullptr, [](Params& p, int64_t v, double, const std::string&) { p.socketNStreams = static_cast<int>(v); }},
      {{"UNIFAB_SOCKET_NTHREADS", ParamType::kInt, "0", "0..16",
        "Progress threads per process driving all socket streams (epoll); 0 (auto) is a quarter of "
        "the cores, 1 to 8"},
       0, 16, nullptr, [](Params& p, int64_t v, double, const std::string&) { p.socketNThreads = static_cast<int>(v); }},
      {{"UNIFAB_SOCKET_BUSY_POLL_US", ParamType::kInt, "-1", "-1..1000000",
        "How long progress threads keep polling after traffic before sleeping; -1 (auto) is 100 us "
        "when the machine has at least 4 cores per progress thread of the job, else 0"},
       -1, 1000000, nullptr,
       [](Params& p, int64_t v, double, const std::string&) { p.socketBusyPollUs = static_cast<int>(v); }},
      {{"UNIFAB_SOCKET_CHUNK_BYTES", ParamType::kSize, "128K", "4K..64M",
        "Smallest piece of a message sent on one stream; smaller messages use one stream"},
       4 * kKiB, 64 * kKiB * kKiB, nullptr,
       [](Params& p, int64_t v, double, const std::string&) { p.socketChunkBytes = v; }},
      {{"UNIFAB_SOCKET_INLINE_BYTES", ParamType::kSize, "64K", "0 or 1K..1M",
        "Payloads up to this size are moved by the thread that posts or tests the request (NCCL's "
        "proxy) instead of a progress thread; 0 disables this"},
       1024, 1 << 20, nullptr, [](Params& p, int64_t v, double, const std::string&) { p.socketInlineBytes = v; },
       true},
      {{"UNIFAB_SOCKET_MAX_RECVS", ParamType::kInt, "8", "1..8",
        "Buffers one grouped receive may carry (reported to NCCL as maxRecvs)"},
       1, 8, nullptr, [](Params& p, int64_t v, double, const std::string&) { p.socketMaxRecvs = static_cast<int>(v); }},
      {{"UNIFAB_SOCKET_SPEED_MBPS", ParamType::kInt, "0", "0..10000000",
        "Port speed reported to NCCL in Mbit/s; 0 reads it from sysfs (10000 if unknown)"},
       0, 10000000, nullptr,
       [](Params& p, int64_t v, double, const std::string&) { p.socketSpeedMbps = static_cast<int>(v); }},
      {{"UNIFAB_SOCKET_BUFFER_BYTES", ParamType::kSize, "0", "0 or 4K..1G",
        "SO_SNDBUF/SO_RCVBUF of each stream; 0 keeps the kernel's autotuning"},
       4 * kKiB, kGiB, nullptr, [](Params& p, int64_t v, double, const std::string&) { p.socketBufferBytes = v; },
       true},
      {{"UNIFAB_SOCKET_TIMEOUT_S", ParamType::kInt, "120", "0..86400",
        "Seconds a stream may go unacknowledged (data in flight, or keepalive probes while idle) before "
        "its connection fails with an error; 0 keeps the kernel's TCP defaults, under which a peer host "
        "that vanishes without closing its sockets leaves requests pending for hours"},
       0, 86400, nullptr, [](Params& p, int64_t v, double, const std::string&) { p.socketTimeoutS = static_cast<int>(v); }},
      {{"UNIFAB_TUNER_ENABLE", ParamType::kBool, "1", "0 or 1",
        "0 leaves every NCCL cost table untouched"},
       0, 1, nullptr, [](Params& p, int64_t v, double, const std::string&) { p.tunerEnable = v != 0; }},
      {{"UNIFAB_TUNER_CONFIG", ParamType::kString, "", "path",
        "Rule file whose matching lines override the cost model (format in README)"},
       0, 0, nullptr, [](Params& p, int64_t, double, const std::string& s) { p.tunerConfig = s; }},
      // A bandwidth near zero would make every estimate overflow and tie: 0.01 GB/s is the floor.
      {{"UNIFAB_TUNER_NVLINK_GBPS", ParamType::kFloat, "0", "0 or 0.01..100000",
        "Per-GPU NVLink bandwidth per direction in GB/s for the cost model; 0 detects it (NVML)"},
       0, 100000, nullptr, [](Params& p, int64_t, double v, const std::string&) { p.tunerNvlinkGbps = v; }, true,
       0.01},
      {{"UNIFAB_TUNER_NET_GBPS", ParamType::kFloat, "0", "0 or 0.01..100000",
        "Per-rank network bandwidth in GB/s for the cost model; 0 uses the net plugin's speed"},
       0, 100000, nullptr, [](Params& p, int64_t, double v, const std::string&) { p.tunerNetGbps = v; }, true,
       0.01},
      {{"UNIFAB_EP_TIMEOUT_MS", ParamType::kInt, "30000", "1..86400000",
        "How long a GPU waits for a peer's signal in an expert-parallel call before it reports a timeout"},
       1, 86400000, nullptr, [](Params& p, int64_t v, double, const std::string&) { p.epTimeoutMs = v; }},
      {{"UNIFAB_PP_TIMEOUT_MS", ParamType::kInt, "30000", "1..86400000",
        "How long a pipeline send or receive may wait on its peer, once its stream reaches the wait, "
        "before the group's watchdog releases it and reports a timeout"},
       1, 86400000, nullptr, [](Params& p, int64_t v, double, const std::string&) { p.ppTimeoutMs = v; }},
      {{"UNIFAB_PP_ENGINE", ParamType::kChoice, "rendezvous", "rendezvous, slots",
        "Pipeline send/recv engine between two ranks: rendezvous (one copy-engine copy between the two "
        "buffers, no SM; at least one of the two must be mappable by CUDA IPC) or slots (chunks through the "
        "receiver's window, which it copies out with a same-GPU copy that this driver runs on SMs). A rank's "
        "transfers to itself always take the slots"},
       0, 0, "slots,rendezvous", [](Params& p, int64_t, double, const std::string& s) { p.ppEngine = s; }},
      {{"UNIFAB_PP_TRACE", ParamType::kBool, "0", "0 or 1",
        "Time each step of every pipeline send and receive on the host and log, when the group is "
        "destroyed (NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=P2P), the mean per call of each step by side and by "
        "how the call went: where a short transfer's time goes"},
       0, 1, nullptr, [](Params& p, int64_t v, double, const std::string&) { p.ppTrace = v != 0; }},
      {{"UNIFAB_EP_VALIDATE", ParamType::kBool, "0", "0 or 1",
        "Check expert ids on the host before every dispatch (synchronises the stream); otherwise the "
        "GPU checks them and reports a bad id through the group's error"},
       0, 1, nullptr, [](Params& p, int64_t v, double, const std::string&) { p.epValidateOnHost = v != 0; }},
      {{"UNIFAB_EP_TRACE", ParamType::kBool, "0", "0 or 1",
        "Record when each phase of every EP call ends on the GPU (global timer) and log the averages "
        "when the group is destroyed (NCCL_DEBUG=INFO)"},
       0, 1, nullptr, [](Params& p, int64_t v, double, const std::string&) { p.epTrace = v != 0; }},
      {{"UNIFAB_EP_COMBINE_SENDERS", ParamType::kInt, "0", "0..1024",
        "Blocks of a high-throughput combine that push partial sums to peers (the others reduce); 0 "
        "takes the tuner's split. At least one block of each kind remains"},
       0, 1024, nullptr, [](Params& p, int64_t v, double, const std::string&) { p.epCombineSenders = v; }},
      {{"UNIFAB_EP_DISPATCH_SENDERS", ParamType::kInt, "0", "0..1024",
        "Blocks of a high-throughput dispatch that write rows into peers (the others write this rank's "
        "own rows); 0 takes the tuner's split. At least one block of each kind remains"},
       0, 1024, nullptr, [](Params& p, int64_t v, double, const std::string&) { p.epDispatchSenders = v; }},
      {{"UNIFAB_EP_TEST_STALL_US", ParamType::kInt, "0", "0..1000000",
        "Tests only: the upper half of every high-throughput dispatch's blocks wait this many microseconds "
        "after writing their count words, as blocks that start late would"},
       0, 1000000, nullptr, [](Params& p, int64_t v, double, const std::string&) { p.epTestStallUs = v; }},
  };
  return table;
}

bool choiceAllowed(const char* choices, const std::string& value) {
  const char* cursor = choices;
  while (*cursor != '\0') {
    size_t len = strcspn(cursor, ",");
    if (len == value.size() && strncasecmp(cursor, value.c_str(), len) == 0) return true;
    cursor += len;
    if (*cursor == ',') ++cursor;
  }
  return false;
}

// Parses `text` for `entry` into (integer, real, string); false if malformed or out of bounds.
bool parseValue(const ParamEntry& entry, const char* text, int64_t* integer, double* real, std::string* str) {
  switch (entry.info.type) {
    case ParamType::kInt:
      return parseInt64(text, entry.min, entry.max, integer);
    case ParamType::kSize:
      if (entry.zeroMeansOff && parseSize(text, 0, 0, integer)) return true;
      return parseSize(text, entry.min, entry.max, integer);
    case ParamType::kBool: {
      bool value = false;
      if (!parseBool(text, &value)) return false;
      *integer = value ? 1 : 0;
      return true;
    }
    case ParamType::kFloat:
      if (entry.zeroMeansOff && parseDouble(text, 0, 0, real)) return true;
      return parseDouble(text, entry.zeroMeansOff ? entry.realMin : static_cast<double>(entry.min),
                         static_cast<double>(entry.max), real);
    case ParamType::kString:
      *str = text;
      return true;
    case ParamType::kChoice: {
      std::string lowered(text);
      for (char& c : lowered) c = static_cast<char>(tolower(static_cast<unsigned char>(c)));
      if (!choiceAllowed(entry.choices, lowered)) return false;
      *str = lowered;
      return true;
    }
  }
  return false;
}

}  // namespace

bool parseInt64(const char* text, int64_t min, int64_t max, int64_t* out) {
  if (text == nullptr || *text == '\0') return false;
  errno = 0;
  char* end = nullptr;
  // Decimal, or hexadecimal with 0x; never octal: "0120" is 120, not 80.
  const char* digits = text;
  while (*digits == ' ' || *digits == '\t') ++digits;
  const bool hex = digits[0] == '0' && (digits[1] == 'x' || digits[1] == 'X');
  long long value = strtoll(text, &end, hex ? 16 : 10);
  if (errno != 0 || end == text) return false;
  while (*end == ' ' || *end == '\t') ++end;
  if (*end != '\0' || value < min || value > max) return false;
  *out = value;
  return true;
}

bool parseSize(const char* text, int64_t min, int64_t max, int64_t* out) {
  if (text == nullptr || *text == '\0' || *text == '-') return false;
  errno = 0;
  char* end = nullptr;
  unsigned long long value = strtoull(text, &end, 10);
  if (errno != 0 || end == text) return false;
  unsigned long long scale = 1;
  switch (*end) {
    case 'k':
    case 'K':
      scale = 1ULL << 10;
      ++end;
      break;
    case 'm':
    case 'M':
      scale = 1ULL << 20;
      ++end;
      break;
    case 'g':
    case 'G':
      scale = 1ULL << 30;
      ++end;
      break;
    default:
      break;
  }
  if (*end == 'i' && scale != 1) ++end;  // accept KiB-style spellings
  if (*end == 'B' || *end == 'b') ++end;
  if (*end != '\0') return false;
  if (value > static_cast<unsigned long long>(INT64_MAX) / scale) return false;
  int64_t bytes = static_cast<int64_t>(value * scale);
  if (bytes < min || bytes > max) return false;
  *out = bytes;
  return true;
}

bool parseBool(const char* text, bool* out) {
  if (text == nullptr) return false;
  static const char* const kTrue[] = {"1", "true", "yes", "on"};
  static const char* const kFalse[] = {"0", "false", "no", "off"};
  for (const char* word : kTrue) {
    if (strcasecmp(text, word) == 0) {
      *out = true;
      return true;
    }
  }
  for (const char* word : kFalse) {
    if (strcasecmp(text, word) == 0) {
      *out = false;
      return true;
    }
  }
  return false;
}

bool parseDouble(const char* text, double min, double max, double* out) {
  if (text == nullptr || *text == '\0') return false;
  errno = 0;
  char* end = nullptr;
  double value = strtod(text, &end);
  if (errno != 0 || end == text || *end != '\0' || !std::isfinite(value)) return false;
  if (value < min || value > max) return false;
  *out = value;
  return true;
}

Params parseParams(const EnvLookup& lookup) {
  Params result{};
  for (const ParamEntry& entry : entries()) {
    int64_t integer = 0;
    double real = 0;
    std::string text;
    const char* value = lookup(entry.info.name);
    bool fromEnv = value != nullptr;
    // Parameters are reported under the module that reads them.
    LogComponent component = strncmp(entry.info.name, "UNIFAB_TUNER", 12) == 0 ? LogComponent::kTuner
                             : strncmp(entry.info.name, "UNIFAB_EP", 9) == 0    ? LogComponent::kExt
                                                                                : LogComponent::kNet;
    if (fromEnv && !parseValue(entry, value, &integer, &real, &text)) {
      logMessage(LogLevel::kWarn, component, 0, __FILE__, __LINE__,
                 "ignoring %s=\"%s\": expected %s; using the default %s", entry.info.name, value,
                 entry.info.bounds, entry.info.defaultValue[0] != '\0' ? entry.info.defaultValue : "(empty)");
      fromEnv = false;
    }
    if (!fromEnv && !parseValue(entry, entry.info.defaultValue, &integer, &real, &text)) {
      UF_WARN(kNet, "internal: default of %s does not parse", entry.info.name);
    }
    if (fromEnv) {
      logMessage(LogLevel::kInfo, component, kLogEnv, __FILE__, __LINE__, "%s set by environment to %s",
                 entry.info.name, value);
    }
    entry.apply(result, integer, real, text);
  }
  return result;
}

const Params& params() {
  static const Params values = parseParams([](const char* name) -> const char* { return getenv(name); });
  return values;
}

const std::vector<ParamInfo>& paramTable() {
  static const std::vector<ParamInfo> infos = [] {
    std::vector<ParamInfo> list;
    for (const ParamEntry& entry : entries()) list.push_back(entry.info);
    return list;
  }();
  return infos;
}

}  // namespace unifab
