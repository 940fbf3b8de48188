// Symmetric memory on the caller's communicator: one cuMem allocation per rank registered as an
// NCCL window, and the device communicator built once per communicator and shared by every
// extension operation on it.
#pragma once

#include <memory>
#include <vector>

#include "collectives/common/nccl_runtime.h"

namespace unifab::collectives {

// The calling thread's current CUDA device is `comm`'s (unifabInvalidUsage naming both otherwise),
// checked without any collective step: an operation's creation calls it before its first one, so
// that a rank that fails here never leaves its peers waiting in NCCL.
Result requireCommDevice(ncclComm_t comm);

// The element-wise maximum of `values` over every rank of `comm`, in place (an NCCL all-reduce on
// a private stream, waited for on the host): for setting memory up only.
Result allRanksMax(const NcclRuntime& nccl, ncclComm_t comm, int64_t* values, size_t count);

// The step every rank of a collective creation takes before any commits memory to it: each rank
// brings whether its own checks passed and the `count` values (named by `names`) that must be the
// same on every rank, and every rank gets the same answer. Success; unifabInvalidUsage naming the
// first value the ranks disagree on (with its range); or unifabInvalidUsage saying another rank
// refused (a rank whose own checks failed returns its own error instead). Without it a rank that
// refused alone, or ranks sizing their windows differently, would leave peers waiting in NCCL
// or reading past each other's memory.
Result agreeAcrossRanks(const NcclRuntime& nccl, ncclComm_t comm, const char* operation, bool locallyValid,
                        const int64_t* values, const char* const* names, size_t count);

// The device communicator of one ncclComm_t (rank, size and the LSA team).
class DeviceComm {
 public:
  // Collective on first use for `comm`; later calls share the same object.
  static Result acquire(ncclComm_t comm, std::shared_ptr<DeviceComm>* out);
  ~DeviceComm();
  DeviceComm(const DeviceComm&) = delete;
  DeviceComm& operator=(const DeviceComm&) = delete;

  ncclComm_t comm() const { return comm_; }
  int rank() const { return devComm_.rank; }
  int nRanks() const { return devComm_.nRanks; }
  int lsaRank() const { return devComm_.lsaRank; }
  int lsaSize() const { return devComm_.lsaSize; }
  int cudaDevice() const { return cudaDevice_; }
  const NcclRuntime& nccl() const { return *nccl_; }
  // Blocks until every rank has called it (an NCCL all-reduce of one word): for setup only.
  Result barrier() const;

 private:
  DeviceComm() = default;
  ncclComm_t comm_ = nullptr;
  ncclDevComm devComm_{};
  int cudaDevice_ = -1;
  const NcclRuntime* nccl_ = nullptr;
};

// A zero-filled window of `bytes` on every rank (collective to create and to destroy), with the
// base address of every LSA peer's copy as this GPU sees it.
class SymmetricWindow {
 public:
  static Result create(std::shared_ptr<DeviceComm> comm, size_t bytes, std::unique_ptr<SymmetricWindow>* out);
  // What create(bytes) allocates and registers: the bytes, 16-aligned, then a 16-byte probe.
  static size_t registeredBytes(size_t bytes) { return (bytes + 15) / 16 * 16 + 16; }
  ~SymmetricWindow();
  SymmetricWindow(const SymmetricWindow&) = delete;
  SymmetricWindow& operator=(const SymmetricWindow&) = delete;

  char* localBase() const { return local_; }
  const std::vector<char*>& peerBases() const { return peerBases_; }

 private:
  SymmetricWindow() = default;
  std::shared_ptr<DeviceComm> comm_;
  char* local_ = nullptr;
  ncclWindow_t window_ = nullptr;
  std::vector<char*> peerBases_;
};

}  // namespace unifab::collectives
