#define BOOST_TEST_MODULE hosts
#include <boost/test/unit_test.hpp>

#include "errors.hpp"

#include <flexcomm/core/hosts.hpp>

namespace fc = flexcomm;

namespace {
using fc::testing::contains;
using fc::testing::error_of;
}  // namespace

BOOST_AUTO_TEST_CASE(blocks_of_consecutive_ranks) {
  const auto m = fc::host_map::parse("2+1+2");
  BOOST_TEST(m.ranks() == 5);
  BOOST_TEST(m.hosts() == 3);
  BOOST_TEST(m.host_of(0) == 0);
  BOOST_TEST(m.host_of(2) == 1);
  BOOST_TEST(m.host_of(4) == 2);
  BOOST_TEST(m.ranks_on(2) == (std::vector<int>{3, 4}));
  BOOST_TEST(m.leader_of(2) == 3);
  BOOST_TEST(m.most_ranks_on_a_host() == 2);
  BOOST_TEST(m.str() == "2+1+2");
  BOOST_TEST(fc::host_map::single(4).str() == "4");
}

BOOST_AUTO_TEST_CASE(keys_number_hosts_by_their_first_rank) {
  const auto m = fc::host_map::from_keys({40, 7, 40, 7, 9});
  BOOST_TEST(m.hosts() == 3);
  BOOST_TEST(m.str() == "0,1,0,1,2");
  BOOST_TEST(m.ranks_on(1) == (std::vector<int>{1, 3}));
  // A member of world ranks 1, 3, 4 of "2+2+1": two hosts, ranks {0, 1} and {2} of the member.
  const auto member = fc::host_map::parse("2+2+1").subset({1, 3, 4});
  BOOST_TEST(member.str() == "1+1+1");
  BOOST_TEST(fc::host_map::parse("2+2+1").subset({2, 3, 4}).str() == "2+1");
}

BOOST_AUTO_TEST_CASE(automatic_hierarchy_needs_hosts_with_several_ranks) {
  const auto allreduce = fc::flat_algorithm::backend_allreduce;
  BOOST_TEST(!fc::use_hierarchy(fc::hierarchy::automatic, fc::host_map::single(4), allreduce));
  BOOST_TEST(!fc::use_hierarchy(fc::hierarchy::automatic, fc::host_map::parse("1+1+1"), allreduce));
  BOOST_TEST(fc::use_hierarchy(fc::hierarchy::automatic, fc::host_map::parse("2+1"), allreduce));
  BOOST_TEST(fc::use_hierarchy(fc::hierarchy::on, fc::host_map::single(4), allreduce));
  BOOST_TEST(!fc::use_hierarchy(fc::hierarchy::off, fc::host_map::parse("2+2"), allreduce));
}

// Against the ring, the tiers are chosen only where the ring would cross hosts more than once per
// host: ranks in host blocks keep the flat ring; interleaved ranks get the tiers.
BOOST_AUTO_TEST_CASE(automatic_hierarchy_against_the_ring_needs_a_ring_that_crosses_often) {
  const auto ring = fc::flat_algorithm::ring;
  BOOST_TEST(fc::ring_crossings(fc::host_map::single(4)) == 0);
  BOOST_TEST(fc::ring_crossings(fc::host_map::parse("2+2")) == 2);
  BOOST_TEST(fc::ring_crossings(fc::host_map::parse("2+1+2")) == 3);
  BOOST_TEST(fc::ring_crossings(fc::host_map({0, 1, 0, 1})) == 4);
  BOOST_TEST(fc::ring_crossings(fc::host_map({0, 0, 1, 0})) == 2);
  BOOST_TEST(!fc::use_hierarchy(fc::hierarchy::automatic, fc::host_map::parse("2+2"), ring));
  BOOST_TEST(!fc::use_hierarchy(fc::hierarchy::automatic, fc::host_map::parse("2+1+2"), ring));
  BOOST_TEST(!fc::use_hierarchy(fc::hierarchy::automatic, fc::host_map::parse("1+1"), ring));
  BOOST_TEST(fc::use_hierarchy(fc::hierarchy::automatic, fc::host_map({0, 1, 0, 1}), ring));
  BOOST_TEST(fc::use_hierarchy(fc::hierarchy::automatic, fc::host_map({0, 1, 1, 0, 2, 0}), ring));
  BOOST_TEST(fc::use_hierarchy(fc::hierarchy::on, fc::host_map::parse("2+2"), ring));
  BOOST_TEST(!fc::use_hierarchy(fc::hierarchy::off, fc::host_map({0, 1, 0, 1}), ring));
}

BOOST_AUTO_TEST_CASE(bad_host_maps_are_named) {
  BOOST_TEST(contains(error_of([] { fc::host_map::parse("2++1"); }), "host 1 has no rank count"));
  BOOST_TEST(contains(error_of([] { fc::host_map::parse("2+0"); }), "host 1 has no ranks"));
  BOOST_TEST(contains(error_of([] { fc::host_map::parse("2+x"); }), "'x' is not a rank count"));
  BOOST_TEST(contains(error_of([] { fc::host_map({1, 0}); }), "rank 0 is on host 1"));
}
