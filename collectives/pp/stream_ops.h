// 64-bit stream memory operations (the driver's cuStreamWaitValue64 / cuStreamWriteValue64),
// reached through the runtime's driver entry points so that unifab does not link libcuda.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "plugin/check.h"

namespace unifab::collectives::pp {

class StreamOps {
 public:
  // Blocks `stream` until the 64-bit word at `address` (device memory) reaches `value` or more
  // (as a signed difference, so sequence numbers may wrap).
  Result waitAtLeast(cudaStream_t stream, const uint64_t* address, uint64_t value) const;
  // Writes `value` to `address` once every earlier operation of `stream` has completed, behind a
  // system-scope memory barrier (a peer that sees the value also sees the data written before it).
  Result write(cudaStream_t stream, uint64_t* address, uint64_t value) const;

 private:
  friend Result streamOps(int device, const StreamOps** ops);
  void* waitValue64_ = nullptr;   // cuStreamWaitValue64
  void* writeValue64_ = nullptr;  // cuStreamWriteValue64
};

// Resolves the entry points once, and checks that `device` supports 64-bit stream memory ops.
Result streamOps(int device, const StreamOps** ops);

// A CUDA driver function by name, at the driver API version whose signatures unifab uses.
Result driverEntryPoint(const char* symbol, void** function);

}  // namespace unifab::collectives::pp
