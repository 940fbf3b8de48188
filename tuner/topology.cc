#include "tuner/topology.h"

#include <dlfcn.h>

#include <cstdio>

#include "plugin/params.h"

namespace unifab::tuner {
namespace {

// NVML is reached through dlopen so that the library loads on machines without a GPU driver.
using NvmlReturn = int;
using NvmlDevice = void*;
constexpr NvmlReturn kNvmlSuccess = 0;
constexpr int kNvmlFeatureEnabled = 1;
constexpr unsigned kMaxNvlinks = 18;

class NvmlLibrary {
 public:
  NvmlLibrary() {
    handle_ = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (handle_ == nullptr) return;
    init_ = reinterpret_cast<NvmlReturn (*)()>(dlsym(handle_, "nvmlInit_v2"));
    shutdown_ = reinterpret_cast<NvmlReturn (*)()>(dlsym(handle_, "nvmlShutdown"));
    getHandle_ = reinterpret_cast<NvmlReturn (*)(unsigned, NvmlDevice*)>(dlsym(handle_, "nvmlDeviceGetHandleByIndex_v2"));
    getLinkState_ = reinterpret_cast<NvmlReturn (*)(NvmlDevice, unsigned, int*)>(dlsym(handle_, "nvmlDeviceGetNvLinkState"));
    getCapability_ = reinterpret_cast<NvmlReturn (*)(NvmlDevice, int*, int*)>(dlsym(handle_, "nvmlDeviceGetCudaComputeCapability"));
    getHandleByBusId_ = reinterpret_cast<NvmlReturn (*)(const char*, NvmlDevice*)>(dlsym(handle_, "nvmlDeviceGetHandleByPciBusId_v2"));
    usable_ = init_ && shutdown_ && getHandle_ && getLinkState_ && getCapability_ && init_() == kNvmlSuccess;
  }
  ~NvmlLibrary() {
    if (usable_) shutdown_();
    if (handle_ != nullptr) dlclose(handle_);
  }
  NvmlLibrary(const NvmlLibrary&) = delete;
  NvmlLibrary& operator=(const NvmlLibrary&) = delete;

  bool query(NvlinkInfo* info) {
    if (!usable_) return false;
    NvmlDevice device = nullptr;
    if (getHandle_(0, &device) != kNvmlSuccess) return false;
    int major = 0;
    int minor = 0;
    if (getCapability_(device, &major, &minor) == kNvmlSuccess) info->computeCapability = major * 10 + minor;
    info->activeLinks = activeLinks(device);
    info->perLinkGBps = nvlinkPerLinkGBps(info->computeCapability);
    return true;
  }

  int activeLinksOf(const char* busId) {
    NvmlDevice device = nullptr;
    if (!usable_ || getHandleByBusId_ == nullptr || getHandleByBusId_(busId, &device) != kNvmlSuccess) return -1;
    return activeLinks(device);
  }

 private:
  void* handle_ = nullptr;
  bool usable_ = false;
  NvmlReturn (*init_)() = nullptr;
  NvmlReturn (*shutdown_)() = nullptr;
  NvmlReturn (*getHandle_)(unsigned, NvmlDevice*) = nullptr;
  NvmlReturn (*getLinkState_)(NvmlDevice, unsigned, int*) = nullptr;
  NvmlReturn (*getCapability_)(NvmlDevice, int*, int*) = nullptr;
  NvmlReturn (*getHandleByBusId_)(const char*, NvmlDevice*) = nullptr;

  int activeLinks(NvmlDevice device) {
    int links = 0;
    for (unsigned link = 0; link < kMaxNvlinks; ++link) {
      int state = 0;
      if (getLinkState_(device, link, &state) != kNvmlSuccess) continue;  // not every link index exists
      if (state == kNvmlFeatureEnabled) ++links;
    }
    return links;
  }
};

}  // namespace

double nvlinkPerLinkGBps(int computeCapability) {
  if (computeCapability >= 100) return 50.0;  // NVLink 5
  if (computeCapability >= 70) return 25.0;   // NVLink 2, 3 and 4 all carry 25 GB/s per link and direction
  if (computeCapability >= 60) return 20.0;   // NVLink 1
  return 0.0;
}

bool detectNvlink(NvlinkInfo* info) {
  NvmlLibrary nvml;
  return nvml.query(info);
}

int activeNvlinks(const char* pciBusId) {
  NvmlLibrary nvml;
  return nvml.activeLinksOf(pciBusId);
}

LocalGpu localGpu() {
  static const NvlinkInfo detected = [] {
    NvlinkInfo info;
    if (!detectNvlink(&info)) info = NvlinkInfo();
    return info;
  }();
  LocalGpu gpu;
  gpu.computeCapability = detected.computeCapability;
  const double configured = params().tunerNvlinkGbps;
  gpu.nvlinkGBps = configured > 0 ? configured : detected.activeLinks * detected.perLinkGBps;
  return gpu;
}

std::string Topology::describe() const {
  char text[256];
  snprintf(text, sizeof(text), "%d ranks on %d node(s), %d per node, NVLink %.0f GB/s, net %.1f GB/s, sm_%d",
           nRanks, nNodes, ranksPerNode, nvlinkGBps, netGBps, computeCapability);
  return text;
}

}  // namespace unifab::tuner
