#include "net/socket/interfaces.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "plugin/log.h"

namespace unifab::net::socket {
namespace {

bool isPciFunction(const std::string& component) {
  // dddd:bb:dd.f in hex digits
  if (component.size() != 12) return false;
  for (size_t i = 0; i < component.size(); ++i) {
    char c = component[i];
    if (i == 4 || i == 7) {
      if (c != ':') return false;
    } else if (i == 10) {
      if (c != '.') return false;
    } else if (!isxdigit(static_cast<unsigned char>(c))) {
      return false;
    }
  }
  return true;
}

int readSpeedMbps(const std::string& ifname) {
  std::ifstream file("/sys/class/net/" + ifname + "/speed");
  long speed = 0;
  if (file && (file >> speed) && speed > 0 && speed < INT_MAX) return static_cast<int>(speed);
  return 0;
}

bool familyAllowed(int family, SocketFamily wanted) {
  if (family != AF_INET && family != AF_INET6) return false;
  if (wanted == SocketFamily::kIpv4) return family == AF_INET;
  if (wanted == SocketFamily::kIpv6) return family == AF_INET6;
  return true;
}

bool isLinkLocalV6(const sockaddr* address) {
  if (address->sa_family != AF_INET6) return false;
  const auto* in6 = reinterpret_cast<const sockaddr_in6*>(address);
  return IN6_IS_ADDR_LINKLOCAL(&in6->sin6_addr);
}

// Without UNIFAB_SOCKET_IFNAME: every up interface except loopback and docker bridges, as NCCL.
constexpr const char* kDefaultSpec = "^lo,docker";

std::vector<NetInterface> collect(const std::string& spec, SocketFamily family, int maxCount) {
  std::vector<NetInterface> result;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) {
    UF_WARN(kNet, "getifaddrs failed: %s; no network interface can be used", strerror(errno));
    return result;
  }
  // Two passes so that an interface's IPv4 address wins over its IPv6 one.
  for (int pass = 0; pass < 2; ++pass) {
    int wantedFamily = pass == 0 ? AF_INET : AF_INET6;
    for (ifaddrs* entry = list; entry != nullptr; entry = entry->ifa_next) {
      if (entry->ifa_addr == nullptr || (entry->ifa_flags & IFF_UP) == 0) continue;
      if (entry->ifa_addr->sa_family != wantedFamily || !familyAllowed(wantedFamily, family)) continue;
      if (isLinkLocalV6(entry->ifa_addr)) continue;
      std::string name = entry->ifa_name;
      if (!interfaceMatches(spec, name)) continue;
      bool seen = false;
      for (const NetInterface& known : result) seen = seen || known.name == name;
      if (seen || static_cast<int>(result.size()) >= maxCount) continue;
      NetInterface iface;
      iface.name = name;
      iface.addressLength = wantedFamily == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
      memcpy(&iface.address, entry->ifa_addr, iface.addressLength);
      char resolved[PATH_MAX];
      std::string devicePath = "/sys/class/net/" + name + "/device";
      if (realpath(devicePath.c_str(), resolved) != nullptr) iface.pciPath = pciFunctionPath(resolved);
      iface.speedMbps = readSpeedMbps(name);
      result.push_back(iface);
    }
  }
  freeifaddrs(list);
  return result;
}

}  // namespace

bool interfaceMatches(const std::string& spec, const std::string& name) {
  size_t pos = 0;
  bool exclude = false;
  bool exact = false;
  if (pos < spec.size() && spec[pos] == '^') {
    exclude = true;
    ++pos;
  }
  if (pos < spec.size() && spec[pos] == '=') {
    exact = true;
    ++pos;
  }
  bool listed = false;
  bool anyEntry = false;
  while (pos <= spec.size()) {
    size_t comma = spec.find(',', pos);
    if (comma == std::string::npos) comma = spec.size();
    std::string entry = spec.substr(pos, comma - pos);
    if (!entry.empty()) {
      anyEntry = true;
      bool hit = exact ? name == entry : name.compare(0, entry.size(), entry) == 0;
      listed = listed || hit;
    }
    pos = comma + 1;
  }
  if (!anyEntry) return false;
  return exclude ? !listed : listed;
}

std::vector<NetInterface> findInterfaces(const std::string& spec, SocketFamily family, int maxCount) {
  if (!spec.empty()) return collect(spec, family, maxCount);
  std::vector<NetInterface> found = collect(kDefaultSpec, family, maxCount);
  if (found.empty()) found = collect("lo", family, maxCount);
  return found;
}

std::string formatAddress(const sockaddr* address) {
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (address->sa_family == AF_INET) {
    const auto* in4 = reinterpret_cast<const sockaddr_in*>(address);
    inet_ntop(AF_INET, &in4->sin_addr, host, sizeof(host));
    port = ntohs(in4->sin_port);
    return std::string(host) + ":" + std::to_string(port);
  }
  if (address->sa_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(address);
    inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof(host));
    port = ntohs(in6->sin6_port);
    return "[" + std::string(host) + "]:" + std::to_string(port);
  }
  return "<unknown address family>";
}

std::string pciFunctionPath(const std::string& sysfsPath) {
  size_t end = std::string::npos;
  size_t pos = 0;
  while (pos < sysfsPath.size()) {
    size_t slash = sysfsPath.find('/', pos);
    if (slash == std::string::npos) slash = sysfsPath.size();
    if (isPciFunction(sysfsPath.substr(pos, slash - pos))) end = slash;
    pos = slash + 1;
  }
  return end == std::string::npos ? std::string() : sysfsPath.substr(0, end);
}

}  // namespace unifab::net::socket
