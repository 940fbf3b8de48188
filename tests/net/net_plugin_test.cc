// The ncclNet v11 table of libnccl-unifab.so driven over loopback exactly as NCCL drives it:
// dlopen(RTLD_NOW|RTLD_LOCAL), non-blocking connect/accept, isend/irecv/test polling. Every test
// checks the bytes that arrive against a pattern, and every wait has a deadline, so a hang fails
// the test instead of stalling CI.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "net/socket/wire.h"
#include "tests/net/net_harness.h"

using namespace unifab::test;

namespace {

const char* libraryPath() { return UNIFAB_TEST_PLUGIN_PATH; }

// One registered host buffer.
struct Buffer {
  std::vector<unsigned char> bytes;
  void* mhandle = nullptr;
};

class NetTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string error;
    ASSERT_TRUE(plugin_.load(libraryPath(), &error)) << error;
    net_ = plugin_.table();
    clearCapturedWarnings();
    ASSERT_EQ(net_->init(&ctx_, 0x1234, nullptr, captureLogger, nullptr), ncclSuccess);
    int ndev = 0;
    ASSERT_EQ(net_->devices(&ndev), ncclSuccess);
    ASSERT_GE(ndev, 1);
  }

  void TearDown() override {
    if (HasFailure()) {
      // The plugin's own explanation of a failure, which CI logs would otherwise not show.
      for (const std::string& warning : capturedWarnings()) fprintf(stderr, "plugin WARN: %s\n", warning.c_str());
    }
    for (auto& [comm, buffer] : registrations_) net_->deregMr(comm, buffer->mhandle);
    registrations_.clear();
    if (send_ != nullptr) {
      EXPECT_EQ(net_->closeSend(send_), ncclSuccess);
    }
    if (recv_ != nullptr) {
      EXPECT_EQ(net_->closeRecv(recv_), ncclSuccess);
    }
    if (ctx_ != nullptr) {
      EXPECT_EQ(net_->finalize(ctx_), ncclSuccess);
    }
  }

  void connect() { ASSERT_EQ(connectPair(net_, ctx_, ctx_, 0, &send_, &recv_), ncclSuccess); }

  Buffer* buffer(void* comm, size_t bytes, unsigned char poison = 0xA5) {
    auto owned = std::make_unique<Buffer>();
    owned->bytes.assign(std::max<size_t>(bytes, 1), poison);
    EXPECT_EQ(net_->regMr(comm, owned->bytes.data(), owned->bytes.size(), NCCL_PTR_HOST, &owned->mhandle), ncclSuccess);
    Buffer* raw = owned.get();
    registrations_.emplace_back(comm, raw);
    buffers_.push_back(std::move(owned));
    return raw;
  }

  void* postRecv(Buffer* into, size_t capacity, int tag = 0) {
    void* data = into->bytes.data();
    int tagCopy = tag;
    void* request = nullptr;
    EXPECT_EQ(net_->irecv(recv_, 1, &data, &capacity, &tagCopy, &into->mhandle, nullptr, &request), ncclSuccess);
    return request;
  }

  void* postSend(Buffer* from, size_t bytes, int tag = 0) {
    void* request = nullptr;
    EXPECT_EQ(net_->isend(send_, from->bytes.data(), bytes, tag, from->mhandle, nullptr, &request), ncclSuccess);
    return request;
  }

  NetPlugin plugin_;
  const ncclNet_v11_t* net_ = nullptr;
  void* ctx_ = nullptr;
  void* send_ = nullptr;
  void* recv_ = nullptr;
  std::vector<std::unique_ptr<Buffer>> buffers_;
  std::vector<std::pair<void*, Buffer*>> registrations_;
};

TEST_F(NetTest, PropertiesAreValid) {
  ncclNetProperties_v11_t props;
  memset(&props, 0xff, sizeof(props));
  ASSERT_EQ(net_->getProperties(0, &props), ncclSuccess);
  ASSERT_NE(props.name, nullptr);
  EXPECT_GT(strlen(props.name), 0u);
  EXPECT_EQ(props.ptrSupport, NCCL_PTR_HOST);
  EXPECT_GT(props.speed, 0);
  EXPECT_GT(props.maxComms, 0);
  EXPECT_GE(props.maxRecvs, 2);
  EXPECT_LE(props.maxRecvs, 8);
  EXPECT_EQ(props.netDeviceType, NCCL_NET_DEVICE_HOST);
  EXPECT_EQ(props.netDeviceVersion, NCCL_NET_DEVICE_INVALID_VERSION);
  EXPECT_EQ(props.vProps.ndevs, 1);
  EXPECT_GT(props.maxP2pBytes, 0u);
  EXPECT_LE(props.maxP2pBytes, NCCL_MAX_NET_SIZE_BYTES);
  EXPECT_LE(props.maxP2pBytes, static_cast<size_t>(INT_MAX));  // test() reports sizes as int
  EXPECT_EQ(props.maxMultiRequestSize, 1);
  int ndev = 0;
  ASSERT_EQ(net_->devices(&ndev), ncclSuccess);
  EXPECT_NE(net_->getProperties(ndev, &props), ncclSuccess) << "a device index past the count must be refused";
}

TEST_F(NetTest, MessagesOfManySizesArriveIntact) {
  connect();
  const size_t sizes[] = {1, 7, 8, 4095, 4096, 65537, 131072, 1 << 20, (1 << 20) + 3, 3 << 20};
  uint64_t seed = 1;
  for (size_t size : sizes) {
    Buffer* in = buffer(recv_, size);
    Buffer* out = buffer(send_, size);
    fillPattern(out->bytes.data(), size, seed);
    void* r = postRecv(in, size);
    void* s = postSend(out, size);
    ASSERT_NE(r, nullptr);
    ASSERT_NE(s, nullptr);
    int received = -1;
    ASSERT_EQ(waitRequest(net_, r, &received), WaitOutcome::kDone) << "size " << size;
    ASSERT_EQ(waitRequest(net_, s, nullptr), WaitOutcome::kDone);
    EXPECT_EQ(received, static_cast<int>(size));
    EXPECT_EQ(firstMismatch(in->bytes.data(), size, seed), SIZE_MAX) << "size " << size;
    ++seed;
  }
}

// TCP streams of this process whose user timeout (ms) is `timeoutMs`, with keepalive on.
int streamsWithTimeout(unsigned int timeoutMs) {
  int found = 0;
  for (int fd = 0; fd < 4096; ++fd) {
    int type = 0;
    socklen_t length = sizeof(type);
    if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &length) != 0 || type != SOCK_STREAM) continue;
    unsigned int userTimeout = 0;
    int keepalive = 0;
    length = sizeof(userTimeout);
    if (getsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &userTimeout, &length) != 0) continue;
    length = sizeof(keepalive);
    if (getsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &keepalive, &length) != 0) continue;
    if (userTimeout == timeoutMs && keepalive != 0) ++found;
  }
  return found;
}

// A peer host that vanishes without closing its sockets sends no FIN: keepalive and a user
// timeout on every stream (UNIFAB_SOCKET_TIMEOUT_S, 120 s by default) turn it into an error.
TEST_F(NetTest, EveryStreamCarriesKeepaliveAndAUserTimeout) {
  const int before = streamsWithTimeout(120000);
  connect();
  // Both ends of every stream of the connection (UNIFAB_SOCKET_NSTREAMS, 4 by default) are in this process.
  EXPECT_GE(streamsWithTimeout(120000) - before, 2) << "the sending and the receiving end";
  EXPECT_EQ((streamsWithTimeout(120000) - before) % 2, 0);
}

