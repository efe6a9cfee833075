// The progress engine: one background thread per process that drives every outstanding
// operation of every adapter, because MPI advances a request only while someone calls into it
// and a trainer busy in forward/backward does not.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <list>
#include <set>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "error.hpp"
#include "trace.hpp"
#include "wait.hpp"
#include "watchdog.hpp"

namespace flexcomm {

// The shared state of one task handed to the engine: the caller waits on it with only atomic
// loads, so a waiting trainer never competes with the engine for MPI's lock.
class completion {
 public:
  explicit completion(std::string what) : what_(std::move(what)) {}

  bool done() const noexcept { return state_.load(std::memory_order_acquire) != pending; }
  const std::string& what() const noexcept { return what_; }

  // Waits under the policy; rethrows what the task threw; a timeout becomes a flexcomm::error.
  void wait(const wait_policy& policy = default_wait(),
            std::chrono::milliseconds timeout = default_timeout()) const {
    if (!wait_answering(policy, timeout, [&] { return done(); }, [] { watchdog::instance().answer_queries(); })) {
      std::string stalled;  // the ranks that stopped, first (stall.hpp)
      const std::string report = watchdog::instance().timed_out(nullptr, 0, timeout, &stalled);
      fail(what_, cat("timed out after ", timeout.count(), " ms (FLEXCOMM_TIMEOUT) waiting in the progress engine",
                      stalled.empty() ? "" : "; ", stalled, "\n", report));
    }
    if (state_.load(std::memory_order_acquire) == failed) std::rethrow_exception(error_);
  }

 private:
  friend class progress_engine;
  enum : int { pending = 0, succeeded = 1, failed = 2 };
  void finish() noexcept { state_.store(succeeded, std::memory_order_release); }
  void finish(std::exception_ptr e) noexcept {
    error_ = std::move(e);
    state_.store(failed, std::memory_order_release);
  }

  std::string what_;
  std::exception_ptr error_;
  std::atomic<int> state_{pending};
};

class progress_engine {
 public:
  // Polled on the engine's thread until it returns true; an exception ends the task with it.
  using poll_fn = std::function<bool()>;

  static progress_engine& instance() {
    static progress_engine engine;
    return engine;
  }

  progress_engine() = default;
  progress_engine(const progress_engine&) = delete;
  progress_engine& operator=(const progress_engine&) = delete;
  ~progress_engine() { stop(); }

  // Hands a task over; the thread starts on first use.
  std::shared_ptr<completion> submit(poll_fn poll, std::string what) {
    auto done = std::make_shared<completion>(std::move(what));
    {
      std::lock_guard<std::mutex> lock(mutex_);
      check(!stopping_, "progress engine", cat("cannot accept '", done->what(), "': engine is stopped"));
      incoming_.push_back({std::move(poll), done});
      // A task counts as background polling from here, not from when the engine's thread wakes
      // to take it: a waiter that yields meanwhile (a trainer in finish()) can keep the core that
      // thread needs for milliseconds, since Linux lets a yielding thread run on while the woken
      // one has used more than its share (docs/architecture.md, "Waiting and progress").
      detail::background_pollers().fetch_add(1, std::memory_order_relaxed);
      pending_names_.insert(done->what());
      ++outstanding_;
      if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
    }
    wake_.notify_one();
    return done;
  }

  // Tasks submitted and not yet finished.
  std::size_t outstanding() const noexcept { return outstanding_.load(std::memory_order_acquire); }

  // Shutdown's first step: lets the tasks already handed over finish (each is someone's pending
  // operation) and reports, on false, what is still outstanding after `limit` (zero: no limit).
  bool quiesce(std::chrono::milliseconds limit, std::string* left = nullptr) const {
    const bool drained = default_wait().until([&] { return outstanding() == 0; }, limit);
    if (!drained && left) {
      std::lock_guard<std::mutex> lock(mutex_);
      *left = cat(outstanding(), " task(s) of the progress engine still outstanding:");
      for (const auto& name : pending_names_) *left += cat(" '", name, "'");
    }
    return drained;
  }

  // Ends the thread; tasks still outstanding end with an error. Called before MPI_Finalize.
  void stop() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_one();
    if (thread_.joinable()) thread_.join();
    std::lock_guard<std::mutex> lock(mutex_);
    detail::background_pollers().fetch_sub(static_cast<int>(incoming_.size()), std::memory_order_relaxed);
    for (auto& t : incoming_) abandon(t);
    incoming_.clear();
  }

