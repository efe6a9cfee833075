// Where a trainer's steps come from: wait for one, hand out its pieces (each as wire.hpp lays it:
// header, shard sizes, shards), let go of it. The feed's next() asks only this; where a piece
// lies is decided here, once, per publisher: in its shared slot on this host (host_slots.hpp),
// read in place, or in this trainer's buffers, received as messages (steps_in_flight.hpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "../../backend/contract.hpp"
#include "../../core/error.hpp"
#include "../../core/span.hpp"
#include "../../core/trace.hpp"
#include "../../backend/shm/feed/host_slots.hpp"
#include "steps_in_flight.hpp"
#include "wire.hpp"

namespace flexcomm {
namespace detail {

// A trainer's steps, from publishers that take turns: one_to_many's producers (round-robin; one
// per host: only its own), all_shared's members (each publishes one step of every round).
template <class B>
class step_source {
 public:
  using request = typename B::request;
  // One entry of messages in flight (one_to_many: a step; all_shared: a round of every member's
  // step): its requests and the buffers they fill.
  struct received : in_flight<request> {
    std::vector<std::vector<std::byte>> buffers;  // per piece of this trainer
    std::vector<std::vector<std::byte>> outgoing;  // all_shared: this trainer's own pieces, sent
    int credit = 1;                                // one_to_many: what the trainer sends for it
  };
  // Where a publisher's piece lies in shared memory: in group rank `publisher`'s slots of
  // `slots`, at `offset`. Without slots, the piece comes as messages.
  struct shared_piece {
    const host_slots<B>* slots = nullptr;
    int publisher = 0;
    std::size_t offset = 0;
  };

  // Step s is publisher (s % turns)'s (s / turns)-th, its piece i lies as shared[s % turns][i]
  // says (the slots outlive this source) and is piece_bytes[i] long. An entry of messages holds
  // `steps_per_entry` consecutive steps, piece i of the j-th at buffers[i] + j * piece_bytes[i];
  // `entries` of them are in flight, sized once by init(entry). Waits are named
  // cat(what, s / steps_per_entry) ("one_to_many: receive of step ").
  template <class Init>
  void setup(std::int64_t turns, std::vector<std::vector<shared_piece>> shared, std::vector<std::size_t> piece_bytes,
             std::int64_t steps_per_entry, std::size_t entries, Init&& init, std::string what) {
    turns_ = turns;
    shared_ = std::move(shared);
    piece_bytes_ = std::move(piece_bytes);
    steps_per_entry_ = steps_per_entry;
    what_ = std::move(what);
    pieces_.resize(piece_bytes_.size());
    ring_.allocate(entries, std::forward<Init>(init));
  }

  // Whether every piece of `step` lies in shared memory (nothing to receive).
  bool in_shared_memory(std::int64_t step) const {
    for (const auto& piece : turn(step))
      if (!piece.slots) return false;
    return true;
  }

  // Posting, in entry order: an entry whose slot is free is claimed (null while the slot holds
  // an earlier one), its requests posted, then started.
  received* claim(std::int64_t entry) {
    received* r = ring_.claim(entry);
    if (r) r->clear();
    return r;
  }
  void start(std::int64_t entry, received& r) {
    if (!r.requests.empty()) ring_.start(entry, r, name(entry));
  }

  // Waits until `step` is here and returns its pieces (valid until release(step)).
  const std::vector<span<const std::byte>>& take(std::int64_t step) {
    trace::span traced(trace::names::feed_wait, step, "step", "feed");
    const std::int64_t e = step / steps_per_entry_, k = step / turns_;
    const std::string what = name(e);
    const auto& where = turn(step);
    received* r = nullptr;  // the entry of messages, looked up for the first piece that came so
    for (std::size_t i = 0; i < pieces_.size(); ++i) {
      const shared_piece& piece = where[i];
      if (piece.slots) {
        piece.slots->wait_arrived(piece.publisher, k, what);
        pieces_[i] = {piece.slots->slot(piece.publisher, k) + piece.offset, piece_bytes_[i]};
        continue;
      }
      if (!r) {
        r = ring_.held(e);
        if (!r) fail(what, cat("never posted (its slot holds ", ring_.holder(e), ")"));
        ring_.await(*r, what);
      }
      pieces_[i] = {r->buffers[i].data() + static_cast<std::size_t>(step % steps_per_entry_) * piece_bytes_[i],
                    piece_bytes_[i]};
    }
    return pieces_;
  }

