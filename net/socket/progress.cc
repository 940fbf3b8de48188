#include "net/socket/progress.h"

#include <dlfcn.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <string>
#include <chrono>
#include <cstring>

namespace unifab::net::socket {
namespace {

constexpr int kMaxEventsPerWait = 64;

// epoll data of a worker's own wake-up eventfd; registrations are never at this address.
char g_wakeMarker;

std::mutex g_engineMutex;
std::weak_ptr<ProgressEngine> g_engine;

// Progress threads run this library's code, so once they exist the library must stay mapped, even
// if NCCL dlcloses it while a communicator it never closed (an aborted job) keeps threads alive.
void pinLibrary() {
  static std::once_flag once;
  std::call_once(once, [] {
    Dl_info info{};
    if (dladdr(reinterpret_cast<void*>(&pinLibrary), &info) == 0 || info.dli_fname == nullptr) return;
    // The handle is deliberately never closed: RTLD_NODELETE makes the mapping permanent.
    if (dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD | RTLD_NODELETE) == nullptr) {
      UF_WARN(kNet, "cannot pin %s in memory (%s); unloading it while threads run would crash", info.dli_fname,
              dlerror());
    }
  });
}

}  // namespace

Result ProgressEngine::acquire(int nThreads, int busyPollUs, std::shared_ptr<ProgressEngine>* engine) {
  std::lock_guard<std::mutex> lock(g_engineMutex);
  std::shared_ptr<ProgressEngine> existing = g_engine.lock();
  if (existing) {
    *engine = std::move(existing);
    return unifabSuccess;
  }
  std::shared_ptr<ProgressEngine> created(new ProgressEngine());
  UF_CHECK(created->start(nThreads, busyPollUs));
  g_engine = created;
  *engine = std::move(created);
  return unifabSuccess;
}

Result ProgressEngine::start(int nThreads, int busyPollUs) {
  pinLibrary();
  busyPollUs_ = busyPollUs;
  for (int i = 0; i < nThreads; ++i) {
    // Owned by the engine before its descriptors exist: on failure the destructor closes them.
    workers_.push_back(std::make_unique<Worker>());
    Worker& worker = *workers_.back();
    worker.epollFd = epoll_create1(EPOLL_CLOEXEC);
    UF_SYSCHECK(worker.epollFd, kNet, "epoll_create1");
    worker.wakeFd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    UF_SYSCHECK(worker.wakeFd, kNet, "eventfd");
    epoll_event event{};
    event.events = EPOLLIN;
    event.data.ptr = &g_wakeMarker;
    UF_SYSCHECK(epoll_ctl(worker.epollFd, EPOLL_CTL_ADD, worker.wakeFd, &event), kNet, "epoll_ctl(ADD wake fd)");
  }
  for (auto& worker : workers_) {
    Worker* raw = worker.get();
    worker->thread = std::thread([this, raw] { run(raw); });
  }
  UF_INFO(kNet, kLogInit, "socket progress engine started with %d thread(s), busy polling %d us", nThreads,
          busyPollUs);
  return unifabSuccess;
}

ProgressEngine::~ProgressEngine() {
  stopping_.store(true, std::memory_order_release);
  for (auto& worker : workers_) {
    if (worker->wakeFd != -1) wake(worker.get());
  }
  for (auto& worker : workers_) {
    if (worker->thread.joinable()) worker->thread.join();
    if (worker->wakeFd != -1) close(worker->wakeFd);
    if (worker->epollFd != -1) close(worker->epollFd);
  }
}

