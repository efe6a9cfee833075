// A feed's requests in flight, polled by one progress-engine task, and how a feed's thread waits
// for them (and names the ranks that never answered when it times out).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "../../core/error.hpp"
#include "../../core/hosts.hpp"
#include "../../core/progress.hpp"
#include "../../core/wait.hpp"

namespace flexcomm {
namespace detail {

// How a feed waits for the progress engine: as the process's policy says, but never spinning,
// because the engine's thread needs the core the waiter would spin on.
inline wait_policy engine_wait() {
  wait_policy p = default_wait();
  return p.kind == wait_kind::spin ? wait_policy::backoff() : p;
}

// Fired when the requests of a step are done (or one failed), so that a feed's thread waiting
// under a backoff policy sleeps until then instead of polling: on a node with more ranks than
// cores, each poll is a context switch charged to the CPU time that feeds are meant to save.
struct wakeup {
  std::mutex mutex;
  std::condition_variable cv;
  std::atomic<bool> fired{false};
  void fire() {
    {
      std::lock_guard<std::mutex> lock(mutex);
      fired.store(true, std::memory_order_release);
    }
    cv.notify_all();
  }
};

// One step's operations in flight, as a pump watches them. Point-to-point requests carry the
// world rank at their other end, so that a timeout names the ranks that never answered (a
// stopped trainer, a producer gone) rather than only the step.
template <class Request>
struct in_flight {
  std::vector<Request> requests;
  std::vector<int> peers;  // world rank per request; empty for collectives (nobody to name alone)
  wakeup wake;
  std::exception_ptr error;
  std::vector<int> owed;  // the peers of requests not done at the engine's last poll (pump's lock)

  void post(Request r, int peer) {
    requests.push_back(std::move(r));
    peers.push_back(peer);
  }
  void clear() {
    requests.clear();
    peers.clear();
  }
};

// The operations in flight of one feed, polled by one progress-engine task for the feed's whole
// life. (A task per step would restart the engine's backoff at every step, and each of its
// short sleeps is a wake-up.) Owner is an in_flight<request>; the pump keeps an owner alive
// while its requests are pending.
template <class Owner>
class pump {
 public:
  pump() = default;
  pump(const pump&) = delete;
  pump& operator=(const pump&) = delete;
  ~pump() { close(); }

  // Starts watching owner->requests, already posted.
  void add(const std::shared_ptr<Owner>& owner, const std::string& what) {
    owner->wake.fired.store(false, std::memory_order_relaxed);
    owner->error = nullptr;
    std::lock_guard<std::mutex> lock(state_->mutex);
    owner->owed = owner->peers;  // nothing has answered yet
    state_->queue.push_back(owner);
    if (!task_) task_ = progress_engine::instance().submit([s = state_] { return poll(*s); }, what);
  }

  // Waits until owner's requests are done and rethrows their failure; a backoff policy sleeps
  // until the engine fires, spin and yield poll (never spinning: the engine needs the core);
  // past default_timeout() it fails. Called by the thread that calls add().
  void await(Owner& owner, const std::string& what) {
    const wait_policy policy = default_wait();
    const auto timeout = default_timeout();
    const auto start = std::chrono::steady_clock::now();
    auto engine_gone = [&] { return task_ && task_->done(); };
    if (policy.kind == wait_kind::backoff) {
      std::unique_lock<std::mutex> lock(owner.wake.mutex);
      while (!owner.wake.fired.load(std::memory_order_acquire)) {
        owner.wake.cv.wait_for(lock, std::chrono::milliseconds(50));
        if (owner.wake.fired.load(std::memory_order_acquire)) break;
        lock.unlock();
        const bool gone = engine_gone();
        lock.lock();
        if (gone) break;
        if (timeout.count() > 0 && std::chrono::steady_clock::now() - start > timeout) {
          lock.unlock();
          timed_out(owner, what, timeout);
        }
      }
    } else if (!engine_wait().until(
                   [&] { return owner.wake.fired.load(std::memory_order_acquire) || engine_gone(); }, timeout)) {
      timed_out(owner, what, timeout);
    }
    if (!owner.wake.fired.load(std::memory_order_acquire)) {
      task_->wait();  // rethrows why the engine gave up
      fail(what, "the progress engine stopped before the operation finished");
    }
    if (owner.error) std::rethrow_exception(owner.error);
  }

  // No more operations: the engine's task ends once those in flight are done.
  void close() {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->closed = true;
  }

 private:
  struct state {
    std::mutex mutex;
    std::vector<std::shared_ptr<Owner>> queue;
    bool closed = false;
  };

  [[noreturn]] void timed_out(Owner& owner, const std::string& what, std::chrono::milliseconds timeout) {
    std::vector<int> owed;
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      owed = owner.owed;
    }
    std::sort(owed.begin(), owed.end());
    owed.erase(std::unique(owed.begin(), owed.end()), owed.end());
    std::string who;
    for (int r : owed) who += cat(who.empty() ? "" : ", ", r, on_host(r));
    fail(what, cat("timed out after ", timeout.count(), " ms (FLEXCOMM_TIMEOUT)",
                   who.empty() ? "" : cat("; not answered by world rank", owed.size() > 1 ? "s " : " ", who)));
  }

  // Tests every request (not only up to the first pending one), so that the ranks still owed
  // are known when a wait times out.
  static bool poll(state& s) {
    std::lock_guard<std::mutex> lock(s.mutex);
    for (auto it = s.queue.begin(); it != s.queue.end();) {
      Owner& owner = **it;
      bool done = true;
      owner.owed.clear();
      try {
        for (std::size_t i = 0; i < owner.requests.size(); ++i)
          if (!owner.requests[i].test()) {
            done = false;
            if (i < owner.peers.size()) owner.owed.push_back(owner.peers[i]);
          }
      } catch (...) {
        // A failed request ends the step at once, whatever else is pending: its waiter must
        // learn why now, not time out on requests the failure may never let finish.
        owner.error = std::current_exception();
        done = true;
      }
      if (done) {
        const auto keep = *it;
        it = s.queue.erase(it);
        keep->wake.fire();
      } else {
        ++it;
      }
    }
    return s.closed && s.queue.empty();
  }

  std::shared_ptr<state> state_ = std::make_shared<state>();
  std::shared_ptr<completion> task_;  // the engine's task, once started
};

}  // namespace detail
}  // namespace flexcomm
