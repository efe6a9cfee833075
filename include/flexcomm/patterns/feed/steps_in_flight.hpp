// The steps a feed keeps in flight as messages: a fixed ring of entries (step or round s in slot
// s mod size, buffers allocated once), whose requests one progress-engine task polls for the
// feed's whole life, and how the feed's thread waits for them (naming, when it times out, the
// ranks that never answered).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
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

// One step's operations in flight, as the engine watches them. Point-to-point requests carry the
// world rank at their other end, so that a timeout names the ranks that never answered (a
// stopped trainer, a producer gone) rather than only the step.
template <class Request>
struct in_flight {
  std::vector<Request> requests;
  std::vector<int> peers;  // world rank per request; empty for collectives (nobody to name alone)
  wakeup wake;
  std::exception_ptr error;
  std::vector<int> owed;  // the peers of requests not done at the engine's last poll (engine's lock)
  bool started = false;   // since its last clear(): an entry never started is never waited for

  void post(Request r, int peer) {
    requests.push_back(std::move(r));
    peers.push_back(peer);
  }
  void clear() {
    requests.clear();
    peers.clear();
    started = false;
  }
};

// Entry holds one or more in_flight<Request> parts (a trainer's entry is one; a producer's has
// its credits and its sends). Entries are shared because the engine keeps a part alive while its
// requests are pending, even past the feed that posted them. Which step each slot holds is kept
// here, not in the entry, so that posting, consuming and draining agree on one answer. One engine
// task for the feed's life: a task per step would restart the engine's backoff at every step, and
// each of its short sleeps is a wake-up.
template <class Request, class Entry>
class steps_in_flight {
 public:
  using part = in_flight<Request>;

  steps_in_flight() = default;
  steps_in_flight(const steps_in_flight&) = delete;
  steps_in_flight& operator=(const steps_in_flight&) = delete;
  // No more operations: the engine's task ends once those in flight are done.
  ~steps_in_flight() {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->closed = true;
  }

  // `size` slots; `init(entry)` sizes each entry's buffers once, for every step the slot will hold.
  template <class Init>
  void allocate(std::size_t size, Init&& init) {
    slots_.assign(size, slot_state{});
    for (auto& s : slots_) {
      s.entry = std::make_shared<Entry>();
      init(*s.entry);
    }
  }
  std::size_t size() const noexcept { return slots_.size(); }

  // The entry of step `index`'s slot, whichever step it holds now.
  Entry& at(std::int64_t index) { return *slot(index).entry; }
  // The step `index`'s slot holds, or -1 when it is free.
  std::int64_t holder(std::int64_t index) const { return slots_[position(index)].held; }
  // The entry of `index` while its slot holds it, else null.
  Entry* held(std::int64_t index) {
    auto& s = slot(index);
    return s.held == index ? s.entry.get() : nullptr;
  }
  // Takes `index`'s slot for it and returns its entry, unless the slot still holds an earlier
  // step (null).
  Entry* claim(std::int64_t index) {
    auto& s = slot(index);
    if (s.held >= 0) return nullptr;
    s.held = index;
    return s.entry.get();
  }
  void release(std::int64_t index) { slot(index).held = -1; }

  // Starts watching `p` (a part of `index`'s entry), whose requests are posted.
  void start(std::int64_t index, part& p, const std::string& what) {
    p.wake.fired.store(false, std::memory_order_relaxed);
    p.error = nullptr;
    p.started = true;
    std::lock_guard<std::mutex> lock(state_->mutex);
    p.owed = p.peers;  // nothing has answered yet
    state_->queue.push_back(std::shared_ptr<part>(slot(index).entry, &p));
    if (!task_) task_ = progress_engine::instance().submit([s = state_] { return poll(*s); }, what);
  }
  bool done(const part& p) const noexcept { return !p.started || p.wake.fired.load(std::memory_order_acquire); }

  // Waits until p's requests are done and rethrows their failure; a backoff policy sleeps until
  // the engine fires, spin and yield poll (never spinning: the engine needs the core); past
  // default_timeout() it fails. A part never started is done. Called by the thread that starts.
  void await(part& p, const std::string& what) {
    if (!p.started) return;
    if (!p.wake.fired.load(std::memory_order_acquire)) sleep_until_fired(p, what);  // done already: no wait
    if (p.error) std::rethrow_exception(p.error);
  }

  // f(step, entry), held slots only: a free slot's entry still carries the flags of its last step.
  template <class F>
  void for_each_held(F&& f) {
    for (auto& s : slots_)
      if (s.held >= 0) f(s.held, *s.entry);
  }
  // f(entry) for every slot, for a user that does not claim (a producer keeps its own account
  // of what it posted).
  template <class F>
  void for_each(F&& f) {
    for (auto& s : slots_) f(*s.entry);
  }

