#include "collectives/pp/rendezvous.h"

#include <cuda.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <new>
#include <random>

#include "collectives/common/cuda_check.h"
#include "collectives/common/device_range.h"

namespace unifab::collectives::pp {
size_t Inbox::bytesFor(int peers) { return sizeof(RendezvousEntry) * static_cast<size_t>(peers) * kRing; }

Result Inbox::create(int peers, std::unique_ptr<Inbox>* out) {
  static std::atomic<int> made{0};
  std::unique_ptr<Inbox> inbox(new Inbox());
  char name[kNameBytes];
  // The process part (pid and a random token drawn once per process) tells a peer whether it
  // shares this process: pids alone repeat across the PID namespaces of containers on one node.
  static const unsigned long long processToken = (static_cast<unsigned long long>(std::random_device{}()) << 32) ^
                                                 std::random_device{}();
  snprintf(name, sizeof(name), "/unifab-pp-%d.%llx-%d", static_cast<int>(getpid()), processToken, made.fetch_add(1));
  inbox->name_ = name;
  inbox->peers_ = peers;
  inbox->bytes_ = bytesFor(peers);
  const int fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) return UF_ERROR(unifabSystemError, kExt, "shm_open(%s) failed: %s", name, strerror(errno));
  inbox->owner_ = true;
  const bool sized = ftruncate(fd, static_cast<off_t>(inbox->bytes_)) == 0;
  const int sizeErrno = errno;
  void* memory = sized ? mmap(nullptr, inbox->bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
  const int mapErrno = errno;
  close(fd);
  if (!sized) return UF_ERROR(unifabSystemError, kExt, "sizing %s to %zu bytes failed: %s", name, inbox->bytes_, strerror(sizeErrno));
  if (memory == MAP_FAILED) return UF_ERROR(unifabSystemError, kExt, "mmap of %s failed: %s", name, strerror(mapErrno));
  inbox->memory_ = memory;
  // ftruncate zero-fills: every sequence word reads 0 ("nothing posted"), a valid atomic state.
  *out = std::move(inbox);
  return unifabSuccess;
}

Result Inbox::open(const char* name, int peers, std::unique_ptr<Inbox>* out) {
  std::unique_ptr<Inbox> inbox(new Inbox());
  inbox->name_ = name;
  inbox->peers_ = peers;
  inbox->bytes_ = bytesFor(peers);
  const int fd = shm_open(name, O_RDWR, 0600);
  if (fd < 0) return UF_ERROR(unifabSystemError, kExt, "shm_open(%s) of a peer failed: %s", name, strerror(errno));
  void* memory = mmap(nullptr, inbox->bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int mapErrno = errno;
  close(fd);
  if (memory == MAP_FAILED) return UF_ERROR(unifabSystemError, kExt, "mmap of %s failed: %s", name, strerror(mapErrno));
  inbox->memory_ = memory;
  *out = std::move(inbox);
  return unifabSuccess;
}

std::string Inbox::processOf(const char* name) {
  // "/unifab-pp-PID.TOKEN-COUNT": the prefix up to the process part's end.
  const char* afterPrefix = name + strlen("/unifab-pp-");
  const char* dash = strchr(afterPrefix, '-');
  return dash == nullptr ? std::string(name) : std::string(name, dash - name);
}

void Inbox::unlink() {
  if (owner_) shm_unlink(name_.c_str());
  owner_ = false;
}

Inbox::~Inbox() {
  unlink();
  if (memory_ != nullptr) munmap(memory_, bytes_);
}

RendezvousEntry& Inbox::entry(int sender, uint64_t sequence) {
  auto* entries = static_cast<RendezvousEntry*>(memory_);
  return entries[static_cast<size_t>(sender) * kRing + (sequence - 1) % kRing];
}

Result BufferExporter::describe(const void* data, size_t bytes, Posting* out) {
  *out = Posting{};
  out->bytes = bytes;
  out->address = reinterpret_cast<uintptr_t>(data);
  if (bytes == 0) return unifabSuccess;
  const unifab::collectives::PointerGetAttributes getAttributes = unifab::collectives::pointerGetAttributes();
  if (getAttributes == nullptr) {
    return UF_ERROR(unifabSystemError, kExt, "the CUDA driver has no cuPointerGetAttributes: pipeline send/recv needs it");
  }
  CUpointer_attribute which[3] = {CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, CU_POINTER_ATTRIBUTE_BUFFER_ID,
                                  CU_POINTER_ATTRIBUTE_RANGE_START_ADDR};
  int capable = 0;
  unsigned long long bufferId = 0;
  CUdeviceptr start = 0;
  void* values[3] = {&capable, &bufferId, &start};
  const CUresult r = getAttributes(3, which, values, reinterpret_cast<CUdeviceptr>(data));
  if (r != CUDA_SUCCESS || capable == 0 || start == 0) return unifabSuccess;
  auto found = handles_.find(bufferId);
  if (found == handles_.end()) {
    cudaIpcMemHandle_t handle;
    if (cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(start)) != cudaSuccess) {
      (void)cudaGetLastError();  // not sticky: the buffer is just not mappable
      return unifabSuccess;
    }
    found = handles_.emplace(bufferId, handle).first;
  }
  out->mappable = 1;
  out->bufferId = bufferId;
  out->offset = reinterpret_cast<CUdeviceptr>(data) - start;
  memcpy(out->allocation, &found->second, sizeof(found->second));
  return unifabSuccess;
}

Result BufferImporter::map(int peer, const Posting& p, char** data) {
  const auto key = std::make_pair(peer, p.bufferId);
  auto found = mapped_.find(key);
  if (found == mapped_.end()) {
    void* opened = nullptr;
    cudaIpcMemHandle_t handle;
    memcpy(&handle, p.allocation, sizeof(handle));
    UF_CUDA_CHECK(cudaIpcOpenMemHandle(&opened, handle, cudaIpcMemLazyEnablePeerAccess));
    found = mapped_.emplace(key, static_cast<char*>(opened)).first;
  }
  *data = found->second + p.offset;
  return unifabSuccess;
}

void BufferImporter::closeAll() {
  for (auto& m : mapped_) UF_CUDA_WARN(cudaIpcCloseMemHandle(m.second));
  mapped_.clear();
}

BufferImporter::~BufferImporter() { closeAll(); }

}  // namespace unifab::collectives::pp