  // Whether every piece of `step` is here, without waiting (a trainer that makes pieces while it
  // waits asks this between them).
  bool here(std::int64_t step) {
    const received* r = ring_.held(step / steps_per_entry_);
    for (const auto& piece : turn(step))
      if (piece.slots ? !piece.slots->arrived(piece.publisher, step / turns_) : !r || !ring_.done(*r)) return false;
    return true;
  }

  // Done with `step`: its slots (shared, and its entry once the entry's last step is done) may
  // be refilled.
  void release(std::int64_t step) {
    if ((step + 1) % steps_per_entry_ != 0) return;  // the entry's other steps are still to come
    for (const auto& piece : turn(step))
      if (piece.slots) piece.slots->release(step / turns_);
    ring_.release(step / steps_per_entry_);
  }

  // The newest step held whose pieces are all here without waiting, or -1 (skip_ahead).
  std::int64_t newest_arrived() {
    std::int64_t newest = -1;
    ring_.for_each_held([&](std::int64_t e, received& r) {
      for (std::int64_t step = e * steps_per_entry_; step < (e + 1) * steps_per_entry_; ++step)
        if (step > newest && arrived(step, r)) newest = step;
    });
    return newest;
  }

  // Leaves the stream: no publisher waits for this trainer's reading again, and every entry held
  // is awaited, posting the rest (`post()`) as slots free, so that the publishers can finish.
  template <class Post>
  void drain(Post&& post) {
    for (const auto& turn : shared_)
      for (const auto& piece : turn)
        if (piece.slots) piece.slots->leave();
    ring_.drain(post, [&](received& r, std::int64_t e) { ring_.await(r, name(e)); });
  }

 private:
  const std::vector<shared_piece>& turn(std::int64_t step) const {
    return shared_[static_cast<std::size_t>(step % turns_)];
  }
  std::string name(std::int64_t e) const { return cat(what_, e); }
  bool arrived(std::int64_t step, const received& r) const {
    for (const auto& piece : turn(step))
      if (piece.slots ? !piece.slots->arrived(piece.publisher, step / turns_) : !ring_.done(r)) return false;
    return true;
  }

  std::int64_t turns_ = 1, steps_per_entry_ = 1;
  std::vector<std::vector<shared_piece>> shared_;  // [turn][piece]
  std::vector<std::size_t> piece_bytes_;
  std::string what_;
  steps_in_flight<request, received> ring_;
  std::vector<span<const std::byte>> pieces_;  // the last step taken
};

// local_feed's source: the trainer is its own publisher, its loader fills the one piece.
class own_steps {
 public:
  own_steps() = default;
  own_steps(loader load, shard_range shards, std::size_t capacity)
      : load_(std::move(load)), shards_(shards), capacity_(capacity),
        slot_(piece_bytes(shards.count, capacity) + guard_bytes) {}

  const std::vector<span<const std::byte>>& take(std::int64_t step) {
    fill_piece(load_, step, shards_.first, shards_.count, capacity_, span<std::byte>(slot_));
    pieces_.assign(1, span<const std::byte>(slot_.data(), slot_.size()));
    return pieces_;
  }

 private:
  loader load_;
  shard_range shards_;
  std::size_t capacity_ = 0;
  std::vector<std::byte> slot_;
  std::vector<span<const std::byte>> pieces_;
};

}  // namespace detail
}  // namespace flexcomm
