#define BOOST_TEST_MODULE layout
#include <boost/test/unit_test.hpp>

#include "errors.hpp"

#include <flexcomm/core/layout.hpp>
#include <flexcomm/core/member_plan.hpp>

#include <cmath>
#include <limits>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

namespace fc = flexcomm;

namespace {
using fc::testing::contains;
using fc::testing::error_of;
}  // namespace

BOOST_AUTO_TEST_CASE(homogeneous_members_follow_producers) {
  const auto l = fc::ensemble_layout::parse("producers=1 members=4x2");
  BOOST_TEST(l.producers() == 1);
  BOOST_TEST(l.members() == 4);
  BOOST_TEST(l.world_size() == 9);
  BOOST_TEST(l.homogeneous());
  BOOST_TEST((l.role_of(0).kind == fc::role::producer));
  const auto r = l.role_of(4);
  BOOST_TEST(r.member == 1);
  BOOST_TEST(r.rank_in_member == 1);
  BOOST_TEST(l.trainer_rank(3, 1) == 8);
  BOOST_TEST(l.str() == "producers=1 members=4x2");
}

BOOST_AUTO_TEST_CASE(heterogeneous_members_and_aggregator) {
  const auto l = fc::ensemble_layout::parse("  members=2,2,4   aggregator=3 producers=2");
  BOOST_TEST(l.member_sizes() == (std::vector<int>{2, 2, 4}));
  BOOST_TEST(l.world_size() == 10);
  BOOST_TEST(!l.homogeneous());
  BOOST_TEST(l.aggregator() == 3);
  BOOST_TEST(l.role_of(9).member == 2);
  BOOST_TEST(l.role_of(9).rank_in_member == 3);
  BOOST_TEST(fc::ensemble_layout::parse(l.str()).str() == l.str());
}

BOOST_AUTO_TEST_CASE(every_rank_has_exactly_one_role) {
  const auto l = fc::ensemble_layout::parse("producers=3 members=1,3,2");
  int producers = 0;
  std::vector<int> seen(3, 0);
  for (int r = 0; r < l.world_size(); ++r) {
    const auto role = l.role_of(r);
    if (role.kind == fc::role::producer) {
      BOOST_TEST(l.producer_rank(role.producer) == r);
      ++producers;
    } else {
      BOOST_TEST(l.trainer_rank(role.member, role.rank_in_member) == r);
      ++seen[static_cast<std::size_t>(role.member)];
    }
  }
  BOOST_TEST(producers == 3);
  BOOST_TEST(seen == l.member_sizes());
}

BOOST_AUTO_TEST_CASE(validation_says_what_is_wrong) {
  const auto l = fc::ensemble_layout::parse("producers=1 members=4x2");
  BOOST_TEST(contains(error_of([&] { l.validate(8); }), "needs 9 ranks, world has 8"));
  BOOST_TEST(error_of([&] { l.validate(9); }).empty());
  BOOST_TEST(contains(error_of([] { fc::ensemble_layout::parse("members=0x2"); }), "at least one member"));
  BOOST_TEST(contains(error_of([] { fc::ensemble_layout::parse("members=2,0"); }), "member 1 has 0 ranks"));
  BOOST_TEST(contains(error_of([] { fc::ensemble_layout::parse("producers=2"); }), "members=... is missing"));
  BOOST_TEST(contains(error_of([] { fc::ensemble_layout::parse("members=2x"); }), "member size is empty"));
  BOOST_TEST(contains(error_of([] { fc::ensemble_layout::parse("members=a,2"); }), "is not a number"));
  BOOST_TEST(contains(error_of([] { fc::ensemble_layout::parse("members=2 workers=3"); }), "unknown key 'workers'"));
  BOOST_TEST(contains(error_of([] { fc::ensemble_layout::parse("members"); }), "expected key=value"));
  BOOST_TEST(contains(error_of([] { fc::ensemble_layout::parse("members=2 members=3"); }), "given twice"));
  BOOST_TEST(contains(error_of([] { fc::ensemble_layout::parse("members=99999999999x2"); }), "exceeds"));
  BOOST_TEST(contains(error_of([] { fc::ensemble_layout::parse("members=1000000x1000000"); }), "too many"));
  BOOST_TEST(contains(error_of([] { fc::ensemble_layout::parse("members=2 aggregator=2"); }), "aggregator is world rank 2"));
  // Read as a count ("one aggregator"), aggregator= would be out of range here: say what it is.
  BOOST_TEST(contains(error_of([] { fc::ensemble_layout::parse("producers=1 members=1 aggregator=2"); }),
                      "aggregator= names the world rank that gathers results, unlike producers=, a count"));
  BOOST_TEST(contains(error_of([] { fc::ensemble_layout::parse("members=2").require_producers("one_to_many"); }),
                      "one_to_many: this feed needs producer ranks"));
}