// The handle NCCL passes back names the connection in progress; one naming none of this
// context's (a stale copy, another context's) is refused instead of followed as a pointer.
TEST_F(NetTest, AHandleNamingNoConnectionInProgressIsRefused) {
  char handle[NCCL_NET_HANDLE_MAXSIZE] = {};
  void* listenComm = nullptr;
  ASSERT_EQ(net_->listen(ctx_, 0, handle, &listenComm), ncclSuccess);
  int notAConnector = 0;
  void* bogus = &notAConnector;
  memcpy(handle + offsetof(unifab::net::socket::ListenHandle, connectStage), &bogus, sizeof(bogus));
  void* sendComm = nullptr;
  EXPECT_NE(net_->connect(ctx_, 0, handle, &sendComm, nullptr), ncclSuccess);
  EXPECT_EQ(sendComm, nullptr);
  EXPECT_EQ(notAConnector, 0);
  EXPECT_EQ(net_->closeListen(listenComm), ncclSuccess);
}

// A progress thread whose epoll fails (an application that closes or reuses its descriptor)
// fails the connections it drives, so their requests report an error and close returns, instead
// of stalling forever.
TEST_F(NetTest, AProgressThreadThatCannotPollFailsItsConnections) {
  connect();
  const size_t bytes = size_t{1} << 20;  // above UNIFAB_SOCKET_INLINE_BYTES: a progress thread moves it
  Buffer* in = buffer(recv_, bytes);
  Buffer* out = buffer(send_, bytes);
  void* r = postRecv(in, bytes);
  ASSERT_NE(r, nullptr);
  int devnull = open("/dev/null", O_RDONLY | O_CLOEXEC);
  ASSERT_GE(devnull, 0);
  int broken = 0;
  for (int fd = 0; fd < 4096; ++fd) {
    char path[64], target[128] = {};
    snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
    if (readlink(path, target, sizeof(target) - 1) > 0 && strcmp(target, "anon_inode:[eventpoll]") == 0) {
      ASSERT_EQ(dup2(devnull, fd), fd);
      ++broken;
    }
  }
  close(devnull);
  ASSERT_GT(broken, 0) << "no epoll instance found";
  void* s = nullptr;
  const ncclResult_t posted = net_->isend(send_, out->bytes.data(), bytes, 0, out->mhandle, nullptr, &s);
  if (posted == ncclSuccess && s != nullptr) {
    EXPECT_EQ(waitRequest(net_, s, nullptr, 10.0), WaitOutcome::kError);
  }
  // NCCL then closes the failed side; closing returns, and the receiving side fails as well.
  for (auto it = registrations_.begin(); it != registrations_.end();) {
    if (it->first != send_) {
      ++it;
      continue;
    }
    EXPECT_EQ(net_->deregMr(send_, it->second->mhandle), ncclSuccess);
    it = registrations_.erase(it);
  }
  EXPECT_EQ(net_->closeSend(send_), ncclSuccess);
  send_ = nullptr;
  EXPECT_EQ(waitRequest(net_, r, nullptr, 10.0), WaitOutcome::kError);
}

TEST_F(NetTest, ZeroByteMessages) {
  connect();
  Buffer* in = buffer(recv_, 64);
  Buffer* out = buffer(send_, 64);
  for (int i = 0; i < 10; ++i) {
    void* r = postRecv(in, i % 2 == 0 ? 0 : 64);  // both an empty and a non-empty posted buffer
    void* s = postSend(out, 0);
    int received = -1;
    ASSERT_EQ(waitRequest(net_, r, &received), WaitOutcome::kDone);
    ASSERT_EQ(waitRequest(net_, s, nullptr), WaitOutcome::kDone);
    EXPECT_EQ(received, 0);
  }
  EXPECT_EQ(firstNotEqual(in->bytes.data(), 64, 0xA5), SIZE_MAX) << "a zero-byte message wrote into the buffer";
}

TEST_F(NetTest, ReceiveBufferLargerThanMessage) {
  connect();
  const size_t capacity = 1 << 20;
  const size_t sent = 300001;
  Buffer* in = buffer(recv_, capacity);
  Buffer* out = buffer(send_, sent);
  fillPattern(out->bytes.data(), sent, 77);
  void* r = postRecv(in, capacity);
  void* s = postSend(out, sent);
  int received = -1;
  ASSERT_EQ(waitRequest(net_, r, &received), WaitOutcome::kDone);
  ASSERT_EQ(waitRequest(net_, s, nullptr), WaitOutcome::kDone);
  EXPECT_EQ(received, static_cast<int>(sent));
  EXPECT_EQ(firstMismatch(in->bytes.data(), sent, 77), SIZE_MAX);
  EXPECT_EQ(firstNotEqual(in->bytes.data() + sent, capacity - sent, 0xA5), SIZE_MAX) << "bytes past the message changed";
}

TEST_F(NetTest, ThirtyTwoInFlightInFifoOrderThenBackPressure) {
  connect();
  const int kInFlight = 32;
  const size_t size = 50000;
  std::vector<Buffer*> ins, outs;
  std::vector<void*> recvs, sends;
  for (int i = 0; i < kInFlight; ++i) {
    ins.push_back(buffer(recv_, size));
    recvs.push_back(postRecv(ins.back(), size));
    ASSERT_NE(recvs.back(), nullptr) << "receive " << i << " of " << kInFlight << " refused";
  }
  Buffer* extra = buffer(recv_, size);
  EXPECT_EQ(postRecv(extra, size), nullptr) << "a 33rd receive must be refused with a NULL request";
  for (int i = 0; i < kInFlight; ++i) {
    outs.push_back(buffer(send_, size));
    fillPattern(outs.back()->bytes.data(), size, 1000 + static_cast<uint64_t>(i));
    sends.push_back(postSend(outs.back(), size));
    ASSERT_NE(sends.back(), nullptr);
  }
  for (int i = 0; i < kInFlight; ++i) {
    int received = -1;
    ASSERT_EQ(waitRequest(net_, recvs[i], &received), WaitOutcome::kDone);
    ASSERT_EQ(waitRequest(net_, sends[i], nullptr), WaitOutcome::kDone);
    EXPECT_EQ(firstMismatch(ins[i]->bytes.data(), size, 1000 + static_cast<uint64_t>(i)), SIZE_MAX)
        << "message " << i << " did not land in receive " << i;
  }
  void* again = postRecv(extra, size);
  EXPECT_NE(again, nullptr) << "completed requests must free their slots";
  void* s = postSend(outs[0], 10);
  ASSERT_EQ(waitRequest(net_, again, nullptr), WaitOutcome::kDone);
  ASSERT_EQ(waitRequest(net_, s, nullptr), WaitOutcome::kDone);
}

TEST_F(NetTest, SendsBeyondTheLimitAreRefusedNotLost) {
  connect();
  ncclNetProperties_v11_t props;
  ASSERT_EQ(net_->getProperties(0, &props), ncclSuccess);
  const int limit = NCCL_NET_MAX_REQUESTS * props.maxRecvs;
  Buffer* out = buffer(send_, 16);
  std::vector<void*> sends;
  for (int i = 0; i < limit; ++i) {
    sends.push_back(postSend(out, 16));
    ASSERT_NE(sends.back(), nullptr) << "send " << i << " of " << limit << " refused";
  }
  EXPECT_EQ(postSend(out, 16), nullptr) << "send beyond 32 x maxRecvs must return a NULL request";
  // Drain: every accepted send is matched by a receive.
  Buffer* in = buffer(recv_, 16);
  for (int i = 0; i < limit; ++i) {
    void* r = nullptr;
    while (r == nullptr) r = postRecv(in, 16);
    ASSERT_EQ(waitRequest(net_, r, nullptr), WaitOutcome::kDone);
    ASSERT_EQ(waitRequest(net_, sends[i], nullptr), WaitOutcome::kDone);
  }
}

