// Where a trainer's steps come from: wait for one, hand it out as a batch made of its pieces
// (each as wire.hpp lays it: header, shard sizes, shards), let go of it. The feed's next() asks
// only this; where a piece lies is decided here, once, per publisher: in its shared slot on this
// host (host_slots.hpp), read in place, or in this trainer's buffers, received as messages
// (steps_in_flight.hpp).
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
#include "vocabulary.hpp"
#include "wire.hpp"

namespace flexcomm {

// One step as a trainer sees it: its shards, concatenated. Valid until the next next().
// bytes() and every shard(i) start on an 8-byte boundary when every shard the loader wrote is a
// multiple of 8 bytes long (the feeds lay pieces out in 8-byte units); nothing more is promised,
// so a trainer that wants wider alignment (SIMD, a framework's tensors) copies, or uses
// typed_feed, whose tensors are 64-byte aligned (typed_batch, typed_feed.hpp).
class batch {
 public:
  batch(std::int64_t step, int first_shard, const std::byte* data, const std::size_t* offsets, int shards)
      : step_(step), first_shard_(first_shard), data_(data), offsets_(offsets), shards_(shards) {}

  std::int64_t step() const noexcept { return step_; }
  span<const std::byte> bytes() const noexcept { return {data_, offsets_[shards_]}; }
  std::size_t size() const noexcept { return offsets_[shards_]; }
  // This trainer's shards are [first_shard(), first_shard() + shards()) of the step.
  int first_shard() const noexcept { return first_shard_; }
  int shards() const noexcept { return shards_; }
  // The bytes of this trainer's i-th shard (global shard first_shard() + i).
  span<const std::byte> shard(int i) const {
    check(i >= 0 && i < shards_, "batch", cat("shard ", i, " of a batch with ", shards_, " shards"));
    return {data_ + offsets_[i], offsets_[i + 1] - offsets_[i]};
  }

 private:
  std::int64_t step_;
  int first_shard_;
  const std::byte* data_;
  const std::size_t* offsets_;  // shards_ + 1 entries, owned by the feed
  int shards_;
};

namespace detail {

// Checks a received piece against what this trainer expects and returns its shard sizes.
// Whatever a peer sent, nothing is read or copied past the slot.
inline const std::uint64_t* read_piece(const char* feed, span<const std::byte> slot, std::int64_t step, int shards,
                                       std::size_t capacity) {
  const auto& h = *reinterpret_cast<const piece_header*>(slot.data());
  check(h.shards == shards && h.step == step, feed,
        cat("expected step ", step, " with ", shards, " shards, received step ", h.step, " with ", h.shards,
            " (ranks disagree on the layout or the stream)"));
  if (h.status != piece_ok) piece_failure(feed, slot, capacity);
  const auto* sizes = reinterpret_cast<const std::uint64_t*>(slot.data() + sizeof(piece_header));
  for (int i = 0; i < shards; ++i)
    check(sizes[i] <= capacity, feed, cat("step ", step, ": a shard of ", sizes[i], " bytes exceeds capacity ", capacity));
  return sizes;
}

inline const std::byte* piece_payload(span<const std::byte> slot, int shards) {
  return slot.data() + sizeof(piece_header) + static_cast<std::size_t>(shards) * sizeof(std::uint64_t);
}

// A trainer's batches, made of its pieces (every piece whose owner in its member is this
// trainer, in shard order): the one call every feed's next() makes once it holds a step's pieces.
class batch_assembly {
 public:
  batch_assembly() = default;
  batch_assembly(const std::vector<piece>& pieces, const ensemble_layout& layout, const rank_role& trainer,
                 std::size_t capacity)
      : batch_assembly(pieces, pieces_of_trainer(pieces, trainer.member, trainer.rank_in_member),
                       layout.shards_of(trainer.member, trainer.rank_in_member), capacity) {}
  // `mine`: which of `pieces` make the trainer's `shards`.
  batch_assembly(const std::vector<piece>& pieces, std::vector<int> mine, shard_range shards, std::size_t capacity)
      : pieces_(std::move(mine)), shards_(shards), capacity_(capacity) {
    for (int c : pieces_) {
      piece_shards_.push_back(pieces[static_cast<std::size_t>(c)].shards);
      piece_bytes_.push_back(piece_bytes(piece_shards_.back(), capacity));
    }
    offsets_.resize(static_cast<std::size_t>(shards_.count) + 1);
  }

