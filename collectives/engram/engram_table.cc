#include "collectives/engram/engram_table.h"

#include "collectives/engram/engram_plan.h"

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <unordered_set>

#include "collectives/common/agreement.h"
#include "collectives/common/copy_engine.h"
#include "collectives/common/cuda_check.h"
#include "collectives/common/device_range.h"
#include "collectives/common/device_guard.h"
#include "collectives/common/struct_size.h"
#include "collectives/ep/ep_common.h"

using unifab::collectives::requireStructSize;
using unifab::Result;
using unifab::kLogInit;
using unifab::collectives::ep::aligned16;
using unifab::collectives::ep::rawEnum;
namespace ken = unifab::kernels::engram;

namespace unifab::collectives::engram {
namespace {

constexpr size_t kMaxRowBytes = size_t{1} << 20;
constexpr int kDefaultGatherSms = 4;
// Copies per cudaMemcpyBatchAsync call. The driver hands a batch to the copy engine when the call
// returns and the host spends ~0.5-0.9 us a copy inside it, about as long as the engine takes for
// a 64 KiB row: one batch of 1024 rows left the engine idle for the first call's length and
// working ~170 us after it. Batches of 64 start it after ~35 us and leave it one batch behind
// (copy-routes, 1024 peer rows of 64 KiB: 716 us alone in one batch, 568 in batches of 64, the
// same host time).
constexpr size_t kCopiesPerBatch = 64;

}  // namespace

}  // namespace unifab::collectives::engram

namespace engram = unifab::collectives::engram;

namespace {

// The fetches issued and not yet waited for. Never destroyed, so that a wait from another static's
// destructor at exit still finds them.
std::mutex& liveFetchesMutex() {
  static auto* m = new std::mutex;
  return *m;
}
std::unordered_set<const unifabEngramFetch*>& liveFetches() {
  static auto* fetches = new std::unordered_set<const unifabEngramFetch*>;
  return *fetches;
}

}  // namespace

