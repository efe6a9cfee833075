// The steps a producer hands to the trainers on its own host in place: the loader writes each
// step into a slot of shared memory once, and every trainer there reads its pieces where they
// lie, with no message and no copy. Flags and credits are counters in the same memory.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "../../backend/contract.hpp"
#include "../../core/error.hpp"
#include "../../core/span.hpp"
#include "../../core/wait.hpp"
#include "../../core/watchdog.hpp"

namespace flexcomm::detail {

// Over a group of one host's ranks: the producer (rank 0 of the group) and the trainers it feeds
// there. The producer's region holds `published` (how many of its steps are in their slots) and
// `slots` slots of `slot_bytes`, its k-th step in slot k mod slots; each trainer's region holds
// `released` (how many steps it is done with). The producer fills slot k only once every trainer
// has released step k - slots, so a trainer's batch stays as it is until it lets go of it (at its
// next next()): no step is ever dropped and no batch changes under a reader. Steps are indexed
// by k, this producer's k-th step, as its trainers receive them in that order.
template <class B>
class host_slots {
 public:
  static constexpr std::size_t line = 64;

  host_slots() = default;

  // Collective over `group`. `world_ranks[r]`: the world rank of group rank r, named in timeouts.
  host_slots(const typename B::communicator& group, std::size_t slots, std::size_t slot_bytes,
             std::vector<int> world_ranks, const std::string& who)
      : slots_(slots), slot_bytes_(round_up(slot_bytes)), world_ranks_(std::move(world_ranks)), who_(who) {
    const bool producer = group.rank() == 0;
    window_ = typename B::host_window(group, producer ? line + slots_ * slot_bytes_ : line, who);
    // Each rank places its own counter; the file starts zeroed, so a peer that reads it before
    // the placement reads 0 all the same.
    static_assert(std::atomic<std::uint64_t>::is_always_lock_free, "shared-memory counters must be lock-free");
    new (window_.region(window_.rank())) std::atomic<std::uint64_t>(0);
  }

  explicit operator bool() const noexcept { return static_cast<bool>(window_); }
  std::size_t slots() const noexcept { return slots_; }
  // Whether the trainer of this world rank reads in place here.
  bool holds(int world_rank) const {
    return std::find(world_ranks_.begin() + 1, world_ranks_.end(), world_rank) != world_ranks_.end();
  }

  // Where the producer's k-th step lies.
  std::byte* slot(std::int64_t k) const noexcept {
    return window_.region(0) + line + static_cast<std::size_t>(k) % slots_ * slot_bytes_;
  }

  // Producer: waits until every trainer is done with the step slot k held before.
  void wait_free(std::int64_t k, const std::string& what) const {
    const auto needed = static_cast<std::uint64_t>(std::max<std::int64_t>(k - static_cast<std::int64_t>(slots_) + 1, 0));
    if (needed == 0) return;
    wait(
        [&] {
          for (int r = 1; r < window_.size(); ++r)
            if (counter(r).load(std::memory_order_acquire) < needed) return false;
          return true;
        },
        what, [&] {
          std::string late;
          for (int r = 1; r < window_.size(); ++r)
            if (counter(r).load(std::memory_order_acquire) < needed)
              late += cat(late.empty() ? "" : ", ", world_ranks_[static_cast<std::size_t>(r)]);
          return cat("a trainer on this host did not release step ", needed - 1, " of this producer; world rank",
                     late.find(',') == std::string::npos ? " " : "s ", late);
        });
  }
  // Producer: step k is in its slot.
  void publish(std::int64_t k) const noexcept {
    counter(0).store(static_cast<std::uint64_t>(k) + 1, std::memory_order_release);
  }

  // Trainer: whether step k is in its slot, and waiting for it.
  bool arrived(std::int64_t k) const noexcept {
    return counter(0).load(std::memory_order_acquire) > static_cast<std::uint64_t>(k);
  }
  void wait_arrived(std::int64_t k, const std::string& what) const {
    wait([&] { return arrived(k); }, what, [&] {
      return cat("the producer on this host (world rank ", world_ranks_[0], ") published ",
                 counter(0).load(std::memory_order_acquire), " steps, not step ", k);
    });
  }
  // Trainer: done with steps [0, k]; the producer may refill their slots.
  void release(std::int64_t k) const noexcept { release_all(static_cast<std::uint64_t>(k) + 1); }
  // Trainer that leaves the stream: the producer never waits for it again.
  void leave() const noexcept { release_all(std::numeric_limits<std::uint64_t>::max()); }

  static std::size_t round_up(std::size_t bytes) { return (bytes + line - 1) / line * line; }

 private:
  std::atomic<std::uint64_t>& counter(int r) const noexcept {
    return *std::launder(reinterpret_cast<std::atomic<std::uint64_t>*>(window_.region(r)));
  }
  void release_all(std::uint64_t done) const noexcept {
    auto& mine = counter(window_.rank());
    if (mine.load(std::memory_order_relaxed) < done) mine.store(done, std::memory_order_release);
  }
  // Through the wait policy, answering the watchdog's queries; past FLEXCOMM_TIMEOUT, `what`
  // fails with who has not moved.
  template <class Done, class Late>
  void wait(Done&& done, const std::string& what, Late&& late) const {
    if (done()) return;
    const auto limit = default_timeout();
    if (!wait_answering(default_wait(), limit, done, [] { watchdog::instance().answer_queries(); }))
      fail(cat(who_, ": ", what), cat("timed out after ", limit.count(), " ms (FLEXCOMM_TIMEOUT) in shared memory: ",
                                      late()));
  }

  typename B::host_window window_;
  std::size_t slots_ = 0, slot_bytes_ = 0;
  std::vector<int> world_ranks_;
  std::string who_;
};

}  // namespace flexcomm::detail
