// The adaptive feed's board on one host: the slots where the pieces of its next steps are made,
// and, beside each piece, who claimed it and whether it is made. Any rank of the host may claim
// a piece (a compare-and-swap every rank sees once), make it with the loader in the slot, and
// mark it made; every trainer there reads its pieces in place. A piece is thus made exactly once
// whoever makes it, and a claim names its maker, so a wait on a piece whose maker stalled or died
// names that rank.
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
#include "../../../core/doorbell.hpp"
#include "../../../core/error.hpp"
#include "host_slots.hpp"

namespace flexcomm::detail {

// Over a group of one host's ranks (producers and trainers). Everything lies in group rank 0's
// region, each counter on a cache line of its own:
//   released[r]        per rank: steps [0, released) read by rank r (readers only; the others
//                      never hold a slot, and mark themselves done with every step); then a
//                      line per reader that is not a rank of the group (a courier's sends,
//                      board_courier.hpp), released by release_line()
//   pace               how long making a piece takes, in ns (smoothed over every maker)
//   freed              a doorbell, rung by a release that frees a slot (producers sleep on it)
//   training           how many trainers hold a step they were handed (training it, as far as
//                      the board can tell)
//   claim[slot][piece] (step + 1) << 16 | (group rank + 1) of the last claim; 0 before any
//   made[slot][piece]  step + 1 once that step's piece is in the slot
//   data[slot]         the pieces of a step side by side, each piece_bytes + guard_bytes long
// Step k lies in slot k mod `slots`, which may take it once every reader released step k - slots.
template <class B>
class claim_board {
 public:
  static constexpr std::size_t line = cache_line;
  static constexpr int rank_bits = 16;
  // The host's counters after the readers' released[], by line: pace, freed, training; the
  // claim and made counters follow them.
  static constexpr std::size_t pace_at = 0, freed_at = 1, training_at = 2, host_counters = 3;

  claim_board() = default;

  // Collective over `group`. `reads`: whether this rank reads pieces (a trainer). `piece_bytes[c]`:
  // piece c's length on the wire, the same on every rank (0: a piece nobody here reads, never
  // made here). `world_ranks[r]`: group rank r's world rank, named in timeouts; entries past the
  // group's ranks are the world ranks of readers that are lines, not ranks (a courier's).
  claim_board(const typename B::communicator& group, bool reads, std::size_t slots,
              const std::vector<std::size_t>& piece_bytes, std::vector<int> world_ranks, const std::string& who)
      : slots_(slots), pieces_(piece_bytes.size()), world_ranks_(std::move(world_ranks)) {
    check(static_cast<std::size_t>(group.size()) < (std::size_t{1} << rank_bits) - 1, who,
          cat("a board of ", group.size(), " ranks on one host; at most ", (1 << rank_bits) - 2));
    check(world_ranks_.size() >= static_cast<std::size_t>(group.size()), who,
          cat(world_ranks_.size(), " world ranks named for a board of ", group.size(), " ranks"));
    std::size_t at = 0;
    for (std::size_t b : piece_bytes) {
      offsets_.push_back(at);
      at += b == 0 ? 0 : round_up(b + guard_bytes);
    }
    slot_bytes_ = at;
    const std::size_t control = (world_ranks_.size() + host_counters + 2 * slots_ * pieces_) * line;
    window_ = typename B::host_window(group, group.rank() == 0 ? control + slots_ * slot_bytes_ : 0, who);
    base_ = window_.region(0);
    data_ = base_ + control;
    static_assert(std::atomic<std::uint64_t>::is_always_lock_free, "shared-memory counters must be lock-free");
    // Rank 0's pages start zeroed, which every claim and made counter reads as "nothing yet",
    // and the doorbell as never rung (nobody places those: a claim may land before rank 0
    // would). Each rank places its own released counter; one that reads nothing is done with
    // every step. A peer that reads it before then reads 0, and only waits a little longer for a
    // slot: the placement rings for it.
    new (base_ + static_cast<std::size_t>(group.rank()) * line)
        std::atomic<std::uint64_t>(reads ? 0 : std::numeric_limits<std::uint64_t>::max());
    freed().ring();
  }

  explicit operator bool() const noexcept { return static_cast<bool>(window_); }
  std::size_t slots() const noexcept { return slots_; }
  std::size_t pieces() const noexcept { return pieces_; }

