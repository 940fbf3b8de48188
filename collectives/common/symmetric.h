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
  // Every rank calls it, `locallyReady` false where the caller's own preparation failed: the ranks
  // agree (agreement.h) before registering, after it and after checking the peers' copies, so a
  // rank that fails anywhere is refused with all the others instead of leaving them in NCCL. A
  // rank that was not ready gets unifabInvalidArgument and returns its own error. `sizedBy` names
  // what set `bytes` (the caller's configuration fields), for the error when they do not fit.
  static Result create(std::shared_ptr<DeviceComm> comm, size_t bytes, bool locallyReady, const char* sizedBy,
                       std::unique_ptr<SymmetricWindow>* out);
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
