// The remote end of the two-process net tests: a separate process that loads the plugin as NCCL
// would and plays one scripted role. It reports progress on stdout, one word per line, so the
// test can synchronise with it and kill it at a chosen moment.
//
//   net_peer LIB listen-recv COUNT BYTES      print "handle HEX", receive COUNT messages, check them
//   net_peer LIB connect-send HEX COUNT BYTES  send COUNT patterned messages
//   net_peer LIB connect-send-hang HEX BYTES   post one send, print "posted", wait to be killed
//   net_peer LIB listen-recv-hang BYTES        print "handle HEX", post one receive, print "posted",
//                                              wait to be killed
//   net_peer LIB connect-close HEX             connect, print "connected", close, exit
#include <unistd.h>

#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "tests/net/net_harness.h"

using namespace unifab::test;

namespace {

void say(const std::string& line) {
  printf("%s\n", line.c_str());
  fflush(stdout);
}

int failWith(const std::string& message) {
  say("error " + message);
  for (const std::string& warning : capturedWarnings()) say("error plugin WARN: " + warning);
  return 1;
}

[[noreturn]] void waitToBeKilled() {
  for (;;) pause();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: net_peer LIBRARY ROLE ARGS...\n");
    return 2;
  }
  NetPlugin plugin;
  std::string error;
  if (!plugin.load(argv[1], &error)) return failWith("load: " + error);
  const ncclNet_v11_t* net = plugin.table();
  void* ctx = nullptr;
  if (net->init(&ctx, 0x7e57, nullptr, captureLogger, nullptr) != ncclSuccess) return failWith("init");
  std::string role = argv[2];
  auto arg = [&](int index) -> const char* { return index < argc ? argv[index] : "0"; };

  if (role == "listen-recv" || role == "listen-recv-hang") {
    char handle[NCCL_NET_HANDLE_MAXSIZE] = {};
    void* listenComm = nullptr;
    if (net->listen(ctx, 0, handle, &listenComm) != ncclSuccess) return failWith("listen");
    say("handle " + toHex(handle, sizeof(handle)));
    void* recvComm = nullptr;
    if (acceptOne(net, listenComm, &recvComm, 60.0) != ncclSuccess) return failWith("accept");
    bool hang = role == "listen-recv-hang";
    long count = hang ? 1 : atol(arg(3));
    size_t bytes = static_cast<size_t>(atoll(arg(hang ? 3 : 4)));
    std::vector<unsigned char> buffer(bytes);
    void* mhandle = nullptr;
    if (net->regMr(recvComm, buffer.data(), bytes, NCCL_PTR_HOST, &mhandle) != ncclSuccess) return failWith("regMr");
    for (long i = 0; i < count; ++i) {
      void* data = buffer.data();
      size_t size = bytes;
      int tag = 0;
      void* request = nullptr;
      while (request == nullptr) {
        if (net->irecv(recvComm, 1, &data, &size, &tag, &mhandle, nullptr, &request) != ncclSuccess) {
          return failWith("irecv");
        }
      }
      if (hang) {
        say("posted");
        waitToBeKilled();
      }
      int received = 0;
      if (waitRequest(net, request, &received, 60.0) != WaitOutcome::kDone) return failWith("receive");
      if (static_cast<size_t>(received) != bytes) return failWith("size " + std::to_string(received));
      size_t bad = firstMismatch(buffer.data(), bytes, static_cast<uint64_t>(i) + 1);
      if (bad != SIZE_MAX) return failWith("data mismatch at byte " + std::to_string(bad));
    }
    net->deregMr(recvComm, mhandle);
    net->closeRecv(recvComm);
    net->closeListen(listenComm);
    net->finalize(ctx);
    say("ok");
    return 0;
  }

  if (role == "connect-send" || role == "connect-send-hang" || role == "connect-close") {
    char handle[NCCL_NET_HANDLE_MAXSIZE];
    if (!fromHex(arg(3), handle, sizeof(handle))) return failWith("bad handle");
    void* sendComm = nullptr;
    if (connectOne(net, ctx, 0, handle, &sendComm, 60.0) != ncclSuccess) return failWith("connect");
    if (role == "connect-close") {
      say("connected");
      net->closeSend(sendComm);
      net->finalize(ctx);
      return 0;
    }
    bool hang = role == "connect-send-hang";
    long count = hang ? 1 : atol(arg(4));
    size_t bytes = static_cast<size_t>(atoll(arg(hang ? 4 : 5)));
    std::vector<unsigned char> buffer(bytes);
    void* mhandle = nullptr;
    if (net->regMr(sendComm, buffer.data(), bytes, NCCL_PTR_HOST, &mhandle) != ncclSuccess) return failWith("regMr");
    for (long i = 0; i < count; ++i) {
      fillPattern(buffer.data(), bytes, static_cast<uint64_t>(i) + 1);
      void* request = nullptr;
      while (request == nullptr) {
        if (net->isend(sendComm, buffer.data(), bytes, 0, mhandle, nullptr, &request) != ncclSuccess) {
          return failWith("isend");
        }
      }
      if (hang) {
        say("posted");
        waitToBeKilled();
      }
      if (waitRequest(net, request, nullptr, 60.0) != WaitOutcome::kDone) return failWith("send");
    }
    net->deregMr(sendComm, mhandle);
    net->closeSend(sendComm);
    net->finalize(ctx);
    say("ok");
    return 0;
  }
  return failWith("unknown role " + role);
}
