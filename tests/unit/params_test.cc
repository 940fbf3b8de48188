#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <sstream>
#include <string>

#include "plugin/params.h"
#include "tests/unit/log_capture.h"

using unifab::Params;
using unifab::parseParams;

namespace {

Params parseFrom(const std::map<std::string, std::string>& env) {
  return parseParams([&env](const char* name) -> const char* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  });
}

TEST(Params, DefaultsWhenNothingIsSet) {
  unifab::test::LogCapture log;
  Params p = parseFrom({});
  EXPECT_EQ(p.netTransport, "socket");
  EXPECT_FALSE(p.netDisable);
  EXPECT_EQ(p.socketIfname, "");
  EXPECT_EQ(p.socketFamily, unifab::SocketFamily::kAny);
  EXPECT_EQ(p.socketNStreams, 4);
  EXPECT_EQ(p.socketNThreads, 0);
  EXPECT_EQ(p.socketBusyPollUs, -1);
  EXPECT_EQ(p.socketChunkBytes, 128 * 1024);
  EXPECT_EQ(p.socketInlineBytes, 64 * 1024);
  EXPECT_EQ(p.socketMaxRecvs, 8);
  EXPECT_EQ(p.socketSpeedMbps, 0);
  EXPECT_EQ(p.socketBufferBytes, 0);
  EXPECT_TRUE(p.tunerEnable);
  EXPECT_EQ(p.tunerConfig, "");
  EXPECT_EQ(p.tunerNvlinkGbps, 0.0);
  EXPECT_EQ(p.tunerNetGbps, 0.0);
  EXPECT_EQ(p.epTimeoutMs, 30000);
  EXPECT_FALSE(p.epValidateOnHost);
  EXPECT_TRUE(log.warnings().empty());
}

TEST(Params, ValidValuesOfEveryType) {
  unifab::test::LogCapture log;
  Params p = parseFrom({{"UNIFAB_NET_DISABLE", "yes"},
                        {"UNIFAB_SOCKET_IFNAME", "^docker,lo"},
                        {"UNIFAB_SOCKET_FAMILY", "IPv6"},
                        {"UNIFAB_SOCKET_NSTREAMS", "16"},
                        {"UNIFAB_SOCKET_NTHREADS", "0x2"},
                        {"UNIFAB_SOCKET_CHUNK_BYTES", "1MiB"},
                        {"UNIFAB_SOCKET_BUFFER_BYTES", "4M"},
                        {"UNIFAB_TUNER_ENABLE", "off"},
                        {"UNIFAB_TUNER_NET_GBPS", "12.5"}});
  EXPECT_TRUE(p.netDisable);
  EXPECT_EQ(p.socketIfname, "^docker,lo");
  EXPECT_EQ(p.socketFamily, unifab::SocketFamily::kIpv6);
  EXPECT_EQ(p.socketNStreams, 16);
  EXPECT_EQ(p.socketNThreads, 2);
  EXPECT_EQ(p.socketChunkBytes, 1 << 20);
  EXPECT_EQ(p.socketBufferBytes, 4 << 20);
  EXPECT_FALSE(p.tunerEnable);
  EXPECT_DOUBLE_EQ(p.tunerNetGbps, 12.5);
  EXPECT_TRUE(log.warnings().empty());
}

// Integers are decimal (or 0x hexadecimal), never octal: a leading zero changes nothing.
TEST(Params, LeadingZerosAreDecimal) {
  unifab::test::LogCapture log;
  Params p = parseFrom({{"UNIFAB_SOCKET_TIMEOUT_S", "0120"}, {"UNIFAB_SOCKET_NSTREAMS", "08"}});
  EXPECT_EQ(p.socketTimeoutS, 120);
  EXPECT_EQ(p.socketNStreams, 8);
  EXPECT_TRUE(log.warnings().empty());
}

// A bandwidth near zero would overflow every estimate: 0 (detect) or at least 0.01 GB/s.
TEST(Params, BandwidthsAreZeroOrAtLeastAHundredthOfAGigabyte) {
  unifab::test::LogCapture log;
  Params tiny = parseFrom({{"UNIFAB_TUNER_NVLINK_GBPS", "1e-300"}, {"UNIFAB_TUNER_NET_GBPS", "0.001"}});
  EXPECT_EQ(tiny.tunerNvlinkGbps, 0.0);
  EXPECT_EQ(tiny.tunerNetGbps, 0.0);
  EXPECT_TRUE(log.warned("0 or 0.01..100000"));
  Params set = parseFrom({{"UNIFAB_TUNER_NVLINK_GBPS", "0"}, {"UNIFAB_TUNER_NET_GBPS", "0.01"}});
  EXPECT_EQ(set.tunerNvlinkGbps, 0.0);
  EXPECT_DOUBLE_EQ(set.tunerNetGbps, 0.01);
}

