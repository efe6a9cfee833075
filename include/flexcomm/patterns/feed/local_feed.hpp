// local_feed: the baseline. Every trainer calls the loader for its own shards of every step,
// so an ensemble of K members preprocesses each batch K times; no communication at all.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "../../core/error.hpp"
#include "../../core/layout.hpp"
#include "../../backend/contract.hpp"
#include "vocabulary.hpp"
#include "wire.hpp"
#include "agreement.hpp"

namespace flexcomm {

class local_feed {
 public:
  static constexpr bool needs_producers = false;

  // Takes any communicator (only its rank and size are read): nothing crosses ranks, except
  // that a per-host layout not yet placed is placed on the hosts of `world` (collective).
  template <class Communicator>
  local_feed(const Communicator& world, const ensemble_layout& layout, loader load, feed_options options)
      : local_feed(world.rank(), world.size(), detail::placed_for(world, layout, "local_feed"), std::move(load),
                   options) {}

  // Producer ranks have nothing to do: the trainers preprocess for themselves.
  void produce() { check(!trainer_, "local_feed", "produce() is for producer ranks; this rank is a trainer"); }

  // The next step of this trainer's shards, or nothing at the end of the stream.
  std::optional<batch> next();

  // Members never wait for one another here, so none falls behind a shared stream.
  std::int64_t skipped() const noexcept { return 0; }
  bool is_trainer() const noexcept { return trainer_; }

 private:
  local_feed(int rank, int size, const ensemble_layout& layout, loader load, feed_options options);

  loader load_;
  feed_options options_;
  bool trainer_ = false;
  shard_range shards_;
  std::int64_t next_step_ = 0;
  std::vector<std::byte> slot_;
  std::vector<std::size_t> offsets_;
};

inline local_feed::local_feed(int rank, int size, const ensemble_layout& layout, loader load, feed_options options)
    : load_(std::move(load)), options_(options) {
  const std::string problem = detail::option_problem(options_);
  check(problem.empty(), "local_feed", problem);
  check(static_cast<bool>(load_), "local_feed", "needs a loader");
  layout.validate(size);
  const rank_role r = layout.role_of(rank);
  trainer_ = r.kind == role::trainer;
  if (!trainer_) return;
  shards_ = layout.shards_of(r.member, r.rank_in_member);
  slot_.resize(detail::piece_bytes(shards_.count, options_.shard_capacity) + detail::guard_bytes);
  offsets_.resize(static_cast<std::size_t>(shards_.count) + 1);
}

inline std::optional<batch> local_feed::next() {
  check(trainer_, "local_feed", "next() is for trainer ranks; this rank is a producer");
  if (next_step_ >= options_.steps) return std::nullopt;
  const std::int64_t step = next_step_++;
  detail::fill_piece(load_, step, shards_.first, shards_.count, options_.shard_capacity, span<std::byte>(slot_));
  const span<const std::byte> slot(slot_.data(), slot_.size());
  const std::uint64_t* sizes = detail::read_piece("local_feed", slot, step, shards_.count, options_.shard_capacity);
  offsets_[0] = 0;
  for (int i = 0; i < shards_.count; ++i) offsets_[static_cast<std::size_t>(i) + 1] = offsets_[static_cast<std::size_t>(i)] + sizes[i];
  return batch(step, shards_.first, detail::piece_payload(slot, shards_.count), offsets_.data(), shards_.count);
}

}  // namespace flexcomm
