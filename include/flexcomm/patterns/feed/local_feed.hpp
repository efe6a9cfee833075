// local_feed: the baseline. Every trainer calls the loader for its own shards of every step,
// so an ensemble of K members preprocesses each batch K times; no communication at all. Its step
// source is the trainer's own loader filling its one piece (step_source.hpp: own_steps).
#pragma once

#include <cstddef>
#include <algorithm>
#include <cstdint>
#include <functional>
#include <optional>
#include <utility>
#include <vector>

#include "../../core/error.hpp"
#include "../../core/layout.hpp"
#include "../../backend/contract.hpp"
#include "vocabulary.hpp"
#include "agreement.hpp"
#include "step_source.hpp"
#include "wire.hpp"

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

  // The pipeline's seam for handing a finished member's ranks on (pipeline/handover.hpp): `each`
  // runs at the top of every next(), with the step about to be delivered (the stream's length at
  // its end), and may reshard() this trainer before that step is taken.
  void between_steps(std::function<void(std::int64_t step)> each) { between_ = std::move(each); }
  // From step `from` on, this trainer loads `shards` of each step: its share of the member it
  // trains now. Nothing here is shared, so every step is delivered once per member as long as
  // the member's ranks reshard alike at the same step (the pipeline's agreement).
  void reshard(shard_range shards, std::int64_t from);
  // The next step next() delivers.
  std::int64_t position() const noexcept { return next_step_; }

 private:
  local_feed(int rank, int size, const ensemble_layout& layout, loader load, feed_options options);

  feed_options options_;
  bool trainer_ = false;
  std::int64_t next_step_ = 0;
  loader load_;
  detail::own_steps source_;
  detail::batch_assembly assembly_;
  std::function<void(std::int64_t)> between_;
};

inline local_feed::local_feed(int rank, int size, const ensemble_layout& layout, loader load, feed_options options)
    : options_(options) {
  const std::string problem = detail::option_problem(options_);
  check(problem.empty(), "local_feed", problem);
  check(static_cast<bool>(load), "local_feed", "needs a loader");
  layout.validate(size);
  const rank_role r = layout.role_of(rank);
  trainer_ = r.kind == role::trainer;
  if (!trainer_) return;
  load_ = std::move(load);
  reshard(layout.shards_of(r.member, r.rank_in_member), 0);
}

inline void local_feed::reshard(shard_range shards, std::int64_t from) {
  check(trainer_, "local_feed", "reshard() is for trainer ranks; this rank is a producer");
  check(shards.count > 0 && from >= 0, "local_feed",
        cat("reshard() to ", shards.count, " shard(s) from step ", from, ": a trainer needs a shard and a step"));
  source_ = detail::own_steps(load_, shards, options_.shard_capacity);
  // One piece: every shard of this trainer's, as if one producer had sent them all.
  assembly_ =
      detail::batch_assembly({detail::piece{shards.first, shards.count, {}}}, {0}, shards, options_.shard_capacity);
  next_step_ = from;
}

inline std::optional<batch> local_feed::next() {
  check(trainer_, "local_feed", "next() is for trainer ranks; this rank is a producer");
  if (between_) between_(std::min(next_step_, options_.steps));
  if (next_step_ >= options_.steps) return std::nullopt;
  const std::int64_t step = next_step_++;
  return source_.take(step, assembly_, "local_feed");
}

}  // namespace flexcomm