// What the text wrote, apart from what it means: "producers=0" is written, a layout built in
// code writes nothing (a preset keeps what the user wrote: presets::choose).
BOOST_AUTO_TEST_CASE(the_parse_records_which_items_the_text_wrote) {
  const auto members_only = fc::ensemble_layout::parse("members=2,1");
  BOOST_TEST((!members_only.wrote_producers() && !members_only.wrote_aggregator()));
  const auto zero = fc::ensemble_layout::parse("\tproducers=0 members=2 aggregator=0");
  BOOST_TEST((zero.wrote_producers() && zero.wrote_aggregator()));
  const auto per_host = fc::ensemble_layout::parse("members=2 producers=per-host");
  BOOST_TEST((per_host.wrote_producers() && !per_host.wrote_aggregator()));
  const fc::ensemble_layout built(1, {2}, 1);
  BOOST_TEST((!built.wrote_producers() && !built.wrote_aggregator()));
}

BOOST_AUTO_TEST_CASE(environment_variable_overrides_the_fallback) {
  ::setenv("FLEXCOMM_LAYOUT", "producers=2 members=3x1", 1);
  BOOST_TEST(fc::ensemble_layout::from_env("members=1").world_size() == 5);
  ::unsetenv("FLEXCOMM_LAYOUT");
  BOOST_TEST(fc::ensemble_layout::from_env("members=1").world_size() == 1);
}

BOOST_AUTO_TEST_CASE(a_step_has_lcm_shards_and_each_trainer_a_contiguous_share) {
  const auto l = fc::ensemble_layout::parse("producers=1 members=2,3");
  BOOST_TEST(l.shards_per_step() == 6);
  BOOST_TEST(l.shards_of(0, 1).first == 3);
  BOOST_TEST(l.shards_of(0, 1).count == 3);
  BOOST_TEST(l.shards_of(1, 2).first == 4);
  BOOST_TEST(l.shards_of(1, 2).count == 2);
  BOOST_TEST(l.owner_of(0, 2) == 0);
  BOOST_TEST(l.owner_of(1, 2) == 1);
  BOOST_TEST(fc::ensemble_layout::parse("members=4x1").shards_per_step() == 1);
  BOOST_TEST(contains(error_of([&] { l.shards_of(1, 3); }), "member 1 has ranks 0..2"));
}

namespace {
// Every member's world ranks, member by member, and the producers' world ranks.
std::vector<std::vector<int>> members_of(const fc::ensemble_layout& l) {
  std::vector<std::vector<int>> out;
  for (int m = 0; m < l.members(); ++m) out.push_back(l.member_ranks(m));
  return out;
}
std::vector<int> producers_of(const fc::ensemble_layout& l) {
  std::vector<int> out;
  for (int p = 0; p < l.producers(); ++p) out.push_back(l.producer_rank(p));
  return out;
}
// The number of hosts member m's ranks are on.
int hosts_spanned(const fc::ensemble_layout& l, const fc::host_map& hosts, int m) {
  std::vector<int> seen;
  for (int r : l.member_ranks(m))
    if (std::find(seen.begin(), seen.end(), hosts.host_of(r)) == seen.end()) seen.push_back(hosts.host_of(r));
  return static_cast<int>(seen.size());
}
// Every rank has exactly one role, the tables agree with one another, and each trainer's
// producer is its host's lowest rank.
bool consistent(const fc::ensemble_layout& l, const fc::host_map& hosts) {
  bool ok = l.world_size() == hosts.ranks() && l.producers() == hosts.hosts();
  for (int r = 0; r < l.world_size(); ++r) {
    const auto role = l.role_of(r);
    if (role.kind == fc::role::producer) {
      ok = ok && l.producer_rank(role.producer) == r && r == hosts.leader_of(hosts.host_of(r));
    } else {
      ok = ok && l.trainer_rank(role.member, role.rank_in_member) == r;
      const int p = l.producer_for(role.member, role.rank_in_member, 7);
      ok = ok && l.producer_rank(p) == hosts.leader_of(hosts.host_of(r));
      for (int q = 0; q < l.producers(); ++q) ok = ok && l.feeds(q, role.member, role.rank_in_member) == (q == p);
    }
  }
  return ok;
}
}  // namespace

