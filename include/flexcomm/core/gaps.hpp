// run_in_gaps: background work (copying parameters for an asynchronous checkpoint, say) that
// runs only while this rank would otherwise wait, in small chunks inside flexcomm's waits.
// The gaps between weight updates that Li et al. (MLHPC19) measured become useful time.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "error.hpp"
#include "trace.hpp"
#include "wait.hpp"

namespace flexcomm {

namespace detail {
struct gaps;
}

// Does a little of the task (tens of microseconds: a waiting thread returns only between
// chunks) and returns true once the whole task is done.
using gap_chunk = std::function<bool()>;

// A task queued by run_in_gaps. Waits of any flexcomm operation on any thread run its chunks,
// first come first served; finish() runs what is left on the caller, now.
class gap_task {
 public:
  gap_task(gap_chunk chunk, std::string what) : chunk_(std::move(chunk)), what_(std::move(what)) {}

  bool done() const noexcept { return done_.load(std::memory_order_acquire); }
  const std::string& what() const noexcept { return what_; }
  // Chunks run inside waits, and by finish().
  std::size_t chunks_in_gaps() const noexcept { return in_gaps_.load(std::memory_order_relaxed); }
  std::size_t chunks_in_finish() const noexcept { return in_finish_.load(std::memory_order_relaxed); }

  // Runs the rest of the task on this thread; rethrows what a chunk threw.
  void finish() {
    {
      std::lock_guard<std::mutex> lock(running_);
      while (!done()) step(in_finish_);
    }
    if (error_) std::rethrow_exception(error_);
  }

 private:
  friend struct detail::gaps;
  // One chunk, with running_ held.
  void step(std::atomic<std::size_t>& counter) noexcept {
    trace::span s("gap work", -1, "step", "gaps");
    counter.fetch_add(1, std::memory_order_relaxed);
    try {
      if (chunk_()) done_.store(true, std::memory_order_release);
    } catch (...) {
      error_ = std::current_exception();
      done_.store(true, std::memory_order_release);
    }
  }

  gap_chunk chunk_;
  std::string what_;
  std::mutex running_;  // one chunk at a time, whichever thread runs it
  std::atomic<bool> done_{false};
  std::exception_ptr error_;
  std::atomic<std::size_t> in_gaps_{0}, in_finish_{0};
};

// Queues `chunk` to run in this process's waits. Keep the returned task: finish() it before
// the result is needed (before the parameters it copies change, for a checkpoint).
inline std::shared_ptr<gap_task> run_in_gaps(gap_chunk chunk, std::string what);

// Copies `bytes` from src to dst in the gaps, `chunk_bytes` at a time. Both buffers must stay
// valid, and src unchanged, until the task is done.
inline std::shared_ptr<gap_task> copy_in_gaps(void* dst, const void* src, std::size_t bytes,
                                              std::size_t chunk_bytes = std::size_t{64} << 10) {
  check(chunk_bytes > 0, "copy_in_gaps", "chunk_bytes must be positive");
  auto copied = std::make_shared<std::size_t>(0);
  return run_in_gaps(
      [=] {
        const std::size_t n = std::min(chunk_bytes, bytes - *copied);
        if (n) std::memcpy(static_cast<char*>(dst) + *copied, static_cast<const char*>(src) + *copied, n);
        *copied += n;
        return *copied == bytes;
      },
      cat("copy of ", bytes, " bytes in gaps"));
}

// Tasks queued and not yet done (finished ones leave the queue at the next gap).
inline std::size_t gap_tasks_pending();

namespace detail {
struct gaps {
  std::mutex mutex;
  std::deque<std::shared_ptr<gap_task>> queue;

  static gaps& instance() {
    static gaps* g = new gaps;  // waits may run during static destruction
    return *g;
  }

  // The wait hook: one chunk of the oldest unfinished task, or false when none could run.
  static bool work() noexcept {
    auto& g = instance();
    std::shared_ptr<gap_task> task;
    {
      std::unique_lock<std::mutex> lock(g.mutex, std::try_to_lock);
      if (!lock) return false;  // another waiter is picking: this one simply pauses
      while (!g.queue.empty() && g.queue.front()->done()) g.queue.pop_front();
      if (g.queue.empty()) {
        detail::gap_work().store(nullptr, std::memory_order_release);
        return false;
      }
      task = g.queue.front();
    }
    std::unique_lock<std::mutex> running(task->running_, std::try_to_lock);
    if (!running || task->done()) return false;
    task->step(task->in_gaps_);
    return true;
  }
};
}  // namespace detail

inline std::shared_ptr<gap_task> run_in_gaps(gap_chunk chunk, std::string what) {
  check(static_cast<bool>(chunk), "run_in_gaps", "no task given");
  auto task = std::make_shared<gap_task>(std::move(chunk), std::move(what));
  auto& g = detail::gaps::instance();
  std::lock_guard<std::mutex> lock(g.mutex);
  g.queue.push_back(task);
  detail::gap_work().store(&detail::gaps::work, std::memory_order_release);
  return task;
}

inline std::size_t gap_tasks_pending() {
  auto& g = detail::gaps::instance();
  std::lock_guard<std::mutex> lock(g.mutex);
  std::size_t n = 0;
  for (auto& t : g.queue) n += !t->done();
  return n;
}

}  // namespace flexcomm
