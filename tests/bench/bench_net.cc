// unifab-bench net: the ncclNet table of this library over loopback, driven as NCCL's proxy
// drives it (a window of isend/irecv in flight, test() polling), without NCCL or a GPU.
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "tests/bench/bench_common.h"
#include "tests/net/net_harness.h"
#include "unifab/nccl/net_v11.h"

extern "C" const ncclNet_v11_t ncclNetPlugin_v11;

namespace unifab::bench {
namespace {

using test::WaitOutcome;

struct Link {
  const ncclNet_v11_t* net;
  void* send = nullptr;
  void* recv = nullptr;
};

// Moves `count` messages of `bytes` with `window` in flight; returns seconds, < 0 on failure.
double stream(const Link& link, size_t bytes, int count, int window, bool verify) {
  const ncclNet_v11_t* net = link.net;
  std::vector<std::vector<unsigned char>> out(window, std::vector<unsigned char>(bytes ? bytes : 1));
  std::vector<std::vector<unsigned char>> in(window, std::vector<unsigned char>(bytes ? bytes : 1));
  std::vector<void*> outMr(window), inMr(window);
  for (int i = 0; i < window; ++i) {
    net->regMr(link.send, out[i].data(), out[i].size(), NCCL_PTR_HOST, &outMr[i]);
    net->regMr(link.recv, in[i].data(), in[i].size(), NCCL_PTR_HOST, &inMr[i]);
    if (verify) test::fillPattern(out[i].data(), bytes, static_cast<uint64_t>(i) + 1);
  }
  std::atomic<bool> failed{false};
  auto start = std::chrono::steady_clock::now();
  std::thread receiver([&] {
    std::vector<void*> pending;
    int posted = 0, done = 0;
    while (done < count && !failed) {
      while (posted < count && posted - done < window) {
        void* data = in[posted % window].data();
        size_t capacity = bytes;
        int tag = 0;
        void* request = nullptr;
        if (net->irecv(link.recv, 1, &data, &capacity, &tag, &inMr[posted % window], nullptr, &request) != ncclSuccess) {
          failed = true;
          return;
        }
        if (request == nullptr) break;
        pending.push_back(request);
        ++posted;
      }
      if (posted == done) continue;  // nothing in flight yet: NCCL's irecv asked us to retry
      int finished = 0;
      int size = 0;
      if (net->test(pending[static_cast<size_t>(done)], &finished, &size) != ncclSuccess) {
        failed = true;
        return;
      }
      if (finished) ++done;
    }
  });
  std::vector<void*> pending;
  int posted = 0, done = 0;
  while (done < count && !failed) {
    while (posted < count && posted - done < window) {
      void* request = nullptr;
      if (net->isend(link.send, out[posted % window].data(), bytes, 0, outMr[posted % window], nullptr, &request) !=
          ncclSuccess) {
        failed = true;
        break;
      }
      if (request == nullptr) break;
      pending.push_back(request);
      ++posted;
    }
    int finished = 0;
    if (posted > done && net->test(pending[static_cast<size_t>(done)], &finished, nullptr) != ncclSuccess) failed = true;
    if (finished) ++done;
  }
  receiver.join();
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (verify && !failed) {
    int last = (count - 1) % window;
    if (test::firstMismatch(in[last].data(), bytes, static_cast<uint64_t>(last) + 1) != SIZE_MAX) failed = true;
  }
  for (int i = 0; i < window; ++i) {
    net->deregMr(link.send, outMr[i]);
    net->deregMr(link.recv, inMr[i]);
  }
  return failed ? -1.0 : seconds;
}

// Half of the median round trip of an 8-byte ping-pong, in microseconds.
double pingPongUs(const Link& there, const Link& back, int rounds) {
  const ncclNet_v11_t* net = there.net;
  unsigned char a[8] = {}, b[8] = {};
  std::vector<double> samples;
  for (int i = 0; i < rounds; ++i) {
    auto start = std::chrono::steady_clock::now();
    void *r1 = nullptr, *s1 = nullptr, *r2 = nullptr, *s2 = nullptr;
    void* data = b;
    size_t capacity = sizeof(b);
    int tag = 0;
    net->irecv(there.recv, 1, &data, &capacity, &tag, nullptr, nullptr, &r1);
    net->isend(there.send, a, sizeof(a), 0, nullptr, nullptr, &s1);
    if (test::waitRequest(net, r1, nullptr, 10) != WaitOutcome::kDone) return -1;
    data = a;
    net->irecv(back.recv, 1, &data, &capacity, &tag, nullptr, nullptr, &r2);
    net->isend(back.send, b, sizeof(b), 0, nullptr, nullptr, &s2);
    if (test::waitRequest(net, r2, nullptr, 10) != WaitOutcome::kDone) return -1;
    test::waitRequest(net, s1, nullptr, 10);
    test::waitRequest(net, s2, nullptr, 10);
    samples.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count());
  }
  samples.erase(samples.begin(), samples.begin() + rounds / 10);  // warm-up
  return median(samples) / 2;
}

}  // namespace