  // Which pieces, and how long each is on the wire.
  const std::vector<int>& pieces() const noexcept { return pieces_; }
  std::size_t bytes(std::size_t i) const { return piece_bytes_[i]; }

  // The batch of `step` from its pieces as the wire lays them (pieces()[i] at pieces[i]): each
  // checked, a loader's failure thrown as that step's; one piece's payload where it lies (in a
  // shared slot or a receive buffer, no copy), several concatenated here. Valid until the next
  // call.
  batch assemble(const char* feed, std::int64_t step, const std::vector<span<const std::byte>>& pieces) {
    std::size_t shard = 0;
    offsets_[0] = 0;
    if (pieces_.size() > 1) bytes_.clear();
    const std::byte* data = nullptr;
    for (std::size_t i = 0; i < pieces_.size(); ++i) {
      const int shards = piece_shards_[i];
      const std::uint64_t* sizes = read_piece(feed, pieces[i], step, shards, capacity_);
      std::size_t total = 0;
      for (int k = 0; k < shards; ++k, ++shard) {
        offsets_[shard + 1] = offsets_[shard] + sizes[k];
        total += sizes[k];
      }
      const std::byte* payload = piece_payload(pieces[i], shards);
      if (pieces_.size() == 1) {
        data = payload;
      } else {
        bytes_.insert(bytes_.end(), payload, payload + total);
        data = bytes_.data();
      }
    }
    return batch(step, shards_.first, data, offsets_.data(), shards_.count);
  }
  // A step the trainer skips: its pieces are checked all the same, so that a loader's failure
  // still stops it at that step.
  void skip(const char* feed, std::int64_t step, const std::vector<span<const std::byte>>& pieces) const {
    for (std::size_t i = 0; i < pieces_.size(); ++i) read_piece(feed, pieces[i], step, piece_shards_[i], capacity_);
  }

 private:
  std::vector<int> pieces_, piece_shards_;
  std::vector<std::size_t> piece_bytes_;
  shard_range shards_;
  std::size_t capacity_ = 0;
  std::vector<std::byte> bytes_;
  std::vector<std::size_t> offsets_;
};


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

  // Waits until `step` is here and returns it as `assembly` makes it of this trainer's pieces
  // (valid until release(step) and the assembly's next call); `feed` names it in errors.
  batch take(std::int64_t step, batch_assembly& assembly, const char* feed) {
    return assembly.assemble(feed, step, wait_for(step));
  }
  // Waits until `step` is here and returns its pieces as the wire lays them (this trainer's,
  // in shard order; valid until release(step)): all_shared repacks them for a changed split.
  const std::vector<span<const std::byte>>& pieces(std::int64_t step) { return wait_for(step); }
  // A step the trainer skips: waited for and checked all the same, so that a loader's failure
  // still stops it there.
  void skip(std::int64_t step, const batch_assembly& assembly, const char* feed) {
    assembly.skip(feed, step, wait_for(step));
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

  // No publisher waits for this trainer's reading in shared memory again (nothing is awaited).
  void leave() const {
    for (const auto& turn : shared_)
      for (const auto& piece : turn)
        if (piece.slots) piece.slots->leave();
  }
  // Leaves the stream: no publisher waits for this trainer's reading again, and every entry held
  // is awaited, posting the rest (`post()`) as slots free, so that the publishers can finish.
  template <class Post>
  void drain(Post&& post) {
    leave();
    ring_.drain(post, [&](received& r, std::int64_t e) { ring_.await(r, name(e)); });
  }

 private:
  // Waits until `step` is here and returns its pieces.
  const std::vector<span<const std::byte>>& wait_for(std::int64_t step) {
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

  batch take(std::int64_t step, batch_assembly& assembly, const char* feed) {
    fill_piece(load_, step, shards_.first, shards_.count, capacity_, span<std::byte>(slot_));
    pieces_.assign(1, span<const std::byte>(slot_.data(), slot_.size()));
    return assembly.assemble(feed, step, pieces_);
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
