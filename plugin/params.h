// The UNIFAB_* parameter table: every environment variable unifab reads, with its type, default
// and bounds, parsed once per process (per load of the library). A malformed or out-of-range
// value produces a WARN naming the variable and its bounds, and the default is used instead.
// unifab never sets NCCL's own variables.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace unifab {

enum class SocketFamily : int { kAny = 0, kIpv4 = 4, kIpv6 = 6 };

struct Params {
  // net/
  std::string netTransport;      // UNIFAB_NET_TRANSPORT
  bool netDisable;               // UNIFAB_NET_DISABLE
  std::string socketIfname;      // UNIFAB_SOCKET_IFNAME
  SocketFamily socketFamily;     // UNIFAB_SOCKET_FAMILY
  int socketNStreams;            // UNIFAB_SOCKET_NSTREAMS
  int socketNThreads;            // UNIFAB_SOCKET_NTHREADS (0: decided by the transport)
  int socketBusyPollUs;          // UNIFAB_SOCKET_BUSY_POLL_US (-1: decided by the transport)
  int64_t socketChunkBytes;      // UNIFAB_SOCKET_CHUNK_BYTES
  int64_t socketInlineBytes;     // UNIFAB_SOCKET_INLINE_BYTES
  int socketMaxRecvs;            // UNIFAB_SOCKET_MAX_RECVS
  int socketSpeedMbps;           // UNIFAB_SOCKET_SPEED_MBPS (0: read from sysfs)
  int64_t socketBufferBytes;     // UNIFAB_SOCKET_BUFFER_BYTES (0: kernel default)
  int socketTimeoutS;            // UNIFAB_SOCKET_TIMEOUT_S (0: the kernel's TCP defaults)
  // tuner/
  bool tunerEnable;              // UNIFAB_TUNER_ENABLE
  std::string tunerConfig;       // UNIFAB_TUNER_CONFIG
  double tunerNvlinkGbps;        // UNIFAB_TUNER_NVLINK_GBPS (0: detect)
  double tunerNetGbps;           // UNIFAB_TUNER_NET_GBPS (0: from the net plugin's speed)
  // collectives/
  int64_t epTimeoutMs;           // UNIFAB_EP_TIMEOUT_MS
  int64_t ppTimeoutMs;           // UNIFAB_PP_TIMEOUT_MS
  std::string ppEngine;          // UNIFAB_PP_ENGINE: slots or rendezvous
  bool ppTrace;                  // UNIFAB_PP_TRACE
  bool epValidateOnHost;         // UNIFAB_EP_VALIDATE
  bool epTrace;                  // UNIFAB_EP_TRACE
  int64_t epCombineSenders;      // UNIFAB_EP_COMBINE_SENDERS: 0 = the tuner's split
  int64_t epDispatchSenders;     // UNIFAB_EP_DISPATCH_SENDERS: 0 = the tuner's split
  int64_t epTestStallUs;         // UNIFAB_EP_TEST_STALL_US: tests only
};

enum class ParamType { kInt, kSize, kBool, kString, kChoice, kFloat };

// Description of one parameter, for the README table check (unit.params) and warnings.
struct ParamInfo {
  const char* name;
  ParamType type;
  const char* defaultValue;
  const char* bounds;  // human-readable range or choices
  const char* help;
};

using EnvLookup = std::function<const char*(const char* name)>;

// Parses every parameter from `lookup` (getenv in production); WARNs about bad values.
Params parseParams(const EnvLookup& lookup);

// The process-wide values, parsed from the environment on first use.
const Params& params();

const std::vector<ParamInfo>& paramTable();

// Parsers of parameter values (the rule-file reader uses parseInt64 and parseSize too); false on
// malformed or out-of-range text.
bool parseInt64(const char* text, int64_t min, int64_t max, int64_t* out);
bool parseSize(const char* text, int64_t min, int64_t max, int64_t* out);  // K/M/G suffixes
bool parseBool(const char* text, bool* out);
bool parseDouble(const char* text, double min, double max, double* out);

}  // namespace unifab
