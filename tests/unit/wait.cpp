#define BOOST_TEST_MODULE wait
#include <boost/test/unit_test.hpp>

#include <chrono>

#include <flexcomm/core/wait.hpp>

namespace fc = flexcomm;
using namespace std::chrono_literals;

BOOST_AUTO_TEST_CASE(parse_accepts_the_documented_forms) {
  BOOST_TEST((fc::wait_policy::parse("spin").kind == fc::wait_kind::spin));
  BOOST_TEST((fc::wait_policy::parse("yield").kind == fc::wait_kind::yield));
  const auto b = fc::wait_policy::parse("backoff:250");
  BOOST_TEST((b.kind == fc::wait_kind::backoff));
  BOOST_TEST(b.max_sleep.count() == 250);
  for (const char* bad : {"", "busy", "backoff:", "backoff:0", "backoff:12x", "backoff:99999999"})
    BOOST_CHECK_THROW(fc::wait_policy::parse(bad), fc::error);
}

BOOST_AUTO_TEST_CASE(automatic_backs_off_only_when_ranks_outnumber_cores) {
  ::unsetenv("FLEXCOMM_WAIT");
  BOOST_TEST((fc::wait_policy::automatic(8, 2).kind == fc::wait_kind::backoff));
  BOOST_TEST((fc::wait_policy::automatic(2, 2).kind == fc::wait_kind::spin));
  ::setenv("FLEXCOMM_WAIT", "yield", 1);
  BOOST_TEST((fc::wait_policy::automatic(8, 2).kind == fc::wait_kind::yield));
  ::unsetenv("FLEXCOMM_WAIT");
}

BOOST_AUTO_TEST_CASE(until_returns_when_done_and_times_out_otherwise) {
  int polls = 0;
  BOOST_TEST(fc::wait_policy::backoff().until([&] { return ++polls == 5; }));
  BOOST_TEST(polls == 5);
  const auto start = std::chrono::steady_clock::now();
  BOOST_TEST(!fc::wait_policy::backoff(50us).until([] { return false; }, 30ms));
  BOOST_TEST((std::chrono::steady_clock::now() - start >= 30ms));
}

BOOST_AUTO_TEST_CASE(backoff_sleeps_instead_of_burning_the_core) {
  // 200 polls under backoff take a measurable nap; under spin they take none.
  const auto t0 = std::chrono::steady_clock::now();
  int n = 0;
  fc::wait_policy::backoff(100us).until([&] { return ++n == 200; });
  BOOST_TEST((std::chrono::steady_clock::now() - t0 >= 5ms));
}

BOOST_AUTO_TEST_CASE(timeout_parsing) {
  BOOST_TEST(fc::parse_timeout("1.5").count() == 1500);
  BOOST_TEST(fc::parse_timeout(nullptr).count() == 0);
  BOOST_CHECK_THROW(fc::parse_timeout("soon"), fc::error);
  BOOST_CHECK_THROW(fc::parse_timeout("-3"), fc::error);
  fc::set_default_timeout(2s);
  BOOST_TEST(fc::default_timeout().count() == 2000);
}
