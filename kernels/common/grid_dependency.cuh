// Programmatic dependent launch (sm_90). A kernel launched with the stream attribute
// cudaLaunchAttributeProgrammaticStreamSerialization may be scheduled while the stream's previous
// kernel still runs: everything before waitForPrerequisiteGrid() overlaps that kernel's tail, so it
// may touch nothing but the kernel's parameters and shared memory. Both instructions do nothing in
// a kernel launched without the attribute.
#pragma once

#include <cuda_runtime.h>

#include <utility>

namespace unifab::kernels {

// Returns once the stream's previous kernel has completed and its memory accesses are visible.
__device__ __forceinline__ void waitForPrerequisiteGrid() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// Lets the stream's next kernel, if launched as a programmatic dependent, be scheduled now
// instead of when this kernel ends (it still waits for this one's completion before its accesses).
__device__ __forceinline__ void allowDependentLaunch() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

// Host: launches `kernel` on `grid` x `block` threads with `dynamicSharedBytes` of shared memory on
// `stream`, as a programmatic dependent launch when `programmatic` (for kernels that call
// waitForPrerequisiteGrid before touching global memory).
template <typename... Params, typename... Args>
cudaError_t launchMaybeDependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t dynamicSharedBytes,
                                 cudaStream_t stream, bool programmatic, Args&&... args) {
  cudaLaunchAttribute dependent{};
  dependent.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  dependent.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = dynamicSharedBytes;
  config.stream = stream;
  config.attrs = &dependent;
  config.numAttrs = programmatic ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace unifab::kernels
