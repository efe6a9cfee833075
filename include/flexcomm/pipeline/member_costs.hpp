// A "members=auto:N" layout planned on a world: from the user's relative hints, or from each
// member's step time measured in a short warm-up on the trainer ranks (core/member_plan.hpp).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "../core/agreement.hpp"
#include "../core/error.hpp"
#include "../core/layout.hpp"
#include "../core/member_plan.hpp"
#include "../core/reduce.hpp"
#include "../core/span.hpp"
#include "../backend/contract.hpp"

namespace flexcomm {

struct measure_options {
  int timed_steps = 3;  // steps timed per member, after one untimed (lazy set-up, caches)
  member_plan_options plan;
};

// Collective over `world` (the world the layout will run on): the ranks the plan gives the
// members, from the members' relative costs. The ranks agree on the layout, hints and options
// in one reduction first, so that no rank goes on with another plan.
template <class Communicator>
layout_plan plan_from_hints(const Communicator& world, const ensemble_layout& unplanned, std::vector<double> hints,
                            const member_plan_options& options = {});

// Collective over `world`: trainer t of the budget (the ranks that are not producers, in rank
// order) measures member t mod N, calling `step(member)` (one step of that member's whole batch
// on this rank alone) once untimed, then `timed_steps` times. A member's cost is the fastest of
// its measurers' means, the least disturbed by neighbours. The ranks first agree on the layout
// and options (one reduction), then share the times (one more), so every rank returns the same
// plan or throws; a rank whose step threw rethrows its own exception, the others name it.
template <class Communicator, class Step>
layout_plan measure_and_plan(const Communicator& world, const ensemble_layout& unplanned, Step&& step,
                             const measure_options& options = {});

namespace detail {

// This rank's index among the trainer ranks of the budget, or -1 for a producer.
inline int trainer_index(const ensemble_layout& layout, const host_map& hosts, int rank) {
  if (!layout.per_host()) return rank < layout.producers() ? -1 : rank - layout.producers();
  int index = 0;
  for (int r = 0; r < rank; ++r) index += hosts.leader_of(hosts.host_of(r)) != r;
  return hosts.leader_of(hosts.host_of(rank)) == rank ? -1 : index;
}

// Mean nanoseconds of `timed` calls of step(member), after one untimed call; at least 1.
template <class Step>
std::int64_t time_member(Step& step, int member, int timed) {
  step(member);
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < timed; ++i) step(member);
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start);
  return std::max<std::int64_t>(1, ns.count() / timed);
}

inline std::uint64_t bits_of(double v) {
  std::uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof bits);
  return bits;
}

// What every rank must share for the same plan: the layout's text, the timed steps, the model,
// the hints where given.
inline std::int64_t plan_fingerprint(const ensemble_layout& layout, const measure_options& options,
                                     const std::vector<double>& hints) {
  fingerprint f;
  f.add(layout.str()).add(static_cast<std::uint64_t>(options.timed_steps)).add(bits_of(options.plan.sync_share));
  for (double h : hints) f.add(bits_of(h));
  return f.add(hints.size()).folded();
}

// What is wrong here before anything is measured, or "" (the same on every rank that passes
// the same layout and options).
inline std::string plan_problem(const ensemble_layout& layout, const host_map& hosts, const measure_options& options) {
  try {
    check(options.timed_steps >= 1, "member plan", cat("timed_steps must be >= 1, got ", options.timed_steps));
    check(!layout.is_planned(), "member plan",
          cat("layout '", layout.str(), "' is planned already; only members=auto:N asks for a plan"));
    const int budget = layout.rank_budget(hosts), members = layout.members();
    check(budget >= members, "member plan",
          cat(members, " members need at least ", members, " ranks, one each; the budget is ", budget,
              " trainer ranks in a world of ", hosts.ranks()));
  } catch (const error& e) {
    return e.cause();
  }
  return "";
}

// Collective: every rank learns whether any rank found a problem or passed another layout or
// options, and throws the same verdict before anyone measures (agreement.hpp's way).
template <class Communicator>
void agree_on_plan(const Communicator& world, const ensemble_layout& layout, const measure_options& options,
                   const std::vector<double>& hints, const std::string& problem) {
  agreement a({problem.empty() ? 0 : 1, plan_fingerprint(layout, options, hints)});
  Communicator::backend::template iallreduce<std::int64_t>(world, a.buffer(), op::max).wait();
  if (!problem.empty()) fail("member plan", problem);
  check(a.highest(0) == 0, "member plan", "another rank rejected the layout or the options");
  check(a.agreed(1), "member plan",
        cat("ranks disagree on the layout, the options or the hints (this rank: '", layout.str(), "', ",
            options.timed_steps, " timed steps, sync share ", options.plan.sync_share, ", ", hints.size(),
            " hints)"));
}

}  // namespace detail

template <class Communicator, class Step>
layout_plan measure_and_plan(const Communicator& world, const ensemble_layout& unplanned, Step&& step,
                             const measure_options& options) {
  const host_map hosts = Communicator::backend::hosts(world);  // collective on every rank alike
  detail::agree_on_plan(world, unplanned, options, {}, detail::plan_problem(unplanned, hosts, options));
  const int members = unplanned.members(), t = detail::trainer_index(unplanned, hosts, world.rank());
  // [0] 1 + the highest rank whose step threw; then each member's nanoseconds, negated so that
  // the max-reduction keeps the fastest measurer's (a rank that measures nothing adds the lowest).
  std::vector<std::int64_t> slots(1 + static_cast<std::size_t>(members), std::numeric_limits<std::int64_t>::min());
  slots[0] = 0;
  std::exception_ptr thrown;
  if (t >= 0) try {
      slots[1 + static_cast<std::size_t>(t % members)] = -detail::time_member(step, t % members, options.timed_steps);
    } catch (...) {
      thrown = std::current_exception();
      slots[0] = world.rank() + 1;
    }
  Communicator::backend::template iallreduce<std::int64_t>(world, span<std::int64_t>(slots), op::max).wait();
  if (thrown) std::rethrow_exception(thrown);
  check(slots[0] == 0, "member plan",
        cat("world rank ", slots[0] - 1, "'s step threw while measuring its member (its own error says what)"));
  std::vector<double> costs;  // every member has a measurer: the budget holds a rank per member
  for (std::size_t m = 1; m < slots.size(); ++m) costs.push_back(static_cast<double>(-slots[m]) * 1e-9);
  layout_plan out = plan_layout(unplanned, unplanned.rank_budget(hosts), std::move(costs), options.plan);
  out.plan.measured = true;
  return out;
}

template <class Communicator>
layout_plan plan_from_hints(const Communicator& world, const ensemble_layout& unplanned, std::vector<double> hints,
                            const member_plan_options& options) {
  const host_map hosts = Communicator::backend::hosts(world);  // collective on every rank alike
  measure_options agreed;
  agreed.plan = options;
  detail::agree_on_plan(world, unplanned, agreed, hints, detail::plan_problem(unplanned, hosts, agreed));
  return plan_layout(unplanned, unplanned.rank_budget(hosts), std::move(hints), options);
}

}  // namespace flexcomm
