// The steps a feed hands to the trainers on one host in place: the loader writes each step into
// a slot of shared memory once, and every trainer there reads its pieces where they lie, with no
// message and no copy. Flags and credits are counters in the same memory. one_to_many's producer
// publishes to the trainers of its host; in all_shared every owner of a piece publishes its turn.
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

#include "../../../core/cache_line.hpp"
#include "../../../core/error.hpp"
#include "../../../core/span.hpp"
#include "../../../core/wait.hpp"
#include "../../../core/watchdog.hpp"

namespace flexcomm::detail {

// What a wait in shared memory does now and then: answer peers' watchdog queries.
inline void answer_watchdog() { watchdog::instance().answer_queries(); }

// Over a group of one host's ranks: the publishers (a producer and, in all_shared, every owner of
// a piece) write their k-th step into slot k mod `slots` of their own region and count it in
// `published`; every reader counts in `released` the steps it is done with. A publisher fills
// slot k only once every other rank of the group has released step k - slots, so a batch stays
// as it is until its reader lets go of it (at its next next()): no step is ever dropped and no
// batch changes under a reader. Each rank's region: `published`, `released`, and for one_to_many's
// hand-overs `asked` and `moved` (a cache line each), then its slots if it publishes.
//   asked   the steps [0, asked) a reader has asked for (a credit, as a counter; global steps)
//   moved   (at + 1) << 16 | (member + 1) once the reader's member splits anew from step `at`
template <class B>
class host_slots {
 public:
  static constexpr std::size_t line = cache_line;

  host_slots() = default;

  // Collective over `group`. `publishes`: whether this rank writes slots of `slot_bytes` (the
  // same on every rank). `world_ranks[r]`: the world rank of group rank r, named in timeouts;
  // `who` names the feed in set-up errors.
  host_slots(const typename B::communicator& group, bool publishes, std::size_t slots, std::size_t slot_bytes,
             std::vector<int> world_ranks, const std::string& who)
      : slots_(slots), slot_bytes_(round_up(slot_bytes)), world_ranks_(std::move(world_ranks)) {
    window_ = typename B::host_window(group, header + (publishes ? slots_ * slot_bytes_ : 0), who);
    for (int r = 0; r < window_.size(); ++r) regions_.push_back(window_.region(r));
    // Each rank places its own counters; the file starts zeroed, so a peer that reads them before
    // the placement reads 0 all the same.
    static_assert(std::atomic<std::uint64_t>::is_always_lock_free, "shared-memory counters must be lock-free");
    for (std::size_t c = 0; c < header / line; ++c) new (window_.region(window_.rank()) + c * line) std::atomic<std::uint64_t>(0);
  }

  explicit operator bool() const noexcept { return static_cast<bool>(window_); }
  std::size_t slots() const noexcept { return slots_; }
  // Whether the rank of this world rank is in the group (and so reads in place).
  bool holds(int world_rank) const {
    return std::find(world_ranks_.begin(), world_ranks_.end(), world_rank) != world_ranks_.end();
  }

  // Where group rank r's k-th step lies.
  std::byte* slot(int r, std::int64_t k) const noexcept {
    return regions_[static_cast<std::size_t>(r)] + header + static_cast<std::size_t>(k) % slots_ * slot_bytes_;
  }

  // Publisher: whether every other rank is done with the step its slot k held before.
  bool is_free(std::int64_t k) const noexcept {
    const auto needed = static_cast<std::uint64_t>(std::max<std::int64_t>(k - static_cast<std::int64_t>(slots_) + 1, 0));
    for (int r = 0; r < window_.size(); ++r)
      if (r != window_.rank() && released(r).load(std::memory_order_acquire) < needed) return false;
    return true;
  }
  // Publisher: waits until every other rank is done with the step its slot k held before.
  void wait_free(std::int64_t k, const std::string& what) const {
    const auto needed = static_cast<std::uint64_t>(std::max<std::int64_t>(k - static_cast<std::int64_t>(slots_) + 1, 0));
    if (needed == 0) return;
    const auto late = [&](int r) { return released(r).load(std::memory_order_acquire) < needed; };
    wait_in_shared_memory([&] { return !any_other(late); }, answer_watchdog, what, [&] {
      return cat(world_ranks_named(others(late)), "\n  (in shared memory on this host: step ", needed - 1,
                 " of world rank ", world_ranks_[static_cast<std::size_t>(window_.rank())], "'s slots not released)");
    });
  }
  // Publisher: its step k is in its slot.
  void publish(std::int64_t k) const noexcept {
    published(window_.rank()).store(static_cast<std::uint64_t>(k) + 1, std::memory_order_release);
  }
  // Publisher, step k whole: waits until slot k is free (wait_free), has `fill()` write it, and
  // publishes it.
  template <class Fill>
  void fill_and_publish(std::int64_t k, const std::string& what, Fill&& fill) const {
    wait_free(k, what);
    fill();
    publish(k);
  }