BOOST_AUTO_TEST_CASE(per_host_parses_prints_back_and_is_not_placed_yet) {
  const auto l = fc::ensemble_layout::parse("members=2,1 producers=per-host");
  BOOST_TEST(l.per_host());
  BOOST_TEST(!l.is_placed());
  BOOST_TEST(l.str() == "producers=per-host members=2,1");
  BOOST_TEST(fc::ensemble_layout::parse(l.str()).str() == l.str());
  BOOST_TEST(fc::ensemble_layout::parse("producers=per-host members=3x2 aggregator=4").str() ==
             "producers=per-host members=3x2 aggregator=4");
  BOOST_TEST(fc::ensemble_layout(fc::producers_per_host, {2, 2}).str() == "producers=per-host members=2x2");
  BOOST_TEST(l.trainers() == 3);
  BOOST_TEST(l.shards_per_step() == 2);
  BOOST_TEST(error_of([&] { l.require_producers("one_to_many"); }).empty());
  // What depends on the hosts says so.
  const std::pair<std::string, std::string> unplaced[] = {
      {error_of([&] { l.world_size(); }), "its world size"},
      {error_of([&] { l.role_of(0); }), "the role of a rank"},
      {error_of([&] { l.trainer_rank(0, 0); }), "the rank of a trainer"},
      {error_of([&] { l.producers(); }), "its producer count"},
      {error_of([&] { l.producer_for(0, 0, 0); }), "which producer feeds a trainer"},
  };
  for (const auto& [e, what] : unplaced) BOOST_TEST(contains(e, "is not placed yet: " + what), e);
  // Unplaced, validation checks what no host map changes: a producer beside the trainers.
  BOOST_TEST(error_of([&] { l.validate(4); }).empty());
  BOOST_TEST(contains(error_of([&] { l.validate(3); }), "needs 3 trainer ranks and a producer on each host, world has 3"));
  BOOST_TEST(contains(error_of([] { fc::ensemble_layout::parse("producers=per-node members=2"); }),
                      "producers (a count or per-host) 'per-node' is not a number"));
}

BOOST_AUTO_TEST_CASE(per_host_on_one_host_is_one_producer_in_front) {
  for (const char* members : {"members=1", "members=2,1", "members=1,2,3", "members=3x2 aggregator=4"}) {
    const auto classic = fc::ensemble_layout::parse(std::string("producers=1 ") + members);
    const auto hosts = fc::host_map::single(classic.world_size());
    const auto l = fc::ensemble_layout::parse(std::string("producers=per-host ") + members).placed_on(hosts);
    BOOST_TEST_INFO(members);
    BOOST_TEST(l.is_placed());
    BOOST_TEST(consistent(l, hosts));
    BOOST_TEST(l.producers() == 1);
    BOOST_TEST(l.aggregator() == classic.aggregator());
    for (int r = 0; r < classic.world_size(); ++r) {
      const auto a = l.role_of(r), b = classic.role_of(r);
      BOOST_TEST((a.kind == b.kind && a.producer == b.producer && a.member == b.member &&
                  a.rank_in_member == b.rank_in_member));
    }
    BOOST_TEST(l.str() == std::string("producers=per-host ") + members);
  }
  // Classic layouts ignore the hosts.
  const auto classic = fc::ensemble_layout::parse("producers=2 members=1,2");
  const auto same = classic.placed_on(fc::host_map::parse("2+3"));
  BOOST_TEST(same.producer_rank(1) == 1);
  BOOST_TEST(same.trainer_rank(1, 0) == 3);
  BOOST_TEST(!same.per_host());
  BOOST_TEST(same.produces(1, 3));
  BOOST_TEST(!same.produces(1, 4));
  BOOST_TEST(same.producer_for(0, 0, 5) == 1);
  BOOST_TEST(same.feeds(0, 1, 1));
}

