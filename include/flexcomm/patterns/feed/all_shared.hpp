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
#include "../../core/progress.hpp"
#include "../../core/trace.hpp"
#include "../../backend/contract.hpp"
#include "vocabulary.hpp"
#include "pump.hpp"
#include "ring.hpp"
#include "wire.hpp"
#include "agreement.hpp"
#include "host_slots.hpp"

namespace flexcomm {

// Round g covers steps [g*M, g*M + M) for M members; in it, member i's owner of piece c fills
// piece c of step g*M + i, and one allgather per piece gives every owner all M steps. Each
// step is thus preprocessed once, and work is spread evenly (a shard cannot be cut smaller,
// so the ensemble shares steps, not parts of a step). `depth` rounds are in flight.
// Where a piece's owners share one host (feed_options.shared_memory, backends with
// has_host_window), there is no allgather: each owner's loader writes its step into a slot of
// shared memory and the others read it in place (feed/host_slots.hpp).
template <class B>
class all_shared {
  static_assert(holds_host_memory<B>,
                "all_shared<B>: the loader writes each batch into host memory and trainers read it there, but B's "
                "buffers live in device memory; feed with a host backend (all_shared<mpi>) and copy the batch to the "
                "device in the trainer (presets with a device Sync backend do: their feed is on its host backend)");

 public:
  static constexpr bool needs_producers = false;
  using communicator = typename B::communicator;

  // Collective over `world`; builds one communicator per piece in a fixed order.
  all_shared(const communicator& world, const ensemble_layout& layout, loader load, feed_options options);
  ~all_shared();
  all_shared(const all_shared&) = delete;
  all_shared& operator=(const all_shared&) = delete;

  // Producer ranks of the layout have nothing to do here.
  void produce() { check(!is_trainer(), "all_shared", "produce() is for producer ranks; this rank is a trainer"); }

  // The next step of this trainer's shards, or nothing at the end of the stream.
  std::optional<batch> next();

  // The members preprocess for one another, so they advance together and none is ever
  // behind a shared stream: nothing is skipped under either flow-control policy.
  std::int64_t skipped() const noexcept { return 0; }
  bool is_trainer() const noexcept { return role_.kind == role::trainer; }
  // Whether some piece of this trainer's goes round in shared memory.
  bool shared_memory() const noexcept {
    for (const auto& h : host_)
      if (h) return true;
    return false;
  }

 private:
  using request = typename B::request;

  struct round : detail::in_flight<request> {
    std::vector<std::vector<std::byte>> send, recv;  // per piece of this trainer
  };

  void post_free_rounds();
  void drain() noexcept;
  void setup_host_slots();
  std::size_t piece_size(std::size_t i) const {
    return detail::piece_bytes(pieces_[static_cast<std::size_t>(my_pieces_[i])].shards, options_.shard_capacity);
  }

  ensemble_layout layout_;
  loader load_;
  feed_options options_;
  rank_role role_;
  std::vector<detail::piece> pieces_;
  std::vector<communicator> comms_;  // per piece; empty where this rank takes no part
  std::vector<int> my_pieces_;
  shard_range shards_;
  int members_ = 1;
  std::int64_t rounds_ = 0;

