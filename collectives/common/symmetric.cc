#include "collectives/common/symmetric.h"

#include <cstring>
#include <map>
#include <string>
#include <mutex>

#include "collectives/common/agreement.h"
#include "collectives/common/cuda_check.h"
#include "collectives/common/device_guard.h"
#include "kernels/common/window.h"

namespace unifab::collectives {
namespace {

// One entry per communicator. Creating a device communicator is collective, so a process that
// drives each of its GPUs from its own thread has several creations in flight at once: each
// waits under its own communicator's mutex, never under the registry's.
struct RegistryEntry {
  std::mutex creating;
  std::weak_ptr<DeviceComm> comm;
  // NCCL's refusal to build a device communicator, kept for the handle's later callers. (Keyed by
  // the handle: a communicator created at the same address after this one is destroyed inherits
  // the refusal; NCCL gives no identity to tell them apart.)
  Result failure = unifabSuccess;
  std::string failureMessage;
};
std::mutex g_registryMutex;
std::map<ncclComm_t, std::shared_ptr<RegistryEntry>> g_registry;

// Every LSA peer's window base as this GPU addresses it, and the probe word read through it. A
// private stream keeps the application's streams out of it; one allocation holds both arrays.
cudaError_t readPeerBases(ncclWindow_t window, int lsaSize, size_t probeOffset, char** bases, int* probes) {
  cudaStream_t stream = nullptr;
  cudaError_t status = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  if (status != cudaSuccess) return status;
  const size_t basesBytes = sizeof(char*) * lsaSize;
  char* scratch = nullptr;
  status = cudaMallocAsync(&scratch, basesBytes + sizeof(int) * lsaSize, stream);
  if (status == cudaSuccess) {
    char** deviceBases = reinterpret_cast<char**>(scratch);
    int* deviceProbes = reinterpret_cast<int*>(scratch + basesBytes);
    status = kernels::queryPeerBases(window, lsaSize, probeOffset, deviceBases, deviceProbes, stream);
    if (status == cudaSuccess) status = cudaMemcpyAsync(bases, deviceBases, basesBytes, cudaMemcpyDeviceToHost, stream);
    if (status == cudaSuccess) {
      status = cudaMemcpyAsync(probes, deviceProbes, sizeof(int) * lsaSize, cudaMemcpyDeviceToHost, stream);
    }
    UF_CUDA_WARN(cudaFreeAsync(scratch, stream));
  }
  cudaError_t synced = cudaStreamSynchronize(stream);
  if (status == cudaSuccess) status = synced;
  UF_CUDA_WARN(cudaStreamDestroy(stream));
  return status;
}

}  // namespace

Result requireCommDevice(ncclComm_t comm) {
  if (comm == nullptr) return UF_ERROR(unifabInvalidArgument, kExt, "comm=NULL");
  const NcclRuntime* nccl = nullptr;
  UF_CHECK(ncclRuntime(&nccl));
  int current = -1, commDevice = -1;
  UF_CUDA_CHECK(cudaGetDevice(&current));
  UF_NCCL_CHECK(nccl->commCuDevice(comm, &commDevice), comm);
  if (current != commDevice) {
    return UF_ERROR(unifabInvalidUsage, kExt, "the current CUDA device is %d but the communicator's is %d", current,
                    commDevice);
  }
  return unifabSuccess;
}

Result DeviceComm::acquire(ncclComm_t comm, std::shared_ptr<DeviceComm>* out) {
  if (comm == nullptr) return UF_ERROR(unifabInvalidArgument, kExt, "comm=NULL");
  std::shared_ptr<RegistryEntry> entry;
  {
    std::lock_guard<std::mutex> lock(g_registryMutex);
    std::shared_ptr<RegistryEntry>& slot = g_registry[comm];
    if (!slot) slot = std::make_shared<RegistryEntry>();
    entry = slot;
  }
  std::lock_guard<std::mutex> creating(entry->creating);
  if (auto existing = entry->comm.lock()) {
    *out = std::move(existing);
    return unifabSuccess;
  }
  // NCCL refused this communicator once: asking again would enter a collective that can hang
  // (measured: a second ncclDevCommCreate after "GIN not supported" never returned).
  if (entry->failure != unifabSuccess) {
    return UF_ERROR(entry->failure, kExt, "%s", entry->failureMessage.c_str());
  }
  std::shared_ptr<DeviceComm> created(new DeviceComm());
  UF_CHECK(ncclRuntime(&created->nccl_));
  const NcclRuntime& n = *created->nccl_;
  // comm_ stays null until NCCL has built the device communicator: the destructor destroys only
  // what exists (ncclDevCommDestroy of a refused one never returned).
  UF_NCCL_CHECK(n.commCuDevice(comm, &created->cudaDevice_), comm);
  DeviceGuard guard(created->cudaDevice_);
#if defined(NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER)
  ncclDevCommRequirements requirements = NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER;
#else
  ncclDevCommRequirements requirements;
  memset(&requirements, 0, sizeof(requirements));  // NCCL 2.28 has no initializer: zero is "nothing extra"
#endif
  const ncclResult_t made = n.devCommCreate(comm, &requirements, &created->devComm_);
  if (made != ncclSuccess) {
    entry->failure = UF_ERROR(made == ncclInvalidUsage ? unifabInvalidUsage : unifabSystemError, kExt,
                              "NCCL cannot build a device communicator on this communicator (%s: %s): extension "
                              "operations in this version need every rank in one NVLink (LSA) domain",
                              n.getErrorString(made), n.getLastError(comm));
    entry->failureMessage = lastErrorMessage();
    return entry->failure;
  }
  created->comm_ = comm;
  UF_INFO(kExt, kLogInit, "device communicator: rank %d of %d, LSA rank %d of %d, GPU %d", created->rank(),
          created->nRanks(), created->lsaRank(), created->lsaSize(), created->cudaDevice_);
  entry->comm = created;
  *out = std::move(created);
  return unifabSuccess;
}

DeviceComm::~DeviceComm() {
  if (comm_ == nullptr) return;
  DeviceGuard guard(cudaDevice_);
  if (nccl_->devCommDestroy(comm_, &devComm_) != ncclSuccess) {
    UF_WARN(kExt, "ncclDevCommDestroy failed: %s", nccl_->getLastError(comm_));
  }
  std::lock_guard<std::mutex> lock(g_registryMutex);
  auto it = g_registry.find(comm_);
  if (it == g_registry.end()) return;
  // A creation for the same communicator may be under way: its entry stays.
  std::lock_guard<std::mutex> creating(it->second->creating);
  if (it->second->comm.expired()) g_registry.erase(it);
}

Result SymmetricWindow::create(std::shared_ptr<DeviceComm> comm, size_t bytes, bool locallyReady, const char* sizedBy,
                               std::unique_ptr<SymmetricWindow>* out) {
  std::unique_ptr<SymmetricWindow> created(new SymmetricWindow());
  created->comm_ = comm;
  const NcclRuntime& n = comm->nccl();
  DeviceGuard guard(comm->cudaDevice());
  // The last 16 bytes hold a probe that proves every peer's copy is mapped here.
  const size_t total = registeredBytes(bytes);
  const size_t probeOffset = total - 16;
  // This rank's memory (the largest allocation of an operation) before any rank registers.
  auto prepare = [&]() -> Result {
    // A configuration too large for the GPU is the caller's argument: say which and by how much,
    // rather than only that the allocation failed.
    size_t freeBytes = 0, deviceBytes = 0;
    UF_CUDA_CHECK(cudaMemGetInfo(&freeBytes, &deviceBytes));
    if (total > freeBytes) {
      return UF_ERROR(unifabInvalidArgument, kExt,
                      "the window of %zu MiB that %s ask for exceeds this GPU's free memory (%zu of %zu MiB)",
                      total >> 20, sizedBy, freeBytes >> 20, deviceBytes >> 20);
    }
    void* memory = nullptr;
    UF_NCCL_CHECK(n.memAlloc(&memory, total), comm->comm());
    created->local_ = static_cast<char*>(memory);
    UF_CUDA_CHECK(cudaMemset(memory, 0, total));
    int probeValue = comm->rank() + 1;
    UF_CUDA_CHECK(cudaMemcpy(created->local_ + probeOffset, &probeValue, sizeof(probeValue), cudaMemcpyHostToDevice));
    // Both may still be in flight on the legacy stream, which the agreement's stream does not
    // follow: the peers read them after it.
    UF_CUDA_CHECK(cudaDeviceSynchronize());
    return unifabSuccess;
  };
  const Result prepared = locallyReady ? prepare() : unifabInvalidArgument;
  const Result allPrepared = agreeAcrossRanks(n, comm->comm(), "creating a symmetric window",
                                              prepared == unifabSuccess);
  if (prepared != unifabSuccess) return prepared;
  UF_CHECK(allPrepared);
  ncclResult_t registered =
      n.windowRegister(comm->comm(), created->local_, total, &created->window_, NCCL_WIN_COLL_SYMMETRIC);
  if (registered != ncclSuccess) {
    created->window_ = nullptr;
    UF_WARN(kExt, "ncclCommWindowRegister of %zu bytes failed: %s", total, n.getLastError(comm->comm()));
  }
  const Result allRegistered =
      agreeAcrossRanks(n, comm->comm(), "registering a symmetric window", registered == ncclSuccess);
  if (allRegistered != unifabSuccess && registered == ncclSuccess) {
    // Deregistering is collective and the rank that failed will not join it: the registration and
    // its memory are left behind rather than this rank waiting for it forever.
    UF_WARN(kExt, "a symmetric window of %zu bytes stays registered: another rank's registration failed", total);
    created->window_ = nullptr;
    created->local_ = nullptr;
  }
  UF_CHECK(allRegistered);

  // Every rank's memory is zeroed, probed and registered: read the peers' copies.
  const int lsaSize = comm->lsaSize();
  std::vector<int> probes(lsaSize, 0);
  created->peerBases_.assign(lsaSize, nullptr);
  auto checkPeers = [&]() -> Result {
    cudaError_t copied =
        readPeerBases(created->window_, lsaSize, probeOffset, created->peerBases_.data(), probes.data());
    if (copied != cudaSuccess) {
      return UF_ERROR(unifabInvalidUsage, kExt,
                      "reading the window of the LSA peers failed (%s): the communicator has no device-API support "
                      "(symmetric windows need CUDA P2P between all local GPUs and NCCL_WIN_ENABLE=1)",
                      cudaGetErrorString(copied));
    }
    int firstLsaWorld = comm->rank() - comm->lsaRank();
    for (int peer = 0; peer < lsaSize; ++peer) {
      if (probes[peer] != firstLsaWorld + peer + 1) {
        return UF_ERROR(unifabInvalidUsage, kExt,
                        "LSA peer %d's window reads %d instead of %d: the communicator has no device-API support "
                        "(symmetric windows need CUDA P2P between all local GPUs and NCCL_WIN_ENABLE=1)",
                        peer, probes[peer], firstLsaWorld + peer + 1);
      }
    }
    return unifabSuccess;
  };
  // Nobody writes into a peer before all have checked the probes, and all learn if one failed.
  const Result peersChecked = checkPeers();
  const Result allChecked = agreeAcrossRanks(n, comm->comm(), "checking a symmetric window's peers",
                                             peersChecked == unifabSuccess);
  if (peersChecked != unifabSuccess) return peersChecked;
  UF_CHECK(allChecked);
  UF_INFO(kExt, kLogAlloc, "symmetric window of %zu bytes registered on %d LSA peer(s)", total, lsaSize);
  *out = std::move(created);
  return unifabSuccess;
}

SymmetricWindow::~SymmetricWindow() {
  if (comm_ == nullptr) return;
  DeviceGuard guard(comm_->cudaDevice());
  const NcclRuntime& n = comm_->nccl();
  if (window_ != nullptr && n.windowDeregister(comm_->comm(), window_) != ncclSuccess) {
    UF_WARN(kExt, "ncclCommWindowDeregister failed: %s", n.getLastError(comm_->comm()));
  }
  if (local_ != nullptr && n.memFree(local_) != ncclSuccess) UF_WARN(kExt, "ncclMemFree failed");
}

}  // namespace unifab::collectives