BOOST_AUTO_TEST_CASE(per_host_puts_a_producer_on_each_host_and_members_on_few_hosts) {
  // Two hosts of two: a rank of each host trains.
  {
    const auto hosts = fc::host_map::parse("2+2");
    const auto l = fc::ensemble_layout::parse("producers=per-host members=1,1").placed_on(hosts);
    BOOST_TEST(consistent(l, hosts));
    BOOST_TEST(producers_of(l) == (std::vector<int>{0, 2}));
    BOOST_TEST(members_of(l) == (std::vector<std::vector<int>>{{1}, {3}}));
    BOOST_TEST(l.producer_for(1, 0, 0) == 1);
    BOOST_TEST(l.produces(0, 5));
    BOOST_TEST(l.produces(1, 5));
    const auto one = fc::ensemble_layout::parse("producers=per-host members=2").placed_on(hosts);
    BOOST_TEST(members_of(one) == (std::vector<std::vector<int>>{{1, 3}}));  // no host holds it: split
  }
  // 2+1+2: the middle host holds only its producer.
  {
    const auto hosts = fc::host_map::parse("2+1+2");
    const auto l = fc::ensemble_layout::parse("producers=per-host members=1,1").placed_on(hosts);
    BOOST_TEST(consistent(l, hosts));
    BOOST_TEST(producers_of(l) == (std::vector<int>{0, 2, 3}));
    BOOST_TEST(members_of(l) == (std::vector<std::vector<int>>{{1}, {4}}));
  }
  // 3+3: each member on one host, even when a larger member comes later.
  {
    const auto hosts = fc::host_map::parse("3+3");
    const auto l = fc::ensemble_layout::parse("producers=per-host members=2,2").placed_on(hosts);
    BOOST_TEST(consistent(l, hosts));
    BOOST_TEST(members_of(l) == (std::vector<std::vector<int>>{{1, 2}, {4, 5}}));
  }
  // Uneven hosts: the largest member first, into the tightest host that holds it.
  {
    const auto hosts = fc::host_map::parse("3+5+2");  // free ranks 2, 4, 1
    const auto l = fc::ensemble_layout::parse("producers=per-host members=1,2,4").placed_on(hosts);
    BOOST_TEST(consistent(l, hosts));
    BOOST_TEST(members_of(l) == (std::vector<std::vector<int>>{{9}, {1, 2}, {4, 5, 6, 7}}));
    for (int m = 0; m < l.members(); ++m) BOOST_TEST(hosts_spanned(l, hosts, m) == 1);
  }
  // A member larger than any host: over the roomiest hosts, the rest into the tightest fit.
  {
    const auto hosts = fc::host_map::parse("4+3+3+2");  // free ranks 3, 2, 2, 1
    const auto l = fc::ensemble_layout::parse("producers=per-host members=6,2").placed_on(hosts);
    BOOST_TEST(consistent(l, hosts));
    BOOST_TEST(hosts_spanned(l, hosts, 0) == 3);
    BOOST_TEST(hosts_spanned(l, hosts, 1) == 1);
    BOOST_TEST(members_of(l) == (std::vector<std::vector<int>>{{1, 2, 3, 5, 6, 11}, {8, 9}}));
    BOOST_TEST(l.role_of(11).rank_in_member == 5);
    BOOST_TEST(l.producer_for(0, 5, 3) == 3);
  }
  // Hosts given rank by rank, not in blocks.
  {
    const auto hosts = fc::host_map(std::vector<int>{0, 1, 0, 1, 0, 1});
    const auto l = fc::ensemble_layout::parse("producers=per-host members=2,2").placed_on(hosts);
    BOOST_TEST(consistent(l, hosts));
    BOOST_TEST(producers_of(l) == (std::vector<int>{0, 1}));
    BOOST_TEST(members_of(l) == (std::vector<std::vector<int>>{{2, 4}, {3, 5}}));
  }
}

BOOST_AUTO_TEST_CASE(per_host_placement_says_what_is_wrong) {
  const auto l = fc::ensemble_layout::parse("producers=per-host members=2,1");
  BOOST_TEST(contains(error_of([&] { l.placed_on(fc::host_map::parse("2+2")); }),
                      "needs 5 ranks, world has 4 (a producer on each of 2 hosts 2+2 and 3 trainers)"));
  BOOST_TEST(error_of([&] { l.placed_on(fc::host_map::parse("2+2+2")); }).empty());
  BOOST_TEST(contains(error_of([&] { l.placed_on(fc::host_map::parse("1+1+1+1")); }), "needs 7 ranks, world has 4"));
  BOOST_TEST(contains(error_of([&] { l.placed_on(fc::host_map()); }), "empty host map"));
  const auto far = fc::ensemble_layout::parse("producers=per-host members=2 aggregator=3");
  BOOST_TEST(contains(error_of([&] { far.placed_on(fc::host_map::parse("3")); }), "aggregator is world rank 3"));
  BOOST_TEST(far.placed_on(fc::host_map::parse("2+2")).role_of(3).member == 0);
  const auto placed = l.placed_on(fc::host_map::parse("3+2"));
  BOOST_TEST(contains(error_of([&] { placed.validate(4); }),
                      "needs 5 ranks, world has 4 (a producer on each of 2 hosts and 3 trainers)"));
  BOOST_TEST(error_of([&] { placed.validate(5); }).empty());
  BOOST_TEST(contains(error_of([&] { placed.producer_rank(2); }), "has producers 0..1, not 2"));
}