  // Where piece c of step k lies: piece_bytes + guard_bytes.
  std::byte* piece(std::int64_t k, std::size_t c) const noexcept {
    return data_ + static_cast<std::size_t>(k) % slots_ * slot_bytes_ + offsets_[c];
  }

  // Whether step k's slot is free: every reader released the step it held before.
  bool slot_free(std::int64_t k) const noexcept { return late_readers(k, nullptr) == 0; }
  // Whether piece c of step k was claimed (by anyone; it is then made, or being made).
  bool claimed(std::int64_t k, std::size_t c) const noexcept {
    return (claim(k, c).load(std::memory_order_acquire) >> rank_bits) >= static_cast<std::uint64_t>(k) + 1;
  }
  // Claims piece c of step k for this rank if nobody has and its slot is free; true: this rank
  // makes it, then calls made(k, c).
  bool try_claim(std::int64_t k, std::size_t c) const noexcept {
    std::uint64_t seen = claim(k, c).load(std::memory_order_acquire);
    if ((seen >> rank_bits) >= static_cast<std::uint64_t>(k) + 1 || !slot_free(k)) return false;
    const std::uint64_t mine = (static_cast<std::uint64_t>(k) + 1) << rank_bits | static_cast<std::uint64_t>(window_.rank() + 1);
    return claim(k, c).compare_exchange_strong(seen, mine, std::memory_order_acq_rel, std::memory_order_acquire);
  }
  // The claimer has made piece c of step k in its slot.
  void mark_made(std::int64_t k, std::size_t c) const noexcept {
    made(k, c).store(static_cast<std::uint64_t>(k) + 1, std::memory_order_release);
  }
  bool is_made(std::int64_t k, std::size_t c) const noexcept {
    return made(k, c).load(std::memory_order_acquire) >= static_cast<std::uint64_t>(k) + 1;
  }

  // A rank made a piece in `ns`; every rank learns how long a piece takes (a race between two
  // makers only blurs the estimate).
  void note_make_time(std::uint64_t ns) const noexcept {
    auto& pace = counter(world_ranks_.size() + pace_at);
    const std::uint64_t old = pace.load(std::memory_order_relaxed);
    pace.store(old == 0 ? ns : (7 * old + ns) / 8, std::memory_order_relaxed);
  }
  std::chrono::nanoseconds make_time() const noexcept {
    return std::chrono::nanoseconds(counter(world_ranks_.size() + pace_at).load(std::memory_order_relaxed));
  }

  // Rung whenever a slot may have come free, on the channel of the step that may now use it; a
  // producer waiting for step k's slot sleeps on channel freed_channel(k).
  static std::uint32_t freed_channel(std::int64_t k, std::size_t slots) noexcept {
    return doorbell::channel(static_cast<std::uint64_t>(k) % slots);
  }
  std::uint32_t freed_channel(std::int64_t k) const noexcept { return freed_channel(k, slots_); }
  doorbell& freed() const noexcept {
    return *std::launder(reinterpret_cast<doorbell*>(base_ + (world_ranks_.size() + freed_at) * line));
  }

  // How many trainers here hold a step handed out to them: a hint (nothing waits on it, so
  // relaxed), counted up when a trainer is handed a step and down when it comes back for the
  // next or leaves.
  void training_starts() const noexcept { training().fetch_add(1, std::memory_order_relaxed); }
  void training_ends() const noexcept { training().fetch_sub(1, std::memory_order_relaxed); }
  std::uint64_t trainers_training() const noexcept { return training().load(std::memory_order_relaxed); }