Result ProgressEngine::add(StreamRegistration* registration) {
  unsigned index = nextWorker_.fetch_add(1, std::memory_order_relaxed) % workers_.size();
  Worker* worker = workers_[index].get();
  {
    std::lock_guard<std::mutex> lock(worker->mutex);
    if (worker->dead) {
      return UF_ERROR(unifabSystemError, kNet, "socket progress thread %u stopped after an epoll failure", index);
    }
    // Set before the registration is published: a worker that fails and detaches every stream it
    // holds reads it (under this mutex) as soon as the registration is in its list.
    registration->worker = static_cast<int>(index);
    worker->registered.push_back(registration);
  }
  epoll_event event{};
  event.events = EPOLLIN | EPOLLRDHUP;
  event.data.ptr = registration;
  if (epoll_ctl(workers_[index]->epollFd, EPOLL_CTL_ADD, registration->fd, &event) == -1) {
    int err = errno;
    return UF_ERROR(unifabSystemError, kNet, "epoll_ctl(ADD fd %d) failed: %s", registration->fd, strerror(err));
  }
  return unifabSuccess;
}

void ProgressEngine::updateInterest(StreamRegistration* registration) {
  if (registration->detached) return;
  epoll_event event{};
  event.events = EPOLLIN | EPOLLRDHUP | (registration->wantWrite ? static_cast<uint32_t>(EPOLLOUT) : 0u);
  event.data.ptr = registration;
  // ENOENT is possible only while the stream is being removed at close; nothing to do then. Any
  // other failure loses the write interest, and the stream's sends would stall: fail it.
  if (epoll_ctl(workers_[registration->worker]->epollFd, EPOLL_CTL_MOD, registration->fd, &event) == -1 &&
      errno != ENOENT) {
    const std::string why = std::string("epoll_ctl(MOD) failed: ") + strerror(errno);
    UF_WARN(kNet, "%s on fd %d; its connection fails", why.c_str(), registration->fd);
    registration->owner->onEngineFailure(why.c_str());
  }
}

void ProgressEngine::setWriteInterest(StreamRegistration* registration, bool enabled) {
  std::lock_guard<std::mutex> lock(registration->mutex);
  if (registration->wantWrite == enabled) return;
  registration->wantWrite = enabled;
  updateInterest(registration);
}

void ProgressEngine::detach(StreamRegistration* registration) {
  std::lock_guard<std::mutex> lock(registration->mutex);
  if (registration->detached) return;
  registration->detached = true;
  // Fails only if the fd is already out of the set (ENOENT), which is the state wanted.
  (void)epoll_ctl(workers_[registration->worker]->epollFd, EPOLL_CTL_DEL, registration->fd, nullptr);
}

void ProgressEngine::wake(Worker* worker) {
  uint64_t one = 1;
  if (write(worker->wakeFd, &one, sizeof(one)) < 0) {
    // eventfd writes only fail on counter overflow, which 2^64 wake-ups cannot reach.
  }
}

void ProgressEngine::requestWrite(StreamRegistration* registration) {
  if (registration->worker < 0 || registration->writeRequested.exchange(true)) return;
  Worker* worker = workers_[registration->worker].get();
  {
    std::lock_guard<std::mutex> lock(worker->mutex);
    worker->writeRequests.push_back(registration);
  }
  // Paired with the worker's store of `sleeping` and its look at the queue before it sleeps:
  // either this sees it asleep and wakes it, or it sees the request.
  if (worker->sleeping.load(std::memory_order_seq_cst)) wake(worker);
}

void ProgressEngine::remove(StreamRegistration* registration) {
  if (registration->worker < 0) return;
  Worker* worker = workers_[registration->worker].get();
  std::future<void> done;
  {
    std::lock_guard<std::mutex> lock(worker->mutex);
    if (worker->dead) {  // its thread has ended, having detached every stream
      registration->worker = -1;
      return;
    }
    worker->removals.push_back(Removal{registration, std::promise<void>()});
    done = worker->removals.back().done.get_future();
  }
  wake(worker);
  done.wait();
  registration->worker = -1;
}