Result unifabEngramTable::create(ncclComm_t comm, const unifabEngramConfig_t* given, unifabEngramTable** out) {
  // Only what makes a collective step impossible returns before the first one.
  if (comm == nullptr) return UF_ERROR(unifabInvalidArgument, kExt, "comm=NULL");
  const unifab::collectives::NcclRuntime* nccl = nullptr;
  UF_CHECK(unifab::collectives::ncclRuntime(&nccl));
  const bool present = given != nullptr && out != nullptr;
  const unifabEngramConfig_t absent{};  // size 0: refused below
  const unifabEngramConfig_t& config = given != nullptr ? *given : absent;
  const bool sized = present && config.size >= sizeof(unifabEngramConfig_t);
  auto checkConfig = [&]() -> Result {
    if (!present) {
      return UF_ERROR(unifabInvalidArgument, kExt, "unifabEngramCreate: config=%p and table=%p must not be NULL",
                      static_cast<const void*>(given), static_cast<void*>(out));
    }
    // A rank on the wrong current device takes part too (the agreement runs on the communicator's).
    UF_CHECK(unifab::collectives::requireCommDevice(comm));
    UF_CHECK(requireStructSize(config, "config", "initialise it with UNIFAB_ENGRAM_CONFIG_INIT"));
    if (config.rowBytes < 16 || config.rowBytes % 16 != 0 || config.rowBytes > engram::kMaxRowBytes) {
      return UF_ERROR(unifabInvalidArgument, kExt, "config->rowBytes=%zu must be a multiple of 16 in 16..%zu",
                      config.rowBytes, engram::kMaxRowBytes);
    }
    if (config.rowsPerRank < 1 || config.rowsPerRank > (int64_t{1} << 40) / static_cast<int64_t>(config.rowBytes)) {
      return UF_ERROR(unifabInvalidArgument, kExt, "config->rowsPerRank=%lld must be in 1..%lld for %zu-byte rows",
                      static_cast<long long>(config.rowsPerRank),
                      static_cast<long long>((int64_t{1} << 40) / static_cast<int64_t>(config.rowBytes)),
                      config.rowBytes);
    }
    if (config.rowScales != 0 && config.rowScales != 1) {
      return UF_ERROR(unifabInvalidArgument, kExt, "config->rowScales=%d is neither 0 nor 1", config.rowScales);
    }
    return unifabSuccess;
  };
  // Every rank learns whether every rank's table is valid and shaped alike before any goes on:
  // equal window sizes from different shapes (64-byte rows x 1000 and 128 x 500) would otherwise
  // pass every check and fetch the wrong bytes.
  const Result checked = checkConfig();
  const int64_t shared[] = {sized ? static_cast<int64_t>(config.rowBytes) : -1, sized ? config.rowsPerRank : -1,
                            sized ? config.rowScales : -1};
  static const char* const kSharedNames[] = {"rowBytes", "rowsPerRank", "rowScales"};
  const Result agreed = unifab::collectives::agreeAcrossRanks(*nccl, comm, "unifabEngramCreate",
                                                              checked == unifabSuccess, shared, kSharedNames, 3);
  if (checked != unifabSuccess) return checked;
  UF_CHECK(agreed);
  std::unique_ptr<unifabEngramTable> table(new unifabEngramTable());
  table->config_ = config;
  UF_CHECK(unifab::collectives::DeviceComm::acquire(comm, &table->comm_));
  const auto& dc = *table->comm_;
  if (dc.lsaSize() > ken::kMaxPeers) {
    return UF_ERROR(unifabInvalidUsage, kExt, "%d NVLink peers: Engram tables span at most %d", dc.lsaSize(),
                    ken::kMaxPeers);
  }
  const size_t rowsBytes = static_cast<size_t>(config.rowsPerRank) * config.rowBytes;
  table->scalesOffset_ = rowsBytes;
  const size_t windowBytes = rowsBytes + (config.rowScales ? sizeof(float) * static_cast<size_t>(config.rowsPerRank) : 0);
  // This rank's own resources first; the window's creation (collective) learns whether every rank
  // got them before any registers.
  unifab::collectives::DeviceGuard guard(dc.cudaDevice());
  auto allocateLocal = [&]() -> Result {
    UF_CUDA_CHECK(cudaStreamCreateWithFlags(&table->stream_, cudaStreamNonBlocking));
    UF_CUDA_CHECK(cudaMalloc(&table->deviceMemory_, sizeof(int)));
    UF_CUDA_CHECK(cudaMemset(table->deviceMemory_, 0, sizeof(int)));
    UF_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&table->hostError_), sizeof(int), cudaHostAllocMapped));
    *table->hostError_ = 0;
    UF_CUDA_CHECK(cudaDeviceGetAttribute(&table->deviceSms_, cudaDevAttrMultiProcessorCount, dc.cudaDevice()));
    UF_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&table->view_.hostError), table->hostError_, 0));
    return unifabSuccess;
  };
  const Result allocated = allocateLocal();
  const Result windowed = unifab::collectives::SymmetricWindow::create(
      table->comm_, windowBytes, allocated == unifabSuccess, "config->rowsPerRank x config->rowBytes", &table->window_);
  if (allocated != unifabSuccess) return allocated;
  UF_CHECK(windowed);
  ken::TableView& v = table->view_;
  v.firstRank = dc.rank() - dc.lsaRank();
  v.peers = dc.lsaSize();
  v.rowsPerRank = config.rowsPerRank;
  v.rowBytes = static_cast<int64_t>(config.rowBytes);
  for (int p = 0; p < v.peers; ++p) {
    v.rows[p] = table->window_->peerBases()[p];
    v.scales[p] = config.rowScales ? reinterpret_cast<float*>(v.rows[p] + table->scalesOffset_) : nullptr;
  }
  v.error = static_cast<int*>(table->deviceMemory_);
  UF_INFO(kExt, kLogInit, "Engram table: rank %d, %lld rows of %zu B per rank%s over %d NVLink peers (%zu MiB here)",
          dc.rank(), static_cast<long long>(config.rowsPerRank), config.rowBytes, config.rowScales ? " with scales" : "",
          v.peers, windowBytes >> 20);
  *out = table.release();
  return unifabSuccess;
}

unifabEngramTable::~unifabEngramTable() {
  if (comm_) {
    unifab::collectives::DeviceGuard guard(comm_->cudaDevice());
    if (stream_ != nullptr) {
      UF_CUDA_WARN(cudaStreamSynchronize(stream_));
      UF_CUDA_WARN(cudaStreamDestroy(stream_));
    }
    UF_CUDA_WARN(cudaDeviceSynchronize());  // readers elsewhere on this GPU may still use the rows
  }
  if (deviceMemory_ != nullptr) UF_CUDA_WARN(cudaFree(deviceMemory_));
  if (hostError_ != nullptr) UF_CUDA_WARN(cudaFreeHost(hostError_));
  window_.reset();  // collective deregistration
}