  std::vector<detail::host_slots<B>> host_;  // per piece of this trainer: where its owners share a host
  detail::pump<round> pump_;
  detail::batch_ring<round> ring_;
  std::int64_t next_round_ = 0, next_step_ = 0, lent_round_ = -1;
  detail::batch_storage batch_;
};

template <class B>
all_shared<B>::all_shared(const communicator& world, const ensemble_layout& layout, loader load,
                          feed_options options)
    : layout_(layout), load_(std::move(load)), options_(options) {
  std::string problem = detail::option_problem(options_);
  try {
    layout_.validate(world.size());
    if (problem.empty() && !load_) problem = "needs a loader";
  } catch (const error& e) {
    problem = e.cause();
  }
  detail::agree<B>(world, layout_, options_, problem, "all_shared");
  layout_ = detail::placed_for(world, layout_, "all_shared");  // per-host producers idle here, as any producers

  role_ = layout_.role_of(world.rank());
  pieces_ = detail::pieces_of(layout_);
  for (std::size_t c = 0; c < pieces_.size(); ++c) {
    const bool mine = role_.kind == role::trainer &&
                      pieces_[c].owner[static_cast<std::size_t>(role_.member)] == role_.rank_in_member;
    comms_.push_back(world.split(mine ? 0 : communicator::undefined, role_.member, cat("all_shared piece ", c)));
  }
  if (role_.kind != role::trainer) return;

  members_ = layout_.members();
  rounds_ = (options_.steps + members_ - 1) / members_;
  my_pieces_ = detail::pieces_of_trainer(pieces_, role_.member, role_.rank_in_member);
  shards_ = layout_.shards_of(role_.member, role_.rank_in_member);
  batch_.offsets.resize(static_cast<std::size_t>(shards_.count) + 1);
  const auto rounds_in_flight = static_cast<std::size_t>(std::max<std::int64_t>(1, std::min<std::int64_t>(options_.depth, rounds_)));
  setup_host_slots();
  ring_ = detail::batch_ring<round>(rounds_in_flight, [&](round& r) {
    for (std::size_t i = 0; i < my_pieces_.size(); ++i) {
      const bool shared = static_cast<bool>(host_[i]);  // then its slots are in shared memory
      r.send.emplace_back(shared ? 0 : piece_size(i) + detail::guard_bytes);
      r.recv.emplace_back(shared ? 0 : piece_size(i) * static_cast<std::size_t>(members_));
    }
  });
}

// Collective over each of this trainer's piece communicators, in piece order (as every owner
// takes them): shared slots for the pieces whose owners share one host.
template <class B>
void all_shared<B>::setup_host_slots() {
  host_.resize(my_pieces_.size());
  if constexpr (has_host_window<B>) {
    if (options_.shared_memory == shared_memory_use::off || members_ < 2) return;
    const auto rounds_in_flight = static_cast<std::size_t>(std::max<std::int64_t>(1, std::min<std::int64_t>(options_.depth, rounds_)));
    for (std::size_t i = 0; i < my_pieces_.size(); ++i) {
      const communicator& owners = comms_[static_cast<std::size_t>(my_pieces_[i])];
      // The host map may pretend several hosts (FLEXCOMM_HOSTS); MPI has the last word.
      if (B::hosts(owners).hosts() != 1 || !B::host_window::on_one_host(owners)) continue;
      std::vector<int> ranks(static_cast<std::size_t>(owners.size()));
      for (int r = 0; r < owners.size(); ++r) ranks[static_cast<std::size_t>(r)] = owners.world_rank_of(r);
      host_[i] = detail::host_slots<B>(owners, true, rounds_in_flight, piece_size(i) + detail::guard_bytes,
                                       std::move(ranks), cat("all_shared piece ", my_pieces_[i]));
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
  while (next_round_ < rounds_) {
    const std::int64_t g = next_round_;
    if (!ring_.claim(g)) return;  // still holds an earlier round
    round& r = ring_.at(g);
    r.clear();
    const std::int64_t step = g * members_ + role_.member;
    for (std::size_t i = 0; i < my_pieces_.size(); ++i) {
      const auto& piece = pieces_[static_cast<std::size_t>(my_pieces_[i])];
      const auto& shared = host_[i];
      // The piece communicator's ranks are the members in order: this trainer is rank member.
      if (shared) shared.wait_free(g, cat("all_shared: allgather of round ", g));
      const span<std::byte> send = shared ? span<std::byte>(shared.slot(role_.member, g), piece_size(i) + detail::guard_bytes)
                                          : span<std::byte>(r.send[i]);
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
          comms_[static_cast<std::size_t>(my_pieces_[i])],
          span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(send.data()), bytes),
          span<std::uint8_t>(reinterpret_cast<std::uint8_t*>(r.recv[i].data()), r.recv[i].size())));
    }
    pump_.add(ring_.shared(g), cat("all_shared: allgather of round ", g));
    ++next_round_;
  }
}

template <class B>
std::optional<batch> all_shared<B>::next() {
  check(role_.kind == role::trainer, "all_shared", "next() is for trainer ranks; this rank is a producer");
  if (lent_round_ >= 0 && lent_round_ != next_step_ / members_) {
    for (const auto& shared : host_)
      if (shared) shared.release(lent_round_);
    ring_.release(lent_round_);
    lent_round_ = -1;
  }
  if (next_step_ >= options_.steps) return std::nullopt;
  trace::span traced(trace::names::feed_wait, next_step_, "step", "feed");
  post_free_rounds();
  const std::int64_t step = next_step_, g = step / members_;
  check(ring_.holder(g) == g, "all_shared", cat("round ", g, " was never posted"));
  round& r = ring_.at(g);
  pump_.await(r, cat("all_shared: allgather of round ", g));
  std::size_t shard = 0;
  batch_.offsets[0] = 0;
  if (my_pieces_.size() > 1) batch_.bytes.clear();
  for (std::size_t i = 0; i < my_pieces_.size(); ++i) {
    const int shards = pieces_[static_cast<std::size_t>(my_pieces_[i])].shards;
    const std::size_t bytes = piece_size(i);
    const int from = static_cast<int>(step % members_);  // the member whose turn the step was
    const auto& shared = host_[i];
    if (shared) shared.wait_arrived(from, g, cat("all_shared: allgather of round ", g));
    const span<const std::byte> slot(shared ? shared.slot(from, g) : r.recv[i].data() + static_cast<std::size_t>(from) * bytes,
                                     bytes);
    const std::uint64_t* sizes = detail::read_piece("all_shared", slot, step, shards, options_.shard_capacity);
    std::size_t total = 0;
    for (int k = 0; k < shards; ++k, ++shard) {
      batch_.offsets[shard + 1] = batch_.offsets[shard] + sizes[k];
      total += sizes[k];
    }
    const std::byte* payload = detail::piece_payload(slot, shards);
    if (my_pieces_.size() == 1) {
      batch_.data = payload;
    } else {
      batch_.bytes.insert(batch_.bytes.end(), payload, payload + total);
      batch_.data = batch_.bytes.data();
    }
  }
  lent_round_ = g;
  ++next_step_;
  return batch(step, shards_.first, batch_.data, batch_.offsets.data(), shards_.count);
}

// Takes part in every round left (preprocessing its share), so the other members can finish.
template <class B>
void all_shared<B>::drain() noexcept {
  try {
    lent_round_ = -1;
    for (const auto& shared : host_)
      if (shared) shared.leave();  // the others never wait for this trainer's reading again
    ring_.drain([&] { post_free_rounds(); },
                [&](round& r, std::int64_t g) { pump_.await(r, cat("all_shared: allgather of round ", g)); });
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n(all_shared: while draining the stream in the destructor)\n", e.what());
  }
}

}  // namespace flexcomm