TEST_F(NetTest, FifoUnderLoadWithRandomSizes) {
  connect();
  const int kMessages = 3000;
  const size_t kMax = 256 * 1024;
  std::mt19937 random(12345);
  std::vector<size_t> sizes(kMessages);
  for (auto& size : sizes) size = random() % 4 == 0 ? random() % kMax : random() % 2048;
  const int kWindow = 32;
  std::vector<Buffer*> ins(kWindow), outs(kWindow);
  for (int i = 0; i < kWindow; ++i) {
    ins[i] = buffer(recv_, kMax);
    outs[i] = buffer(send_, kMax);
  }
  std::vector<void*> recvs(kMessages, nullptr), sends(kMessages, nullptr);
  int posted = 0, sent = 0, completed = 0;
  double deadline = nowSeconds() + 120;
  while (completed < kMessages) {
    ASSERT_LT(nowSeconds(), deadline) << "stalled at message " << completed;
    // Keep up to a window of receives and sends in flight, like NCCL's pipelined steps.
    while (posted < kMessages && posted - completed < kWindow) {
      recvs[posted] = postRecv(ins[posted % kWindow], kMax);
      ASSERT_NE(recvs[posted], nullptr);
      ++posted;
    }
    while (sent < posted) {
      Buffer* out = outs[sent % kWindow];
      fillPattern(out->bytes.data(), sizes[sent], 5000 + static_cast<uint64_t>(sent));
      sends[sent] = postSend(out, sizes[sent]);
      ASSERT_NE(sends[sent], nullptr);
      ++sent;
    }
    int done = 0;
    int received = -1;
    ASSERT_EQ(net_->test(recvs[completed], &done, &received), ncclSuccess);
    if (!done) continue;
    ASSERT_EQ(waitRequest(net_, sends[completed], nullptr), WaitOutcome::kDone);
    ASSERT_EQ(received, static_cast<int>(sizes[completed])) << "message " << completed;
    ASSERT_EQ(firstMismatch(ins[completed % kWindow]->bytes.data(), sizes[completed], 5000 + static_cast<uint64_t>(completed)),
              SIZE_MAX)
        << "message " << completed;
    ++completed;
  }
}

TEST_F(NetTest, GroupedReceivesPlaceMessagesByTag) {
  connect();
  ncclNetProperties_v11_t props;
  ASSERT_EQ(net_->getProperties(0, &props), ncclSuccess);
  const int n = props.maxRecvs;
  ASSERT_GE(n, 2);
  std::mt19937 random(7);
  for (int round = 0; round < 20; ++round) {
    std::vector<Buffer*> ins(n);
    std::vector<void*> data(n), mhandles(n);
    std::vector<size_t> capacities(n);
    std::vector<int> tags(n), messageSizes(n);
    for (int i = 0; i < n; ++i) {
      messageSizes[i] = static_cast<int>(random() % 200000);
      capacities[i] = static_cast<size_t>(messageSizes[i]) + random() % 1000;
      ins[i] = buffer(recv_, capacities[i]);
      data[i] = ins[i]->bytes.data();
      mhandles[i] = ins[i]->mhandle;
      tags[i] = 100 + i * 3;  // distinct, not equal to the slot index
    }
    void* request = nullptr;
    ASSERT_EQ(net_->irecv(recv_, n, data.data(), capacities.data(), tags.data(), mhandles.data(), nullptr, &request),
              ncclSuccess);
    ASSERT_NE(request, nullptr);
    // Senders of one grouped receive post in any order.
    std::vector<int> order(n);
    for (int i = 0; i < n; ++i) order[i] = i;
    std::shuffle(order.begin(), order.end(), random);
    std::vector<void*> sends;
    for (int slot : order) {
      Buffer* out = buffer(send_, static_cast<size_t>(messageSizes[slot]));
      fillPattern(out->bytes.data(), static_cast<size_t>(messageSizes[slot]), 900 + static_cast<uint64_t>(slot));
      sends.push_back(postSend(out, static_cast<size_t>(messageSizes[slot]), tags[slot]));
      ASSERT_NE(sends.back(), nullptr);
    }
    std::vector<int> received(n, -1);
    ASSERT_EQ(waitRequest(net_, request, received.data()), WaitOutcome::kDone);
    for (void* s : sends) ASSERT_EQ(waitRequest(net_, s, nullptr), WaitOutcome::kDone);
    for (int i = 0; i < n; ++i) {
      EXPECT_EQ(received[i], messageSizes[i]) << "slot " << i;
      EXPECT_EQ(firstMismatch(ins[i]->bytes.data(), static_cast<size_t>(messageSizes[i]), 900 + static_cast<uint64_t>(i)),
                SIZE_MAX)
          << "slot " << i << " round " << round;
    }
  }
}

TEST_F(NetTest, GroupedReceivesKeepPerTagOrderAcrossGroups) {
  connect();
  const int n = 2;
  const int tagA = 4, tagB = 9;
  // Two sends with tag A before any with tag B: the second A belongs to the second group.
  Buffer* outA1 = buffer(send_, 1000);
  Buffer* outA2 = buffer(send_, 1000);
  Buffer* outB1 = buffer(send_, 1000);
  Buffer* outB2 = buffer(send_, 1000);
  fillPattern(outA1->bytes.data(), 1000, 1);
  fillPattern(outA2->bytes.data(), 1000, 2);
  fillPattern(outB1->bytes.data(), 1000, 3);
  fillPattern(outB2->bytes.data(), 1000, 4);
  std::vector<void*> sends = {postSend(outA1, 1000, tagA), postSend(outA2, 1000, tagA), postSend(outB1, 1000, tagB),
                              postSend(outB2, 1000, tagB)};
  void* requests[2];
  Buffer* ins[2][2];
  for (int g = 0; g < 2; ++g) {
    ins[g][0] = buffer(recv_, 1000);
    ins[g][1] = buffer(recv_, 1000);
    void* data[n] = {ins[g][0]->bytes.data(), ins[g][1]->bytes.data()};
    void* mh[n] = {ins[g][0]->mhandle, ins[g][1]->mhandle};
    size_t caps[n] = {1000, 1000};
    int tags[n] = {tagB, tagA};
    ASSERT_EQ(net_->irecv(recv_, n, data, caps, tags, mh, nullptr, &requests[g]), ncclSuccess);
  }
  for (int g = 0; g < 2; ++g) ASSERT_EQ(waitRequest(net_, requests[g], nullptr), WaitOutcome::kDone);
  for (void* s : sends) ASSERT_EQ(waitRequest(net_, s, nullptr), WaitOutcome::kDone);
  EXPECT_EQ(firstMismatch(ins[0][1]->bytes.data(), 1000, 1), SIZE_MAX) << "first A must land in the first group";
  EXPECT_EQ(firstMismatch(ins[1][1]->bytes.data(), 1000, 2), SIZE_MAX);
  EXPECT_EQ(firstMismatch(ins[0][0]->bytes.data(), 1000, 3), SIZE_MAX);
  EXPECT_EQ(firstMismatch(ins[1][0]->bytes.data(), 1000, 4), SIZE_MAX);
}

TEST_F(NetTest, SendWithATagNoGroupedBufferHasFailsInsteadOfHanging) {
  connect();
  Buffer* in0 = buffer(recv_, 100);
  Buffer* in1 = buffer(recv_, 100);
  void* data[2] = {in0->bytes.data(), in1->bytes.data()};
  void* mh[2] = {in0->mhandle, in1->mhandle};
  size_t caps[2] = {100, 100};
  int tags[2] = {1, 2};
  void* r = nullptr;
  ASSERT_EQ(net_->irecv(recv_, 2, data, caps, tags, mh, nullptr, &r), ncclSuccess);
  Buffer* out = buffer(send_, 100);
  void* s = postSend(out, 100, 3);
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(waitRequest(net_, s, nullptr, 10.0), WaitOutcome::kError);
  EXPECT_FALSE(capturedWarnings().empty());
}

// A single-buffer receive compares the tag too: another tag's bytes never land in it.
TEST_F(NetTest, SendWithAnotherTagThanASingleReceiveFailsInsteadOfLandingInIt) {
  connect();
  Buffer* in = buffer(recv_, 100, 0x11);
  void* r = postRecv(in, 100, 1);
  ASSERT_NE(r, nullptr);
  Buffer* out = buffer(send_, 100, 0x22);
  void* s = postSend(out, 100, 2);
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(waitRequest(net_, s, nullptr, 10.0), WaitOutcome::kError);
  EXPECT_TRUE(std::all_of(in->bytes.begin(), in->bytes.end(), [](unsigned char b) { return b == 0x11; }))
      << "the receive buffer kept its contents";
}

