// The vocabulary every feed shares: the trainer's loader, the options, the flow-control policy
// and the batch a trainer gets from next(). local_feed, one_to_many and all_shared all speak it.
// How they move batches is beside it: step_source.hpp (where a trainer's next step lies: wait,
// take its pieces, release), host_slots.hpp (steps in shared memory on a host),
// steps_in_flight.hpp (steps as messages, polled by the progress engine), wire.hpp (a piece of a
// step on the wire, and a trainer's batch made of pieces) and agreement.hpp (options every rank
// must share).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

#include "../../core/error.hpp"
#include "../../core/hosts.hpp"
#include "../../core/span.hpp"

namespace flexcomm {

// Writes shard `shard` of step `step` into `out` and returns the bytes written (<= out.size()).
// Which rank calls it is the feed's business; it must give the same bytes wherever it runs.
using loader = std::function<std::size_t(std::int64_t step, int shard, span<std::byte> out)>;

// What a feed does when members train at different rates.
struct flow_control {
  enum class policy { lockstep, skip_ahead };
  policy kind = policy::lockstep;
  std::int64_t max_behind = 0;  // skip_ahead: a member more than this many steps behind skips

  // Every member receives every step; a slow member slows the producers (bounded buffering).
  static flow_control lockstep() { return {policy::lockstep, 0}; }
  // A member that finds more than `n` newer steps waiting skips to the newest; the skipped steps
  // are counted (feed.skipped()). Each trainer then buffers up to n + 3 batches.
  static flow_control skip_ahead(std::int64_t n) { return {policy::skip_ahead, n}; }
};

struct feed_options {
  std::int64_t steps = 0;          // the stream's length
  std::size_t shard_capacity = 0;  // the most bytes the loader may write for one shard
  int depth = 2;                   // batches in flight
  flow_control flow = flow_control::lockstep();
  // Whether a producer hands its steps to the trainers on its own host through shared memory
  // (backends with has_host_window): the loader writes a slot once and they read it in place.
  // automatic: wherever a producer shares a host with trainers it feeds; on: the same, and an
  // error where the backend has no shared memory; off: messages to every trainer (FLEXCOMM_SHM).
  shared_memory_use shared_memory = shared_memory_from_env();
};

// One step as a trainer sees it: its shards, concatenated. Valid until the next next().
// bytes() and every shard(i) start on an 8-byte boundary when every shard the loader wrote is a
// multiple of 8 bytes long (the feeds lay pieces out in 8-byte units); nothing more is promised,
// so a trainer that wants wider alignment (SIMD, a framework's tensors) copies, or uses
// typed_feed, whose tensors are 64-byte aligned (typed_batch.hpp).
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

}  // namespace flexcomm