int runNet(Args& args) {
  size_t minBytes = parseBytes(args.value("--min", "4K"));
  size_t maxBytes = parseBytes(args.value("--max", "64M"));
  int window = atoi(args.value("--window", "8").c_str());
  double secondsPerSize = atof(args.value("--seconds", "0.3").c_str());
  if (!args.leftovers().empty()) {
    fprintf(stderr, "unifab-bench net: unknown argument '%s'\n", args.leftovers()[0].c_str());
    return 2;
  }
  if (minBytes == 0 || maxBytes < minBytes || maxBytes > (size_t{1} << 30) || window < 1 || window > 32) {
    fprintf(stderr, "unifab-bench net: need 0 < --min <= --max <= 1G and 1 <= --window <= 32\n");
    return 2;
  }
  // A loopback benchmark: unless told otherwise, keep every byte on the loopback interface (the
  // plugin's default would pick the machine's network interfaces).
  setenv("UNIFAB_SOCKET_IFNAME", "lo", 0);
  const ncclNet_v11_t* net = &ncclNetPlugin_v11;
  void *ctxA = nullptr, *ctxB = nullptr;
  if (net->init(&ctxA, 1, nullptr, test::captureLogger, nullptr) != ncclSuccess ||
      net->init(&ctxB, 2, nullptr, test::captureLogger, nullptr) != ncclSuccess) {
    fprintf(stderr, "unifab-bench net: plugin init failed (UNIFAB_TEST_VERBOSE=1 shows why)\n");
    return 1;
  }
  ncclNetProperties_v11_t props;
  net->getProperties(0, &props);
  Link forward{net}, backward{net};
  if (test::connectPair(net, ctxA, ctxB, 0, &forward.send, &forward.recv) != ncclSuccess ||
      test::connectPair(net, ctxB, ctxA, 0, &backward.send, &backward.recv) != ncclSuccess) {
    fprintf(stderr, "unifab-bench net: loopback connection failed\n");
    return 1;
  }
  printf("# unifab-bench net: ncclNet v11 '%s' over %s, %d message(s) in flight, one process, two threads\n",
         net->name, props.name, window);
  printf("# latency (8 B ping-pong, half round trip, median): %.1f us\n", pingPongUs(forward, backward, 2000));
  printf("# %10s %10s %12s %10s\n", "size", "messages", "GB/s", "us/msg");
  int status = 0;
  for (size_t bytes = minBytes; bytes <= maxBytes; bytes *= 4) {
    // Size the run from a short probe so each size takes about --seconds.
    double probe = stream(forward, bytes, window * 2, window, false);
    int count = probe > 0 ? static_cast<int>(secondsPerSize / (probe / (window * 2))) : 0;
    count = std::max(window * 2, std::min(count, 200000));
    double seconds = stream(forward, bytes, count, window, true);
    if (seconds < 0) {
      printf("  %10s  FAILED (transfer error or data mismatch)\n", formatBytes(bytes).c_str());
      status = 1;
      break;
    }
    printf("  %10s %10d %12.2f %10.1f\n", formatBytes(bytes).c_str(), count,
           static_cast<double>(bytes) * count / seconds / 1e9, seconds / count * 1e6);
  }
  net->closeSend(forward.send);
  net->closeRecv(forward.recv);
  net->closeSend(backward.send);
  net->closeRecv(backward.recv);
  net->finalize(ctxA);
  net->finalize(ctxB);
  return status;
}

}  // namespace unifab::bench
