#define BOOST_TEST_MODULE watchdog
#include <boost/test/unit_test.hpp>

#include <chrono>
#include <string>

#include <flexcomm/core/watchdog.hpp>

namespace fc = flexcomm;
using namespace std::chrono_literals;

namespace {
fc::op_record allreduce(std::size_t n) {
  fc::op_record r;
  r.op = "iallreduce";
  r.count = n;
  r.type = fc::dtype::f32;
  r.redop = "sum";
  return r;
}
}  // namespace

BOOST_AUTO_TEST_CASE(recorder_numbers_operations_and_tracks_their_state) {
  fc::flight_recorder rec(4);
  const auto a = rec.enqueue(allreduce(10));
  const auto b = rec.enqueue(allreduce(20));
  const auto c = rec.reserve();  // a sequence number without a record
  const auto d = rec.enqueue(allreduce(40));
  BOOST_TEST(a == 1u);
  BOOST_TEST(b == 2u);
  BOOST_TEST(c == 3u);
  BOOST_TEST(d == 4u);
  BOOST_TEST(rec.in_flight() == 3u);
  BOOST_TEST(rec.oldest_in_flight() == 1u);
  rec.finish(b, fc::op_state::completed);
  BOOST_TEST(rec.last_completed() == 2u);
  BOOST_TEST(rec.oldest_in_flight() == 1u);
  rec.finish(a, fc::op_state::timed_out);
  BOOST_TEST(rec.in_flight() == 1u);
  BOOST_TEST(rec.oldest_in_flight() == 1u);  // a timed-out operation is still unfinished
  rec.finish(a, fc::op_state::abandoned);
  BOOST_TEST(rec.in_flight() == 1u);         // finishing twice does not count twice
  BOOST_TEST((rec.find(a).state == fc::op_state::abandoned));
  BOOST_TEST(rec.find(b).str() == "#2 iallreduce 20 x float sum");
  BOOST_TEST(rec.last_enqueued() == 4u);
}

BOOST_AUTO_TEST_CASE(recorder_keeps_the_last_operations_in_order) {
  fc::flight_recorder rec(4);
  for (int i = 0; i < 10; ++i) rec.finish(rec.enqueue(allreduce(static_cast<std::size_t>(i))), fc::op_state::completed);
  const auto recent = rec.recent();
  BOOST_TEST_REQUIRE(recent.size() == 4u);
  BOOST_TEST(recent.front().seq == 7u);
  BOOST_TEST(recent.back().seq == 10u);
  BOOST_TEST(rec.find(3).seq == 0u);  // evicted
  BOOST_TEST(rec.in_flight() == 0u);
  const auto text = rec.dump("'member 1'");
  BOOST_TEST(text.find("flight recorder of 'member 1' (last 4 of 10)") != std::string::npos);
  BOOST_TEST(text.find("#10 iallreduce 9 x float sum: completed") != std::string::npos);
}

BOOST_AUTO_TEST_CASE(peers_and_roots_are_named_by_their_role) {
  fc::op_record r;
  r.seq = 5;
  r.op = "isend";
  r.count = 3;
  r.type = fc::dtype::u8;
  r.peer = 2;
  r.tag = 9;
  BOOST_TEST(r.str() == "#5 isend 3 x uint8 to 2 tag 9");
  r.op = "irecv";
  BOOST_TEST(r.str() == "#5 irecv 3 x uint8 from 2 tag 9");
  r.op = "ibcast";
  r.tag = -1;
  BOOST_TEST(r.str() == "#5 ibcast 3 x uint8 root 2");
}

BOOST_AUTO_TEST_CASE(check_switch_parses_and_defaults_to_on) {
  BOOST_TEST(fc::parse_check(nullptr));
  BOOST_TEST(fc::parse_check(""));
  BOOST_TEST(fc::parse_check("1"));
  BOOST_TEST(fc::parse_check("on"));
  BOOST_TEST(!fc::parse_check("0"));
  BOOST_TEST(!fc::parse_check("false"));
  for (const char* bad : {"2", "yes please", " 1", "01"})
    BOOST_CHECK_EXCEPTION(fc::parse_check(bad), fc::error, [](const fc::error& e) {
      return e.operation() == "FLEXCOMM_CHECK" && e.cause().find("expected 1 (on) or 0 (off)") != std::string::npos;
    });
  fc::set_checks(false);
  BOOST_TEST(!fc::checks_enabled());
  fc::set_checks(true);
  BOOST_TEST(fc::checks_enabled());
}

BOOST_AUTO_TEST_CASE(check_labels_nest) {
  BOOST_TEST(fc::check_label::current() == -1);
  {
    fc::check_label bucket(3);
    BOOST_TEST(fc::check_label::current() == 3);
    {
      fc::check_label inner(7);
      BOOST_TEST(fc::check_label::current() == 7);
    }
    BOOST_TEST(fc::check_label::current() == 3);
  }
  BOOST_TEST(fc::check_label::current() == -1);
}

BOOST_AUTO_TEST_CASE(grace_is_a_bounded_share_of_the_timeout) {
  BOOST_TEST(fc::watchdog::grace(2000ms).count() == 500);
  BOOST_TEST(fc::watchdog::grace(100ms).count() == 250);
  BOOST_TEST(fc::watchdog::grace(3600s).count() == 5000);
}

BOOST_AUTO_TEST_CASE(a_timeout_without_communicators_says_so_and_marks_the_job) {
  auto& dog = fc::watchdog::instance();
  BOOST_TEST(!dog.job_must_end());
  BOOST_TEST(dog.timed_out(nullptr, 0, 1000ms).find("no flexcomm operation is in flight") != std::string::npos);
  BOOST_TEST(dog.job_must_end());
}
