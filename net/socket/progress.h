// The socket transport's progress engine: a few threads, each running an epoll loop over the
// streams assigned to it, shared by every connection of the process. Bulk socket I/O happens
// here; payloads up to UNIFAB_SOCKET_INLINE_BYTES are moved by NCCL's proxy thread itself when it
// posts or tests a request (connection.h), which saves a thread hand-off on small messages.
#pragma once

#include <atomic>
#include <future>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "plugin/check.h"

namespace unifab::net::socket {

// Implemented by a connection; called on the stream's progress thread only.
class StreamOwner {
 public:
  virtual void onReadable(int stream) = 0;  // also called on EOF, hang-up and socket errors
  virtual void onWritable(int stream) = 0;
  // The stream cannot be polled any more (its progress thread's epoll failed, or changing its
  // interest did): nothing would move it again, so the connection must fail. Any thread.
  virtual void onEngineFailure(const char* why) = 0;

 protected:
  ~StreamOwner() = default;
};

// One registered socket. The connection owns it and must call ProgressEngine::remove before
// freeing it or closing the fd.
struct StreamRegistration {
  StreamOwner* owner = nullptr;
  int stream = 0;
  int fd = -1;
  int worker = -1;
  std::mutex mutex;  // guards the interest flags and their epoll_ctl calls
  bool wantWrite = false;
  std::atomic<bool> detached{false};  // read without the mutex by the worker loop
  std::atomic<bool> writeRequested{false};  // queued for onWritable by requestWrite
};

class ProgressEngine {
 public:
  // The process-wide engine, started by its first user with `nThreads` threads that keep polling
  // for `busyPollUs` microseconds after their last event before they sleep in epoll_wait (0:
  // always sleep). Polling saves the thread wake-up (several microseconds) on every message.
  static Result acquire(int nThreads, int busyPollUs, std::shared_ptr<ProgressEngine>* engine);

  ~ProgressEngine();
  ProgressEngine(const ProgressEngine&) = delete;
  ProgressEngine& operator=(const ProgressEngine&) = delete;

  // Assigns the stream to a thread and starts watching it for input.
  Result add(StreamRegistration* registration);
  // Returns once no progress thread can touch `registration` any more. Not from a progress thread.
  void remove(StreamRegistration* registration);
  // Turns output readiness notifications on or off; callable from any thread.
  void setWriteInterest(StreamRegistration* registration, bool enabled);
  // Stops all notifications for a stream that hit EOF or an error, so that a dead socket does not
  // wake the loop forever. Any thread (a progress thread, or the proxy during inline I/O).
  void detach(StreamRegistration* registration);
  // Has the stream's progress thread call onWritable soon. While that thread polls this costs
  // the caller no system call, which takes small control writes off NCCL's proxy thread.
  void requestWrite(StreamRegistration* registration);
  bool polls() const { return busyPollUs_ > 0; }


 private:
  struct Removal {
    StreamRegistration* registration;
    std::promise<void> done;
  };
  struct Worker {
    int epollFd = -1;
    int wakeFd = -1;
    std::thread thread;
    std::mutex mutex;  // guards removals and writeRequests
    std::vector<Removal> removals;
    std::vector<StreamRegistration*> writeRequests;
    std::vector<StreamRegistration*> registered;  // every stream it watches, to fail if it stops
    bool dead = false;  // stopped on an epoll failure: removals need no hand-off, adds are refused
    std::atomic<bool> sleeping{false};  // in epoll_wait without a timeout: needs the eventfd
  };

  ProgressEngine() = default;
  Result start(int nThreads, int busyPollUs);
  void run(Worker* worker);
  // After an epoll failure: fails every stream of the worker, then releases its removals.
  void stop(Worker* worker, const char* why);
  void updateInterest(StreamRegistration* registration);
  static void wake(Worker* worker);

  std::vector<std::unique_ptr<Worker>> workers_;
  int busyPollUs_ = 0;
  std::atomic<bool> stopping_{false};
  std::atomic<unsigned> nextWorker_{0};
};

}  // namespace unifab::net::socket
