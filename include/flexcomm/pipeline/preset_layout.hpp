// The preset and the layout a job runs on, from what its user wrote: a preset's name and a
// layout's text (or only a member count). The layout is the user's own: the preset adds its
// fewest producers only where the text names none (the aggregator stays on its trainer), and
// producers or an aggregator the text names are kept, or refused saying why, never rewritten.
// Every refusal quotes the user's text, names the preset and says what the preset added:
//
//   layout 'members=2,1,1' with preset single_broadcast (which adds producers=1 and aggregator=1,
//   making 'producers=1 members=2,1,1 aggregator=1') needs 5 ranks, world has 4
//
// Plain data parallel runs whatever the preset: where the text names no producers and no
// aggregator (or there is no text) and the members fill the world, leaving no room for the
// producers the preset would add, the baseline runs instead (every trainer loads its own
// batches), and `note` says so in one line. Where the world has room for them, the preset runs.
// A layout whose members flexcomm sizes ("members=auto:N") comes back unplanned, with the
// preset's producers where it takes them: the caller plans it on the world.
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "../core/error.hpp"
#include "../core/layout.hpp"
#include "../core/setting_values.hpp"
#include "presets.hpp"

namespace flexcomm {
namespace presets {

struct choice {
  std::string preset;      // the preset that runs: the one asked for, or baseline (note says why)
  ensemble_layout layout;  // the layout it runs on
  std::string note;        // empty, or one line: which preset was asked for, which runs, and why
};

namespace detail {
// The producer counts preset `name` takes, fewest and most; an unknown name is an error.
inline std::pair<int, int> producers_taken(std::string_view name) {
  return presets::visit(name, "allreduce", [](auto p) {
    using P = decltype(p);
    return std::pair<int, int>(P::min_producers, P::max_producers);
  });
}

// What `to` has that the user's `from` did not: "producers=1 and aggregator=1", or "". An
// aggregator the user wrote moves with its trainer: "producers=1 and aggregator=3 for 2".
inline std::string added(const ensemble_layout& from, const ensemble_layout& to, bool aggregator_written) {
  if (from.per_host()) return "";  // kept as written (layout_for)
  std::string s = to.producers() != from.producers() ? cat("producers=", to.producers()) : "";
  if (to.aggregator() != from.aggregator())
    s += cat(s.empty() ? "" : " and ", "aggregator=", to.aggregator(),
             aggregator_written ? cat(" for ", from.aggregator(), ", the same trainer") : "");
  return s;
}

// Refuses producers the user wrote that preset `asked` does not take, naming the presets that do.
inline void check_named_producers(std::string_view text, const ensemble_layout& user, std::string_view asked,
                                  std::pair<int, int> taken, const char* what) {
  const bool per_host = user.per_host();
  const int p = per_host ? 0 : user.producers();
  if (per_host ? taken.second > 0 : p >= taken.first && p <= taken.second) return;
  std::string others;
  for (const char* n : names) {
    const auto t = producers_taken(n);
    if (per_host ? t.second > 0 : p >= t.first && p <= t.second) others += cat(others.empty() ? "" : ", ", n);
  }
  const std::string has = per_host ? std::string("puts a producer on each host") : cat("has ", p, " producers");
  fail(what, cat("layout '", text, "' ", has,
                 "; preset ", asked, " takes ", producers_text(taken.first, taken.second),
                 ", and a layout's own producers are kept as written (presets that take these: ", others, ")"));
}

// Said once where the baseline runs instead: `members` (the layout, or a count) fill the world.
inline std::string baseline_note(std::string_view asked, int producers, int needs, const std::string& members,
                                 int world) {
  return cat("preset ", asked, " asked for, baseline used: no room for ", asked, "'s ", producers, " producer",
             producers == 1 ? "" : "s", " beside ", members, " on ", world, " rank", world == 1 ? "" : "s",
             ", so every trainer loads its own batches (", asked, " runs from ", needs, " ranks)");
}

// No layout text: `members` members spread over the ranks after the preset's producers, the
// first members taking one rank more where they do not divide, the first trainer aggregating.
inline choice spread(std::string_view asked, int producers, int members, int world, const char* what) {
  const bool plain = producers > 0 && world >= members && world - producers < members;
  const int first = plain ? 0 : producers, trainers = world - first;
  check(trainers >= members, what,
        cat(world, " ranks, less ", asked, "'s producers (", producers, "), leave ", trainers,
            " to train, fewer than the ", members, " members (start ", producers + members,
            " ranks or more, or give a layout)"));
  std::vector<int> sizes;
  for (int m = 0; m < members; ++m) sizes.push_back(trainers / members + (m < trainers % members ? 1 : 0));
  if (!plain) return {std::string(asked), ensemble_layout(first, sizes, first), ""};
  return {"baseline", ensemble_layout(0, sizes, 0),
          baseline_note(asked, producers, producers + members, cat(members, " member", members == 1 ? "" : "s"),
                        world)};
}
// "members=auto:N" (flexcomm sizes the members): the preset's producers go in front where the text
// names none and the world has room for them beside one rank per member, the aggregator staying
// on its trainer; the result stays unplanned (interop::train_ensemble plans it from the
// members' costs; pipeline/member_costs.hpp).
inline choice unplanned(std::string_view asked, std::string_view text, const ensemble_layout& user,
                        std::pair<int, int> taken, int world, const char* what) {
  const int members = user.members();
  if (!user.wrote_producers() && !user.wrote_aggregator() && taken.first > 0 && world >= members &&
      world - taken.first < members)
    return {"baseline", user,
            baseline_note(asked, taken.first, taken.first + members, cat("layout '", text, "'"), world)};
  if (user.wrote_producers()) check_named_producers(text, user, asked, taken, what);
  const bool adds = !user.per_host() && user.producers() == 0 && taken.first > 0;
  const ensemble_layout run =
      adds ? ensemble_layout::parse(cat("producers=", taken.first, " members=auto:", members, " aggregator=",
                                        user.aggregator() + taken.first))
           : user;
  const int budget = run.per_host() ? world - 1 : world - run.producers();
  check(budget >= members, what,
        cat("layout '", text, "' with preset ", asked,
            adds ? cat(" (which adds producers=", taken.first, ", making '", run.str(), "')") : std::string(),
            " sizes ", members, " members from ", budget, " trainer ranks: each needs one at least (world has ",
            world, ")"));
  return {std::string(asked), run, ""};
}
}  // namespace detail

// The preset and layout to run on a world of `world_size` ranks: preset `asked` (a name of
// presets::names), the layout `text` (ensemble_layout::parse; empty: `members` members, 0
// meaning 1, spread over the ranks after the preset's producers), which must have `members`
// members when both are given. Errors are `what`'s, the same on every rank.
inline choice choose(std::string_view asked, std::string_view text, int members, int world_size,
                     const char* what = "presets::choose") {
  check(members >= 0, what, cat("an ensemble of ", members, " members"));
  const auto taken = detail::producers_taken(asked);
  if (text.empty()) return detail::spread(asked, taken.first, members > 0 ? members : 1, world_size, what);
  const auto user = ensemble_layout::parse(text);
  check(members == 0 || user.members() == members, what,
        cat("layout '", text, "' has ", user.members(), " members; the trainer asks for ", members));
  if (!user.is_planned()) return detail::unplanned(asked, text, user, taken, world_size, what);
  const bool names_producers = user.wrote_producers(), names_aggregator = user.wrote_aggregator();
  if (!names_producers && !names_aggregator && taken.first > 0 && user.world_size() == world_size) {
    const int needs = taken.first + world_size;
    return {"baseline", user, detail::baseline_note(asked, taken.first, needs, cat("layout '", text, "'"), world_size)};
  }
  if (names_producers) detail::check_named_producers(text, user, asked, taken, what);
  const auto run = presets::visit(asked, "allreduce", [&](auto p) { return decltype(p)::layout_for(user); });
  const std::string more = detail::added(user, run, names_aggregator);
  const std::string story = cat("layout '", text, "' with preset ", asked,
                                more.empty() ? "" : cat(" (which adds ", more, ", making '", run.str(), "')"));
  if (run.is_placed()) {
    check(run.world_size() == world_size, what,
          cat(story, " needs ", run.world_size(), " ranks, world has ", world_size));
  } else {
    check(world_size > run.trainers(), what,
          cat(story, " needs ", run.trainers(), " trainer ranks and a producer on each host, world has ", world_size));
  }
  return {std::string(asked), run, ""};
}

}  // namespace presets
}  // namespace flexcomm