  // Reader: whether group rank r's step k is in its slot, and waiting for it.
  bool arrived(int r, std::int64_t k) const noexcept {
    return published(r).load(std::memory_order_acquire) > static_cast<std::uint64_t>(k);
  }
  void wait_arrived(int r, std::int64_t k, const std::string& what) const {
    wait_in_shared_memory([&] { return arrived(r, k); }, answer_watchdog, what, [&] {
      return cat("world rank ", world_ranks_[static_cast<std::size_t>(r)],
                 "\n  (in shared memory on this host: it published ", published(r).load(std::memory_order_acquire),
                 " steps, not step ", k, ")");
    });
  }
  // Reader: done with steps [0, k] of every publisher; they may refill those slots.
  void release(std::int64_t k) const noexcept { release_all(static_cast<std::uint64_t>(k) + 1); }
  // Reader that leaves the stream: no publisher waits for it again.
  void leave() const noexcept { release_all(std::numeric_limits<std::uint64_t>::max()); }

  // one_to_many's hand-over, where a member's split may change at a step the member agrees on
  // (first_unasked(): the first it has not asked for), a producer must learn of a change before it
  // ships that step, as from a credit by message. Reader: it has asked for steps [0, n).
  void ask_up_to(std::int64_t n) const noexcept {
    auto& mine = counter(window_.rank(), asked_at);
    if (mine.load(std::memory_order_relaxed) < static_cast<std::uint64_t>(n))
      mine.store(static_cast<std::uint64_t>(n), std::memory_order_release);
  }
  // Reader: its member's split changes at step `at`; it asks for nothing from there.
  void move(int member, std::int64_t at) const noexcept {
    counter(window_.rank(), moved_at)
        .store((static_cast<std::uint64_t>(at) + 1) << member_bits | static_cast<std::uint64_t>(member + 1),
               std::memory_order_release);
  }
  // Publisher, before it ships `step` (a global step): waits until every other rank asked for it,
  // left, or said its member splits anew at or before it; those members into `moved`, once each.
  void await_asked(std::int64_t step, std::vector<std::pair<int, std::int64_t>>& moved, const std::string& what) const {
    const auto late = [&](int r) {
      return released(r).load(std::memory_order_acquire) != std::numeric_limits<std::uint64_t>::max() &&
             counter(r, asked_at).load(std::memory_order_acquire) <= static_cast<std::uint64_t>(step) &&
             move_of(r).second > step;
    };
    wait_in_shared_memory([&] { return !any_other(late); }, answer_watchdog, what, [&] {
      return cat(world_ranks_named(others(late)), "\n  (in shared memory on this host: step ", step, " not asked for)");
    });
    for (int r = 0; r < window_.size(); ++r) {
      const auto m = move_of(r);
      if (r != window_.rank() && m.second <= step && std::find(moved.begin(), moved.end(), m) == moved.end())
        moved.push_back(m);
    }
  }


 private:
  static constexpr std::size_t published_at = 0, released_at = 1, asked_at = 2, moved_at = 3, header = 4 * line;
  static constexpr int member_bits = 16;
  std::atomic<std::uint64_t>& counter(int r, std::size_t at) const noexcept {
    return *std::launder(reinterpret_cast<std::atomic<std::uint64_t>*>(regions_[static_cast<std::size_t>(r)] + at * line));
  }
  std::atomic<std::uint64_t>& published(int r) const noexcept { return counter(r, published_at); }
  std::atomic<std::uint64_t>& released(int r) const noexcept { return counter(r, released_at); }
  // Whether late(r) for some other rank r of the group (the waits' test: no list made per look).
  template <class Late>
  bool any_other(Late&& late) const {
    for (int r = 0; r < window_.size(); ++r)
      if (r != window_.rank() && late(r)) return true;
    return false;
  }
  // The world ranks of the group's other ranks r for which late(r).
  template <class Late>
  std::vector<int> others(Late&& late) const {
    std::vector<int> out;
    for (int r = 0; r < window_.size(); ++r)
      if (r != window_.rank() && late(r)) out.push_back(world_ranks_[static_cast<std::size_t>(r)]);
    return out;
  }
  // Rank r's move(): its member and the step its split changes at; {-1, the largest step} before.
  std::pair<int, std::int64_t> move_of(int r) const noexcept {
    const std::uint64_t w = counter(r, moved_at).load(std::memory_order_acquire);
    if (w == 0) return {-1, std::numeric_limits<std::int64_t>::max()};
    return {static_cast<int>(w & ((std::uint64_t{1} << member_bits) - 1)) - 1, static_cast<std::int64_t>(w >> member_bits) - 1};
  }
  void release_all(std::uint64_t done) const noexcept {
    auto& mine = released(window_.rank());
    if (mine.load(std::memory_order_relaxed) < done) mine.store(done, std::memory_order_release);
  }
  typename B::host_window window_;
  std::vector<std::byte*> regions_;  // each rank's, valid for the window's life: read on every step
  std::size_t slots_ = 0, slot_bytes_ = 0;
  std::vector<int> world_ranks_;
};

// Whether any of a feed's slots is in use (those of ranks on other hosts stay empty).
template <class B>
bool any_shared(const std::vector<host_slots<B>>& slots) noexcept {
  for (const auto& s : slots)
    if (s) return true;
  return false;
}

}  // namespace flexcomm::detail
