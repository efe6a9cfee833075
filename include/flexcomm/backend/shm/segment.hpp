// The shared-memory segment of one host_reducer (host_reducer.hpp) and what every task on it
// shares: each rank's region (its progress counter, a cache line, then two small slots and two
// large ones), the step each rank last published, and the queue that drives the tasks in the order
// they were started, one thread at a time.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "../../core/error.hpp"
#include "host_group.hpp"
#include "host_window.hpp"
#include "slot_writer.hpp"

namespace flexcomm::detail {

// How long a task has waited for its peers at one stage, against the communicator's timeout. The
// clock is read when a wait begins (the first poll that finds the peers not there) and then one
// poll in 64: reading it on every step and poll cost a third of a 4-byte allreduce.
class stall_clock {
 public:
  // The task moved on: the next wait starts afresh.
  void moved() noexcept { polls_ = 0; }
  // Another poll found the peers not there: true once that wait has lasted longer than `limit`
  // (zero: no limit).
  bool past(std::chrono::milliseconds limit) {
    if (polls_++ == 0) {
      since_ = std::chrono::steady_clock::now();
      return false;
    }
    return limit.count() > 0 && polls_ % 64 == 0 && std::chrono::steady_clock::now() - since_ > limit;
  }

 private:
  std::uint64_t polls_ = 0;
  std::chrono::steady_clock::time_point since_;
};

// A task of one host_segment (an allreduce or a broadcast).
class segment_task {
 public:
  segment_task() = default;
  segment_task(const segment_task&) = delete;
  segment_task& operator=(const segment_task&) = delete;
  virtual ~segment_task() = default;

  // Whether this rank's part is finished; readable from any thread.
  bool done() const noexcept { return done_.load(std::memory_order_acquire); }

 protected:
  void finished() noexcept { done_.store(true, std::memory_order_release); }

 private:
  friend class host_segment;
  // Advances as far as it can without waiting; true once finished. Called by one thread at a
  // time (the segment's driver), in start order.
  virtual bool step() = 0;

  std::atomic<bool> done_{false};
};

// The segment and the bookkeeping every task of one reducer shares; tasks hold it, so a task the
// engine still polls never outlives it.
class host_segment {
 public:
  static constexpr std::size_t line = 64;

  // Collective over `group` (the segment's own: it keeps it for its names and timeout).
  host_segment(std::unique_ptr<shm::host_group> own, std::size_t large_bytes, std::size_t small_bytes)
      : group(std::move(own)),
        rank(group->rank()),
        ranks(group->size()),
        large_bytes(round_up(std::max(large_bytes, line))),
        small_bytes(round_up(small_bytes)),
        window(*group, line + 2 * this->small_bytes + 2 * this->large_bytes,
               cat(group->name(), ": shared-memory setup")) {
    const std::string who = cat(group->name(), ": shared-memory setup");
    for (int r = 0; r < ranks; ++r)
      check(window.region_bytes(r) == window.region_bytes(rank), who,
            cat("the slot sizes differ across the ranks (this rank's region is ", window.region_bytes(rank),
                " bytes, rank ", r, "'s ", window.region_bytes(r), ")"));
    world_ranks = group->world_ranks();
    regions.resize(static_cast<std::size_t>(ranks));
    for (int r = 0; r < ranks; ++r) regions[static_cast<std::size_t>(r)] = window.region(r);
    // Each rank's counter lives in its own region (whose pages the window placed near it).
    static_assert(std::atomic<std::uint64_t>::is_always_lock_free, "shared-memory counters must be lock-free");
    new (regions[static_cast<std::size_t>(rank)]) std::atomic<std::uint64_t>(0);
    group->barrier(who);
  }
  host_segment(const host_segment&) = delete;
  host_segment& operator=(const host_segment&) = delete;