// "members=auto:N": parsed, printed back, unplanned until planned, and refused until then.
BOOST_AUTO_TEST_CASE(auto_members_parse_print_back_and_refuse_use_before_planning) {
  const auto l = fc::ensemble_layout::parse("producers=1 members=auto:3 aggregator=2");
  BOOST_TEST(!l.is_planned());
  BOOST_TEST(l.members() == 3);
  BOOST_TEST(l.producers() == 1);
  BOOST_TEST(l.str() == "producers=1 members=auto:3 aggregator=2");
  BOOST_TEST(fc::ensemble_layout::parse(l.str()).str() == l.str());
  BOOST_TEST(l.rank_budget(8) == 7);
  for (const std::string& e : {error_of([&] { l.validate(8); }), error_of([&] { (void)l.role_of(0); }),
                               error_of([&] { (void)l.member_sizes(); }), error_of([&] { (void)l.world_size(); }),
                               error_of([&] { (void)l.shards_per_step(); })})
    BOOST_TEST(contains(e, "'producers=1 members=auto:3 aggregator=2' asks flexcomm to size its 3 members and is "
                           "not planned yet"), e);
  const auto p = l.planned({4, 2, 1});
  BOOST_TEST(p.is_planned());
  BOOST_TEST(p.str() == "producers=1 members=4,2,1 aggregator=2");
  BOOST_TEST(p.wrote_producers());
  p.validate(8);
  BOOST_TEST(contains(error_of([&] { (void)l.planned({4, 2}); }), "has 3 members, the plan gives sizes for 2"));
  BOOST_TEST(contains(error_of([&] { (void)p.planned({4, 2, 1}); }), "is planned already"));
  BOOST_TEST(contains(error_of([&] { (void)fc::ensemble_layout::parse("members=auto:0"); }), "needs N >= 1"));
  BOOST_TEST(contains(error_of([&] { (void)fc::ensemble_layout::parse("members=auto:x"); }), "is not a number"));
  BOOST_TEST(contains(error_of([&] { (void)l.rank_budget(1); }), "leaving no trainer rank in a world of 1"));
  // The aggregator's rank is checked once the world is known, by the plan.
  BOOST_TEST(contains(error_of([&] { (void)fc::ensemble_layout::parse("members=auto:2 aggregator=5").planned({1, 1}); }),
                      "aggregator is world rank 5"));
}

BOOST_AUTO_TEST_CASE(auto_members_per_host_budget_counts_a_producer_per_host) {
  const auto l = fc::ensemble_layout::parse("producers=per-host members=auto:2");
  BOOST_TEST(l.str() == "producers=per-host members=auto:2");
  BOOST_TEST(l.rank_budget(fc::host_map::parse("2+1+2")) == 2);
  BOOST_TEST(contains(error_of([&] { (void)l.rank_budget(5); }), "depends on the hosts"));
  const auto placed = l.planned({1, 1}).placed_on(fc::host_map::parse("2+1+2"));
  BOOST_TEST(placed.world_size() == 5);
}

// Costs 10x apart: the costly member gets about 10x the ranks, and the times even out.
BOOST_AUTO_TEST_CASE(plan_gives_the_costly_member_more_ranks) {
  const auto p = fc::plan_members({10.0, 1.0, 2.0}, 13);
  BOOST_TEST(p.ranks == (std::vector<int>{10, 1, 2}));
  BOOST_TEST(p.ranks[0] + p.ranks[1] + p.ranks[2] == 13);
  for (std::size_t m = 0; m < 3; ++m)
    BOOST_TEST(p.expected[m] == fc::expected_step_time(p.costs[m], p.ranks[m]));
  const auto pure = fc::plan_members({8.0, 1.0}, 9, fc::member_plan_options{0.0});
  BOOST_TEST(pure.ranks == (std::vector<int>{8, 1}));
  BOOST_TEST(pure.expected[0] == 1.0);
}