TEST(Params, BadValuesWarnWithNameAndBoundsAndKeepTheDefault) {
  unifab::test::LogCapture log;
  Params p = parseFrom({{"UNIFAB_SOCKET_NSTREAMS", "17"},
                        {"UNIFAB_SOCKET_NTHREADS", "four"},
                        {"UNIFAB_SOCKET_CHUNK_BYTES", "1K"},
                        {"UNIFAB_NET_DISABLE", "maybe"},
                        {"UNIFAB_NET_TRANSPORT", "carrier-pigeon"},
                        {"UNIFAB_TUNER_NET_GBPS", "-3"}});
  EXPECT_EQ(p.socketNStreams, 4);
  EXPECT_EQ(p.socketNThreads, 0);
  EXPECT_EQ(p.socketChunkBytes, 128 * 1024);
  EXPECT_FALSE(p.netDisable);
  EXPECT_EQ(p.netTransport, "socket");
  EXPECT_EQ(p.tunerNetGbps, 0.0);
  EXPECT_TRUE(log.warned("UNIFAB_SOCKET_NSTREAMS=\"17\": expected 1..16"));
  EXPECT_TRUE(log.warned("UNIFAB_SOCKET_NTHREADS"));
  EXPECT_TRUE(log.warned("UNIFAB_SOCKET_CHUNK_BYTES"));
  EXPECT_TRUE(log.warned("UNIFAB_NET_DISABLE"));
  EXPECT_TRUE(log.warned("UNIFAB_NET_TRANSPORT"));
  EXPECT_TRUE(log.warned("UNIFAB_TUNER_NET_GBPS"));
  EXPECT_EQ(log.warnings().size(), 6u);
}

TEST(Params, ZeroMeansOffOnlyWhereDocumented) {
  unifab::test::LogCapture log;
  Params off = parseFrom({{"UNIFAB_SOCKET_INLINE_BYTES", "0"}, {"UNIFAB_SOCKET_BUFFER_BYTES", "0"}});
  EXPECT_EQ(off.socketInlineBytes, 0);
  EXPECT_EQ(off.socketBufferBytes, 0);
  EXPECT_TRUE(log.warnings().empty());
  Params bad = parseFrom({{"UNIFAB_SOCKET_CHUNK_BYTES", "0"}, {"UNIFAB_SOCKET_BUFFER_BYTES", "100"}});
  EXPECT_EQ(bad.socketChunkBytes, 128 * 1024);
  EXPECT_EQ(bad.socketBufferBytes, 0);
  EXPECT_TRUE(log.warned("UNIFAB_SOCKET_CHUNK_BYTES"));
  EXPECT_TRUE(log.warned("UNIFAB_SOCKET_BUFFER_BYTES"));
}

TEST(Params, Parsers) {
  int64_t v = 0;
  EXPECT_TRUE(unifab::parseInt64("42", 0, 100, &v));
  EXPECT_EQ(v, 42);
  EXPECT_FALSE(unifab::parseInt64("42x", 0, 100, &v));
  EXPECT_FALSE(unifab::parseInt64("", 0, 100, &v));
  EXPECT_FALSE(unifab::parseInt64("101", 0, 100, &v));
  EXPECT_FALSE(unifab::parseInt64("99999999999999999999", 0, INT64_MAX, &v));
  EXPECT_TRUE(unifab::parseSize("64K", 0, INT64_MAX, &v));
  EXPECT_EQ(v, 65536);
  EXPECT_TRUE(unifab::parseSize("2GiB", 0, INT64_MAX, &v));
  EXPECT_EQ(v, int64_t{2} << 30);
  EXPECT_FALSE(unifab::parseSize("-1", -10, 10, &v));
  EXPECT_FALSE(unifab::parseSize("3T", 0, INT64_MAX, &v));
  EXPECT_FALSE(unifab::parseSize("99999999999G", 0, INT64_MAX, &v));
  bool b = false;
  EXPECT_TRUE(unifab::parseBool("TRUE", &b));
  EXPECT_TRUE(b);
  EXPECT_TRUE(unifab::parseBool("0", &b));
  EXPECT_FALSE(b);
  EXPECT_FALSE(unifab::parseBool("2", &b));
  double d = 0;
  EXPECT_TRUE(unifab::parseDouble("1e2", 0, 1000, &d));
  EXPECT_EQ(d, 100.0);
  EXPECT_FALSE(unifab::parseDouble("nan", 0, 1000, &d));
  EXPECT_FALSE(unifab::parseDouble("5abc", 0, 1000, &d));
}

TEST(Params, EveryParameterIsDocumentedInTheReadme) {
  std::ifstream readme(UNIFAB_SOURCE_DIR "/README.md");
  ASSERT_TRUE(readme) << "README.md not found";
  std::stringstream text;
  text << readme.rdbuf();
  for (const unifab::ParamInfo& info : unifab::paramTable()) {
    EXPECT_NE(text.str().find(std::string("`") + info.name + "`"), std::string::npos)
        << info.name << " is missing from README.md's parameter table";
  }
}

}  // namespace
