// The watch over a blocking NCCL communicator: a call on one (ncclGroupEnd of the first send or
// receive between two ranks, which connects them; ncclCommFinalize) can block the host until the
// peer takes part. Past the communicator's timeout, a watcher thread aborts the communicator
// (ncclCommAbort, which NCCL allows from another thread), so that the call returns and becomes a
// named error instead of a hang. Arming and disarming a call are one atomic store each: no lock,
// no allocation, so the posts stay as cheap as a blocking communicator's.
#pragma once

#include "../cuda/runtime.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace flexcomm {

namespace detail {

// One blocking communicator's watch. The handle is set once, before the watch is registered.
class blocking_watch {
 public:
  explicit blocking_watch(device::nccl_comm_t comm) : comm_(comm) {}
  blocking_watch(const blocking_watch&) = delete;
  blocking_watch& operator=(const blocking_watch&) = delete;

  // A blocking call begins; `limit` zero: no limit (FLEXCOMM_TIMEOUT=0), not armed.
  void arm(std::chrono::milliseconds limit) noexcept {
    if (limit.count() <= 0) return;
    limit_ns_.store(std::chrono::duration_cast<std::chrono::nanoseconds>(limit).count(), std::memory_order_relaxed);
    since_.store(now_ns(), std::memory_order_release);
  }
  // The call returned: true when the watcher aborted the communicator meanwhile (it is gone:
  // the caller must never touch its handle again). Waits for the abort to have returned.
  bool disarm() noexcept {
    if (since_.exchange(0, std::memory_order_acq_rel) != fired) return false;
    while (!aborted_.load(std::memory_order_acquire)) std::this_thread::yield();
    return true;
  }
  // The watcher's check: aborts the communicator when its call has run past its limit.
  void check(std::int64_t now) noexcept {
    std::int64_t since = since_.load(std::memory_order_acquire);
    if (since <= 0 || now - since < limit_ns_.load(std::memory_order_relaxed)) return;
    if (!since_.compare_exchange_strong(since, fired, std::memory_order_acq_rel)) return;
    device::nccl_comm_abort(comm_);
    aborted_.store(true, std::memory_order_release);
  }

  static std::int64_t now_ns() noexcept {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

 private:
  static constexpr std::int64_t fired = -1;
  device::nccl_comm_t comm_;
  std::atomic<std::int64_t> since_{0};  // when the call in progress began; 0: none; fired: aborted
  std::atomic<std::int64_t> limit_ns_{0};
  std::atomic<bool> aborted_{false};
};

// The process's watcher: one thread, started with the first watch, that looks at the live
// watches every `tick` (a blocking call ends at most a tick past its limit).
class blocking_watcher {
 public:
  static constexpr std::chrono::milliseconds tick{20};

  static blocking_watcher& instance() {
    static blocking_watcher* w = new blocking_watcher;  // never destroyed: its thread may outlive main
    return *w;
  }

  void add(const std::shared_ptr<blocking_watch>& w) {
    std::lock_guard<std::mutex> lock(mutex_);
    watches_.erase(std::remove_if(watches_.begin(), watches_.end(), [](const auto& x) { return x.expired(); }),
                   watches_.end());
    watches_.push_back(w);
    if (!started_) {
      started_ = true;
      std::thread([this] { loop(); }).detach();
    }
  }

 private:
  blocking_watcher() = default;

  void loop() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      wake_.wait_for(lock, tick);
      const std::int64_t now = blocking_watch::now_ns();
      for (const auto& weak : watches_)
        if (auto w = weak.lock()) w->check(now);
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::vector<std::weak_ptr<blocking_watch>> watches_;
  bool started_ = false;
};

}  // namespace detail

}  // namespace flexcomm
