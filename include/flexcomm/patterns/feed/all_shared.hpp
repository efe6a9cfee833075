// all_shared: no producers. The trainers that receive a piece (one per member) take turns
// preprocessing it, one step each per round of M steps, and allgather the results (All-Shared).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "../../core/error.hpp"
#include "../../core/layout.hpp"
#include "../../backend/contract.hpp"
#include "vocabulary.hpp"
#include "agreement.hpp"
#include "../../backend/shm/feed/host_slots.hpp"
#include "step_source.hpp"
#include "wire.hpp"

namespace flexcomm {

// Round g covers steps [g*M, g*M + M) for M members; in it, member i's owner of piece c fills
// piece c of step g*M + i, and one allgather per piece gives every owner all M steps. Each
// step is thus preprocessed once, and work is spread evenly (a shard cannot be cut smaller,
// so the ensemble shares steps, not parts of a step). `depth` rounds are in flight.
// Where a piece's owners share one host (feed_options.shared_memory, backends with
// has_host_window), there is no allgather: each owner's loader writes its step into a slot of
// shared memory and the others read it in place (host_slots.hpp). A trainer takes its steps from
// a step_source (step_source.hpp) whose publishers are the members, one step each per round.
template <class B>
class all_shared : private detail::agreed_feed {
  static_assert(holds_host_memory<B>,
                "all_shared<B>: the loader writes each batch into host memory and trainers read it there, but B's "
                "buffers live in device memory; feed with a host backend (all_shared<mpi>) and copy the batch to the "
                "device in the trainer (presets with a device Sync backend do: their feed is on its host backend)");

 public:
  static constexpr bool needs_producers = false;
  // Producer ranks of the layout have nothing to do here.
  void produce() { check(!is_trainer(), "all_shared", "produce() is for producer ranks; this rank is a trainer"); }

  using communicator = typename B::communicator;

  // Collective over `world`; builds one communicator per piece in a fixed order.
  all_shared(const communicator& world, const ensemble_layout& layout, loader load, feed_options options);
  ~all_shared();
  all_shared(const all_shared&) = delete;
  all_shared& operator=(const all_shared&) = delete;

  // The next step of this trainer's shards, or nothing at the end of the stream.
  std::optional<batch> next();

  // The members preprocess for one another, so they advance together and none is ever
  // behind a shared stream: nothing is skipped under either flow-control policy.
  std::int64_t skipped() const noexcept { return 0; }
  bool is_trainer() const noexcept { return role_.kind == role::trainer; }
  // Whether some piece of this trainer's goes round in shared memory.
  bool shared_memory() const noexcept { return detail::any_shared(host_); }

 private:
  using source = detail::step_source<B>;

  void setup_host_slots();
  void setup_source();
  void post_free_rounds();
  void drain() noexcept;
  std::size_t rounds_in_flight() const {
    return static_cast<std::size_t>(std::max<std::int64_t>(1, std::min<std::int64_t>(options_.depth, rounds_)));
  }

  std::vector<communicator> comms_;  // per piece; empty where this rank takes no part
  int members_ = 1;
  std::int64_t rounds_ = 0;

