#define BOOST_TEST_MODULE progress
#include <boost/test/unit_test.hpp>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>
#include <vector>

#include <flexcomm/core/progress.hpp>

namespace fc = flexcomm;
using namespace std::chrono_literals;

BOOST_AUTO_TEST_CASE(tasks_finish_on_the_engine_thread) {
  fc::progress_engine engine;
  const auto caller = std::this_thread::get_id();
  std::atomic<int> polls{0};
  std::atomic<bool> on_other_thread{false};
  auto done = engine.submit(
      [&] {
        on_other_thread = std::this_thread::get_id() != caller;
        return ++polls >= 10;
      },
      "count to ten");
  done->wait(fc::wait_policy::backoff(), 5s);
  BOOST_TEST(polls.load() == 10);
  BOOST_TEST(on_other_thread.load());
  BOOST_TEST(engine.outstanding() == 0u);
}

BOOST_AUTO_TEST_CASE(many_tasks_from_many_threads) {
  fc::progress_engine engine;
  std::vector<std::thread> submitters;
  std::atomic<int> finished{0};
  std::vector<std::shared_ptr<fc::completion>> all(64);
  for (int t = 0; t < 4; ++t)
    submitters.emplace_back([&, t] {
      for (int i = 0; i < 16; ++i) {
        auto left = std::make_shared<int>(i % 5);
        all[static_cast<std::size_t>(t * 16 + i)] =
            engine.submit([left, &finished] { return --*left < 0 && ++finished; }, "countdown");
      }
    });
  for (auto& s : submitters) s.join();
  for (auto& c : all) c->wait(fc::wait_policy::backoff(), 5s);
  BOOST_TEST(finished.load() == 64);
}

// Waits beside the engine back off from the moment a task is handed over, not from when the
// engine's thread wakes to take it (a waiter yielding in between keeps the core it needs), and
// stop doing so once the engine has nothing left.
BOOST_AUTO_TEST_CASE(a_task_handed_over_counts_as_background_polling_at_once) {
  fc::progress_engine engine;
  std::atomic<bool> release{false};
  auto done = engine.submit([&] { return release.load(); }, "held");
  BOOST_TEST(fc::detail::background_pollers().load() > 0);
  release = true;
  done->wait(fc::wait_policy::backoff(), 5s);
  BOOST_TEST(fc::wait_policy::backoff().until([] { return fc::detail::background_pollers().load() == 0; }, 5s));
  auto late = engine.submit([] { return true; }, "after the engine went idle");
  late->wait(fc::wait_policy::backoff(), 5s);
  engine.stop();
  BOOST_TEST(fc::detail::background_pollers().load() == 0);
}

BOOST_AUTO_TEST_CASE(an_exception_in_a_task_reaches_the_waiter) {
  fc::progress_engine engine;
  auto done = engine.submit([]() -> bool { throw std::runtime_error("peer vanished"); }, "bad task");
  BOOST_CHECK_EXCEPTION(done->wait(), std::runtime_error,
                        [](const std::runtime_error& e) { return std::string(e.what()) == "peer vanished"; });
}

BOOST_AUTO_TEST_CASE(a_task_that_never_finishes_times_out) {
  fc::progress_engine engine;
  auto done = engine.submit([] { return false; }, "stuck op");
  BOOST_CHECK_EXCEPTION(done->wait(fc::wait_policy::backoff(), 50ms), fc::error, [](const fc::error& e) {
    return e.operation() == "stuck op" && std::string(e.cause()).find("timed out after 50 ms") != std::string::npos;
  });
  engine.stop();  // abandons the stuck task with an error instead of hanging
  BOOST_TEST(done->done());
  BOOST_CHECK_THROW(done->wait(), fc::error);
  BOOST_CHECK_THROW(engine.submit([] { return true; }, "late"), fc::error);
}
