#include <gtest/gtest.h>

#include "net/socket/interfaces.h"

using unifab::net::socket::findInterfaces;
using unifab::net::socket::interfaceMatches;
using unifab::net::socket::pciFunctionPath;

TEST(Interfaces, NcclStyleSelection) {
  EXPECT_TRUE(interfaceMatches("eth", "eth0"));
  EXPECT_TRUE(interfaceMatches("ib,eth", "eth1"));
  EXPECT_FALSE(interfaceMatches("ib", "eth0"));
  EXPECT_FALSE(interfaceMatches("^eth", "eth0"));
  EXPECT_TRUE(interfaceMatches("^eth", "ib0"));
  EXPECT_TRUE(interfaceMatches("=eth0", "eth0"));
  EXPECT_FALSE(interfaceMatches("=eth", "eth0"));
  EXPECT_FALSE(interfaceMatches("^=eth0", "eth0"));
  EXPECT_TRUE(interfaceMatches("^=eth0", "eth01"));
  EXPECT_FALSE(interfaceMatches("", "eth0"));
  EXPECT_FALSE(interfaceMatches(",", "eth0"));
}

TEST(Interfaces, LoopbackCanBeSelectedExplicitly) {
  auto found = findInterfaces("lo", unifab::SocketFamily::kIpv4, 16);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].name, "lo");
  EXPECT_EQ(found[0].address.ss_family, AF_INET);
  EXPECT_TRUE(found[0].pciPath.empty());
  EXPECT_TRUE(findInterfaces("no-such-interface", unifab::SocketFamily::kAny, 16).empty());
}

TEST(Interfaces, DefaultPolicyAlwaysFindsSomething) {
  auto found = findInterfaces("", unifab::SocketFamily::kAny, 16);
  ASSERT_FALSE(found.empty());
  for (const auto& iface : found) {
    if (found.size() > 1) {
      EXPECT_NE(iface.name.compare(0, 2, "lo"), 0) << "loopback only when nothing else is up";
    }
  }
}

TEST(Interfaces, PciFunctionPathKeepsTheLastFunction) {
  EXPECT_EQ(pciFunctionPath("/sys/devices/pci0000:00/0000:00:03.0/virtio0"), "/sys/devices/pci0000:00/0000:00:03.0");
  EXPECT_EQ(pciFunctionPath("/sys/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.1"),
            "/sys/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.1");
  EXPECT_EQ(pciFunctionPath("/sys/devices/virtual/net/lo"), "");
}