TEST_F(NetTest, SixtyFourMebibyteMessage) {
  connect();
  const size_t size = 64u << 20;
  Buffer* in = buffer(recv_, size);
  Buffer* out = buffer(send_, size);
  fillPattern(out->bytes.data(), size, 64);
  void* r = postRecv(in, size);
  void* s = postSend(out, size);
  int received = -1;
  ASSERT_EQ(waitRequest(net_, r, &received, 60.0), WaitOutcome::kDone);
  ASSERT_EQ(waitRequest(net_, s, nullptr, 60.0), WaitOutcome::kDone);
  EXPECT_EQ(received, static_cast<int>(size));
  EXPECT_EQ(firstMismatch(in->bytes.data(), size, 64), SIZE_MAX);
}

TEST_F(NetTest, MessageLargerThanPostedBufferFailsBothSides) {
  connect();
  Buffer* in = buffer(recv_, 100);
  Buffer* out = buffer(send_, 200);
  void* r = postRecv(in, 100);
  void* s = postSend(out, 200);
  EXPECT_EQ(waitRequest(net_, s, nullptr, 10.0), WaitOutcome::kError);
  EXPECT_EQ(waitRequest(net_, r, nullptr, 10.0), WaitOutcome::kError);
  EXPECT_EQ(firstNotEqual(in->bytes.data(), 100, 0xA5), SIZE_MAX) << "a truncated message must not be written";
}

TEST_F(NetTest, FlushOfHostMemoryNeedsNoRequest) {
  connect();
  Buffer* in = buffer(recv_, 128);
  void* data = in->bytes.data();
  int size = 128;
  void* request = reinterpret_cast<void*>(0x1);
  EXPECT_EQ(net_->iflush(recv_, 1, &data, &size, &in->mhandle, &request), ncclSuccess);
  EXPECT_EQ(request, nullptr);
}

TEST_F(NetTest, OptionalCompletionMarkerIsReplacedByARealRequest) {
  connect();
  Buffer* in = buffer(recv_, 64);
  Buffer* out = buffer(send_, 64);
  fillPattern(out->bytes.data(), 64, 9);
  void* data = in->bytes.data();
  size_t capacity = 64;
  int tag = 0;
  void* request = reinterpret_cast<void*>(NCCL_NET_OPTIONAL_RECV_COMPLETION);
  ASSERT_EQ(net_->irecv(recv_, 1, &data, &capacity, &tag, &in->mhandle, nullptr, &request), ncclSuccess);
  ASSERT_NE(request, reinterpret_cast<void*>(NCCL_NET_OPTIONAL_RECV_COMPLETION));
  ASSERT_NE(request, nullptr);
  void* s = postSend(out, 64);
  ASSERT_EQ(waitRequest(net_, request, nullptr), WaitOutcome::kDone);
  ASSERT_EQ(waitRequest(net_, s, nullptr), WaitOutcome::kDone);
  EXPECT_EQ(firstMismatch(in->bytes.data(), 64, 9), SIZE_MAX);
}

TEST_F(NetTest, RegistrationRejectsWhatTheTransportCannotMove) {
  connect();
  unsigned char host[64];
  void* mhandle = nullptr;
  EXPECT_NE(net_->regMr(send_, host, sizeof(host), NCCL_PTR_CUDA, &mhandle), ncclSuccess);
  EXPECT_NE(net_->regMrDmaBuf(send_, host, sizeof(host), NCCL_PTR_CUDA, 0, 3, &mhandle), ncclSuccess);
  EXPECT_FALSE(capturedWarnings().empty()) << "refusals must be explained through NCCL's logger";
  Buffer* in = buffer(recv_, 16);
  void* data = in->bytes.data();
  size_t capacity = 16;
  int tags[9] = {};
  void* datas[9];
  size_t caps[9];
  void* mhs[9];
  for (int i = 0; i < 9; ++i) {
    datas[i] = data;
    caps[i] = capacity;
    mhs[i] = in->mhandle;
  }
  void* request = nullptr;
  EXPECT_EQ(net_->irecv(recv_, 9, datas, caps, tags, mhs, nullptr, &request), ncclInvalidArgument);
  EXPECT_EQ(request, nullptr);
}

TEST_F(NetTest, OneListenerAcceptsSeveralConnections) {
  char handle[NCCL_NET_HANDLE_MAXSIZE] = {};
  void* listenComm = nullptr;
  ASSERT_EQ(net_->listen(ctx_, 0, handle, &listenComm), ncclSuccess);
  char handle2[NCCL_NET_HANDLE_MAXSIZE];
  memcpy(handle2, handle, sizeof(handle));  // each connector keeps its own progress in its copy
  void* sendA = nullptr;
  void* sendB = nullptr;
  void* recvs[2] = {nullptr, nullptr};
  int accepted = 0;
  double deadline = nowSeconds() + 30;
  while ((sendA == nullptr || sendB == nullptr || accepted < 2) && nowSeconds() < deadline) {
    if (sendA == nullptr) {
      ASSERT_EQ(net_->connect(ctx_, 0, handle, &sendA, nullptr), ncclSuccess);
    }
    if (sendB == nullptr) {
      ASSERT_EQ(net_->connect(ctx_, 0, handle2, &sendB, nullptr), ncclSuccess);
    }
    if (accepted < 2) {
      ASSERT_EQ(net_->accept(listenComm, &recvs[accepted], nullptr), ncclSuccess);
      if (recvs[accepted] != nullptr) ++accepted;
    }
  }
  ASSERT_EQ(accepted, 2);
  ASSERT_NE(sendA, nullptr);
  ASSERT_NE(sendB, nullptr);
  EXPECT_EQ(net_->closeSend(sendA), ncclSuccess);
  EXPECT_EQ(net_->closeSend(sendB), ncclSuccess);
  EXPECT_EQ(net_->closeRecv(recvs[0]), ncclSuccess);
  EXPECT_EQ(net_->closeRecv(recvs[1]), ncclSuccess);
  EXPECT_EQ(net_->closeListen(listenComm), ncclSuccess);
}

TEST_F(NetTest, ReceiverSeesAnErrorWhenTheSenderClosesWithReceivesPending) {
  connect();
  Buffer* in = buffer(recv_, 1024);
  void* r = postRecv(in, 1024);
  ASSERT_EQ(net_->closeSend(send_), ncclSuccess);
  send_ = nullptr;
  EXPECT_EQ(waitRequest(net_, r, nullptr, 10.0), WaitOutcome::kError);
}

// A sender speaking the wire protocol (net/socket/wire.h) by hand on one stream, to send what
// unifab's own sender never would: chunks that overrun, overlap, repeat or contradict each other.
class RawSender {
 public:
  RawSender() = default;
  RawSender(const RawSender&) = delete;
  RawSender& operator=(const RawSender&) = delete;
  ~RawSender() {
    if (fd_ >= 0) close(fd_);
  }

  // Connects to the listener that wrote `handle` and introduces itself as stream 0 of a sender of
  // `streamCount` streams; with `hello` false it says nothing at all.
  bool open(const char* handle, int streamCount = 1, bool hello = true) {
    unifab::net::socket::ListenHandle listen;
    memcpy(&listen, handle, sizeof(listen));
    fd_ = socket(listen.address.sa.sa_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd_ < 0 || ::connect(fd_, &listen.address.sa, listen.addressLength) != 0) return false;
    if (!hello) return true;
    return introduce(listen, streamCount);
  }

