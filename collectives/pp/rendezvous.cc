#include "collectives/pp/rendezvous.h"

#include <cuda.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <new>
#include <random>
#include <type_traits>

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

std::string channelNameOf(const char* inboxName) {
  return std::string(inboxName[0] == '/' ? inboxName + 1 : inboxName) + "-fd";
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

namespace {

// The driver's virtual-memory calls, through the runtime (unifab does not link libcuda), resolved
// once; `usable` false if this driver lacks any of them (virtual-memory buffers are then not
// mappable by the peer, as before).
struct VmmDriver {
  CUresult(CUDAAPI* retainAllocationHandle)(CUmemGenericAllocationHandle*, void*) = nullptr;
  CUresult(CUDAAPI* exportToShareableHandle)(void*, CUmemGenericAllocationHandle, CUmemAllocationHandleType,
                                             unsigned long long) = nullptr;
  CUresult(CUDAAPI* importFromShareableHandle)(CUmemGenericAllocationHandle*, void*, CUmemAllocationHandleType) = nullptr;
  CUresult(CUDAAPI* release)(CUmemGenericAllocationHandle) = nullptr;
  CUresult(CUDAAPI* addressReserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long) = nullptr;
  CUresult(CUDAAPI* addressFree)(CUdeviceptr, size_t) = nullptr;
  CUresult(CUDAAPI* map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long) = nullptr;
  CUresult(CUDAAPI* unmap)(CUdeviceptr, size_t) = nullptr;
  CUresult(CUDAAPI* setAccess)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t) = nullptr;
  bool usable = false;
};

const VmmDriver& vmmDriver() {
  static const VmmDriver resolved = [] {
    VmmDriver d;
    auto get = [](const char* name, auto* function) {
      void* found = nullptr;
      cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
      if (cudaGetDriverEntryPointByVersion(name, &found, 12000, cudaEnableDefault, &status) != cudaSuccess ||
          status != cudaDriverEntryPointSuccess) {
        (void)cudaGetLastError();
        found = nullptr;
      }
      *function = reinterpret_cast<std::remove_pointer_t<decltype(function)>>(found);
      return found != nullptr;
    };
    d.usable = get("cuMemRetainAllocationHandle", &d.retainAllocationHandle) &&
               get("cuMemExportToShareableHandle", &d.exportToShareableHandle) &&
               get("cuMemImportFromShareableHandle", &d.importFromShareableHandle) && get("cuMemRelease", &d.release) &&
               get("cuMemAddressReserve", &d.addressReserve) && get("cuMemAddressFree", &d.addressFree) &&
               get("cuMemMap", &d.map) && get("cuMemUnmap", &d.unmap) && get("cuMemSetAccess", &d.setAccess);
    return d;
  }();
  return resolved;
}

// A POSIX descriptor for the allocation that holds `at`, owned by the caller.
CUresult exportHandle(const VmmDriver& vmm, const void* at, int* fd) {
  *fd = -1;
  CUmemGenericAllocationHandle handle = 0;
  const CUresult retained = vmm.retainAllocationHandle(&handle, const_cast<void*>(at));
  if (retained != CUDA_SUCCESS) return retained;
  const CUresult result = vmm.exportToShareableHandle(fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
  (void)vmm.release(handle);  // the retained reference; the allocation lives on with its owner
  return result;
}

Result driverCheck(CUresult result, const char* call) {
  if (result == CUDA_SUCCESS) return unifabSuccess;
  return UF_ERROR(unifabUnhandledCudaError, kExt, "%s failed: CUresult %d (cuda.h)", call, static_cast<int>(result));
}

}  // namespace

Result BufferExporter::describe(const void* data, size_t bytes, bool haveChannel, Posting* out) {
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
  const CUdeviceptr at = reinterpret_cast<CUdeviceptr>(data);
  if (getAttributes(3, which, values, at) != CUDA_SUCCESS) return unifabSuccess;  // not mappable
  std::lock_guard<std::mutex> lock(mutex_);
  if (capable != 0 && start != 0) {
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
    out->kind = kLegacyIpc;
    out->bufferId = bufferId;
    out->offset = at - start;
    memcpy(out->allocation, &found->second, sizeof(found->second));
    return unifabSuccess;
  }
  // Virtual memory: its own physical allocation (not a stream-ordered pool's), allowing POSIX
  // descriptors, one mapping holding the whole buffer (an expandable segment maps several
  // allocations side by side), and a handle the driver exports.
  const VmmDriver& vmm = vmmDriver();
  if (!vmm.usable || !haveChannel) return unifabSuccess;
  auto known = bufferId != 0 ? mappings_.find(bufferId) : mappings_.end();
  VmmMapping queried{};
  if (known == mappings_.end()) {
    CUpointer_attribute vmmWhich[5] = {CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES, CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR,
                                       CU_POINTER_ATTRIBUTE_MAPPING_SIZE, CU_POINTER_ATTRIBUTE_MEMORY_BLOCK_ID,
                                       CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE};
    unsigned long long handleTypes = 0, blockId = 0;
    CUdeviceptr mappingBase = 0;
    size_t mappingBytes = 0;
    CUmemoryPool pool = nullptr;
    void* vmmValues[5] = {&handleTypes, &mappingBase, &mappingBytes, &blockId, &pool};
    if (getAttributes(5, vmmWhich, vmmValues, at) != CUDA_SUCCESS) return unifabSuccess;
    bool shareable = (handleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) != 0 && pool == nullptr &&
                     blockId != 0 && mappingBase != 0;
    int trial = -1;
    bool exportFailed = false;
    if (shareable && exportHandle(vmm, data, &trial) != CUDA_SUCCESS) {
      shareable = false;
      exportFailed = true;
    }
    if (trial >= 0) close(trial);
    queried = VmmMapping{shareable, blockId, static_cast<uintptr_t>(mappingBase), mappingBytes};
    // A failed export may pass (descriptors exhausted for a moment): asked again next call.
    if (bufferId != 0 && !exportFailed) known = mappings_.emplace(bufferId, queried).first;
  }
  const VmmMapping& mapping = known != mappings_.end() ? known->second : queried;
  const uint64_t blockId = mapping.blockId;
  const uintptr_t mappingBase = mapping.base;
  const size_t mappingBytes = mapping.bytes;
  if (!mapping.shareable || at < mappingBase || at - mappingBase > mappingBytes || bytes > mappingBytes - (at - mappingBase)) {
    return unifabSuccess;
  }
  out->mappable = 1;
  out->kind = kSharedHandle;
  out->bufferId = blockId;
  out->offset = at - mappingBase;
  out->mappingBytes = mappingBytes;
  return unifabSuccess;
}

Result BufferExporter::deliver(const Posting& mine, FdChannel* channel, const std::string& peerChannel, int poster,
                               FdChannel::Deadline deadline) {
  if (mine.kind != kSharedHandle) return unifabSuccess;
  const auto key = std::make_pair(peerChannel, mine.bufferId);
  {
    std::unique_lock<std::mutex> lock(mutex_);
    if (!sendingDone_.wait_until(lock, deadline, [&] { return sending_.count(key) == 0; })) {
      return UF_ERROR(unifabTimeout, kExt, "pipeline send/recv: another thread's call kept sending the handle of "
                      "memory block %llu past UNIFAB_PP_TIMEOUT_MS", static_cast<unsigned long long>(mine.bufferId));
    }
    if (sent_.count(key) != 0) return unifabSuccess;
    sending_.insert(key);
  }
  int fd = -1;
  const CUresult exported = exportHandle(vmmDriver(), reinterpret_cast<const void*>(mine.address), &fd);
  Result sent = unifabSuccess;
  if (exported != CUDA_SUCCESS) {
    sent = UF_ERROR(unifabUnhandledCudaError, kExt, "pipeline send/recv: exporting the handle of memory block %llu "
                    "failed (CUresult %d) though it succeeded when the buffer was first seen; the peer's matching call "
                    "will time out", static_cast<unsigned long long>(mine.bufferId), static_cast<int>(exported));
  } else {
    UF_INFO(kExt, unifab::kLogP2p, "pipeline send/recv: exported the handle of memory block %llu (a %llu-byte mapping) "
            "for %s", static_cast<unsigned long long>(mine.bufferId),
            static_cast<unsigned long long>(mine.mappingBytes), peerChannel.c_str());
    // The kernel duplicates the descriptor into the datagram.
    sent = channel->send(peerChannel, handleKey(poster, mine.bufferId), fd, deadline);
  }
  if (fd >= 0) close(fd);
  std::lock_guard<std::mutex> lock(mutex_);
  sending_.erase(key);
  if (sent == unifabSuccess) sent_.insert(key);
  sendingDone_.notify_all();
  return sent;
}

Result BufferImporter::map(int peer, const Posting& p, FdChannel* channel, FdChannel::Deadline deadline, char** data) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto key = std::make_tuple(peer, p.kind, p.bufferId);
  auto found = mapped_.find(key);
  if (found != mapped_.end()) {
    if (p.kind == kSharedHandle && (found->second.bytes != p.mappingBytes || p.offset > p.mappingBytes ||
                                    p.bytes > p.mappingBytes - p.offset)) {
      return UF_ERROR(unifabInternalError, kExt, "rank %d posted %llu bytes at offset %llu of its allocation %llu, "
                      "mapped here as %zu bytes: the allocation changed under the same id",
                      peer, static_cast<unsigned long long>(p.bytes), static_cast<unsigned long long>(p.offset),
                      static_cast<unsigned long long>(p.bufferId), found->second.bytes);
    }
  } else if (p.kind == kLegacyIpc) {
    void* opened = nullptr;
    cudaIpcMemHandle_t handle;
    memcpy(&handle, p.allocation, sizeof(handle));
    UF_CUDA_CHECK(cudaIpcOpenMemHandle(&opened, handle, cudaIpcMemLazyEnablePeerAccess));
    found = mapped_.emplace(key, Mapping{static_cast<char*>(opened), 0}).first;
  } else if (p.kind == kSharedHandle) {
    const VmmDriver& vmm = vmmDriver();
    if (!vmm.usable || channel == nullptr) {
      return UF_ERROR(unifabInternalError, kExt, "rank %d posted a virtual-memory buffer, but this process has no "
                      "descriptor channel or lacks the driver's cuMem calls (do both ranks load the same unifab build?)",
                      peer);
    }
    int device = 0;
    UF_CUDA_CHECK(cudaGetDevice(&device));
    int fd = -1;
    UF_CHECK(channel->take(handleKey(peer, p.bufferId), deadline, &fd));
    CUmemGenericAllocationHandle handle = 0;
    const CUresult imported = vmm.importFromShareableHandle(&handle, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
                                                            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    close(fd);
    UF_CHECK(driverCheck(imported, "cuMemImportFromShareableHandle"));
    CUdeviceptr base = 0;
    Result mapped = driverCheck(vmm.addressReserve(&base, p.mappingBytes, 0, 0, 0), "cuMemAddressReserve");
    if (mapped == unifabSuccess) {
      mapped = driverCheck(vmm.map(base, p.mappingBytes, 0, handle, 0), "cuMemMap");
      if (mapped == unifabSuccess) {
        CUmemAccessDesc access{};
        access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        access.location.id = device;
        access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        mapped = driverCheck(vmm.setAccess(base, p.mappingBytes, &access, 1), "cuMemSetAccess");
        if (mapped != unifabSuccess) (void)vmm.unmap(base, p.mappingBytes);
      }
      if (mapped != unifabSuccess) (void)vmm.addressFree(base, p.mappingBytes);
    }
    (void)vmm.release(handle);  // the mapping holds the allocation from here on
    UF_CHECK(mapped);
    found = mapped_.emplace(key, Mapping{reinterpret_cast<char*>(base), p.mappingBytes}).first;
    UF_INFO(kExt, unifab::kLogP2p, "pipeline send/recv: mapped rank %d's memory block %llu (%llu bytes)", peer,
            static_cast<unsigned long long>(p.bufferId), static_cast<unsigned long long>(p.mappingBytes));
  } else {
    return UF_ERROR(unifabInternalError, kExt, "rank %d posted a buffer of unknown kind %u", peer, p.kind);
  }
  *data = found->second.base + p.offset;
  return unifabSuccess;
}

void BufferImporter::closeAll() {
  std::lock_guard<std::mutex> lock(mutex_);
  const VmmDriver& vmm = vmmDriver();
  for (auto& m : mapped_) {
    if (m.second.bytes == 0) {
      UF_CUDA_WARN(cudaIpcCloseMemHandle(m.second.base));
      continue;
    }
    const CUdeviceptr base = reinterpret_cast<CUdeviceptr>(m.second.base);
    const CUresult unmapped = vmm.unmap(base, m.second.bytes);
    const CUresult freed = vmm.addressFree(base, m.second.bytes);
    if (unmapped != CUDA_SUCCESS || freed != CUDA_SUCCESS) {
      UF_WARN(kExt, "PP: unmapping a peer's buffer failed (cuMemUnmap %d, cuMemAddressFree %d)",
              static_cast<int>(unmapped), static_cast<int>(freed));
    }
  }
  mapped_.clear();
}

BufferImporter::~BufferImporter() { closeAll(); }

}  // namespace unifab::collectives::pp
