#include "collectives/common/symmetric.h"

#include <cstring>
#include <map>
#include <mutex>

#include "collectives/common/cuda_check.h"
#include "kernels/common/window.h"

namespace unifab::collectives {
namespace {

std::mutex g_registryMutex;
std::map<ncclComm_t, std::weak_ptr<DeviceComm>> g_registry;

// Makes `device` current for a scope and restores the caller's device afterwards.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    UF_CUDA_WARN(cudaGetDevice(&previous_));
    if (previous_ != device) UF_CUDA_WARN(cudaSetDevice(device));
  }
  ~DeviceGuard() { UF_CUDA_WARN(cudaSetDevice(previous_)); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

// A blocking all-rank barrier on the communicator, used only while setting memory up.
Result hostBarrier(const DeviceComm& comm) {
  cudaStream_t stream = nullptr;
  int* scratch = nullptr;
  UF_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  Result result = unifabSuccess;
  if (cudaMallocAsync(&scratch, sizeof(int), stream) != cudaSuccess ||
      cudaMemsetAsync(scratch, 0, sizeof(int), stream) != cudaSuccess) {
    result = UF_ERROR(unifabUnhandledCudaError, kExt, "allocating barrier scratch failed");
  } else if (comm.nccl().allReduce(scratch, scratch, 1, ncclInt32, ncclSum, comm.comm(), stream) != ncclSuccess) {
    result = UF_ERROR(unifabRemoteError, kExt, "barrier over the communicator failed: %s",
                      comm.nccl().getLastError(comm.comm()));
  }
  if (scratch != nullptr) UF_CUDA_WARN(cudaFreeAsync(scratch, stream));
  if (cudaStreamSynchronize(stream) != cudaSuccess && result == unifabSuccess) {
    result = UF_ERROR(unifabUnhandledCudaError, kExt, "barrier stream failed");
  }
  UF_CUDA_WARN(cudaStreamDestroy(stream));
  return result;
}

}  // namespace

Result DeviceComm::acquire(ncclComm_t comm, std::shared_ptr<DeviceComm>* out) {
  if (comm == nullptr) return UF_ERROR(unifabInvalidArgument, kExt, "comm=NULL");
  std::lock_guard<std::mutex> lock(g_registryMutex);
  if (auto existing = g_registry[comm].lock()) {
    *out = std::move(existing);
    return unifabSuccess;
  }
  std::shared_ptr<DeviceComm> created(new DeviceComm());
  UF_CHECK(ncclRuntime(&created->nccl_));
  const NcclRuntime& n = *created->nccl_;
  created->comm_ = comm;
  UF_NCCL_CHECK(n, n.commCuDevice(comm, &created->cudaDevice_), comm);
  DeviceGuard guard(created->cudaDevice_);
  ncclDevCommRequirements requirements;
  memset(&requirements, 0, sizeof(requirements));  // NCCL 2.28 has no initializer: zero is "nothing extra"
  UF_NCCL_CHECK(n, n.devCommCreate(comm, &requirements, &created->devComm_), comm);
  UF_INFO(kExt, kLogInit, "device communicator: rank %d of %d, LSA rank %d of %d, GPU %d", created->rank(),
          created->nRanks(), created->lsaRank(), created->lsaSize(), created->cudaDevice_);
  g_registry[comm] = created;
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
  if (it != g_registry.end() && it->second.expired()) g_registry.erase(it);
}

Result SymmetricWindow::create(std::shared_ptr<DeviceComm> comm, size_t bytes, std::unique_ptr<SymmetricWindow>* out) {
  std::unique_ptr<SymmetricWindow> created(new SymmetricWindow());
  created->comm_ = comm;
  const NcclRuntime& n = comm->nccl();
  DeviceGuard guard(comm->cudaDevice());
  // The last 16 bytes hold a probe that proves every peer's copy is mapped here.
  size_t probeOffset = (bytes + 15) / 16 * 16;
  size_t total = probeOffset + 16;
  void* memory = nullptr;
  UF_NCCL_CHECK(n, n.memAlloc(&memory, total), comm->comm());
  created->local_ = static_cast<char*>(memory);
  created->bytes_ = bytes;
  UF_CUDA_CHECK(cudaMemset(memory, 0, total));
  int probeValue = comm->rank() + 1;
  UF_CUDA_CHECK(cudaMemcpy(created->local_ + probeOffset, &probeValue, sizeof(probeValue), cudaMemcpyHostToDevice));
  UF_NCCL_CHECK(n, n.windowRegister(comm->comm(), memory, total, &created->window_, NCCL_WIN_COLL_SYMMETRIC),
                comm->comm());
  UF_CHECK(hostBarrier(*comm));  // every rank's memory is zeroed, probed and registered

  const int lsaSize = comm->lsaSize();
  char** deviceBases = nullptr;
  int* deviceProbe = nullptr;
  UF_CUDA_CHECK(cudaMalloc(&deviceBases, sizeof(char*) * lsaSize));
  UF_CUDA_CHECK(cudaMalloc(&deviceProbe, sizeof(int) * lsaSize));
  cudaError_t launched = kernels::queryPeerBases(created->window_, lsaSize, probeOffset, deviceBases, deviceProbe, nullptr);
  std::vector<int> probes(lsaSize, 0);
  created->peerBases_.assign(lsaSize, nullptr);
  cudaError_t copied = launched == cudaSuccess ? cudaDeviceSynchronize() : launched;
  if (copied == cudaSuccess) copied = cudaMemcpy(created->peerBases_.data(), deviceBases, sizeof(char*) * lsaSize, cudaMemcpyDeviceToHost);
  if (copied == cudaSuccess) copied = cudaMemcpy(probes.data(), deviceProbe, sizeof(int) * lsaSize, cudaMemcpyDeviceToHost);
  UF_CUDA_WARN(cudaFree(deviceBases));
  UF_CUDA_WARN(cudaFree(deviceProbe));
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
  UF_CHECK(hostBarrier(*comm));  // nobody writes into a peer before all have checked the probes
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