  // Until nothing is held: `post()` claims what it can, then the oldest step held is awaited
  // (`await(entry, step)`) and released. Oldest first: its slot is the one the next step to
  // post needs. A failed wait leaves its step held.
  template <class Post, class Await>
  void drain(Post&& post, Await&& await) {
    for (;;) {
      post();
      std::int64_t oldest = -1;
      for (const auto& s : slots_)
        if (s.held >= 0 && (oldest < 0 || s.held < oldest)) oldest = s.held;
      if (oldest < 0) return;
      await(at(oldest), oldest);
      release(oldest);
    }
  }

 private:
  struct slot_state {
    std::shared_ptr<Entry> entry;
    std::int64_t held = -1;
  };
  struct state {
    std::mutex mutex;
    std::vector<std::shared_ptr<part>> queue;
    bool closed = false;
  };

  std::size_t position(std::int64_t index) const {
    return static_cast<std::size_t>(index % static_cast<std::int64_t>(slots_.size()));
  }
  slot_state& slot(std::int64_t index) { return slots_[position(index)]; }

  // The half of await() that waits: p's requests were not done yet.
  void sleep_until_fired(part& p, const std::string& what) {
    const wait_policy policy = default_wait();
    const auto timeout = default_timeout();
    const auto start = std::chrono::steady_clock::now();
    auto engine_gone = [&] { return task_ && task_->done(); };
    // Once long, whom it waits on, for peers that follow a stall through this rank (stall.hpp).
    waiting_note note;
    auto answer = [&] {
      note.set(what, owed_by(p));
      stall_registry::instance().answer();
    };
    if (policy.kind == wait_kind::backoff) {
      std::unique_lock<std::mutex> lock(p.wake.mutex);
      while (!p.wake.fired.load(std::memory_order_acquire)) {
        p.wake.cv.wait_for(lock, std::chrono::milliseconds(50));
        if (p.wake.fired.load(std::memory_order_acquire)) break;
        lock.unlock();
        const bool gone = engine_gone();
        if (std::chrono::steady_clock::now() - start > answer_queries_after) answer();
        lock.lock();
        if (gone) break;
        if (timeout.count() > 0 && std::chrono::steady_clock::now() - start > timeout) {
          lock.unlock();
          fail_timed_out(p, what, timeout);
        }
      }
    } else if (!wait_answering(engine_wait(), timeout,
                               [&] { return p.wake.fired.load(std::memory_order_acquire) || engine_gone(); },
                               [&] { note.set(what, owed_by(p)); })) {
      fail_timed_out(p, what, timeout);
    }
    if (!p.wake.fired.load(std::memory_order_acquire)) {
      task_->wait();  // rethrows why the engine gave up
      fail(what, "the progress engine stopped before the operation finished");
    }
  }

 public:
  // Fails `what` as a wait on p that timed out, naming the ranks p's requests still owe (for a
  // thread that waits on p its own way: a producer answering claims, claims.hpp).
  // The followed stall leads (stall.hpp: the ranks that stopped, where the owed ones wait on them).
  [[noreturn]] void fail_timed_out(part& p, const std::string& what, std::chrono::milliseconds timeout) {
    const std::vector<int> owed = owed_by(p);
    const std::string stalled = stall_registry::instance().lead(what, owed, timeout);
    fail(what, cat("timed out after ", timeout.count(), " ms (FLEXCOMM_TIMEOUT)",
                   owed.empty() ? "" : cat("; ", stalled, "not answered by ", world_ranks_named(owed, on_host))));
  }

 private:
  // The world ranks p's requests still owe, each once.
  std::vector<int> owed_by(part& p) {
    std::vector<int> owed;
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      owed = p.owed;
    }
    std::sort(owed.begin(), owed.end());
    owed.erase(std::unique(owed.begin(), owed.end()), owed.end());
    return owed;
  }

  // Tests every request (not only up to the first pending one), so that the ranks still owed
  // are known when a wait times out.
  static bool poll(state& s) {
    std::lock_guard<std::mutex> lock(s.mutex);
    for (auto it = s.queue.begin(); it != s.queue.end();) {
      part& p = **it;
      bool done = true;
      p.owed.clear();
      try {
        for (std::size_t i = 0; i < p.requests.size(); ++i)
          if (!p.requests[i].test()) {
            done = false;
            if (i < p.peers.size()) p.owed.push_back(p.peers[i]);
          }
      } catch (...) {
        // A failed request ends the step at once, whatever else is pending: its waiter must
        // learn why now, not time out on requests the failure may never let finish.
        p.error = std::current_exception();
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

  std::vector<slot_state> slots_;
  std::shared_ptr<state> state_ = std::make_shared<state>();
  std::shared_ptr<completion> task_;  // the engine's task, once started
};

}  // namespace detail
}  // namespace flexcomm
