// The descriptor channel of pipeline transfers between processes: a descriptor sent with a key is
// taken by that key as a descriptor of the same open file, whatever order the keys arrive in; a
// key that never comes times out; a peer without a channel is an error, not a hang.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <memory>
#include <random>
#include <string>

#include "collectives/pp/fd_channel.h"

namespace {

using unifab::collectives::pp::FdChannel;
using Clock = std::chrono::steady_clock;

// Abstract socket names are per network namespace, which CI containers may share: the pid and a
// random token.
std::string uniqueName(const char* what) {
  static const unsigned token = std::random_device{}();
  return "unifab-test-" + std::to_string(getpid()) + "-" + std::to_string(token) + "-" + what;
}

FdChannel::Deadline inSeconds(int seconds) { return Clock::now() + std::chrono::seconds(seconds); }

// A pipe's write end sent through the channel writes into the same pipe.
void expectSamePipe(int readEnd, int writeEnd, char byte) {
  ASSERT_EQ(write(writeEnd, &byte, 1), 1);
  char got = 0;
  ASSERT_EQ(read(readEnd, &got, 1), 1);
  EXPECT_EQ(got, byte);
}

TEST(PpFdChannel, DescriptorsArriveByKeyInAnyOrder) {
  std::unique_ptr<FdChannel> receiver, sender;
  ASSERT_EQ(FdChannel::create(uniqueName("r"), &receiver), unifabSuccess);
  ASSERT_EQ(FdChannel::create(uniqueName("s"), &sender), unifabSuccess);
  int first[2], second[2];
  ASSERT_EQ(pipe(first), 0);
  ASSERT_EQ(pipe(second), 0);
  ASSERT_EQ(sender->send(uniqueName("r"), 7, first[1], inSeconds(5)), unifabSuccess);
  ASSERT_EQ(sender->send(uniqueName("r"), 3, -1, inSeconds(5)), unifabSuccess);  // a probe: dropped
  ASSERT_EQ(sender->send(uniqueName("r"), 9, second[1], inSeconds(5)), unifabSuccess);
  const auto deadline = Clock::now() + std::chrono::seconds(5);
  int took9 = -1, took7 = -1;
  ASSERT_EQ(receiver->take(9, deadline, &took9), unifabSuccess);  // key 7 arrives first and waits
  ASSERT_EQ(receiver->take(7, deadline, &took7), unifabSuccess);
  EXPECT_NE(took7, first[1]);  // a duplicate, not the sender's number
  expectSamePipe(first[0], took7, 'a');
  expectSamePipe(second[0], took9, 'b');
  for (int fd : {first[0], first[1], second[0], second[1], took7, took9}) close(fd);
}

TEST(PpFdChannel, BetweenProcesses) {
  const std::string parent = uniqueName("parent"), childName = uniqueName("child");  // before the pid changes
  std::unique_ptr<FdChannel> receiver;
  ASSERT_EQ(FdChannel::create(parent, &receiver), unifabSuccess);
  int channel[2];
  ASSERT_EQ(pipe(channel), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    std::unique_ptr<FdChannel> sender;
    const bool ok = FdChannel::create(childName, &sender) == unifabSuccess &&
                    sender->send(parent, 42, channel[1], inSeconds(5)) == unifabSuccess;
    _exit(ok ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  close(channel[1]);  // only the copy that travelled is left open for writing
  int took = -1;
  ASSERT_EQ(receiver->take(42, Clock::now() + std::chrono::seconds(5), &took), unifabSuccess);
  expectSamePipe(channel[0], took, 'c');
  close(took);
  char end = 0;
  EXPECT_EQ(read(channel[0], &end, 1), 0) << "no other writer: the descriptor was the child's";
  close(channel[0]);
}

TEST(PpFdChannel, MissingKeyTimesOutAndMissingPeerFails) {
  std::unique_ptr<FdChannel> channel;
  ASSERT_EQ(FdChannel::create(uniqueName("alone"), &channel), unifabSuccess);
  int fd = -1;
  const auto start = Clock::now();
  EXPECT_EQ(channel->take(1, start + std::chrono::milliseconds(100), &fd), unifabTimeout);
  EXPECT_GE(Clock::now() - start, std::chrono::milliseconds(100));
  EXPECT_EQ(fd, -1);
  int pipeEnds[2];
  ASSERT_EQ(pipe(pipeEnds), 0);
  EXPECT_EQ(channel->send(uniqueName("nobody"), 1, pipeEnds[1], inSeconds(1)), unifabSystemError);
  int probed = -1;
  ASSERT_EQ(channel->send(uniqueName("alone"), 5, -1, inSeconds(1)), unifabSuccess);  // to itself
  EXPECT_EQ(channel->take(5, Clock::now() + std::chrono::milliseconds(50), &probed), unifabTimeout)
      << "a probe carries no descriptor to take";
  std::unique_ptr<FdChannel> clash;
  EXPECT_EQ(FdChannel::create(uniqueName("alone"), &clash), unifabSystemError) << "one channel per name";
  EXPECT_EQ(FdChannel::create(std::string(FdChannel::kMaxName + 1, 'x'), &clash), unifabInternalError);
  close(pipeEnds[0]);
  close(pipeEnds[1]);
}

}  // namespace
