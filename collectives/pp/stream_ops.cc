#include "collectives/pp/stream_ops.h"

#include <cuda.h>

#include <mutex>

#include "collectives/common/cuda_check.h"

namespace unifab::collectives::pp {
namespace {

using WaitValue64 = CUresult(CUDAAPI*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
using WriteValue64 = CUresult(CUDAAPI*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
using DeviceGet = CUresult(CUDAAPI*)(CUdevice*, int);
using DeviceGetAttribute = CUresult(CUDAAPI*)(int*, CUdevice_attribute, CUdevice);

constexpr unsigned kDriverApiVersion = 12000;  // the 64-bit memory ops' current signatures

}  // namespace

Result driverEntryPoint(const char* symbol, void** function) {
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  UF_CUDA_CHECK(cudaGetDriverEntryPointByVersion(symbol, function, kDriverApiVersion, cudaEnableDefault, &found));
  if (found != cudaDriverEntryPointSuccess || *function == nullptr) {
    return UF_ERROR(unifabSystemError, kExt, "the CUDA driver has no %s (version %u): pipeline send/recv needs it",
                    symbol, kDriverApiVersion);
  }
  return unifabSuccess;
}

Result StreamOps::waitAtLeast(cudaStream_t stream, const uint64_t* address, uint64_t value) const {
  const CUresult r = reinterpret_cast<WaitValue64>(waitValue64_)(
      reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(address), value, CU_STREAM_WAIT_VALUE_GEQ);
  if (r != CUDA_SUCCESS) return UF_ERROR(unifabUnhandledCudaError, kExt, "cuStreamWaitValue64 failed: CUresult %d", r);
  return unifabSuccess;
}

Result StreamOps::write(cudaStream_t stream, uint64_t* address, uint64_t value) const {
  const CUresult r = reinterpret_cast<WriteValue64>(writeValue64_)(
      reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(address), value, CU_STREAM_WRITE_VALUE_DEFAULT);
  if (r != CUDA_SUCCESS) return UF_ERROR(unifabUnhandledCudaError, kExt, "cuStreamWriteValue64 failed: CUresult %d", r);
  return unifabSuccess;
}

Result streamOps(int device, const StreamOps** ops) {
  static std::once_flag once;
  static StreamOps resolved;
  static Result status = unifabSuccess;
  std::call_once(once, [] {
    status = driverEntryPoint("cuStreamWaitValue64", &resolved.waitValue64_);
    if (status == unifabSuccess) status = driverEntryPoint("cuStreamWriteValue64", &resolved.writeValue64_);
  });
  UF_CHECK(status);
  void* deviceGet = nullptr;
  void* getAttribute = nullptr;
  UF_CHECK(driverEntryPoint("cuDeviceGet", &deviceGet));
  UF_CHECK(driverEntryPoint("cuDeviceGetAttribute", &getAttribute));
  CUdevice handle = 0;
  int supported = 0;
  if (reinterpret_cast<DeviceGet>(deviceGet)(&handle, device) != CUDA_SUCCESS ||
      reinterpret_cast<DeviceGetAttribute>(getAttribute)(&supported, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS,
                                                         handle) != CUDA_SUCCESS) {
    return UF_ERROR(unifabUnhandledCudaError, kExt, "cannot query CUDA device %d for 64-bit stream memory operations",
                    device);
  }
  if (supported == 0) {
    return UF_ERROR(unifabInvalidUsage, kExt,
                    "CUDA device %d does not support 64-bit stream memory operations, which pipeline send/recv uses",
                    device);
  }
  *ops = &resolved;
  return unifabSuccess;
}

}  // namespace unifab::collectives::pp
