// Functions of plain data shared by host code (compiled by the host compiler) and kernels.
#pragma once

#if defined(__CUDACC__)
#define UNIFAB_HOST_DEVICE __host__ __device__
#else
#define UNIFAB_HOST_DEVICE
#endif
