// Engram tables against byte patterns, one process per GPU under unifab-launch. Each rank fills
// its rows (row bytes 64 B to 64 KiB, with and without row scales); every rank then fetches
// random global ids (repeats and runs of adjacent ids, rows of every rank) with the gather kernel
// on 1 to 4 SMs, with the copy engine and with the automatic choice, with work on the caller's
// stream between issue and wait, and checks every byte and scale; rows are rewritten between
// fetches. Ids outside the table: refused on the host for the copy engine, reported by
// unifabEngramGetAsyncError (rows zeroed) for the kernel.
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "tests/common/check_tally.h"
#include "tests/common/device_data.h"
#include "tests/common/nccl_session.h"
#include "tests/common/test_util.h"
#include "unifab/unifab.h"

using namespace unifab::test;

namespace {

// The host side of fillBytes' pattern (device_data.cu).
uint8_t patternByte(uint64_t seed, size_t i) { return static_cast<uint8_t>(mix64(seed * 0x9e3779b97f4a7c15ULL + i)); }

uint64_t shardSeed(int rank, size_t rowBytes, int version) {
  return (static_cast<uint64_t>(rank) << 48) ^ (static_cast<uint64_t>(rowBytes) << 8) ^ static_cast<uint64_t>(version);
}

float rowScale(int rank, int64_t row, int version) { return static_cast<float>(rank * 1000000 + row) + 0.25f * version; }

struct Table {
  size_t rowBytes;
  int64_t rows;
  bool scales;
  unifabEngramTable_t handle = nullptr;
  std::vector<int> version;  // per row of this rank: the pattern version written last
};

// Writes rows [first, first + count) of this rank with `version`'s pattern (byte j of row r is
// byte r * rowBytes + j of the shard's pattern), and their scales.
// Without `pending`, waits for the write; with it, returns at once and leaves the source buffers
// in *pending for the caller to free after its stream has run (cudaFree would wait for the GPU).
bool writeRows(NcclSession& session, Table& t, int64_t first, int64_t count, int version,
               std::vector<void*>* pending = nullptr) {
  void* rows = nullptr;
  float* scales = nullptr;
  const size_t bytes = static_cast<size_t>(count) * t.rowBytes;
  TEST_CUDA_CHECK(cudaMalloc(&rows, std::max<size_t>(bytes, 16)));
  // The pattern is defined over the whole shard: fill from offset first * rowBytes.
  std::vector<uint8_t> host(bytes);
  const uint64_t seed = shardSeed(session.rank(), t.rowBytes, version);
  for (size_t i = 0; i < bytes; ++i) host[i] = patternByte(seed, static_cast<size_t>(first) * t.rowBytes + i);
  TEST_CUDA_CHECK(cudaMemcpy(rows, host.data(), bytes, cudaMemcpyHostToDevice));
  std::vector<float> hostScales(static_cast<size_t>(count));
  for (int64_t r = 0; r < count; ++r) hostScales[r] = rowScale(session.rank(), first + r, version);
  if (t.scales) {
    TEST_CUDA_CHECK(cudaMalloc(&scales, sizeof(float) * std::max<int64_t>(count, 1)));
    TEST_CUDA_CHECK(cudaMemcpy(scales, hostScales.data(), sizeof(float) * count, cudaMemcpyHostToDevice));
  }
  TEST_UNIFAB_CHECK(unifabEngramWrite(t.handle, first, count, rows, scales, session.stream()));
  if (pending != nullptr) {
    pending->push_back(rows);
    pending->push_back(scales);
  } else {
    TEST_CUDA_CHECK(cudaStreamSynchronize(session.stream()));
    cudaFree(rows);
    cudaFree(scales);
  }
  for (int64_t r = first; r < first + count; ++r) t.version[r] = version;
  return true;
}

bool fetchAndCheck(NcclSession& session, Table& t, unifabEngramEngine_t engine, int maxSms, bool int32, int round,
                   const std::string& what) {
  const int n = session.nRanks();
  std::mt19937_64 random(977 + 31 * round + session.rank());
  std::vector<int64_t> ids;
  const size_t count = 5000;  // more rows than one pass of the gather kernel's warps
  while (ids.size() < count) {
    const int64_t start = static_cast<int64_t>(random() % (static_cast<uint64_t>(n) * t.rows));
    const int run = 1 + static_cast<int>(random() % 6);  // runs of adjacent ids
    for (int k = 0; k < run && ids.size() < count; ++k) ids.push_back(std::min<int64_t>(start + k, n * t.rows - 1));
    if (random() % 4 == 0) ids.push_back(ids.back());  // repeats
  }
  ids.resize(count);
  std::vector<int32_t> ids32(ids.begin(), ids.end());
  const void* hostIds = int32 ? static_cast<const void*>(ids32.data()) : static_cast<const void*>(ids.data());
  const size_t idBytes = count * (int32 ? 4 : 8);
  void* deviceIds = nullptr;
  void* out = nullptr;
  float* outScales = nullptr;
  TEST_CUDA_CHECK(cudaMalloc(&deviceIds, idBytes));
  TEST_CUDA_CHECK(cudaMemcpy(deviceIds, hostIds, idBytes, cudaMemcpyHostToDevice));
  TEST_CUDA_CHECK(cudaMalloc(&out, count * t.rowBytes));
  TEST_CUDA_CHECK(cudaMemset(out, 0xa5, count * t.rowBytes));
  TEST_CUDA_CHECK(cudaMalloc(&outScales, sizeof(float) * count));
  TEST_CUDA_CHECK(cudaMemset(outScales, 0xff, sizeof(float) * count));
  unifabEngramFetchArgs_t args = UNIFAB_ENGRAM_FETCH_ARGS_INIT;
  const bool copyEngine = engine == unifabEngramCopyEngine || (engine == unifabEngramAuto && t.rowBytes >= (32 << 10));
  args.rowIds = copyEngine ? hostIds : deviceIds;
  args.hostRowIds = copyEngine ? 1 : 0;
  args.rowIdType = int32 ? unifabEpIndexInt32 : unifabEpIndexInt64;
  args.numRows = count;
  args.out = out;
  args.outScales = outScales;
  args.engine = engine;
  args.maxSms = maxSms;
  unifabEngramFetch_t fetch = nullptr;
  TEST_UNIFAB_CHECK(unifabEngramFetchIssue(t.handle, &args, session.stream(), &fetch));
  TEST_CUDA_CHECK(spinOnDevice(30000, session.stream()));  // the caller's work between issue and wait
  int sms = -1;
  TEST_UNIFAB_CHECK(unifabEngramWait(fetch, session.stream(), &sms));
  TEST_CUDA_CHECK(cudaStreamSynchronize(session.stream()));
  check(unifabEngramGetAsyncError(t.handle) == unifabSuccess, what + ": no device error");
  check(copyEngine ? sms == 0 : (sms >= 1 && sms <= (maxSms ? maxSms : 4)),
        what + ": SMs held " + std::to_string(sms));
  std::vector<uint8_t> got(count * t.rowBytes);
  std::vector<float> gotScales(count);
  TEST_CUDA_CHECK(cudaMemcpy(got.data(), out, got.size(), cudaMemcpyDeviceToHost));
  TEST_CUDA_CHECK(cudaMemcpy(gotScales.data(), outScales, sizeof(float) * count, cudaMemcpyDeviceToHost));
  size_t badRows = 0, badScales = 0;
  for (size_t i = 0; i < count; ++i) {
    const int rank = static_cast<int>(ids[i] / t.rows);
    const int64_t row = ids[i] % t.rows;
    const int version = t.version[static_cast<size_t>(row)];  // every rank applies the same updates
    const uint64_t seed = shardSeed(rank, t.rowBytes, version);
    bool same = true;
    for (size_t j = 0; j < t.rowBytes && same; ++j) {
      same = got[i * t.rowBytes + j] == patternByte(seed, static_cast<size_t>(row) * t.rowBytes + j);
    }
    badRows += same ? 0 : 1;
    if (t.scales) badScales += gotScales[i] == rowScale(rank, row, version) ? 0 : 1;
  }
  check(badRows == 0, what + ": " + std::to_string(badRows) + " of " + std::to_string(count) + " rows differ");
  if (t.scales) check(badScales == 0, what + ": " + std::to_string(badScales) + " scales differ");
  cudaFree(deviceIds);
  cudaFree(out);
  cudaFree(outScales);
  return true;
}

bool runTable(NcclSession& session, size_t rowBytes, bool scales) {
  Table t;
  t.rowBytes = rowBytes;
  t.rows = std::min<int64_t>(4096, (int64_t{128} << 20) / static_cast<int64_t>(rowBytes));
  t.scales = scales;
  t.version.assign(static_cast<size_t>(t.rows), 0);
  unifabEngramConfig_t config = UNIFAB_ENGRAM_CONFIG_INIT;
  config.rowBytes = rowBytes;
  config.rowsPerRank = t.rows;
  config.rowScales = scales ? 1 : 0;
  TEST_UNIFAB_CHECK(unifabEngramCreate(session.comm(), &config, &t.handle));
  if (!writeRows(session, t, 0, t.rows, 0)) return false;
  const std::string name = std::to_string(rowBytes) + " B rows" + (scales ? " with scales" : "");
  for (int round = 0; round < 3; ++round) {
    if (round > 0) {
      // Rows with row % 7 == round % 7 get this round's version on every rank.
      for (int64_t r = round % 7; r < t.rows; r += 7) {
        if (!writeRows(session, t, r, 1, round)) return false;
      }
    }
    if (!session.barrier(true)) return false;  // every rank's rows are written
    const std::string what = name + " round " + std::to_string(round);
    if (!fetchAndCheck(session, t, unifabEngramSmGather, 1 + round, round % 2 == 1, round, what + " gather")) return false;
    if (!fetchAndCheck(session, t, unifabEngramCopyEngine, 0, round % 2 == 0, round, what + " copy engine")) return false;
    if (!fetchAndCheck(session, t, unifabEngramAuto, 0, false, round, what + " auto")) return false;
    if (!session.barrier(true)) return false;  // no rank rewrites rows another still reads
  }
  // A fetch issued right after a write on the same stream, with no synchronisation between them,
  // sees the written rows (this rank's own: only they are ordered with this stream).
  {
    const int version = 99;
    const int64_t first = 3, count = std::min<int64_t>(64, t.rows - first);
    std::vector<int64_t> ids(static_cast<size_t>(count));
    for (int64_t i = 0; i < count; ++i) ids[static_cast<size_t>(i)] = static_cast<int64_t>(session.rank()) * t.rows + first + i;
    int64_t* deviceIds = nullptr;
    void* out = nullptr;
    float* outScales = nullptr;
    TEST_CUDA_CHECK(cudaMalloc(&deviceIds, sizeof(int64_t) * ids.size()));
    TEST_CUDA_CHECK(cudaMemcpy(deviceIds, ids.data(), sizeof(int64_t) * ids.size(), cudaMemcpyHostToDevice));
    TEST_CUDA_CHECK(cudaMalloc(&out, ids.size() * rowBytes));
    TEST_CUDA_CHECK(cudaMalloc(&outScales, sizeof(float) * ids.size()));
    std::vector<void*> pending;
    if (!writeRows(session, t, first, count, version, &pending)) return false;
    unifabEngramFetchArgs_t args = UNIFAB_ENGRAM_FETCH_ARGS_INIT;
    args.rowIds = deviceIds;
    args.numRows = ids.size();
    args.out = out;
    args.outScales = outScales;
    args.engine = unifabEngramSmGather;
    unifabEngramFetch_t fetch = nullptr;
    TEST_UNIFAB_CHECK(unifabEngramFetchIssue(t.handle, &args, session.stream(), &fetch));
    TEST_UNIFAB_CHECK(unifabEngramWait(fetch, session.stream(), nullptr));
    TEST_CUDA_CHECK(cudaStreamSynchronize(session.stream()));
    std::vector<uint8_t> got(ids.size() * rowBytes);
    TEST_CUDA_CHECK(cudaMemcpy(got.data(), out, got.size(), cudaMemcpyDeviceToHost));
    const uint64_t seed = shardSeed(session.rank(), rowBytes, version);
    size_t bad = 0;
    for (size_t i = 0; i < ids.size(); ++i) {
      for (size_t j = 0; j < rowBytes; ++j) {
        if (got[i * rowBytes + j] != patternByte(seed, static_cast<size_t>(first + static_cast<int64_t>(i)) * rowBytes + j)) {
          ++bad;
          break;
        }
      }
    }
    check(bad == 0, name + ": a fetch after an unsynchronised write on its stream sees the new rows (" +
                        std::to_string(bad) + " stale)");
    for (void* p : pending) cudaFree(p);
    cudaFree(deviceIds);
    cudaFree(out);
    cudaFree(outScales);
  }
  if (!session.barrier(true)) return false;
  // Ids outside the table: the copy engine refuses them before issuing anything.
  const int64_t outside = static_cast<int64_t>(session.nRanks()) * t.rows;
  unifabEngramFetchArgs_t args = UNIFAB_ENGRAM_FETCH_ARGS_INIT;
  void* out = nullptr;
  float* outScales = nullptr;
  TEST_CUDA_CHECK(cudaMalloc(&out, rowBytes));
  TEST_CUDA_CHECK(cudaMalloc(&outScales, sizeof(float)));
  args.rowIds = &outside;
  args.hostRowIds = 1;
  args.numRows = 1;
  args.out = out;
  args.outScales = outScales;
  args.engine = unifabEngramCopyEngine;
  unifabEngramFetch_t fetch = nullptr;
  const unifabResult_t refused = unifabEngramFetchIssue(t.handle, &args, session.stream(), &fetch);
  check(refused == unifabInvalidArgument && fetch == nullptr && strstr(unifabGetLastError(), "rowIds[0]") != nullptr,
        name + ": an id outside the table is refused on the host, naming it");
  // Counts whose sizes would wrap, and host ids that are device memory: refused, naming them.
  auto refusedNaming = [&](const unifabEngramFetchArgs_t& a, const char* mentions, const std::string& what) {
    unifabEngramFetch_t none = nullptr;
    const unifabResult_t got = unifabEngramFetchIssue(t.handle, &a, session.stream(), &none);
    check(got == unifabInvalidArgument && none == nullptr && strstr(unifabGetLastError(), mentions) != nullptr,
          name + ": " + what);
  };
  unifabEngramFetchArgs_t huge = args;
  huge.numRows = SIZE_MAX;
  refusedNaming(huge, "numRows", "numRows=SIZE_MAX is refused");
  int64_t* deviceIds = nullptr;
  TEST_CUDA_CHECK(cudaMalloc(&deviceIds, sizeof(int64_t)));
  unifabEngramFetchArgs_t hostIdsOnDevice = args;
  hostIdsOnDevice.rowIds = deviceIds;
  refusedNaming(hostIdsOnDevice, "hostRowIds", "hostRowIds=1 with device memory is refused");
  // The gather kernel loads ids whole and from device memory: misaligned or host ids are refused.
  unifabEngramFetchArgs_t misaligned = args;
  misaligned.engine = unifabEngramSmGather;
  misaligned.hostRowIds = 0;
  misaligned.rowIds = reinterpret_cast<const char*>(deviceIds) + 4;
  refusedNaming(misaligned, "rowIds", "int64 ids 4 bytes off are refused");
  unifabEngramFetchArgs_t idsOnHost = misaligned;
  idsOnHost.rowIds = &outside;
  refusedNaming(idsOnHost, "not device memory", "hostRowIds=0 with host ids is refused");
  if (t.scales) {
    unifabEngramFetchArgs_t oddScales = args;
    oddScales.outScales = reinterpret_cast<float*>(reinterpret_cast<char*>(outScales) + 2);
    refusedNaming(oddScales, "outScales", "outScales 2 bytes off are refused");
  }
  cudaFree(deviceIds);
  const unifabResult_t wrapped = unifabEngramWrite(t.handle, INT64_MAX, 1, out, outScales, session.stream());
  check(wrapped == unifabInvalidArgument && strstr(unifabGetLastError(), "firstRow") != nullptr,
        name + ": a write whose last row would wrap past INT64_MAX is refused");
  std::vector<uint8_t> hostRows(t.rowBytes);
  const unifabResult_t fromHost = unifabEngramWrite(t.handle, 0, 1, hostRows.data(), outScales, session.stream());
  check(fromHost == unifabInvalidArgument && strstr(unifabGetLastError(), "rows") != nullptr,
        name + ": a write from pageable host memory is refused naming rows");
  // ... and the gather kernel reports it (the table then refuses further calls).
  int64_t* deviceOutside = nullptr;
  TEST_CUDA_CHECK(cudaMalloc(&deviceOutside, sizeof(int64_t)));
  TEST_CUDA_CHECK(cudaMemcpy(deviceOutside, &outside, sizeof(int64_t), cudaMemcpyHostToDevice));
  args.rowIds = deviceOutside;
  args.hostRowIds = 0;
  args.engine = unifabEngramSmGather;
  TEST_UNIFAB_CHECK(unifabEngramFetchIssue(t.handle, &args, session.stream(), &fetch));
  TEST_UNIFAB_CHECK(unifabEngramWait(fetch, session.stream(), nullptr));
  check(unifabEngramWait(fetch, session.stream(), nullptr) == unifabInvalidArgument &&
            strstr(unifabGetLastError(), "not a pending fetch") != nullptr,
        name + ": a fetch waited for twice is refused");
  TEST_CUDA_CHECK(cudaStreamSynchronize(session.stream()));
  check(unifabEngramGetAsyncError(t.handle) == unifabInvalidArgument, name + ": the kernel reports an id outside");
  std::vector<uint8_t> zeroed(rowBytes, 1);
  TEST_CUDA_CHECK(cudaMemcpy(zeroed.data(), out, rowBytes, cudaMemcpyDeviceToHost));
  check(std::all_of(zeroed.begin(), zeroed.end(), [](uint8_t b) { return b == 0; }), name + ": its row is zeroed");
  cudaFree(out);
  cudaFree(outScales);
  cudaFree(deviceOutside);
  if (!session.barrier(true)) return false;
  TEST_UNIFAB_CHECK(unifabEngramDestroy(t.handle));
  return true;
}

}  // namespace

int main() {
  RankEnvironment env = rankEnvironment();
  tally().rank = env.rank;
  NcclSession session;
  if (!session.init(env)) return session.skipped() ? kSkipExitCode : 1;
  const size_t rowSizes[] = {64, 256, 1024, 4096, 14336, 65536};
  for (size_t i = 0; i < sizeof(rowSizes) / sizeof(rowSizes[0]); ++i) {
    if (!runTable(session, rowSizes[i], i % 2 == 1)) {
      abandonRank("at " + std::to_string(rowSizes[i]) + " B rows");
    }
  }
  return finishChecks();
}