Result unifabEngramTable::write(int64_t firstRow, int64_t numRows, const void* rows, const float* scales,
                                cudaStream_t stream) {
  UF_CHECK(asyncError());
  // numRows against what is left after firstRow: firstRow + numRows could wrap.
  if (firstRow < 0 || numRows < 0 || firstRow > config_.rowsPerRank || numRows > config_.rowsPerRank - firstRow) {
    return UF_ERROR(unifabInvalidArgument, kExt, "firstRow=%lld, numRows=%lld: rows outside this rank's 0..%lld",
                    static_cast<long long>(firstRow), static_cast<long long>(numRows),
                    static_cast<long long>(config_.rowsPerRank - 1));
  }
  if (numRows > 0 && rows == nullptr) return UF_ERROR(unifabInvalidArgument, kExt, "rows=NULL with numRows=%lld",
                                                      static_cast<long long>(numRows));
  if (numRows > 0 && config_.rowScales && scales == nullptr) {
    return UF_ERROR(unifabInvalidArgument, kExt, "scales=NULL: the table carries a scale per row");
  }
  UF_CHECK(unifab::collectives::checkStreamDevice(stream, comm_->cudaDevice()));
  // The copy engine would fault on a range past its allocation, or read host memory the caller
  // did not mean: the documented source is device memory.
  if (numRows > 0) {
    UF_CHECK(unifab::collectives::checkDeviceRange(rows, static_cast<size_t>(numRows) * config_.rowBytes,
                                                   comm_->cudaDevice(), "rows"));
    if (config_.rowScales) {
      UF_CHECK(unifab::collectives::checkDeviceRange(scales, sizeof(float) * static_cast<size_t>(numRows),
                                                     comm_->cudaDevice(), "scales"));
    }
  }
  unifab::collectives::DeviceGuard guard(comm_->cudaDevice());
  char* local = window_->localBase();
  UF_CHECK(unifab::collectives::copyEngineCopy(local + static_cast<size_t>(firstRow) * config_.rowBytes, rows,
                                               static_cast<size_t>(numRows) * config_.rowBytes, stream));
  if (config_.rowScales && numRows > 0) {
    UF_CHECK(unifab::collectives::copyEngineCopy(reinterpret_cast<float*>(local + scalesOffset_) + firstRow, scales,
                                                 sizeof(float) * static_cast<size_t>(numRows), stream));
  }
  return unifabSuccess;
}

Result unifabEngramTable::validate(const unifabEngramFetchArgs_t& a, cudaStream_t stream) const {
  UF_CHECK(requireStructSize(a, "args", "initialise it with UNIFAB_ENGRAM_FETCH_ARGS_INIT"));
  if (rawEnum(a.rowIdType) != unifabEpIndexInt64 && rawEnum(a.rowIdType) != unifabEpIndexInt32) {
    return UF_ERROR(unifabInvalidArgument, kExt, "rowIdType=%d is neither int64 (0) nor int32 (1)", rawEnum(a.rowIdType));
  }
  const int engine = rawEnum(a.engine);
  if (engine != unifabEngramAuto && engine != unifabEngramCopyEngine && engine != unifabEngramSmGather) {
    return UF_ERROR(unifabInvalidArgument, kExt, "engine=%d is not a unifabEngramEngine_t value (0..2)", engine);
  }
  if (engine == unifabEngramCopyEngine && a.hostRowIds == 0) {
    return UF_ERROR(unifabInvalidArgument, kExt,
                    "engine=unifabEngramCopyEngine needs hostRowIds=1: the copy engine's copies are built on the host");
  }
  if (a.maxSms < 0 || a.maxSms > deviceSms_) {
    return UF_ERROR(unifabInvalidArgument, kExt, "maxSms=%d is outside 0..%d (0: %d)", a.maxSms, deviceSms_,
                    engram::kDefaultGatherSms);
  }
  // Bounded so that numRows x rowBytes (the output's size) and the row counts the kernels take as
  // int64 cannot wrap.
  const size_t maxRows = static_cast<size_t>(INT64_MAX) / config_.rowBytes;
  if (a.numRows > maxRows) {
    return UF_ERROR(unifabInvalidArgument, kExt, "numRows=%zu exceeds %zu (numRows x rowBytes=%zu must fit int64)",
                    a.numRows, maxRows, config_.rowBytes);
  }
  const size_t idBytes = rawEnum(a.rowIdType) == unifabEpIndexInt32 ? sizeof(int32_t) : sizeof(int64_t);
  if (a.numRows > 0) {
    if (a.rowIds == nullptr) return UF_ERROR(unifabInvalidArgument, kExt, "rowIds=NULL with numRows=%zu", a.numRows);
    // The gather kernel loads each id whole: a misaligned one faults the context (host ids are
    // read by the host, where they need not be).
    if (a.hostRowIds == 0 && !unifab::collectives::alignedTo(a.rowIds, idBytes)) {
      return UF_ERROR(unifabInvalidArgument, kExt, "rowIds=%p must be aligned to its %zu-byte ids", a.rowIds, idBytes);
    }
    if (a.hostRowIds != 0) {
      // Read on the host: device memory there would fault the process instead of failing the call.
      cudaPointerAttributes where{};
      UF_CUDA_CHECK(cudaPointerGetAttributes(&where, a.rowIds));
      if (where.type == cudaMemoryTypeDevice) {
        return UF_ERROR(unifabInvalidArgument, kExt,
                        "rowIds=%p is device memory with hostRowIds=1: host ids must be host-readable", a.rowIds);
      }
    }
    if (a.out == nullptr || !aligned16(a.out)) {
      return UF_ERROR(unifabInvalidArgument, kExt, "out=%p must be a non-NULL device pointer aligned to 16 bytes", a.out);
    }
    if (config_.rowScales && (a.outScales == nullptr || !unifab::collectives::alignedTo(a.outScales, sizeof(float)))) {
      return UF_ERROR(unifabInvalidArgument, kExt,
                      "outScales=%p must be a non-NULL device pointer aligned to 4 bytes: the table carries a float "
                      "scale per row", static_cast<const void*>(a.outScales));
    }
  }
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  UF_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone) {
    return UF_ERROR(unifabInvalidUsage, kExt,
                    "Engram fetches cannot be captured in a CUDA graph yet: they run on the table's own stream, which "
                    "other fetches share");
  }
  UF_CHECK(unifab::collectives::checkStreamDevice(stream, comm_->cudaDevice()));
  UF_CHECK(checkedRanges_.check(a.out, a.numRows * config_.rowBytes, comm_->cudaDevice(), "out"));
  if (a.hostRowIds == 0) {
    // Read by the gather kernel: host or another GPU's memory would fault the context.
    UF_CHECK(checkedRanges_.check(a.rowIds, a.numRows * idBytes, comm_->cudaDevice(), "rowIds"));
  }
  if (config_.rowScales) {
    UF_CHECK(checkedRanges_.check(a.outScales, a.numRows * sizeof(float), comm_->cudaDevice(), "outScales"));
  }
  return unifabSuccess;
}

