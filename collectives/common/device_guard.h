// Makes a CUDA device current for a scope and restores the caller's afterwards: extension
// operations run on the communicator's GPU whatever device the calling thread had selected.
#pragma once

#include "collectives/common/cuda_check.h"

namespace unifab::collectives {

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

}  // namespace unifab::collectives
