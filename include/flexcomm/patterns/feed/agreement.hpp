// What every rank of a feed must share (layout, steps, capacities, flow policy), checked in one
// reduction at construction so that a mismatch is an error on every rank, never a hang.
#pragma once

#include <cstdint>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "../../core/agreement.hpp"
#include "../../core/error.hpp"
#include "../../core/layout.hpp"
#include "../../core/reduce.hpp"
#include "../../core/span.hpp"
#include "../../backend/contract.hpp"
#include "vocabulary.hpp"
#include "wire.hpp"

namespace flexcomm {
namespace detail {

// Options every rank must agree on, as numbers a reduction can compare: whether this rank
// rejected them first, then the options, then the layout's fingerprint (its text and, for a
// per-host layout, its placement).
inline std::vector<std::int64_t> agreement_key(bool rejected, const ensemble_layout& layout, const feed_options& o) {
  fingerprint f;
  f.add(layout.str());
  if (layout.per_host()) {
    f.add(layout.is_placed() ? 1 : 2);
    if (layout.is_placed())
      for (int m = 0; m < layout.members(); ++m)
        for (int r : layout.member_ranks(m)) f.add(static_cast<std::uint64_t>(r));
  }
  return {rejected ? 1 : 0, o.steps, static_cast<std::int64_t>(o.shard_capacity), o.depth,
          static_cast<std::int64_t>(o.flow.kind), o.flow.max_behind, f.folded(),
          static_cast<std::int64_t>(o.shared_memory), o.hand_over ? 1 : 0};
}

// What is wrong with these options on their own, or "" (the same answer on every rank).
inline std::string option_problem(const feed_options& o) {
  if (o.steps < 0) return cat("steps must be >= 0, got ", o.steps);
  if (o.shard_capacity == 0) return "shard_capacity must be > 0";
  if (o.shard_capacity > (std::size_t{1} << 30)) return cat("shard_capacity ", o.shard_capacity, " exceeds 1 GiB");
  if (o.depth < 1) return cat("depth must be >= 1, got ", o.depth);
  if (o.flow.kind == flow_control::policy::skip_ahead && o.flow.max_behind < 0)
    return cat("skip_ahead needs n >= 0, got ", o.flow.max_behind);
  return "";
}

// Collective over `world`: every rank learns whether any rank rejected the layout or options,
// or whether ranks passed different ones, and throws the same verdict (no rank is left waiting).
template <class B>
void agree(const typename B::communicator& world, const ensemble_layout& layout, const feed_options& options,
           const std::string& local_problem, const char* feed) {
  agreement a(agreement_key(!local_problem.empty(), layout, options));
  B::template iallreduce<std::int64_t>(world, a.buffer(), op::max).wait();
  if (!local_problem.empty()) fail(feed, local_problem);
  check(a.highest(0) == 0, feed, "another rank rejected the layout or the feed options");
  static const char* names[] = {"",           "steps",  "shard_capacity",
                                "depth",      "flow policy", "skip_ahead n",
                                "layout",     "shared_memory (FLEXCOMM_SHM)", "hand_over"};
  for (std::size_t i = 1; i < std::size(names); ++i)
    check(a.agreed(i), feed,
          cat("ranks disagree on ", names[i], i == 6 ? cat(" (this rank: '", layout.str(), "')") : cat(
                  ": values range from ", a.lowest(i), " to ", a.highest(i))));
}

// What every feed with communication does first, collective over `world`: checks the layout and
// options here, agrees on them with every rank (one verdict everywhere), and returns the layout
// as it runs (a per-host one placed on world's hosts).
template <class B>
ensemble_layout agreed_layout(const typename B::communicator& world, const ensemble_layout& layout, const loader& load,
                              const feed_options& options, bool needs_producers, const char* feed) {
  std::string problem = option_problem(options);
  try {
    layout.validate(world.size());
    if (needs_producers) layout.require_producers(feed);
    if (problem.empty() && !load) problem = "needs a loader";
  } catch (const error& e) {
    problem = e.cause();
  }
  agree<B>(world, layout, options, problem, feed);
  return placed_for(world, layout, feed);  // the same on every rank, or the same error
}

// What a feed over several ranks starts from, agreed by every rank at construction (collective
// over `world`): the layout (validated, placed), the loader, the options, this rank's role and
// the pieces a step is cut into. one_to_many and all_shared derive from it.
struct agreed_feed {
  template <class Communicator>
  agreed_feed(const Communicator& world, const ensemble_layout& layout, loader load, const feed_options& options,
              bool needs_producers, const char* feed)
      : layout_(agreed_layout<typename Communicator::backend>(world, layout, load, options, needs_producers, feed)),
        load_(std::move(load)),
        options_(options),
        role_(layout_.role_of(world.rank())),
        pieces_(pieces_of(layout_)) {}

  ensemble_layout layout_;
  loader load_;
  feed_options options_;
  rank_role role_;
  std::vector<piece> pieces_;
};

}  // namespace detail
}  // namespace flexcomm
