// flexcomm::mutex: the mutex the device backends lock on an operation's way (the nccl state, event
// pools, the staged lane, the pinned pool), counted per thread, so that a test can hold a post to
// the one lock it takes (docs/cuda.md, "Host work per operation"). A count costs a thread-local
// increment; the lock is std::mutex's.
#pragma once

#include <cstdint>
#include <mutex>

namespace flexcomm {

namespace detail {
inline std::uint64_t& thread_locks() noexcept {
  thread_local std::uint64_t taken = 0;
  return taken;
}

class counted_mutex {
 public:
  void lock() {
    mutex_.lock();
    ++thread_locks();
  }
  bool try_lock() {
    if (!mutex_.try_lock()) return false;
    ++thread_locks();
    return true;
  }
  void unlock() { mutex_.unlock(); }

 private:
  std::mutex mutex_;
};
}  // namespace detail

using mutex = detail::counted_mutex;

// Locks of flexcomm::mutex this thread has taken so far.
inline std::uint64_t locks_taken() noexcept { return detail::thread_locks(); }

}  // namespace flexcomm
