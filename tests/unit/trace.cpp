#define BOOST_TEST_MODULE trace
#include <boost/test/unit_test.hpp>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <new>
#include <unistd.h>
#include <string>
#include <thread>
#include <vector>

#include <flexcomm/core/gaps.hpp>
#include <flexcomm/core/trace.hpp>
#include <flexcomm/core/wait.hpp>

#include "analysis.hpp"

// Every allocation of this program is counted, so a probe that allocates is caught. GCC sees
// through the replacement and mistakes the malloc/free pairing for a mismatch.
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
static std::atomic<long> allocations{0};
void* operator new(std::size_t n) {
  allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }

namespace fc = flexcomm;
namespace trace = flexcomm::trace;
using flexcomm::trace_tools::json;

static std::string scratch(const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("flexcomm-unit-trace-" + std::to_string(::getpid()) + "-" + name);
  std::filesystem::remove_all(dir);
  return dir.string();
}

// What the library does on its hot paths, once per call: a trainer span, a collective, a mark.
static void hot_path(int steps) {
  for (int step = 0; step < steps; ++step) {
    trace::span s(trace::names::forward, step);
    const auto id = trace::collective_begin("iallreduce", "member 0", static_cast<std::uint64_t>(step));
    trace::collective_end("iallreduce", id);
    trace::instant("bucket ready", "sync", step, "bucket");
    trace::complete(trace::names::bucket_reduce, "sync", trace::now(), trace::now(), step, "bucket");
    int polls = 0;
    fc::wait_policy::spin().until([&] { return ++polls > 3; });
  }
}

BOOST_AUTO_TEST_CASE(tracing_off_allocates_nothing) {
  BOOST_TEST_REQUIRE(!trace::enabled());
  const long before = allocations.load();
  hot_path(1000);
  BOOST_TEST(allocations.load() - before == 0);
}

BOOST_AUTO_TEST_CASE(tracing_on_allocates_only_a_threads_first_buffer) {
  const auto dir = scratch("on");
  trace::start(dir, 0);
  hot_path(1);  // this thread's buffer
  const long before = allocations.load();
  hot_path(1000);
  BOOST_TEST(allocations.load() - before == 0);
  trace::stop();
  BOOST_TEST(!trace::enabled());
  std::filesystem::remove_all(dir);
}

BOOST_AUTO_TEST_CASE(threads_record_concurrently_into_valid_chrome_json) {
  const auto dir = scratch("threads");
  trace::start(dir, 3);
  trace::name_thread("trainer");
  constexpr int threads = 4, steps = 200;
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t)
    workers.emplace_back([t] {
      trace::name_thread(t % 2 ? "odd worker" : "even \"worker\"");
      for (int step = 0; step < steps; ++step) {
        trace::span s(trace::names::backward, step);
        if (step % 50 == 0) trace::flush();  // flushing while others record
      }
    });
  // A collective that ends on another thread, as the progress engine ends them.
  const auto id = trace::collective_begin("ibcast", "feed \"shard\" 0", 7);
  std::thread([id] { trace::collective_end("ibcast", id); }).join();
  for (auto& w : workers) w.join();
  trace::stop();

  const json trace_file = flexcomm::trace_tools::load(trace::file_of(dir, 3));
  int backward = 0, begins = 0, ends = 0, names = 0;
  bool quoted_name = false;
  for (const auto& e : trace_file["traceEvents"]) {
    BOOST_TEST(e["pid"].get<int>() == 3);
    const std::string ph = e["ph"];
    if (ph == "X" && e["name"] == "backward") {
      ++backward;
      BOOST_TEST(e["dur"].get<double>() >= 0.0);
      BOOST_TEST(e["args"]["step"].get<int>() < steps);
    }
    if (ph == "b") {
      ++begins;
      BOOST_TEST(e["args"]["comm"] == "feed \"shard\" 0");
      BOOST_TEST(e["args"]["seq"].get<int>() == 7);
    }
    if (ph == "e") ++ends;
    if (ph == "M" && e["name"] == "thread_name") {
      ++names;
      quoted_name = quoted_name || e["args"]["name"] == "even \"worker\"";
    }
  }
  BOOST_TEST(backward == threads * steps);
  BOOST_TEST(begins == 1);
  BOOST_TEST(ends == 1);
  BOOST_TEST(names >= threads + 2);
  BOOST_TEST(quoted_name);
  BOOST_TEST(trace_file["otherData"]["rank"].get<int>() == 3);
  BOOST_TEST(trace_file["otherData"]["dropped"].get<int>() == 0);
  std::filesystem::remove_all(dir);
}

BOOST_AUTO_TEST_CASE(a_full_buffer_drops_and_counts_instead_of_growing) {
  const auto dir = scratch("bounded");
  trace::options small;
  small.events_per_thread = 10;
  trace::start(dir, 0, small);
  const auto before = trace::dropped();
  std::thread([] {
    for (int i = 0; i < 25; ++i) trace::instant("tick");
  }).join();
  trace::stop();
  BOOST_TEST(trace::dropped() - before == 15u);
  const json trace_file = flexcomm::trace_tools::load(trace::file_of(dir, 0));
  int ticks = 0;
  for (const auto& e : trace_file["traceEvents"]) ticks += e["name"] == "tick";
  BOOST_TEST(ticks == 10);
  std::filesystem::remove_all(dir);
}

BOOST_AUTO_TEST_CASE(a_new_session_leaves_out_the_previous_ones_events) {
  const auto dir = scratch("sessions");
  trace::start(dir, 0);
  trace::instant("first session");
  trace::stop();
  std::this_thread::sleep_for(std::chrono::milliseconds(1));
  trace::start(dir, 0);
  trace::instant("second session");
  trace::stop();
  const json trace_file = flexcomm::trace_tools::load(trace::file_of(dir, 0));
  int first = 0, second = 0;
  for (const auto& e : trace_file["traceEvents"]) {
    first += e["name"] == "first session";
    second += e["name"] == "second session";
  }
  BOOST_TEST(first == 0);
  BOOST_TEST(second == 1);
  std::filesystem::remove_all(dir);
}

BOOST_AUTO_TEST_CASE(an_unwritable_directory_is_an_error) {
  BOOST_CHECK_THROW(trace::start("/proc/flexcomm-no-such-dir", 0), fc::error);
  BOOST_CHECK_THROW(trace::start("", 0), fc::error);
  BOOST_TEST(!trace::enabled());
}