  // Reader: done with steps [0, k]; their slots may be refilled.
  void release(std::int64_t k) const noexcept { release_line(this_rank(), static_cast<std::uint64_t>(k) + 1); }
  // Reader that leaves the stream: nobody waits for it again.
  void leave() const noexcept { release_line(this_rank(), std::numeric_limits<std::uint64_t>::max()); }
  // A reader that left comes back at step k (a hand-over): steps from k on wait for it again. Only
  // while every slot from k on is held by another reader, which keeps k's from coming free.
  void hold(std::int64_t k) const noexcept {
    counter(this_rank()).store(static_cast<std::uint64_t>(k), std::memory_order_seq_cst);
  }
  // Reader line `line` is done with steps [0, done). The reader that moves the slowest reader on
  // frees a slot, and rings for the producer that sleeps on it. Of two readers that release the
  // same step at once, at least one sees the other's store (both are sequentially consistent, as
  // are the loads after them), so a slot never comes free unrung. One thread per line.
  void release_line(std::size_t line, std::uint64_t done) const noexcept {
    auto& mine = counter(line);
    const std::uint64_t before = mine.load(std::memory_order_relaxed);
    if (before >= done) return;
    mine.store(done, std::memory_order_seq_cst);
    std::uint64_t slowest = std::numeric_limits<std::uint64_t>::max();
    for (std::size_t r = 0; r < world_ranks_.size(); ++r)
      slowest = std::min(slowest, released(static_cast<int>(r)).load(std::memory_order_seq_cst));
    if (slowest <= before) return;
    // Steps [before, slowest) are released by everyone: steps [before, slowest) + slots may use
    // their slots.
    std::uint32_t channels = 0;
    for (std::uint64_t j = before; j < slowest && j < before + 32; ++j)
      channels |= freed_channel(static_cast<std::int64_t>(j), slots_);
    freed().ring(slowest - before >= 32 ? doorbell::every_channel : channels);
  }

  // Why piece c of step k is not made yet, for a timeout: its maker, or the readers that hold
  // its slot.
  std::string holder(std::int64_t k, std::size_t c) const {
    const std::uint64_t seen = claim(k, c).load(std::memory_order_acquire);
    if ((seen >> rank_bits) >= static_cast<std::uint64_t>(k) + 1) {
      const auto r = static_cast<std::size_t>(seen & ((std::uint64_t{1} << rank_bits) - 1)) - 1;
      return cat("world rank ", world_ranks_[r], "\n  (in shared memory on this host: it claimed piece ", c,
                 " of step ", k, " and has not made it)");
    }
    std::string late;
    late_readers(k, &late);
    return cat(late.empty() ? std::string("nobody (the slot came free just now)") : late,
               "\n  (in shared memory on this host: step ", k - static_cast<std::int64_t>(slots_),
               " not released, so nobody can make step ", k, " in its slot)");
  }

 private:
  std::atomic<std::uint64_t>& counter(std::size_t index) const noexcept {
    return *std::launder(reinterpret_cast<std::atomic<std::uint64_t>*>(base_ + index * line));
  }
  std::atomic<std::uint64_t>& released(int r) const noexcept { return counter(static_cast<std::size_t>(r)); }
  std::size_t this_rank() const noexcept { return static_cast<std::size_t>(window_.rank()); }
  std::atomic<std::uint64_t>& training() const noexcept { return counter(world_ranks_.size() + training_at); }
  std::size_t control(std::int64_t k, std::size_t c) const noexcept {
    return world_ranks_.size() + host_counters + 2 * (static_cast<std::size_t>(k) % slots_ * pieces_ + c);
  }
  std::atomic<std::uint64_t>& claim(std::int64_t k, std::size_t c) const noexcept { return counter(control(k, c)); }
  std::atomic<std::uint64_t>& made(std::int64_t k, std::size_t c) const noexcept { return counter(control(k, c) + 1); }

  // How many readers still hold the step before k in its slot; their world ranks into `names`.
  int late_readers(std::int64_t k, std::string* names) const {
    const std::int64_t before = k - static_cast<std::int64_t>(slots_);
    if (before < 0) return 0;
    std::vector<int> late;
    for (std::size_t r = 0; r < world_ranks_.size(); ++r)
      if (released(static_cast<int>(r)).load(std::memory_order_acquire) <= static_cast<std::uint64_t>(before))
        late.push_back(world_ranks_[r]);
    if (names && !late.empty()) *names = world_ranks_named(late);
    return static_cast<int>(late.size());
  }

  typename B::host_window window_;
  std::byte* base_ = nullptr;
  std::byte* data_ = nullptr;
  std::size_t slots_ = 0, pieces_ = 0, slot_bytes_ = 0;
  std::vector<std::size_t> offsets_;  // [piece] within a slot
  std::vector<int> world_ranks_;      // [reader line]: the group's ranks, then lines like a courier's
};

}  // namespace flexcomm::detail