  std::atomic<std::uint64_t>& progress(int r) const noexcept {
    return *std::launder(reinterpret_cast<std::atomic<std::uint64_t>*>(regions[static_cast<std::size_t>(r)]));
  }
  std::byte* small_slot(int r, int which) const noexcept {
    return regions[static_cast<std::size_t>(r)] + line + static_cast<std::size_t>(which) * small_bytes;
  }
  std::byte* large_slot(int r, int which) const noexcept {
    return regions[static_cast<std::size_t>(r)] + line + 2 * small_bytes + static_cast<std::size_t>(which) * large_bytes;
  }
  // Chunks of an n-element task of T: at most a large slot each.
  template <class T>
  std::uint64_t chunks_of(std::size_t n) const noexcept {
    const std::size_t per_chunk = large_bytes / sizeof(T);
    return (n + per_chunk - 1) / per_chunk;
  }
  void publish(std::uint64_t step) const noexcept { progress(rank).store(step, std::memory_order_release); }
  // Whether every rank has finished `step`.
  bool reached(std::uint64_t step) const noexcept {
    for (int r = 0; r < ranks; ++r)
      if (progress(r).load(std::memory_order_acquire) < step) return false;
    return true;
  }
  // Whether rank r has finished `step`.
  bool reached_by(int r, std::uint64_t step) const noexcept { return progress(r).load(std::memory_order_acquire) >= step; }
  // "world rank 5 (rank 2, at step 5), world rank 7 (rank 3, at step 4)": the ranks that have
  // not finished `step`.
  std::string behind(std::uint64_t step) const {
    std::string out;
    for (int r = 0; r < ranks; ++r) {
      const std::uint64_t p = progress(r).load(std::memory_order_acquire);
      if (p < step) out += cat(out.empty() ? "" : ", ", "world rank ", world_rank(r), " (rank ", r, ", at step ", p, ")");
    }
    return out;
  }
  int world_rank(int r) const { return world_ranks[static_cast<std::size_t>(r)]; }

  static std::size_t round_up(std::size_t bytes, std::size_t to = line) { return (bytes + to - 1) / to * to; }

  // Queues a started task behind the others (the caller's thread, in start order).
  void enqueue(const std::shared_ptr<segment_task>& task) {
    std::lock_guard<std::mutex> lock(queue_mutex_);
    queue_.push_back(task);
  }
  // Drives the queued tasks in start order as far as they go without waiting, unless another
  // thread is driving them now. Throws what a task's step throws (that task stays queued, and
  // throws again when next driven).
  void drive() {
    std::unique_lock<std::mutex> driving(driving_, std::try_to_lock);
    if (!driving.owns_lock()) return;
    for (;;) {
      std::shared_ptr<segment_task> front;
      {
        std::lock_guard<std::mutex> lock(queue_mutex_);
        if (queue_.empty()) return;
        front = queue_.front().lock();
        if (!front) {
          // Dropped before it finished (an engine stopped with it pending): its peers will wait
          // for steps this rank never takes, so nothing after it may run.
          broken.store(true, std::memory_order_release);
          queue_.pop_front();
          continue;
        }
      }
      if (!front->step()) return;
      front->finished();
      std::lock_guard<std::mutex> lock(queue_mutex_);
      queue_.pop_front();
    }
  }

  std::unique_ptr<shm::host_group> group;
  int rank = 0, ranks = 0;
  std::size_t large_bytes = 0, small_bytes = 0;
  shm::host_window window;
  std::vector<std::byte*> regions;
  std::vector<int> world_ranks;  // of each rank of the group
  std::atomic<bool> broken{false};         // a task timed out or was dropped: no later one may run
  slot_writer writer;                      // how this rank writes its large slots

 private:
  std::mutex driving_;      // held by the thread driving the tasks
  std::mutex queue_mutex_;  // guards queue_ only: start() never waits for a step to end
  std::deque<std::weak_ptr<segment_task>> queue_;  // started, not finished, in start order
};

}  // namespace flexcomm::detail
