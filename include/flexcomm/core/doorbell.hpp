// doorbell: lets a rank sleep in shared memory until a peer on its host says something may
// have changed, instead of waking on a timer to look. A producer of the adaptive feed that is a
// whole board ahead waits a whole training step for a slot, and waking on a timer to find nothing
// costs CPU where preprocessing is cheap (benchmarks/history/feed.md). On Linux it is a futex on
// the shared page, so the kernel wakes exactly the sleepers, across processes; elsewhere
// sleep_unless sleeps a bounded slice, as backoff would.
#pragma once

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <thread>

#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <ctime>
#endif

namespace flexcomm::detail {

// Lies in a shared mapping whose pages start zeroed: a zeroed doorbell was never rung and has
// nobody asleep, so nobody needs to place it before a peer rings.
struct doorbell {
  // A sleeper says which of 32 channels it waits on, and a ring which channels it is for; the
  // kernel wakes only the sleepers on those (two producers wait for different slots: a ring for
  // every slot woke both at every step).
  static constexpr std::uint32_t every_channel = ~std::uint32_t{0};
  static constexpr std::uint32_t channel(std::uint64_t i) noexcept { return std::uint32_t{1} << (i % 32); }

  std::atomic<std::uint32_t> rings{0};
  std::atomic<std::uint32_t> sleepers{0};

  // After a change a sleeper may wait for (made with a store its done() reads): wakes those on
  // `channels`. Costs an atomic add and a load when nobody sleeps.
  void ring(std::uint32_t channels = every_channel) noexcept {
    rings.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers.load(std::memory_order_seq_cst) > 0) wake(channels);
  }

  // Sleeps until a ring on one of `channels`, or at most `longest`, unless done() (which must
  // read what the ringer changed) is true. A ring between the first look and the sleep is not
  // lost: the kernel sleeps only while `rings` still holds the value read before that look (any
  // ring in between, on any channel, ends the sleep at once; the caller looks again).
  template <class Done>
  void sleep_unless(Done&& done, std::chrono::nanoseconds longest, std::uint32_t channels = every_channel) noexcept(
      noexcept(done())) {
    const std::uint32_t seen = rings.load(std::memory_order_seq_cst);
    if (done()) return;
    sleepers.fetch_add(1, std::memory_order_seq_cst);
    if (!done()) sleep(seen, longest, channels);
    sleepers.fetch_sub(1, std::memory_order_seq_cst);
  }

 private:
  static_assert(sizeof(std::atomic<std::uint32_t>) == sizeof(std::uint32_t) &&
                    std::atomic<std::uint32_t>::is_always_lock_free,
                "a futex needs the atomic's own 32-bit word");

#ifdef __linux__
  // Not FUTEX_PRIVATE_FLAG: the sleepers are other processes mapping the same page.
  std::uint32_t* word() noexcept { return reinterpret_cast<std::uint32_t*>(&rings); }
  void wake(std::uint32_t channels) noexcept {
    syscall(SYS_futex, word(), FUTEX_WAKE_BITSET, INT_MAX, nullptr, nullptr, channels);
  }
  void sleep(std::uint32_t seen, std::chrono::nanoseconds longest, std::uint32_t channels) noexcept {
    // FUTEX_WAIT_BITSET takes an absolute CLOCK_MONOTONIC time.
    timespec until{};
    clock_gettime(CLOCK_MONOTONIC, &until);
    const auto ns = static_cast<long long>(until.tv_nsec) + longest.count();
    until.tv_sec += static_cast<time_t>(ns / 1000000000);
    until.tv_nsec = static_cast<long>(ns % 1000000000);
    // Returns on a ring, a signal, the limit, or at once if rung since `seen`; the caller looks
    // again in every case.
    syscall(SYS_futex, word(), FUTEX_WAIT_BITSET, seen, &until, nullptr, channels);
  }
#else
  void wake(std::uint32_t) noexcept {}
  void sleep(std::uint32_t seen, std::chrono::nanoseconds longest, std::uint32_t) noexcept {
    const auto slice = std::chrono::nanoseconds(std::chrono::microseconds(100));
    for (auto slept = std::chrono::nanoseconds(0); slept < longest && rings.load() == seen; slept += slice)
      std::this_thread::sleep_for(slice);
  }
#endif
};

}  // namespace flexcomm::detail