BOOST_AUTO_TEST_CASE(plan_with_one_rank_per_member_gives_one_each) {
  const auto p = fc::plan_members({10.0, 1.0, 3.0, 0.5}, 4);
  BOOST_TEST(p.ranks == (std::vector<int>{1, 1, 1, 1}));
  BOOST_TEST(p.expected == p.costs);
}

// Ties go to the lower member index; the same costs give the same plan.
BOOST_AUTO_TEST_CASE(plan_is_deterministic_and_breaks_ties_by_member_index) {
  BOOST_TEST(fc::plan_members({1.0, 1.0, 1.0}, 5).ranks == (std::vector<int>{2, 2, 1}));
  const std::vector<double> costs{3.7, 0.9, 12.5, 3.7, 1.1};
  const auto a = fc::plan_members(costs, 40), b = fc::plan_members(costs, 40);
  BOOST_TEST(a.ranks == b.ranks);
  BOOST_TEST(a.ranks[0] == a.ranks[3]);
}

// Past its sync optimum a member stops taking ranks: the rest go where they slow least.
BOOST_AUTO_TEST_CASE(plan_passes_over_members_a_further_rank_slows) {
  const auto p = fc::plan_members({10.0, 1.0}, 30, fc::member_plan_options{0.1});
  BOOST_TEST(p.ranks[0] + p.ranks[1] == 30);
  BOOST_TEST(p.ranks[0] <= 4);  // 10/r + (r-1): fastest at r = 3
  BOOST_TEST(p.expected[0] == *std::max_element(p.expected.begin(), p.expected.end()));
}

BOOST_AUTO_TEST_CASE(plan_refuses_what_it_cannot_plan) {
  BOOST_TEST(contains(error_of([] { (void)fc::plan_members({1.0, 2.0, 3.0}, 2); }),
                      "member plan: 3 members need at least 3 ranks, one each; the budget is 2"));
  BOOST_TEST(contains(error_of([] { (void)fc::plan_members({1.0, 0.0}, 4); }), "member 1's cost is 0"));
  BOOST_TEST(contains(error_of([] { (void)fc::plan_members({-2.0}, 4); }), "member 0's cost is -2"));
  BOOST_TEST(contains(error_of([] { (void)fc::plan_members({std::nan(""), 1.0}, 4); }), "must be finite and > 0"));
  BOOST_TEST(contains(error_of([] { (void)fc::plan_members({std::numeric_limits<double>::infinity()}, 4); }),
                      "member 0's cost is inf"));
  BOOST_TEST(contains(error_of([] { (void)fc::plan_members({}, 4); }), "the costs are empty"));
  BOOST_TEST(contains(error_of([] { (void)fc::plan_members({1.0}, 4, fc::member_plan_options{-1}); }),
                      "sync_share is -1"));
  const auto l = fc::ensemble_layout::parse("members=auto:2");
  BOOST_TEST(contains(error_of([&] { (void)fc::plan_layout(l, 4, {1.0}); }), "has 2 members, got 1 costs"));
  BOOST_TEST(contains(error_of([&] { (void)fc::plan_layout(l.planned({1, 1}), 4, {1.0, 1.0}); }),
                      "is planned already"));
}

BOOST_AUTO_TEST_CASE(plan_layout_sizes_the_members_and_prints_a_table) {
  const auto l = fc::ensemble_layout::parse("producers=1 members=auto:2");
  const auto planned = fc::plan_layout(l, l.rank_budget(6), {4.0, 1.0});
  BOOST_TEST(planned.layout.str() == "producers=1 members=4,1");
  planned.layout.validate(6);
  const std::string text = planned.text();
  BOOST_TEST(contains(text, "layout 'producers=1 members=4,1' planned:"), text);
  BOOST_TEST(contains(text, "cost: relative, as hinted"), text);
  BOOST_TEST(contains(text, "     0      4           4        1.12\n"), text);
  fc::member_plan measured = planned.plan;
  measured.measured = true;
  measured.costs = {0.012, 0.0004};
  BOOST_TEST(contains(measured.table(), "12 ms"), measured.table());
  BOOST_TEST(contains(measured.table(), "400 us"), measured.table());
}