Result unifabEngramTable::copyEngineFetch(const unifabEngramFetchArgs_t& a) {
  std::vector<int64_t> ids(a.numRows);
  for (size_t i = 0; i < a.numRows; ++i) {
    ids[i] = a.rowIdType == unifabEpIndexInt32 ? static_cast<int64_t>(static_cast<const int32_t*>(a.rowIds)[i])
                                               : static_cast<const int64_t*>(a.rowIds)[i];
  }
  std::vector<engram::RowRun> runs;
  size_t bad = 0;
  if (!engram::planRuns(ids, view_.firstRank, view_.peers, view_.rowsPerRank, &runs, &bad)) {
    return UF_ERROR(unifabInvalidArgument, kExt,
                    "rowIds[%zu]=%lld is outside the rows of ranks %d..%d (0..%lld rows each; other ranks are not "
                    "NVLink peers of this one)", bad, static_cast<long long>(ids[bad]), view_.firstRank,
                    view_.firstRank + view_.peers - 1, static_cast<long long>(view_.rowsPerRank - 1));
  }
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<size_t> sizes;
  auto flush = [&]() -> Result {
    if (dsts.empty()) return unifabSuccess;
    UF_CHECK(unifab::collectives::copyEngineBatch(dsts.data(), srcs.data(), sizes.data(), dsts.size(), stream_));
    dsts.clear();
    srcs.clear();
    sizes.clear();
    return unifabSuccess;
  };
  for (bool scales : {false, true}) {
    if (scales && !config_.rowScales) break;
    const size_t unit = scales ? sizeof(float) : config_.rowBytes;
    for (const engram::RowRun& run : runs) {
      const char* base = scales ? reinterpret_cast<const char*>(view_.scales[run.peer]) : view_.rows[run.peer];
      char* out = scales ? reinterpret_cast<char*>(a.outScales) : static_cast<char*>(a.out);
      dsts.push_back(out + run.firstOut * unit);
      srcs.push_back(base + static_cast<size_t>(run.firstRow) * unit);
      sizes.push_back(static_cast<size_t>(run.rows) * unit);
      if (dsts.size() == engram::kCopiesPerBatch) UF_CHECK(flush());
    }
    UF_CHECK(flush());
  }
  return unifabSuccess;
}

