// EP configuration checks and buffer sizing through the public C API (no GPU needed).
#include <cstring>
#include <gtest/gtest.h>

#include <string>

#include "unifab/unifab.h"

namespace {

unifabEpConfig_t standard() {
  unifabEpConfig_t config = UNIFAB_EP_CONFIG_INIT;
  config.numExperts = 256;
  config.maxTokensPerRank = 4096;
  config.hidden = 7168;
  config.topk = 8;
  return config;
}

TEST(EpConfig, BufferSizeCoversPayloadsAndCombineSlots) {
  unifabEpConfig_t config = standard();
  size_t bytes = 0;
  ASSERT_EQ(unifabEpBufferSize(&config, 2, &bytes), unifabSuccess);
  // Receive rows for 2 x 4096 tokens (BF16) plus the combine slots of 2 x 4096 tokens.
  size_t payload = size_t{2} * 4096 * 7168 * 2;
  EXPECT_GE(bytes, 2 * payload);
  EXPECT_LT(bytes, 2 * payload + (size_t{16} << 20)) << "metadata should stay small next to the payload";
  size_t eight = 0;
  ASSERT_EQ(unifabEpBufferSize(&config, 8, &eight), unifabSuccess);
  EXPECT_GT(eight, bytes) << "more ranks, more receive rows";
}

struct BadCase {
  const char* field;
  void (*mutate)(unifabEpConfig_t*, int*);
  unifabResult_t expected;
};

TEST(EpConfig, EachBadFieldIsNamed) {
  const BadCase cases[] = {
      {"config->size", [](unifabEpConfig_t* c, int*) { c->size = 8; }, unifabInvalidArgument},
      {"config->mode", [](unifabEpConfig_t* c, int*) {
         const int unlisted = 7;  // as a C caller could store it; a C++ enum cast of 7 would itself be UB
         std::memcpy(&c->mode, &unlisted, sizeof unlisted);
       }, unifabInvalidArgument},
      {"config->numExperts", [](unifabEpConfig_t* c, int*) { c->numExperts = 255; }, unifabInvalidArgument},
      {"config->numExperts", [](unifabEpConfig_t* c, int*) { c->numExperts = 4096; }, unifabInvalidArgument},
      {"config->topk", [](unifabEpConfig_t* c, int*) { c->topk = 0; }, unifabInvalidArgument},
      {"config->topk", [](unifabEpConfig_t* c, int*) { c->topk = 33; }, unifabInvalidArgument},
      {"config->hidden", [](unifabEpConfig_t* c, int*) { c->hidden = 7000; }, unifabInvalidArgument},
      {"config->maxTokensPerRank", [](unifabEpConfig_t* c, int*) { c->maxTokensPerRank = 0; }, unifabInvalidArgument},
      {"config->maxSms", [](unifabEpConfig_t* c, int*) { c->maxSms = -1; }, unifabInvalidArgument},
      {"config->programmaticLaunch", [](unifabEpConfig_t* c, int*) { c->programmaticLaunch = 2; }, unifabInvalidArgument},
      {"nRanks", [](unifabEpConfig_t*, int* n) { *n = 65; }, unifabInvalidArgument},
      {"nRanks", [](unifabEpConfig_t*, int* n) { *n = 0; }, unifabInvalidArgument},
      {"config->numExperts", [](unifabEpConfig_t* c, int* n) {
         *n = 8;
         c->numExperts = 4;  // fewer experts than ranks
         c->topk = 2;
       }, unifabInvalidArgument},
      {"config->topk", [](unifabEpConfig_t* c, int*) {
         c->numExperts = 8;
         c->topk = 9;  // more than the experts
       }, unifabInvalidArgument},
      {"config->hidden", [](unifabEpConfig_t* c, int*) { c->hidden = 65536 + 128; }, unifabInvalidArgument},
      {"config->maxTokensPerRank", [](unifabEpConfig_t* c, int*) { c->maxTokensPerRank = (1 << 20) + 1; },
       unifabInvalidArgument},
      {"config->maxTokensPerRank", [](unifabEpConfig_t* c, int*) {
         c->mode = unifabEpLowLatency;
         c->maxTokensPerRank = 1025;  // a low-latency group takes at most 1024
       }, unifabInvalidArgument},
  };
  for (const BadCase& bad : cases) {
    unifabEpConfig_t config = standard();
    int nRanks = 2;
    bad.mutate(&config, &nRanks);
    size_t bytes = 12345;
    EXPECT_EQ(unifabEpBufferSize(&config, nRanks, &bytes), bad.expected) << bad.field;
    EXPECT_NE(std::string(unifabGetLastError()).find(bad.field), std::string::npos)
        << "message '" << unifabGetLastError() << "' should name " << bad.field;
    EXPECT_EQ(bytes, 12345u) << "no output on failure";
  }
  size_t bytes = 0;
  EXPECT_EQ(unifabEpBufferSize(nullptr, 2, &bytes), unifabInvalidArgument);
}

// Low latency: a message slot per (source rank, token) in each of four generations (a send of
// epoch e writes generation e % 4, so that no slot needs a release word) and a BF16 combine
// partial per (rank, token) in each of two buffer sets, both as flagged lines (112 payload bytes in
// each 128-byte line): a BF16 message of 7168 values is 8 parts of 16 value lines and one header
// line (64 bytes for top-8), a partial 8 parts of 16 lines; the per-expert receive regions live in
// ordinary device memory, not in the window.
TEST(EpConfig, LowLatencyBufferSizeCoversMessageGenerationsAndPartialSets) {
  unifabEpConfig_t config = standard();
  config.mode = unifabEpLowLatency;
  config.maxTokensPerRank = 128;
  size_t bytes = 0;
  ASSERT_EQ(unifabEpBufferSize(&config, 2, &bytes), unifabSuccess);
  const size_t slots = size_t{2} * 128;
  const size_t message = (8 * 16 + 1) * 128;
  const size_t partial = 8 * 16 * 128;
  const size_t lines = 4 * slots * message + 2 * slots * partial;
  EXPECT_GE(bytes, lines);
  EXPECT_LT(bytes, lines + (size_t{1} << 20)) << "bitmaps and registration padding stay small";
  config.maxTokensPerRank = 1025;
  EXPECT_EQ(unifabEpBufferSize(&config, 2, &bytes), unifabInvalidArgument);
  EXPECT_NE(std::string(unifabGetLastError()).find("config->maxTokensPerRank"), std::string::npos)
      << unifabGetLastError();
}

TEST(EpConfig, NullGroupsAndHandlesAreRefused) {
  EXPECT_EQ(unifabEpDispatch(nullptr, nullptr, nullptr, nullptr, nullptr), unifabInvalidArgument);
  EXPECT_EQ(unifabEpCombine(nullptr, nullptr, nullptr, nullptr), unifabInvalidArgument);
  EXPECT_EQ(unifabEpLowLatencyDispatch(nullptr, nullptr, nullptr, nullptr, nullptr), unifabInvalidArgument);
  EXPECT_EQ(unifabEpLowLatencyCombine(nullptr, nullptr, nullptr, nullptr), unifabInvalidArgument);
  EXPECT_EQ(unifabEpGetAsyncError(nullptr), unifabInvalidArgument);
  unifabEpConfig_t config = standard();
  unifabEpGroup_t group = nullptr;
  EXPECT_EQ(unifabEpCreate(nullptr, &config, &group), unifabInvalidArgument);
  EXPECT_EQ(group, nullptr);
}

// Groups and tables the library never created (or already destroyed) are refused by every entry
// point, without being touched; destroying NULL does nothing.
TEST(EpConfig, ObjectsNeverCreatedAreRefusedUntouched) {
  // Poisoned storage standing in for a freed group: any read of it would be a use after free.
  alignas(64) static unsigned char poison[4096];
  memset(poison, 0xA5, sizeof(poison));
  auto ep = reinterpret_cast<unifabEpGroup_t>(poison);
  auto pp = reinterpret_cast<unifabPpGroup_t>(poison);
  auto table = reinterpret_cast<unifabEngramTable_t>(poison);
  unifabEpDispatchArgs_t dispatch = UNIFAB_EP_DISPATCH_ARGS_INIT;
  unifabEpCombineArgs_t combine = UNIFAB_EP_COMBINE_ARGS_INIT;
  unifabEpLowLatencyDispatchArgs_t llDispatch = UNIFAB_EP_LL_DISPATCH_ARGS_INIT;
  unifabEpLowLatencyCombineArgs_t llCombine = UNIFAB_EP_LL_COMBINE_ARGS_INIT;
  unifabEpHandle_t handle = nullptr;
  unifabEpDispatchResult_t result = UNIFAB_EP_DISPATCH_RESULT_INIT;
  void* buffer = nullptr;
  int maxRows = 0;
  EXPECT_EQ(unifabEpDispatch(ep, &dispatch, nullptr, &handle, &result), unifabInvalidArgument);
  EXPECT_NE(std::string(unifabGetLastError()).find("group="), std::string::npos) << unifabGetLastError();
  EXPECT_NE(std::string(unifabGetLastError()).find("destroyed or never created"), std::string::npos);
  EXPECT_EQ(unifabEpCombine(ep, nullptr, &combine, nullptr), unifabInvalidArgument);
  EXPECT_EQ(unifabEpCombineInputBuffer(ep, &buffer, &maxRows), unifabInvalidArgument);
  unifabEpLowLatencyDispatchResult_t llResult = UNIFAB_EP_LL_DISPATCH_RESULT_INIT;  // every INIT macro compiles in C++
  EXPECT_EQ(unifabEpLowLatencyDispatch(ep, &llDispatch, nullptr, &handle, &llResult), unifabInvalidArgument);
  EXPECT_EQ(unifabEpLowLatencyCombine(ep, nullptr, &llCombine, nullptr), unifabInvalidArgument);
  EXPECT_EQ(unifabEpGetAsyncError(ep), unifabInvalidArgument);
  EXPECT_EQ(unifabEpDestroy(ep), unifabInvalidArgument);
  EXPECT_NE(std::string(unifabGetLastError()).find("destroyed already or never created"), std::string::npos);
  EXPECT_EQ(unifabPpSend(pp, poison, 16, 0, nullptr), unifabInvalidArgument);
  EXPECT_EQ(unifabPpRecv(pp, poison, 16, 0, nullptr), unifabInvalidArgument);
  EXPECT_EQ(unifabPpGetAsyncError(pp), unifabInvalidArgument);
  EXPECT_EQ(unifabPpDestroy(pp), unifabInvalidArgument);
  unifabEngramFetchArgs_t fetchArgs = UNIFAB_ENGRAM_FETCH_ARGS_INIT;
  unifabEngramFetch_t fetch = nullptr;
  EXPECT_EQ(unifabEngramWrite(table, 0, 1, poison, nullptr, nullptr), unifabInvalidArgument);
  EXPECT_EQ(unifabEngramFetchIssue(table, &fetchArgs, nullptr, &fetch), unifabInvalidArgument);
  EXPECT_EQ(unifabEngramGetAsyncError(table), unifabInvalidArgument);
  EXPECT_EQ(unifabEngramDestroy(table), unifabInvalidArgument);
  for (unsigned char byte : poison) ASSERT_EQ(byte, 0xA5) << "an entry point wrote into an object it never created";
  EXPECT_EQ(unifabEpDestroy(nullptr), unifabSuccess);
  EXPECT_EQ(unifabPpDestroy(nullptr), unifabSuccess);
  EXPECT_EQ(unifabEngramDestroy(nullptr), unifabSuccess);
}

}  // namespace
