#define BOOST_TEST_MODULE layout
#include <boost/test/unit_test.hpp>

#include <flexcomm/core/layout.hpp>

namespace fc = flexcomm;

namespace {
// The message of the flexcomm::error that `f` throws, or "" when it throws none.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const fc::error& e) {
    return e.what();
  }
  return "";
}
bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }
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
  BOOST_TEST(contains(error_of([] { fc::ensemble_layout::parse("members=2").require_producers("one_to_many"); }),
                      "one_to_many: this feed needs producer ranks"));
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