  std::vector<detail::host_slots<B>> host_;  // per piece of this trainer: where its owners share a host
  detail::batch_assembly assembly_;          // this trainer's pieces, and its batches made of them
  source source_;
  std::int64_t next_round_ = 0, next_step_ = 0, lent_ = -1;
};

template <class B>
all_shared<B>::all_shared(const communicator& world, const ensemble_layout& layout, loader load,
                          feed_options options)
    // per-host producers idle here, as any producers
    : detail::agreed_feed(world, layout, std::move(load), options, false, "all_shared") {
  for (std::size_t c = 0; c < pieces_.size(); ++c) {
    const bool mine = role_.kind == role::trainer &&
                      pieces_[c].owner[static_cast<std::size_t>(role_.member)] == role_.rank_in_member;
    comms_.push_back(world.split(mine ? 0 : communicator::undefined, role_.member, cat("all_shared piece ", c)));
  }
  if (role_.kind != role::trainer) return;

  members_ = layout_.members();
  rounds_ = (options_.steps + members_ - 1) / members_;
  assembly_ = detail::batch_assembly(pieces_, layout_, role_, options_.shard_capacity);
  setup_host_slots();
  setup_source();
}

// Step s of round g = s / M is member s % M's, its piece i in that member's slot of the piece's
// shared memory, or in the round's allgather at member s % M's place.
template <class B>
void all_shared<B>::setup_source() {
  const std::size_t mine = assembly_.pieces().size();
  std::vector<std::vector<typename source::shared_piece>> shared(static_cast<std::size_t>(members_));
  std::vector<std::size_t> bytes;
  for (std::size_t i = 0; i < mine; ++i) bytes.push_back(assembly_.bytes(i));
  for (int m = 0; m < members_; ++m)
    for (std::size_t i = 0; i < mine; ++i)  // the owners' group has the members in order
      shared[static_cast<std::size_t>(m)].push_back({host_[i] ? &host_[i] : nullptr, m, 0});
  source_.setup(members_, std::move(shared), bytes, members_, rounds_in_flight(), [&](typename source::received& r) {
    for (std::size_t i = 0; i < mine; ++i) {
      const bool shared_memory = static_cast<bool>(host_[i]);  // then its slots are in shared memory
      r.outgoing.emplace_back(shared_memory ? 0 : bytes[i] + detail::guard_bytes);
      r.buffers.emplace_back(shared_memory ? 0 : bytes[i] * static_cast<std::size_t>(members_));
    }
  }, "all_shared: allgather of round ");
}

// Collective over each of this trainer's piece communicators, in piece order (as every owner
// takes them): shared slots for the pieces whose owners share one host.
template <class B>
void all_shared<B>::setup_host_slots() {
  const std::vector<int>& mine = assembly_.pieces();
  host_.resize(mine.size());
  if constexpr (has_host_window<B>) {
    if (options_.shared_memory == shared_memory_use::off || members_ < 2) return;
    for (std::size_t i = 0; i < mine.size(); ++i) {
      const communicator& owners = comms_[static_cast<std::size_t>(mine[i])];
      // The host map may pretend several hosts (FLEXCOMM_HOSTS); MPI has the last word.
      if (B::hosts(owners).hosts() != 1 || !B::host_window::on_one_host(owners)) continue;
      std::vector<int> ranks(static_cast<std::size_t>(owners.size()));
      for (int r = 0; r < owners.size(); ++r) ranks[static_cast<std::size_t>(r)] = owners.world_rank_of(r);
      host_[i] = detail::host_slots<B>(owners, true, rounds_in_flight(), assembly_.bytes(i) + detail::guard_bytes,
                                       std::move(ranks), cat("all_shared piece ", mine[i]));
    }
  } else {
    check(options_.shared_memory != shared_memory_use::on, "all_shared",
          "feed_options.shared_memory (FLEXCOMM_SHM) is on, but this backend has no shared memory");
  }
}

template <class B>
all_shared<B>::~all_shared() {
  if (role_.kind == role::trainer) drain();
}

// Preprocesses this trainer's step of every round whose slot is free, and starts its allgathers.
template <class B>
void all_shared<B>::post_free_rounds() {
  const std::vector<int>& mine = assembly_.pieces();
  for (; next_round_ < rounds_; ++next_round_) {
    const std::int64_t g = next_round_;
    auto* claimed = source_.claim(g);
    if (!claimed) return;  // still holds an earlier round
    auto& r = *claimed;
    const std::int64_t step = g * members_ + role_.member;
    for (std::size_t i = 0; i < mine.size(); ++i) {
      const auto& piece = pieces_[static_cast<std::size_t>(mine[i])];
      const auto& shared = host_[i];
      // The piece communicator's ranks are the members in order: this trainer is rank member.
      if (shared) shared.wait_free(g, cat("all_shared: allgather of round ", g));
      const span<std::byte> send =
          shared ? span<std::byte>(shared.slot(role_.member, g), assembly_.bytes(i) + detail::guard_bytes)
                 : span<std::byte>(r.outgoing[i]);
      if (step < options_.steps)
        detail::fill_piece(load_, step, piece.first_shard, piece.shards, options_.shard_capacity, send);
      else
        detail::empty_piece(step, piece.shards, send);  // past the end: nobody reads it
      if (shared) {
        shared.publish(g);
        continue;
      }
      const std::size_t bytes = send.size() - detail::guard_bytes;
      r.requests.push_back(B::template iallgather<std::uint8_t>(
          comms_[static_cast<std::size_t>(mine[i])],
          span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(send.data()), bytes),
          span<std::uint8_t>(reinterpret_cast<std::uint8_t*>(r.buffers[i].data()), r.buffers[i].size())));
    }
    source_.start(g, r);
  }
}

template <class B>
std::optional<batch> all_shared<B>::next() {
  check(role_.kind == role::trainer, "all_shared", "next() is for trainer ranks; this rank is a producer");
  if (lent_ >= 0) source_.release(lent_);  // a round is let go of with its last step
  lent_ = -1;
  if (next_step_ >= options_.steps) return std::nullopt;
  post_free_rounds();
  const batch out = source_.take(next_step_, assembly_, "all_shared");
  lent_ = next_step_++;
  return out;
}

// Takes part in every round left (preprocessing its share), so the other members can finish.
template <class B>
void all_shared<B>::drain() noexcept {
  try {
    lent_ = -1;
    source_.drain([&] { post_free_rounds(); });
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n(all_shared: while draining the stream in the destructor)\n", e.what());
  }
}

}  // namespace flexcomm
