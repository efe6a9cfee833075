// The vocabulary every feed shares: the trainer's loader, the options and the flow-control
// policy. local_feed, one_to_many and all_shared all speak it. How they move batches is beside
// it: step_source.hpp (the batch a trainer gets from next(), and where its next step lies: wait,
// assemble it from its pieces, release), host_slots.hpp (steps in shared memory on a host),
// steps_in_flight.hpp (steps as messages, polled by the progress engine), wire.hpp (a piece of a
// step on the wire) and agreement.hpp (options every rank must share).
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
  // Whether a member's split may change mid-stream (ensemble_pipeline::on_handover sets it):
  // one_to_many then makes the communicator a changed split's steps travel on.
  bool hand_over = false;
};

}  // namespace flexcomm
