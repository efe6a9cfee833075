#define BOOST_TEST_MODULE layout
#include <boost/test/unit_test.hpp>

#include "errors.hpp"

#include <flexcomm/core/layout.hpp>

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
