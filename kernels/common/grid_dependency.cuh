// Programmatic dependent launch (sm_90). A kernel launched with the stream attribute
// cudaLaunchAttributeProgrammaticStreamSerialization may be scheduled while the stream's previous
// kernel still runs: everything before waitForPrerequisiteGrid() overlaps that kernel's tail, so it
// may touch nothing but the kernel's parameters and shared memory. Both instructions do nothing in
// a kernel launched without the attribute.
#pragma once

namespace unifab::kernels {

// Returns once the stream's previous kernel has completed and its memory accesses are visible.
__device__ __forceinline__ void waitForPrerequisiteGrid() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// Lets the stream's next kernel, if launched as a programmatic dependent, be scheduled now
// instead of when this kernel ends (it still waits for this one's completion before its accesses).
__device__ __forceinline__ void allowDependentLaunch() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

}  // namespace unifab::kernels