Result unifabEngramTable::gatherFetch(const unifabEngramFetchArgs_t& a, int sms) {
  ken::GatherArgs args;
  args.rowIds = a.rowIds;
  args.rowIdsAre32 = a.rowIdType == unifabEpIndexInt32;
  args.numRows = static_cast<int64_t>(a.numRows);
  args.out = static_cast<char*>(a.out);
  args.outScales = config_.rowScales ? a.outScales : nullptr;
  UF_CUDA_CHECK(ken::launchGather(view_, args, sms, stream_));
  return unifabSuccess;
}

Result unifabEngramTable::issue(const unifabEngramFetchArgs_t& a, cudaStream_t stream, unifabEngramFetch** fetch) {
  UF_CHECK(asyncError());
  UF_CHECK(validate(a, stream));
  unifab::collectives::DeviceGuard guard(comm_->cudaDevice());
  // The gather kernel reads the ids on the device, the copy engine on the host: the automatic
  // choice follows where the ids are.
  const bool copyEngine = a.engine == unifabEngramCopyEngine || (a.engine == unifabEngramAuto && a.hostRowIds != 0);
  if (!copyEngine && a.hostRowIds != 0) {
    return UF_ERROR(unifabInvalidArgument, kExt,
                    "hostRowIds=1 with the gather kernel: pass the ids in device memory, or choose the copy engine");
  }
  const int cap = a.maxSms > 0 ? a.maxSms : engram::kDefaultGatherSms;
  const int sms = copyEngine ? 0 : static_cast<int>(std::clamp<size_t>((a.numRows + 31) / 32, 1, static_cast<size_t>(cap)));
  auto made = std::make_unique<unifabEngramFetch>();
  made->smsUsed = sms;
  std::lock_guard<std::mutex> lock(mutex_);
  cudaEvent_t after = nullptr;
  UF_CUDA_CHECK(cudaEventCreateWithFlags(&after, cudaEventDisableTiming));
  cudaError_t forked = cudaEventRecord(after, stream);
  if (forked == cudaSuccess) forked = cudaStreamWaitEvent(stream_, after, 0);
  UF_CUDA_WARN(cudaEventDestroy(after));  // released once the wait has used it
  UF_CUDA_CHECK(forked);
  if (a.numRows > 0) {
    const Result fetched = copyEngine ? copyEngineFetch(a) : gatherFetch(a, sms);
    if (fetched != unifabSuccess) {
      // Copies of earlier batches may be queued: the caller gets no handle to wait on, so they
      // must be over before it may reuse `out`.
      UF_CUDA_WARN(cudaStreamSynchronize(stream_));
      return fetched;
    }
  }
  UF_CUDA_CHECK(cudaEventCreateWithFlags(&made->done, cudaEventDisableTiming));
  UF_CUDA_CHECK(cudaEventRecord(made->done, stream_));
  {
    std::lock_guard<std::mutex> live(liveFetchesMutex());
    liveFetches().insert(made.get());
  }
  *fetch = made.release();
  return unifabSuccess;
}

Result unifabEngramTable::wait(unifabEngramFetch* fetch, cudaStream_t stream, int* smsUsed) {
  if (fetch == nullptr) return UF_ERROR(unifabInvalidArgument, kExt, "unifabEngramWait: fetch=NULL");
  {
    // Claimed here, so that of two threads waiting on one fetch only one goes on.
    std::lock_guard<std::mutex> live(liveFetchesMutex());
    if (liveFetches().erase(fetch) == 0) {
      return UF_ERROR(unifabInvalidArgument, kExt,
                      "unifabEngramWait: fetch=%p is not a pending fetch (waited for already, or not from "
                      "unifabEngramFetchIssue)", static_cast<void*>(fetch));
    }
  }
  // Released only once `stream` waits for it: after a failed wait the caller still holds a fetch
  // to wait for before it reuses the output.
  const cudaError_t waited = cudaStreamWaitEvent(stream, fetch->done, 0);
  if (waited != cudaSuccess) {
    std::lock_guard<std::mutex> live(liveFetchesMutex());
    liveFetches().insert(fetch);
  }
  UF_CUDA_CHECK(waited);
  std::unique_ptr<unifabEngramFetch> owned(fetch);
  if (smsUsed != nullptr) *smsUsed = owned->smsUsed;
  UF_CUDA_CHECK(cudaEventDestroy(owned->done));  // released once the wait has used it
  return unifabSuccess;
}

Result unifabEngramTable::asyncError() const {
  const int code = *reinterpret_cast<volatile int*>(hostError_);
  if ((code & ken::kErrorRowId) != 0) {
    return UF_ERROR(unifabInvalidArgument, kExt,
                    "an earlier Engram fetch on rank %d met a row id outside the table (its row was zeroed)",
                    comm_->rank());
  }
  return unifabSuccess;
}