  // Whether the other side closed this socket within `seconds` (reading and discarding data).
  bool closedWithin(double seconds) {
    const double deadline = nowSeconds() + seconds;
    char discard[256];
    while (nowSeconds() < deadline) {
      pollfd readable{fd_, POLLIN, 0};
      if (poll(&readable, 1, 50) < 0) return false;
      if ((readable.revents & (POLLIN | POLLHUP)) == 0) continue;
      ssize_t n = recv(fd_, discard, sizeof(discard), MSG_DONTWAIT);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) return true;
    }
    return false;
  }

 private:
  bool introduce(const unifab::net::socket::ListenHandle& listen, int streamCount) {
    unifab::net::socket::Hello hello{};
    hello.magic = unifab::net::socket::kWireMagic;
    hello.version = unifab::net::socket::kWireVersion;
    hello.streamIndex = 0;
    hello.streamCount = static_cast<uint16_t>(streamCount);
    hello.connectionId = 0x5eed5eed;
    hello.listenId = listen.listenId;
    return writeAll(&hello, sizeof(hello));
  }

 public:
  // The receiver's next announcement (a posted receive), within `seconds`.
  bool readAnnouncement(unifab::net::socket::ClearToSend* announcement, double seconds = 10.0) {
    char* into = reinterpret_cast<char*>(announcement);
    size_t got = 0;
    const double deadline = nowSeconds() + seconds;
    while (got < sizeof(*announcement)) {
      pollfd readable{fd_, POLLIN, 0};
      if (nowSeconds() > deadline || poll(&readable, 1, 100) < 0) return false;
      if ((readable.revents & POLLIN) == 0) continue;
      ssize_t n = recv(fd_, into + got, sizeof(*announcement) - got, 0);
      if (n <= 0) return false;
      got += static_cast<size_t>(n);
    }
    return true;
  }

  // A chunk header and `header.length` payload bytes of `fill`.
  bool sendChunk(const unifab::net::socket::ChunkHeader& header, unsigned char fill = 0x3C) {
    if (!writeAll(&header, sizeof(header))) return false;
    std::vector<unsigned char> payload(static_cast<size_t>(std::min<uint64_t>(header.length, 1 << 20)), fill);
    return payload.empty() || writeAll(payload.data(), payload.size());
  }

 private:
  bool writeAll(const void* data, size_t bytes) {
    const char* from = static_cast<const char*>(data);
    while (bytes > 0) {
      ssize_t n = send(fd_, from, bytes, MSG_NOSIGNAL);
      if (n <= 0) return false;
      from += n;
      bytes -= static_cast<size_t>(n);
    }
    return true;
  }
  int fd_ = -1;
};

// Receives from a RawSender: `recv_` accepted from it, buffers guarded on both sides.
class HostileSenderTest : public NetTest {
 protected:
  static constexpr size_t kGuard = 4096;
  static constexpr unsigned char kPoison = 0xA5;

  void SetUp() override {
    NetTest::SetUp();
    char handle[NCCL_NET_HANDLE_MAXSIZE] = {};
    void* listenComm = nullptr;
    ASSERT_EQ(net_->listen(ctx_, 0, handle, &listenComm), ncclSuccess);
    ASSERT_TRUE(sender_.open(handle)) << strerror(errno);
    ASSERT_EQ(acceptOne(net_, listenComm, &recv_, 10.0), ncclSuccess);
    ASSERT_EQ(net_->closeListen(listenComm), ncclSuccess);
    ASSERT_NE(recv_, nullptr);
    arena_ = buffer(recv_, 2 * kGuard + 2 * kBufferBytes + kGuard, kPoison);
  }

  // Posts a receive of `n` buffers of kBufferBytes (tags 0..n-1) and reads its announcement.
  void* postGrouped(int n, unifab::net::socket::ClearToSend* announcement) {
    void* data[2] = {slotBuffer(0), slotBuffer(1)};
    size_t sizes[2] = {kBufferBytes, kBufferBytes};
    int tags[2] = {0, 1};
    void* handles[2] = {arena_->mhandle, arena_->mhandle};
    void* request = nullptr;
    EXPECT_EQ(net_->irecv(recv_, n, data, sizes, tags, handles, nullptr, &request), ncclSuccess);
    EXPECT_NE(request, nullptr);
    EXPECT_TRUE(sender_.readAnnouncement(announcement));
    return request;
  }

  unsigned char* slotBuffer(int slot) { return arena_->bytes.data() + kGuard + slot * (kBufferBytes + kGuard); }

  // Nothing outside the posted buffers was written.
  void expectGuardsIntact() {
    const unsigned char* base = arena_->bytes.data();
    EXPECT_EQ(firstNotEqual(base, kGuard, kPoison), SIZE_MAX) << "written before buffer 0";
    EXPECT_EQ(firstNotEqual(slotBuffer(0) + kBufferBytes, kGuard, kPoison), SIZE_MAX) << "written between the buffers";
    EXPECT_EQ(firstNotEqual(slotBuffer(1) + kBufferBytes, kGuard, kPoison), SIZE_MAX) << "written after buffer 1";
  }

  // One chunk as (slot, messageBytes, offset, length, chunkBytes); the receive's sequence is added.
  struct Piece {
    uint32_t slot;
    uint64_t messageBytes, offset, length, chunkBytes;
  };

  // A receive of `buffers` buffers gets `pieces`: it must fail, with nothing written outside its
  // buffers (and, with two buffers, nothing in the second).
  void expectRefused(int buffers, std::initializer_list<Piece> pieces) {
    unifab::net::socket::ClearToSend announcement{};
    void* r = postGrouped(buffers, &announcement);
    for (const Piece& p : pieces) {
      ASSERT_TRUE(sender_.sendChunk(chunk(announcement.sequence, p.slot, p.messageBytes, p.offset, p.length,
                                          p.chunkBytes)));
    }
    EXPECT_EQ(waitRequest(net_, r, nullptr, 10.0), WaitOutcome::kError);
    if (buffers == 2) {
      EXPECT_EQ(firstNotEqual(slotBuffer(1), kBufferBytes, kPoison), SIZE_MAX);
    }
    expectGuardsIntact();
  }

  static unifab::net::socket::ChunkHeader chunk(uint64_t sequence, uint32_t slot, uint64_t messageBytes, uint64_t offset,
                                                uint64_t length, uint64_t chunkBytes) {
    unifab::net::socket::ChunkHeader header{};
    header.sequence = sequence;
    header.slot = slot;
    header.messageBytes = messageBytes;
    header.offset = offset;
    header.length = length;
    header.chunkBytes = chunkBytes;
    return header;
  }

  static constexpr size_t kBufferBytes = 8192;
  RawSender sender_;
  Buffer* arena_ = nullptr;
};

// The honest case through the hand-written sender: the receive completes with the bytes sent.
TEST_F(HostileSenderTest, AWellCutMessageArrives) {
  unifab::net::socket::ClearToSend announcement{};
  void* r = postGrouped(1, &announcement);
  ASSERT_TRUE(sender_.sendChunk(chunk(announcement.sequence, 0, 6000, 4096, 1904, 4096), 0x11));
  ASSERT_TRUE(sender_.sendChunk(chunk(announcement.sequence, 0, 6000, 0, 4096, 4096), 0x22));
  int size = -1;
  EXPECT_EQ(waitRequest(net_, r, &size, 10.0), WaitOutcome::kDone);
  EXPECT_EQ(size, 6000);
  EXPECT_EQ(firstNotEqual(slotBuffer(0), 4096, 0x22), SIZE_MAX);
  EXPECT_EQ(firstNotEqual(slotBuffer(0) + 4096, 1904, 0x11), SIZE_MAX);
  expectGuardsIntact();
}

// offset + length wraps around 2^64 to a small number: it must not pass as inside the buffer.
TEST_F(HostileSenderTest, AnOffsetThatWrapsAroundIsRefused) {
  expectRefused(1, {{0, 4096, ~uint64_t{0} - 4095, 8192, 8192}});
}