void ProgressEngine::stop(Worker* worker, const char* why) {
  // Fails every stream, including one added while this runs (it is marked dead only once none is
  // left). Streams being removed meanwhile stay alive: their removers wait for the removals below.
  std::vector<Removal> removals;
  for (;;) {
    std::vector<StreamRegistration*> streams;
    {
      std::lock_guard<std::mutex> lock(worker->mutex);
      if (worker->registered.empty()) {
        worker->dead = true;
        worker->writeRequests.clear();
        removals.swap(worker->removals);
        break;
      }
      streams.swap(worker->registered);
    }
    for (StreamRegistration* registration : streams) {
      detach(registration);
      registration->owner->onEngineFailure(why);
    }
  }
  for (Removal& removal : removals) removal.done.set_value();
}

void ProgressEngine::run(Worker* worker) {
  epoll_event events[kMaxEventsPerWait];
  std::vector<Removal> removals;
  std::vector<StreamRegistration*> writeRequests;
  using Clock = std::chrono::steady_clock;
  const auto pollWindow = std::chrono::microseconds(busyPollUs_);
  auto lastActivity = Clock::now() - pollWindow;
  while (!stopping_.load(std::memory_order_acquire)) {
    // Keep polling while traffic flows; sleep once the connection has been quiet for a while.
    bool polling = busyPollUs_ > 0 && Clock::now() - lastActivity < pollWindow;
    if (!polling) {
      worker->sleeping.store(true, std::memory_order_seq_cst);
      std::lock_guard<std::mutex> lock(worker->mutex);
      polling = !worker->writeRequests.empty() || !worker->removals.empty();
    }
    int count = epoll_wait(worker->epollFd, events, kMaxEventsPerWait, polling ? 0 : -1);
    worker->sleeping.store(false, std::memory_order_relaxed);
    if (count > 0) lastActivity = Clock::now();
    if (count < 0) {
      if (errno == EINTR) continue;
      const std::string why = std::string("epoll_wait failed: ") + strerror(errno);
      UF_WARN(kNet, "%s; socket progress thread stops and fails its connections", why.c_str());
      stop(worker, why.c_str());
      return;
    }
    // Removals first: events of this batch for a removed stream must be skipped, and the remover
    // is released only after the batch, so its memory stays valid until then.
    {
      std::lock_guard<std::mutex> lock(worker->mutex);
      removals.swap(worker->removals);
      writeRequests.swap(worker->writeRequests);
    }
    if (!writeRequests.empty()) lastActivity = Clock::now();
    if (!removals.empty()) {
      std::lock_guard<std::mutex> lock(worker->mutex);
      auto& registered = worker->registered;
      for (Removal& removal : removals) {
        registered.erase(std::remove(registered.begin(), registered.end(), removal.registration), registered.end());
      }
    }
    for (Removal& removal : removals) {
      StreamRegistration* registration = removal.registration;
      std::lock_guard<std::mutex> lock(registration->mutex);
      if (!registration->detached) {
        epoll_ctl(worker->epollFd, EPOLL_CTL_DEL, registration->fd, nullptr);
        registration->detached = true;
      }
    }
    auto removed = [&removals](const void* ptr) {
      return std::any_of(removals.begin(), removals.end(),
                         [ptr](const Removal& r) { return r.registration == ptr; });
    };
    for (int i = 0; i < count; ++i) {
      void* ptr = events[i].data.ptr;
      if (ptr == &g_wakeMarker) {
        uint64_t drained;
        while (read(worker->wakeFd, &drained, sizeof(drained)) > 0) {
        }
        continue;
      }
      if (!removals.empty() && removed(ptr)) continue;
      auto* registration = static_cast<StreamRegistration*>(ptr);
      uint32_t mask = events[i].events;
      if (mask & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) {
        registration->owner->onReadable(registration->stream);
      }
      if ((mask & EPOLLOUT) && !registration->detached) {
        registration->owner->onWritable(registration->stream);
      }
    }
    for (StreamRegistration* registration : writeRequests) {
      if (!removals.empty() && removed(registration)) continue;
      registration->writeRequested.store(false, std::memory_order_relaxed);
      if (!registration->detached) registration->owner->onWritable(registration->stream);
    }
    writeRequests.clear();
    for (Removal& removal : removals) removal.done.set_value();
    removals.clear();
  }
}

}  // namespace unifab::net::socket
