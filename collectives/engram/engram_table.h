// Host side of Engram: the table's window (rows and row scales), its own stream, the choice of
// engine per fetch, and the copy-engine path (runs of adjacent ids merged into one copy).
#pragma once

#include <cuda_runtime.h>

#include <memory>
#include <mutex>
#include <vector>

#include "collectives/common/device_range.h"
#include "collectives/common/symmetric.h"
#include "kernels/engram/gather.h"
#include "unifab/unifab.h"


struct unifabEngramFetch {
  cudaEvent_t done = nullptr;
  int smsUsed = 0;
};

struct unifabEngramTable {
  // Collective; a NULL config or out is refused in the ranks' agreement (as unifabEpGroup::create).
  static unifab::Result create(ncclComm_t comm, const unifabEngramConfig_t* config, unifabEngramTable** out);
  ~unifabEngramTable();

  unifab::Result write(int64_t firstRow, int64_t numRows, const void* rows, const float* scales, cudaStream_t stream);
  unifab::Result issue(const unifabEngramFetchArgs_t& args, cudaStream_t stream, unifabEngramFetch** fetch);
  // Makes `stream` wait for `fetch` and releases it. A fetch waited for already (or not from
  // issue) is refused instead of read after its free; after a failed wait the caller still holds
  // it. (An address a newer fetch reuses passes.)
  static unifab::Result wait(unifabEngramFetch* fetch, cudaStream_t stream, int* smsUsed);
  unifab::Result asyncError() const;

 private:
  unifabEngramTable() = default;
  unifab::Result validate(const unifabEngramFetchArgs_t& a, cudaStream_t stream) const;
  unifab::Result copyEngineFetch(const unifabEngramFetchArgs_t& a);
  unifab::Result gatherFetch(const unifabEngramFetchArgs_t& a, int sms);

  std::shared_ptr<unifab::collectives::DeviceComm> comm_;
  std::unique_ptr<unifab::collectives::SymmetricWindow> window_;
  unifabEngramConfig_t config_{};
  unifab::kernels::engram::TableView view_{};
  size_t scalesOffset_ = 0;
  cudaStream_t stream_ = nullptr;  // fetches run here, after the caller's stream's earlier work
  void* deviceMemory_ = nullptr;   // the error word
  int* hostError_ = nullptr;
  int deviceSms_ = 0;
  std::mutex mutex_;               // one fetch at a time is posted to stream_
  // A decoding loop fetches into the same buffers call after call: each allocation is asked of the
  // driver once (three pointer queries would cost ~5 us of a fetch's host time).
  mutable unifab::collectives::CheckedRanges checkedRanges_;
};
