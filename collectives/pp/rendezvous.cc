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

Result driverCheck(CUresult result, const char* call) {
  if (result == CUDA_SUCCESS) return unifabSuccess;
  return UF_ERROR(unifabUnhandledCudaError, kExt, "%s failed with CUDA driver error %d", call, static_cast<int>(result));
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
  CUpointer_attribute vmmWhich[3] = {CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES, CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR,
                                     CU_POINTER_ATTRIBUTE_MAPPING_SIZE};
  unsigned long long handleTypes = 0;
  CUdeviceptr mappingBase = 0;
  size_t mappingBytes = 0;
  void* vmmValues[3] = {&handleTypes, &mappingBase, &mappingBytes};
  if (getAttributes(3, vmmWhich, vmmValues, at) != CUDA_SUCCESS) return unifabSuccess;
  // Virtual memory: one mapping must hold the whole buffer (an expandable segment maps several
  // allocations side by side), and its allocation must allow POSIX descriptors.
  const VmmDriver& vmm = vmmDriver();
  if (!vmm.usable || !haveChannel || (handleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) == 0 ||
      mappingBase == 0 || at < mappingBase || at - mappingBase > mappingBytes || bytes > mappingBytes - (at - mappingBase)) {
    return unifabSuccess;
  }
  out->mappable = 1;
  out->kind = kSharedHandle;
  out->bufferId = bufferId;
  out->offset = at - mappingBase;
  out->mappingBytes = mappingBytes;
  return unifabSuccess;
}

Result BufferExporter::deliver(const void* data, const Posting& mine, FdChannel* channel, const std::string& peerChannel,
                               int poster) {
  if (mine.kind != kSharedHandle) return unifabSuccess;
  const auto sent = std::make_pair(peerChannel, mine.bufferId);
  if (sent_.count(sent) != 0) return unifabSuccess;
  const VmmDriver& vmm = vmmDriver();
  CUmemGenericAllocationHandle handle = 0;
  UF_CHECK(driverCheck(vmm.retainAllocationHandle(&handle, const_cast<void*>(data)), "cuMemRetainAllocationHandle"));
  int fd = -1;
  const CUresult exported = vmm.exportToShareableHandle(&fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
  (void)vmm.release(handle);  // the retained reference; the allocation lives on with its owner
  UF_CHECK(driverCheck(exported, "cuMemExportToShareableHandle"));
  // The descriptor goes to the peer (the kernel duplicates it there) and is closed here at once:
  // held open, it would keep the allocation's memory alive after the application freed it.
  const Result delivered = channel->send(peerChannel, handleKey(poster, mine.bufferId), fd);
  close(fd);
  UF_CHECK(delivered);
  sent_.insert(sent);
  return unifabSuccess;
}

Result BufferImporter::map(int peer, const Posting& p, FdChannel* channel, std::chrono::steady_clock::time_point deadline,
                           char** data) {
  const auto key = std::make_pair(peer, p.bufferId);
  auto found = mapped_.find(key);
  if (found == mapped_.end()) {
    if (p.kind == kLegacyIpc) {
      void* opened = nullptr;
      cudaIpcMemHandle_t handle;
      memcpy(&handle, p.allocation, sizeof(handle));
      UF_CUDA_CHECK(cudaIpcOpenMemHandle(&opened, handle, cudaIpcMemLazyEnablePeerAccess));
      found = mapped_.emplace(key, Mapping{static_cast<char*>(opened), 0}).first;
    } else if (p.kind == kSharedHandle) {
      const VmmDriver& vmm = vmmDriver();
      if (!vmm.usable || channel == nullptr) {
        return UF_ERROR(unifabInternalError, kExt, "rank %d posted a virtual-memory buffer this process cannot map "
                        "(the driver lacks the cuMem calls)", peer);
      }
      int fd = -1;
      UF_CHECK(channel->take(handleKey(peer, p.bufferId), deadline, &fd));
      CUmemGenericAllocationHandle handle = 0;
      const CUresult imported =
          vmm.importFromShareableHandle(&handle, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
                                        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
      close(fd);
      UF_CHECK(driverCheck(imported, "cuMemImportFromShareableHandle"));
      int device = 0;
      UF_CUDA_CHECK(cudaGetDevice(&device));
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
    } else {
      return UF_ERROR(unifabInternalError, kExt, "rank %d posted a buffer of unknown kind %u", peer, p.kind);
    }
  }
  *data = found->second.base + p.offset;
  return unifabSuccess;
}

void BufferImporter::closeAll() {
  const VmmDriver& vmm = vmmDriver();
  for (auto& m : mapped_) {
    if (m.second.bytes == 0) {
      UF_CUDA_WARN(cudaIpcCloseMemHandle(m.second.base));
    } else {
      const CUdeviceptr base = reinterpret_cast<CUdeviceptr>(m.second.base);
      (void)vmm.unmap(base, m.second.bytes);
      (void)vmm.addressFree(base, m.second.bytes);
    }
  }
  mapped_.clear();
}

BufferImporter::~BufferImporter() { closeAll(); }

}  // namespace unifab::collectives::pp