// Two empty chunks for buffer 0 of a two-buffer receive must not complete it with buffer 1 unwritten.
TEST_F(HostileSenderTest, ARepeatedChunkIsRefused) { expectRefused(2, {{0, 0, 0, 0, 0}, {0, 0, 0, 0, 0}}); }

// Overlapping chunks whose lengths add up to the message must not complete it half written.
TEST_F(HostileSenderTest, OverlappingChunksAreRefused) {
  expectRefused(1, {{0, 8192, 0, 4096, 4096}, {0, 8192, 2048, 4096, 2048}});
}

// Chunks of one buffer that name different message sizes.
TEST_F(HostileSenderTest, ChunksThatDisagreeOnTheMessageSizeAreRefused) {
  expectRefused(1, {{0, 8192, 0, 4096, 4096}, {0, 6000, 4096, 1904, 4096}});
}

// A message larger than the buffer without the truncation mark.
TEST_F(HostileSenderTest, AnUnmarkedOversizedMessageIsRefused) {
  expectRefused(1, {{0, 2 * kBufferBytes, kBufferBytes, 4096, kBufferBytes}});
}

// Both buffers of a grouped receive too small, the notices read one after the other: one error,
// reported through the request (not a connection-wide protocol error).
TEST_F(HostileSenderTest, TwoTruncatedBuffersOfOneReceiveFailItOnce) {
  unifab::net::socket::ClearToSend announcement{};
  void* r = postGrouped(2, &announcement);
  for (uint32_t slot : {0u, 1u}) {
    unifab::net::socket::ChunkHeader header = chunk(announcement.sequence, slot, 2 * kBufferBytes, 0, 0, 0);
    header.flags = unifab::net::socket::kChunkTruncated;
    ASSERT_TRUE(sender_.sendChunk(header));
  }
  EXPECT_EQ(waitRequest(net_, r, nullptr, 10.0), WaitOutcome::kError);
  bool namesTheBuffer = false;
  for (const std::string& warning : capturedWarnings()) {
    namesTheBuffer |= warning.find("is larger than buffer") != std::string::npos;
  }
  EXPECT_TRUE(namesTheBuffer) << "the error should say which buffer was too small";
  expectGuardsIntact();
}

// One buffer of a grouped receive too small and the other's message sent in full: the receive
// fails with the truncation, and the other buffer's chunks are taken, not a protocol error.
TEST_F(NetTest, OneTruncatedBufferOfAGroupedReceiveFailsItWithoutAProtocolError) {
  connect();
  Buffer* small = buffer(recv_, 100);
  Buffer* large = buffer(recv_, 4096);
  void* data[2] = {small->bytes.data(), large->bytes.data()};
  size_t sizes[2] = {100, 4096};
  int tags[2] = {1, 2};
  void* handles[2] = {small->mhandle, large->mhandle};
  void* r = nullptr;
  ASSERT_EQ(net_->irecv(recv_, 2, data, sizes, tags, handles, nullptr, &r), ncclSuccess);
  Buffer* tooLarge = buffer(send_, 200);
  Buffer* fits = buffer(send_, 4096);
  fillPattern(fits->bytes.data(), 4096, 7);
  void* s1 = postSend(tooLarge, 200, 1);
  void* s2 = postSend(fits, 4096, 2);
  EXPECT_EQ(waitRequest(net_, s1, nullptr, 10.0), WaitOutcome::kError);
  EXPECT_EQ(waitRequest(net_, s2, nullptr, 10.0), WaitOutcome::kDone);
  clearCapturedWarnings();
  EXPECT_EQ(waitRequest(net_, r, nullptr, 10.0), WaitOutcome::kError);
  bool truncation = false, protocolError = false;
  for (const std::string& warning : capturedWarnings()) {
    truncation |= warning.find("is larger than buffer 0") != std::string::npos;
    protocolError |= warning.find("protocol error") != std::string::npos;
  }
  EXPECT_TRUE(truncation);
  EXPECT_FALSE(protocolError);
  EXPECT_EQ(firstNotEqual(small->bytes.data(), 100, 0xA5), SIZE_MAX) << "a truncated message must not be written";
}

TEST_F(NetTest, SenderSeesAnErrorWhenTheReceiverCloses) {
  connect();
  Buffer* out = buffer(send_, 1024);
  void* s = postSend(out, 1024);  // never matched: no receive is posted
  ASSERT_EQ(net_->closeRecv(recv_), ncclSuccess);
  recv_ = nullptr;
  EXPECT_EQ(waitRequest(net_, s, nullptr, 10.0), WaitOutcome::kError);
}

TEST_F(NetTest, CloseWithRequestsInFlightAndFinalizeFirst) {
  connect();
  Buffer* out = buffer(send_, 8 << 20);
  for (int i = 0; i < 4; ++i) {
    postRecv(buffer(recv_, 8 << 20), 8 << 20);  // concurrent receives never share a buffer
    postSend(out, 8 << 20);
  }
  // Finalize the context before the comms: the comms keep what they need alive.
  ASSERT_EQ(net_->finalize(ctx_), ncclSuccess);
  ctx_ = nullptr;
  for (auto& [comm, buf] : registrations_) net_->deregMr(comm, buf->mhandle);
  registrations_.clear();
  EXPECT_EQ(net_->closeRecv(recv_), ncclSuccess);
  recv_ = nullptr;
  EXPECT_EQ(net_->closeSend(send_), ncclSuccess);
  send_ = nullptr;
}

// Two contexts of one loaded plugin (two "communicators") and a connection between them.
void openTwoContexts(const ncclNet_v11_t* net, void** ctxA, void** ctxB, void** send, void** recv) {
  ASSERT_EQ(net->init(ctxA, 1, nullptr, captureLogger, nullptr), ncclSuccess);
  ASSERT_EQ(net->init(ctxB, 2, nullptr, captureLogger, nullptr), ncclSuccess);
  ASSERT_EQ(connectPair(net, *ctxA, *ctxB, 0, send, recv), ncclSuccess);
}

