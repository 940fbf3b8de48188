// GPU time of the kernels one operation launches, as a profiler sees it: CUPTI's activity records
// give each kernel's start and end on the GPU, and an operation's time is from its first kernel's
// start to its last kernel's end. No launch, no event overhead, no host: the measure that DeepEP's
// and NCCL EP's kineto/CUPTI-based benchmarks report as kernel time. A kernel that starts before
// the previous kernel of its stream has ended (a programmatic dependent launch, which waits for it
// first) counts from that end: in-stream kernels' times never overlap. Built only where the CUDA
// toolkit has CUPTI (available() says so); one recording at a time per process.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace unifab::bench {

class KernelTimer {
 public:
  // Built with CUPTI, and no earlier CUPTI call of this process failed.
  static bool available();
  // Why available() is false (empty when it is true).
  static std::string unavailableReason();

  // Starts recording kernels. False (and available() false from then on) if CUPTI refuses.
  bool begin();
  // Kernels launched by this thread from enter(id) to leave() belong to `id` (1..ids of end()).
  void enter(uint64_t id);
  void leave();
  // Stops recording once every recorded kernel has ended (the caller synchronised its streams) and
  // gives spansUs[id - 1] for ids 1..ids: first start to last end in microseconds, 0 where no
  // kernel of that id was recorded.
  bool end(uint64_t ids, std::vector<double>* spansUs);
};

}  // namespace unifab::bench