  // Before MPI_Abort: the thread polls no task again, so that none of flexcomm's threads is
  // inside MPI while the abort tears it down. Waits up to `limit` for a round of polls under way
  // to end; on the engine's own thread, for none. stop() still ends the thread.
  void halt(std::chrono::milliseconds limit) noexcept {
    halted_.store(true);
    wake_.notify_one();
    if (std::this_thread::get_id() == engine_thread_.load()) return;
    const auto until = std::chrono::steady_clock::now() + limit;
    while (in_round_.load() && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds{1});
  }

  // Lets a process start the engine again after stop() (tests that build several environments).
  void restart() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!thread_.joinable()) stopping_ = false;
  }

 private:
  struct task {
    poll_fn poll;
    std::shared_ptr<completion> done;
  };

  void forget(const std::string& what) {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = pending_names_.find(what);
    if (it != pending_names_.end()) pending_names_.erase(it);
  }

  void abandon(task& t) {  // with mutex_ held
    const auto it = pending_names_.find(t.done->what());
    if (it != pending_names_.end()) pending_names_.erase(it);
    t.done->finish(std::make_exception_ptr(
        error(process_rank(), t.done->what(), "progress engine stopped before the operation finished")));
    outstanding_.fetch_sub(1, std::memory_order_acq_rel);
  }

  void loop() {
    trace::name_thread("progress engine");
    engine_thread_.store(std::this_thread::get_id());
    std::list<task> active;  // touched by this thread only
    unsigned idle_rounds = 0;
    bool polling = false;  // counted in detail::background_pollers(), as is each task not yet taken
    auto set_polling = [&](bool on) {
      if (on != polling) detail::background_pollers().fetch_add(on ? 1 : -1, std::memory_order_relaxed);
      polling = on;
    };
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        if (active.empty()) {
          set_polling(false);
          wake_.wait(lock, [&] { return stopping_ || !incoming_.empty(); });
        }
        in_round_.store(true);  // before halted_ is read: halt() then sees one or the other
        if (halted_.load()) {
          in_round_.store(false);
          wake_.wait(lock, [&] { return stopping_; });
        }
        // Taken over, the tasks stop counting as handed over once this thread counts itself
        // as polling, so the count never drops to zero in between.
        const auto taken = static_cast<int>(incoming_.size());
        active.splice(active.end(), incoming_);
        if (stopping_) {
          set_polling(false);
          detail::background_pollers().fetch_sub(taken, std::memory_order_relaxed);
          for (auto& t : active) abandon(t);
          return;
        }
        set_polling(true);
        detail::background_pollers().fetch_sub(taken, std::memory_order_relaxed);
      }
      bool progressed = false;
      for (auto it = active.begin(); it != active.end();) {
        bool finished = false;
        std::exception_ptr thrown;
        try {
          finished = it->poll();
        } catch (...) {
          thrown = std::current_exception();
          finished = true;
        }
        if (!finished) {
          ++it;
          continue;
        }
        // Count it out before the waiter can see it done, so outstanding() never lags.
        auto done = std::move(it->done);
        it = active.erase(it);
        forget(done->what());
        outstanding_.fetch_sub(1, std::memory_order_acq_rel);
        if (thrown) done->finish(std::move(thrown));
        else done->finish();
        progressed = true;
      }
      in_round_.store(false);
      idle_rounds = progressed ? 0 : idle_rounds + 1;
      // The engine itself must not busy-poll a shared core away from the trainer.
      if (!active.empty()) default_wait().pause_engine(idle_rounds);
    }
  }

  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::list<task> incoming_;
  std::multiset<std::string> pending_names_;  // what each outstanding task is, for shutdown's report
  std::atomic<std::size_t> outstanding_{0};
  bool stopping_ = false;
  std::atomic<bool> halted_{false}, in_round_{false};  // halt(): sequentially consistent, a pair
  std::atomic<std::thread::id> engine_thread_{};
  std::thread thread_;
};

namespace detail {
// How a thread waits for the progress engine: as the process's policy says, but never spinning,
// because the engine's thread needs the core the waiter would spin on.
inline wait_policy engine_wait() {
  wait_policy p = default_wait();
  return p.kind == wait_kind::spin ? wait_policy::backoff() : p;
}
}  // namespace detail

}  // namespace flexcomm