// A socket that never says Hello, and a connection whose second stream never comes, are closed
// by the listener after UNIFAB_SOCKET_TIMEOUT_S instead of holding descriptors until it closes.
TEST(NetListener, SilentAndIncompleteConnectionsAreDroppedAfterTheTimeout) {
  const char* timeout = getenv("UNIFAB_SOCKET_TIMEOUT_S");
  if (timeout == nullptr || strcmp(timeout, "1") != 0) {
    GTEST_SKIP() << "needs UNIFAB_SOCKET_TIMEOUT_S=1 (ctest net.plugin_listener_timeout)";
  }
  NetPlugin plugin;
  std::string error;
  ASSERT_TRUE(plugin.load(UNIFAB_TEST_PLUGIN_PATH, &error)) << error;
  const ncclNet_v11_t* net = plugin.table();
  clearCapturedWarnings();
  void* ctx = nullptr;
  ASSERT_EQ(net->init(&ctx, 0x77, nullptr, captureLogger, nullptr), ncclSuccess);
  char handle[NCCL_NET_HANDLE_MAXSIZE] = {};
  void* listenComm = nullptr;
  ASSERT_EQ(net->listen(ctx, 0, handle, &listenComm), ncclSuccess);
  RawSender silent, incomplete;
  ASSERT_TRUE(silent.open(handle, 1, /*hello=*/false));
  ASSERT_TRUE(incomplete.open(handle, /*streamCount=*/2));
  const double start = nowSeconds();
  // NCCL keeps calling accept while it waits for its peers: that is when the listener tidies up.
  std::atomic<bool> accepting{true};
  std::thread acceptor([&] {
    while (accepting.load()) {
      void* recvComm = nullptr;
      EXPECT_EQ(net->accept(listenComm, &recvComm, nullptr), ncclSuccess);
      EXPECT_EQ(recvComm, nullptr) << "neither connection is complete";
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  });
  EXPECT_TRUE(silent.closedWithin(10.0));
  EXPECT_TRUE(incomplete.closedWithin(10.0));
  const double elapsed = nowSeconds() - start;
  accepting.store(false);
  acceptor.join();
  EXPECT_GE(elapsed, 0.9) << "dropped before the timeout";
  bool noHello = false, missingStream = false;
  for (const std::string& warning : capturedWarnings()) {
    noHello |= warning.find("sent no complete Hello") != std::string::npos;
    missingStream |= warning.find("1 of its 2 streams arrived") != std::string::npos;
  }
  EXPECT_TRUE(noHello);
  EXPECT_TRUE(missingStream);
  EXPECT_EQ(net->closeListen(listenComm), ncclSuccess);
  EXPECT_EQ(net->finalize(ctx), ncclSuccess);
}

TEST(NetLifecycle, RepeatedInitFinalizeAndReload) {
  for (int load = 0; load < 4; ++load) {
    NetPlugin plugin;
    std::string error;
    ASSERT_TRUE(plugin.load(libraryPath(), &error)) << error;
    const ncclNet_v11_t* net = plugin.table();
    for (int round = 0; round < 5; ++round) {
      void *ctxA = nullptr, *ctxB = nullptr, *send = nullptr, *recv = nullptr;
      openTwoContexts(net, &ctxA, &ctxB, &send, &recv);
      if (HasFatalFailure()) return;
      std::vector<unsigned char> in(4096, 0), out(4096);
      fillPattern(out.data(), out.size(), 31);
      void *mhIn = nullptr, *mhOut = nullptr;
      ASSERT_EQ(net->regMr(recv, in.data(), in.size(), NCCL_PTR_HOST, &mhIn), ncclSuccess);
      ASSERT_EQ(net->regMr(send, out.data(), out.size(), NCCL_PTR_HOST, &mhOut), ncclSuccess);
      void* data = in.data();
      size_t capacity = in.size();
      int tag = 0;
      void *r = nullptr, *s = nullptr;
      ASSERT_EQ(net->irecv(recv, 1, &data, &capacity, &tag, &mhIn, nullptr, &r), ncclSuccess);
      ASSERT_EQ(net->isend(send, out.data(), out.size(), 0, mhOut, nullptr, &s), ncclSuccess);
      ASSERT_EQ(waitRequest(net, r, nullptr), WaitOutcome::kDone);
      ASSERT_EQ(waitRequest(net, s, nullptr), WaitOutcome::kDone);
      EXPECT_EQ(firstMismatch(in.data(), in.size(), 31), SIZE_MAX);
      // Alternate the teardown order between rounds.
      if (round % 2 == 0) {
        net->deregMr(recv, mhIn);
        net->deregMr(send, mhOut);
        EXPECT_EQ(net->closeRecv(recv), ncclSuccess);
        EXPECT_EQ(net->finalize(ctxB), ncclSuccess);
        EXPECT_EQ(net->closeSend(send), ncclSuccess);
        EXPECT_EQ(net->finalize(ctxA), ncclSuccess);
      } else {
        EXPECT_EQ(net->finalize(ctxA), ncclSuccess);
        EXPECT_EQ(net->finalize(ctxB), ncclSuccess);
        net->deregMr(send, mhOut);
        EXPECT_EQ(net->closeSend(send), ncclSuccess);
        net->deregMr(recv, mhIn);
        EXPECT_EQ(net->closeRecv(recv), ncclSuccess);
      }
    }
    plugin.unload();  // NCCL dlcloses the plugin after its last communicator
  }
}

TEST(NetThreads, TwoContextsOnTwoThreads) {
  NetPlugin plugin;
  std::string error;
  ASSERT_TRUE(plugin.load(libraryPath(), &error)) << error;
  const ncclNet_v11_t* net = plugin.table();
  void *ctxA = nullptr, *ctxB = nullptr, *send = nullptr, *recv = nullptr;
  openTwoContexts(net, &ctxA, &ctxB, &send, &recv);
  if (HasFatalFailure()) return;
  const int kMessages = 500;
  const size_t kSize = 300000;
  std::atomic<int> failures{0};
  std::thread receiver([&] {
    std::vector<unsigned char> in(kSize);
    void* mh = nullptr;
    net->regMr(recv, in.data(), in.size(), NCCL_PTR_HOST, &mh);
    for (int i = 0; i < kMessages; ++i) {
      void* data = in.data();
      size_t capacity = kSize;
      int tag = 0;
      void* r = nullptr;
      while (r == nullptr) net->irecv(recv, 1, &data, &capacity, &tag, &mh, nullptr, &r);
      int size = -1;
      if (waitRequest(net, r, &size, 60.0) != WaitOutcome::kDone) {
        ++failures;
        return;
      }
      size_t expected = kSize - static_cast<size_t>(i);
      if (static_cast<size_t>(size) != expected || firstMismatch(in.data(), expected, 3000 + static_cast<uint64_t>(i)) != SIZE_MAX) {
        ++failures;
      }
    }
    net->deregMr(recv, mh);
  });
  std::thread sender([&] {
    std::vector<unsigned char> out(kSize);
    void* mh = nullptr;
    net->regMr(send, out.data(), out.size(), NCCL_PTR_HOST, &mh);
    for (int i = 0; i < kMessages; ++i) {
      fillPattern(out.data(), kSize - static_cast<size_t>(i), 3000 + static_cast<uint64_t>(i));
      void* s = nullptr;
      while (s == nullptr) net->isend(send, out.data(), kSize - static_cast<size_t>(i), 0, mh, nullptr, &s);
      if (waitRequest(net, s, nullptr, 60.0) != WaitOutcome::kDone) {
        ++failures;
        return;
      }
    }
    net->deregMr(send, mh);
  });
  sender.join();
  receiver.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(net->closeSend(send), ncclSuccess);
  EXPECT_EQ(net->closeRecv(recv), ncclSuccess);
  EXPECT_EQ(net->finalize(ctxA), ncclSuccess);
  EXPECT_EQ(net->finalize(ctxB), ncclSuccess);
}

TEST(NetSelection, InterfaceChosenByTheEnvironment) {
  const char* spec = getenv("UNIFAB_SOCKET_IFNAME");
  if (spec == nullptr) GTEST_SKIP() << "UNIFAB_SOCKET_IFNAME is not set";
  NetPlugin plugin;
  std::string error;
  ASSERT_TRUE(plugin.load(libraryPath(), &error)) << error;
  const ncclNet_v11_t* net = plugin.table();
  clearCapturedWarnings();
  void* ctx = nullptr;
  ncclResult_t result = net->init(&ctx, 9, nullptr, captureLogger, nullptr);
  if (std::string(spec) == "lo") {
    ASSERT_EQ(result, ncclSuccess);
    ncclNetProperties_v11_t props;
    ASSERT_EQ(net->getProperties(0, &props), ncclSuccess);
    EXPECT_STREQ(props.name, "lo");
    EXPECT_EQ(props.pciPath, nullptr) << "loopback is no PCI device";
    EXPECT_EQ(props.speed, 10000) << "no sysfs speed: NCCL's 10 Gb/s default";
    EXPECT_EQ(net->finalize(ctx), ncclSuccess);
    return;
  }
  // NCCL finalizes a context whose init failed; the plugin must tolerate that.
  EXPECT_NE(result, ncclSuccess) << "init must fail when no interface matches";
  bool explained = false;
  for (const std::string& warning : capturedWarnings()) {
    explained = explained || warning.find("UNIFAB_SOCKET_IFNAME") != std::string::npos;
  }
  EXPECT_TRUE(explained) << "the warning must name the variable";
  EXPECT_EQ(net->finalize(ctx), ncclSuccess);
}

// ---- two processes -----------------------------------------------------------------------

// A net_peer child process with its stdout on a pipe.
class Peer {
 public:
  explicit Peer(std::vector<std::string> args) {
    int fds[2];
    if (pipe(fds) != 0) return;
    pid_ = fork();
    if (pid_ == 0) {
      dup2(fds[1], STDOUT_FILENO);
      close(fds[0]);
      close(fds[1]);
      std::vector<char*> argv;
      std::string program = UNIFAB_TEST_PEER_PATH;
      argv.push_back(program.data());
      std::string library = libraryPath();
      argv.push_back(library.data());
      for (auto& arg : args) argv.push_back(arg.data());
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      _exit(127);
    }
    close(fds[1]);
    out_ = fds[0];
  }
  ~Peer() {
    // Whatever the peer reported and nobody read explains a failure on this side.
    for (std::string line = readLine(0.2); !line.empty(); line = readLine(0.2)) {
      fprintf(stderr, "peer said: %s\n", line.c_str());
    }
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    if (out_ >= 0) close(out_);
  }
  // Next line of the peer's output, or "" after the deadline.
  std::string readLine(double timeoutSeconds = 30.0) {
    std::string line;
    double deadline = nowSeconds() + timeoutSeconds;
    while (nowSeconds() < deadline) {
      pollfd p{out_, POLLIN, 0};
      if (poll(&p, 1, 100) <= 0) continue;
      char c;
      if (read(out_, &c, 1) != 1) break;
      if (c == '\n') return line;
      line.push_back(c);
    }
    return std::string();
  }
  void killHard() {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }
  int wait() {
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128;
  }

 private:
  pid_t pid_ = -1;
  int out_ = -1;
};

TEST_F(NetTest, TwoProcessesSendAndReceive) {
  // This process sends to a receiving peer ...
  {
    Peer peer({"listen-recv", "20", std::to_string(5 << 20)});
    std::string line = peer.readLine();
    ASSERT_EQ(line.rfind("handle ", 0), 0u) << line;
    char handle[NCCL_NET_HANDLE_MAXSIZE];
    ASSERT_TRUE(fromHex(line.substr(7), handle, sizeof(handle)));
    ASSERT_EQ(connectOne(net_, ctx_, 0, handle, &send_), ncclSuccess);
    void* send = send_;
    const size_t size = 5 << 20;
    Buffer* out = buffer(send, size);
    for (int i = 0; i < 20; ++i) {
      fillPattern(out->bytes.data(), size, static_cast<uint64_t>(i) + 1);
      void* s = nullptr;
      while (s == nullptr) ASSERT_EQ(net_->isend(send, out->bytes.data(), size, 0, out->mhandle, nullptr, &s), ncclSuccess);
      ASSERT_EQ(waitRequest(net_, s, nullptr), WaitOutcome::kDone);
    }
    EXPECT_EQ(peer.readLine(60), "ok");
    EXPECT_EQ(peer.wait(), 0);
    net_->deregMr(send, out->mhandle);
    registrations_.clear();
    net_->closeSend(send);
    send_ = nullptr;
  }
  // ... and receives from a sending peer.
  {
    char handle[NCCL_NET_HANDLE_MAXSIZE] = {};
    void* listenComm = nullptr;
    ASSERT_EQ(net_->listen(ctx_, 0, handle, &listenComm), ncclSuccess);
    Peer peer({"connect-send", toHex(handle, sizeof(handle)), "20", std::to_string(3 << 20)});
    ncclResult_t accepted = acceptOne(net_, listenComm, &recv_);
    net_->closeListen(listenComm);
    ASSERT_EQ(accepted, ncclSuccess);
    void* recv = recv_;
    const size_t size = 3 << 20;
    Buffer* in = buffer(recv, size);
    for (int i = 0; i < 20; ++i) {
      void* data = in->bytes.data();
      size_t capacity = size;
      int tag = 0;
      void* r = nullptr;
      while (r == nullptr) ASSERT_EQ(net_->irecv(recv, 1, &data, &capacity, &tag, &in->mhandle, nullptr, &r), ncclSuccess);
      int received = -1;
      ASSERT_EQ(waitRequest(net_, r, &received), WaitOutcome::kDone);
      ASSERT_EQ(received, static_cast<int>(size));
      ASSERT_EQ(firstMismatch(in->bytes.data(), size, static_cast<uint64_t>(i) + 1), SIZE_MAX) << "message " << i;
    }
    EXPECT_EQ(peer.readLine(), "ok");
    EXPECT_EQ(peer.wait(), 0);
    net_->deregMr(recv, in->mhandle);
    registrations_.clear();
    net_->closeRecv(recv);
    recv_ = nullptr;
  }
}

TEST_F(NetTest, DeadSenderYieldsAnErrorNotAHang) {
  char handle[NCCL_NET_HANDLE_MAXSIZE] = {};
  void* listenComm = nullptr;
  ASSERT_EQ(net_->listen(ctx_, 0, handle, &listenComm), ncclSuccess);
  const size_t size = 64u << 20;
  Peer peer({"connect-send-hang", toHex(handle, sizeof(handle)), std::to_string(size)});
  ASSERT_EQ(acceptOne(net_, listenComm, &recv_), ncclSuccess);
  // Post two receives: the first may complete from the dying sender's socket buffers, the second
  // can only end in an error.
  void* r1 = postRecv(buffer(recv_, size), size);
  void* r2 = postRecv(buffer(recv_, size), size);
  ASSERT_EQ(peer.readLine(), "posted");
  peer.killHard();
  WaitOutcome first = waitRequest(net_, r1, nullptr, 20.0);
  EXPECT_NE(first, WaitOutcome::kTimeout);
  if (first == WaitOutcome::kDone) {
    EXPECT_EQ(waitRequest(net_, r2, nullptr, 20.0), WaitOutcome::kError);
  }
  net_->closeListen(listenComm);
}

TEST_F(NetTest, DeadReceiverYieldsAnErrorNotAHang) {
  const size_t size = 64u << 20;
  Peer peer({"listen-recv-hang", std::to_string(size)});
  std::string line = peer.readLine();
  ASSERT_EQ(line.rfind("handle ", 0), 0u) << line;
  char handle[NCCL_NET_HANDLE_MAXSIZE];
  ASSERT_TRUE(fromHex(line.substr(7), handle, sizeof(handle)));
  ASSERT_EQ(connectOne(net_, ctx_, 0, handle, &send_), ncclSuccess);
  Buffer* out = buffer(send_, size);
  // The first send matches the peer's posted receive; the second waits for one that never comes.
  void* s1 = postSend(out, size);
  void* s2 = postSend(out, size);
  ASSERT_EQ(peer.readLine(), "posted");
  peer.killHard();
  WaitOutcome first = waitRequest(net_, s1, nullptr, 20.0);
  EXPECT_NE(first, WaitOutcome::kTimeout);
  EXPECT_EQ(waitRequest(net_, s2, nullptr, 20.0), WaitOutcome::kError);
}

TEST_F(NetTest, PeerThatClosesCleanlyFailsPendingReceives) {
  char handle[NCCL_NET_HANDLE_MAXSIZE] = {};
  void* listenComm = nullptr;
  ASSERT_EQ(net_->listen(ctx_, 0, handle, &listenComm), ncclSuccess);
  Peer peer({"connect-close", toHex(handle, sizeof(handle))});
  ASSERT_EQ(acceptOne(net_, listenComm, &recv_), ncclSuccess);
  Buffer* in = buffer(recv_, 100);
  EXPECT_EQ(peer.readLine(), "connected");
  EXPECT_EQ(peer.wait(), 0);
  // The receive fails either when posted (the close was already seen) or when tested.
  void* data = in->bytes.data();
  size_t capacity = 100;
  int tag = 0;
  void* r = nullptr;
  ncclResult_t posted = net_->irecv(recv_, 1, &data, &capacity, &tag, &in->mhandle, nullptr, &r);
  if (posted == ncclSuccess) {
    ASSERT_NE(r, nullptr);
    EXPECT_EQ(waitRequest(net_, r, nullptr, 20.0), WaitOutcome::kError);
  } else {
    EXPECT_EQ(posted, ncclRemoteError);
    EXPECT_EQ(r, nullptr);
  }
  net_->closeListen(listenComm);
}

}  // namespace
