// Network interface discovery and selection for the socket transport.
#pragma once

#include <sys/socket.h>

#include <string>
#include <vector>

#include "plugin/params.h"

namespace unifab::net::socket {

struct NetInterface {
  std::string name;
  sockaddr_storage address{};
  socklen_t addressLength = 0;
  std::string pciPath;  // /sys/devices/... of the PCI function, empty when there is none
  int speedMbps = 0;    // from sysfs; 0 when unknown
};

// True if interface `name` is selected by `spec` in NCCL_SOCKET_IFNAME syntax: a comma-separated
// list of name prefixes; a leading '^' turns it into an exclusion list; a leading '=' (after any
// '^') requires exact names. An empty spec selects nothing (callers apply the default policy).
bool interfaceMatches(const std::string& spec, const std::string& name);

// The up interfaces selected by `spec` (empty: every interface except loopback and docker*, or
// loopback when nothing else is up), one address each, IPv4 preferred, at most `maxCount`.
std::vector<NetInterface> findInterfaces(const std::string& spec, SocketFamily family, int maxCount);

// "address:port" (IPv6 in brackets), for logs and errors.
std::string formatAddress(const sockaddr* address);

// Trims a sysfs device path to its last PCI function (dddd:bb:dd.f) component, "" if none.
std::string pciFunctionPath(const std::string& sysfsPath);

}  // namespace unifab::net::socket
