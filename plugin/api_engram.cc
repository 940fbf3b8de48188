// The unifabEngram* C entry points: argument plumbing onto collectives/engram.
#include "collectives/common/cuda_check.h"
#include "collectives/engram/engram_table.h"
#include "plugin/boundary.h"
#include "plugin/live_objects.h"

using unifab::LogComponent;
using unifab::guarded;
using unifab::LiveObjects;
using unifab::requireLive;

extern "C" {

UNIFAB_API unifabResult_t unifabEngramCreate(ncclComm_t comm, const unifabEngramConfig_t* config,
                                             unifabEngramTable_t* table) {
  return guarded(LogComponent::kExt, "unifabEngramCreate", [&] {
    // A NULL config or table still takes part in the ranks' agreement (create refuses it there).
    if (table != nullptr) *table = nullptr;
    UF_CHECK(unifabEngramTable::create(comm, config, table));
    LiveObjects<unifabEngramTable>::add(*table);
    return unifabSuccess;
  });
}

UNIFAB_API unifabResult_t unifabEngramDestroy(unifabEngramTable_t table) {
  return guarded(LogComponent::kExt, "unifabEngramDestroy", [&] {
    return unifab::destroyLive(table, "unifabEngramDestroy", "table");
  });
}

UNIFAB_API unifabResult_t unifabEngramWrite(unifabEngramTable_t table, int64_t firstRow, int64_t numRows,
                                            const void* rows, const float* scales, cudaStream_t stream) {
  return guarded(LogComponent::kExt, "unifabEngramWrite", [&] {
    UF_CHECK(requireLive(table, "unifabEngramWrite", "table"));
    return table->write(firstRow, numRows, rows, scales, stream);
  });
}

UNIFAB_API unifabResult_t unifabEngramFetchIssue(unifabEngramTable_t table, const unifabEngramFetchArgs_t* args,
                                                 cudaStream_t stream, unifabEngramFetch_t* fetch) {
  return guarded(LogComponent::kExt, "unifabEngramFetchIssue", [&] {
    if (table == nullptr || args == nullptr || fetch == nullptr) {
      return UF_ERROR(unifabInvalidArgument, kExt, "unifabEngramFetchIssue: table, args and fetch must not be NULL");
    }
    UF_CHECK(requireLive(table, "unifabEngramFetchIssue", "table"));
    *fetch = nullptr;
    return table->issue(*args, stream, fetch);
  });
}

UNIFAB_API unifabResult_t unifabEngramWait(unifabEngramFetch_t fetch, cudaStream_t stream, int* smsUsed) {
  return guarded(LogComponent::kExt, "unifabEngramWait", [&] {
    return unifabEngramTable::wait(fetch, stream, smsUsed);
  });
}

UNIFAB_API unifabResult_t unifabEngramGetAsyncError(unifabEngramTable_t table) {
  return guarded(LogComponent::kExt, "unifabEngramGetAsyncError", [&] {
    UF_CHECK(requireLive(table, "unifabEngramGetAsyncError", "table"));
    return table->asyncError();
  });
}

}  // extern "C"
