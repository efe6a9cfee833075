#define BOOST_TEST_MODULE gaps
#include <boost/test/unit_test.hpp>

#include <atomic>
#include <chrono>
#include <numeric>
#include <stdexcept>
#include <thread>
#include <vector>

#include <flexcomm/core/gaps.hpp>

namespace fc = flexcomm;
using namespace std::chrono_literals;

// A wait that lasts a while: the gaps a rank would otherwise sleep through.
static void wait_for(std::chrono::milliseconds how_long) {
  const auto until = std::chrono::steady_clock::now() + how_long;
  fc::wait_policy::backoff().until([&] { return std::chrono::steady_clock::now() >= until; });
}

BOOST_AUTO_TEST_CASE(a_copy_runs_inside_waits_and_is_exact) {
  std::vector<int> params(1 << 18), copy(params.size(), -1);
  std::iota(params.begin(), params.end(), 0);
  auto task = fc::copy_in_gaps(copy.data(), params.data(), params.size() * sizeof(int), 4096);
  BOOST_TEST(!task->done());
  BOOST_TEST(fc::gap_tasks_pending() == 1u);
  for (int i = 0; i < 1000 && !task->done(); ++i) wait_for(1ms);
  BOOST_TEST_REQUIRE(task->done());
  BOOST_TEST(task->chunks_in_gaps() == params.size() * sizeof(int) / 4096);
  BOOST_TEST(task->chunks_in_finish() == 0u);
  task->finish();
  BOOST_TEST(copy == params);
  wait_for(1ms);  // lets the queue drop the finished task
  BOOST_TEST(fc::gap_tasks_pending() == 0u);
}

BOOST_AUTO_TEST_CASE(finish_runs_the_rest_on_the_caller) {
  std::vector<char> src(1000, 'x'), dst(1000, 0);
  auto task = fc::copy_in_gaps(dst.data(), src.data(), src.size(), 100);
  task->finish();  // no wait happened: everything runs here
  BOOST_TEST(task->done());
  BOOST_TEST(task->chunks_in_gaps() == 0u);
  BOOST_TEST(task->chunks_in_finish() == 10u);
  BOOST_TEST(dst == src);
}

BOOST_AUTO_TEST_CASE(tasks_run_in_order_and_a_failure_reaches_finish) {
  std::vector<int> order;
  auto failing = fc::run_in_gaps([&]() -> bool {
    order.push_back(1);
    throw std::runtime_error("disk full");
  }, "failing");
  auto second = fc::run_in_gaps([&] {
    order.push_back(2);
    return true;
  }, "second");
  for (int i = 0; i < 1000 && !second->done(); ++i) wait_for(1ms);
  BOOST_TEST_REQUIRE(second->done());
  BOOST_TEST((order == std::vector<int>{1, 2}));
  BOOST_CHECK_THROW(failing->finish(), std::runtime_error);
  BOOST_CHECK_NO_THROW(second->finish());
}

BOOST_AUTO_TEST_CASE(many_waiting_threads_share_one_task_safely) {
  std::vector<long> src(1 << 16), dst(src.size(), 0);
  std::iota(src.begin(), src.end(), 5);
  auto task = fc::copy_in_gaps(dst.data(), src.data(), src.size() * sizeof(long), 1024);
  std::vector<std::thread> waiters;
  for (int t = 0; t < 4; ++t)
    waiters.emplace_back([&] {
      for (int i = 0; i < 1000 && !task->done(); ++i) wait_for(1ms);
    });
  for (auto& w : waiters) w.join();
  task->finish();
  BOOST_TEST(dst == src);
  BOOST_TEST(task->chunks_in_gaps() + task->chunks_in_finish() == src.size() * sizeof(long) / 1024);
}

BOOST_AUTO_TEST_CASE(no_task_is_an_error) {
  BOOST_CHECK_THROW(fc::run_in_gaps(fc::gap_chunk{}, "nothing"), fc::error);
}
