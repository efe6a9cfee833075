// Ranks per member from the members' step costs, for a "members=auto:N" layout: members that
// cost 10x more get more ranks, so that the ensemble's members step at an even pace.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "error.hpp"
#include "layout.hpp"

namespace flexcomm {

// How a member's step time is expected to change with its ranks: its one-rank step split over
// r ranks, plus the averaging of its gradients, which grows with r. The sync term is a share of
// the member's own cost so that relative hints and measured seconds plan alike (a member's
// gradients grow with its compute, roughly); measured times at several r can replace the model.
struct member_plan_options {
  // Each rank past the first adds this share of the member's one-rank step. 0: compute alone.
  double sync_share = 0.01;
};

// Expected time of one step on `ranks` ranks, in the unit of `cost` (one rank's whole step).
inline double expected_step_time(double cost, int ranks, const member_plan_options& options = {}) {
  return cost / ranks + options.sync_share * cost * (ranks - 1);
}

// The ranks each member gets, its cost (seconds per step on one rank, or a relative hint) and
// its expected step time on those ranks, by member index.
struct member_plan {
  std::vector<int> ranks;
  std::vector<double> costs;
  std::vector<double> expected;
  bool measured = false;  // costs in seconds (measured) rather than relative hints
  member_plan_options options;

  // What the aggregator prints once: what the numbers mean, then a line per member
  // ("member  ranks  cost  expected").
  std::string table() const;
};

// FLEET's greedy (Guan et al., MLSys 2020): every member starts at one rank, and each further
// rank goes to the member with the largest expected step time among those it speeds up; when a
// rank speeds up none (every member past its sync optimum), to the member it leaves fastest.
// Ties go to the lower member index, so every rank computes the same plan from the same costs.
// Throws for fewer ranks than members and for costs that are not finite and > 0.
member_plan plan_members(std::vector<double> costs, int budget, const member_plan_options& options = {});

// An unplanned layout ("members=auto:N") planned over `budget` trainer ranks
// (layout.rank_budget(world)), and the plan that sized it.
struct layout_plan {
  ensemble_layout layout;
  member_plan plan;

  // The planned layout's text, then the plan's table.
  std::string text() const { return cat("layout '", layout.str(), "' planned:\n", plan.table()); }
};
layout_plan plan_layout(const ensemble_layout& unplanned, int budget, std::vector<double> costs,
                        const member_plan_options& options = {});

namespace detail {

// Each member's cost: finite and > 0 (the plan's, and the hand-over's default target's).
inline void check_member_costs(const std::vector<double>& costs, const char* what) {
  for (std::size_t m = 0; m < costs.size(); ++m)
    check(std::isfinite(costs[m]) && costs[m] > 0, what,
          cat("member ", m, "'s cost is ", costs[m], "; a cost must be finite and > 0 (seconds per step on one rank, "
              "or a relative hint)"));
}

inline void check_plan_input(const std::vector<double>& costs, int budget, const member_plan_options& options) {
  check(!costs.empty(), "member plan", "no members to plan: the costs are empty");
  check(budget >= static_cast<long long>(costs.size()), "member plan",
        cat(costs.size(), " members need at least ", costs.size(), " ranks, one each; the budget is ", budget,
            " trainer ranks"));
  check_member_costs(costs, "member plan");
  check(std::isfinite(options.sync_share) && options.sync_share >= 0, "member plan",
        cat("sync_share is ", options.sync_share, "; it must be finite and >= 0"));
}

// The member the next rank goes to (see plan_members): a linear scan, members are few.
inline std::size_t next_rank_goes_to(const std::vector<int>& ranks, const std::vector<double>& costs,
                                     const member_plan_options& options) {
  std::size_t best = costs.size();
  double best_now = 0;
  for (std::size_t m = 0; m < costs.size(); ++m) {
    const double now = expected_step_time(costs[m], ranks[m], options);
    const double after = expected_step_time(costs[m], ranks[m] + 1, options);
    if (after < now && (best == costs.size() || now > best_now)) best = m, best_now = now;
  }
  if (best < costs.size()) return best;
  double best_after = 0;
  for (std::size_t m = 0; m < costs.size(); ++m) {
    const double after = expected_step_time(costs[m], ranks[m] + 1, options);
    if (best == costs.size() || after < best_after) best = m, best_after = after;
  }
  return best;
}

// A duration for the table: seconds with a unit where measured, else a plain relative number.
inline std::string plan_number(double v, bool seconds) {
  char buf[32];
  if (!seconds) std::snprintf(buf, sizeof buf, "%.3g", v);
  else if (v >= 1) std::snprintf(buf, sizeof buf, "%.3g s", v);
  else if (v >= 1e-3) std::snprintf(buf, sizeof buf, "%.3g ms", v * 1e3);
  else std::snprintf(buf, sizeof buf, "%.3g us", v * 1e6);
  return buf;
}

}  // namespace detail

inline member_plan plan_members(std::vector<double> costs, int budget, const member_plan_options& options) {
  detail::check_plan_input(costs, budget, options);
  member_plan plan;
  plan.ranks.assign(costs.size(), 1);
  for (long long left = budget - static_cast<long long>(costs.size()); left > 0; --left)
    ++plan.ranks[detail::next_rank_goes_to(plan.ranks, costs, options)];
  for (std::size_t m = 0; m < costs.size(); ++m)
    plan.expected.push_back(expected_step_time(costs[m], plan.ranks[m], options));
  plan.costs = std::move(costs);
  plan.options = options;
  return plan;
}

inline std::string member_plan::table() const {
  std::string s = cat(measured ? "cost: one step on one rank, measured" : "cost: relative, as hinted",
                      "; expected: one step on the member's ranks (sync share ", options.sync_share, ")\n",
                      "member  ranks        cost    expected\n");
  for (std::size_t m = 0; m < ranks.size(); ++m) {
    char line[96];
    std::snprintf(line, sizeof line, "%6zu  %5d  %10s  %10s\n", m, ranks[m],
                  detail::plan_number(costs[m], measured).c_str(), detail::plan_number(expected[m], measured).c_str());
    s += line;
  }
  return s;
}

inline layout_plan plan_layout(const ensemble_layout& unplanned, int budget, std::vector<double> costs,
                               const member_plan_options& options) {
  check(!unplanned.is_planned(), "member plan",
        cat("layout '", unplanned.str(), "' is planned already; only members=auto:N asks for a plan"));
  check(static_cast<int>(costs.size()) == unplanned.members(), "member plan",
        cat("layout '", unplanned.str(), "' has ", unplanned.members(), " members, got ", costs.size(), " costs"));
  member_plan plan = plan_members(std::move(costs), budget, options);
  return {unplanned.planned(plan.ranks), std::move(plan)};
}

}  // namespace flexcomm
