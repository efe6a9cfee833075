#define BOOST_TEST_MODULE mpi_trace
#include "mpi_fixture.hpp"

#include <chrono>
#include <filesystem>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "analysis.hpp"

namespace fc = flexcomm;
namespace trace = flexcomm::trace;
namespace tt = flexcomm::trace_tools;
using fc::mpi;
using fc::testing::world;

// The directory every rank writes into (the first argument), one per world size.
static std::string trace_dir() {
  const auto& suite = boost::unit_test::framework::master_test_suite();
  const std::string base = suite.argc > 1 ? suite.argv[1] : std::filesystem::temp_directory_path().string();
  return base + "/mpi-trace-np" + std::to_string(world().size());
}

// A training loop in miniature: forward, a backward that averages two gradient buckets (the
// first completed by the progress engine, as an overlapped sync does), an update.
// `slow_rank` is the straggler: its backward takes `delay` longer before the allreduces.
static void train(int steps, int slow_rank, std::chrono::milliseconds delay) {
  std::vector<float> grad(1024, 1.0f), early(4096, 2.0f);
  for (int step = 0; step < steps; ++step) {
    { trace::span s(trace::names::forward, step); std::this_thread::sleep_for(std::chrono::milliseconds(1)); }
    {
      trace::span s(trace::names::backward, step);
      if (world().rank() == slow_rank) std::this_thread::sleep_for(delay);
      auto bucket = std::make_shared<mpi::request>(mpi::iallreduce(world(), fc::span<float>(early), fc::op::avg));
      auto in_background = fc::progress_engine::instance().submit([bucket] { return bucket->test(); }, "bucket");
      mpi::iallreduce(world(), fc::span<float>(grad), fc::op::avg).wait();
      in_background->wait();
    }
    { trace::span s(trace::names::update, step); std::this_thread::sleep_for(std::chrono::microseconds(200)); }
  }
}

BOOST_AUTO_TEST_CASE(every_rank_writes_a_trace_and_the_report_finds_the_straggler) {
  const int size = world().size(), rank = world().rank();
  const std::string dir = trace_dir();
  if (rank == 0) std::filesystem::remove_all(dir);
  BOOST_TEST_REQUIRE(fc::testing::all_ranks(true));  // the directory is clean before anyone writes
  constexpr int steps = 12;
  const int slow = size - 1;

  trace::start(world(), dir);
  trace::name_thread("trainer");
  train(steps, slow, std::chrono::milliseconds(20));
  trace::stop();
  BOOST_TEST_REQUIRE(fc::testing::all_ranks(true));  // every file is written

  bool ok = true;
  if (rank == 0) {
    // Each rank's file is valid JSON with its own events and aligned clocks.
    for (int r = 0; r < size; ++r) {
      const auto file = tt::load(trace::file_of(dir, r));
      std::map<std::string, int> spans;
      int begins = 0, ends = 0;
      for (const auto& e : file["traceEvents"]) {
        ok = ok && e["pid"].get<int>() == r;
        if (e["ph"] == "X") ++spans[e["name"].get<std::string>()];
        if (e["ph"] == "b") ++begins, ok = ok && e["args"]["comm"] == "world";
        if (e["ph"] == "e") ++ends;
      }
      BOOST_TEST(spans["forward"] == steps);
      BOOST_TEST(spans["backward"] == steps);
      BOOST_TEST(spans["update"] == steps);
      BOOST_TEST(begins == 2 * steps);  // the allreduces; clock alignment stays out of the trace
      BOOST_TEST(ends == begins);
      BOOST_TEST(file["otherData"]["aligned"].get<bool>());
      BOOST_TEST(file["otherData"]["ranks"].get<int>() == size);
    }
    // Merged: one track per rank.
    const auto merged = tt::merge(tt::trace_files({dir}));
    std::set<int> tracks;
    for (const auto& e : merged["traceEvents"])
      if (e["ph"] == "M" && e["name"] == "process_name") tracks.insert(e["pid"].get<int>());
    BOOST_TEST(static_cast<int>(tracks.size()) == size);

    const auto rep = tt::analyze(merged["traceEvents"]);
    if (size == 1) {
      BOOST_TEST(rep.collectives.empty());  // nothing to be late for
      BOOST_TEST(rep.stragglers.empty());
    } else {
      BOOST_TEST(rep.collectives.size() == static_cast<std::size_t>(2 * steps));
      BOOST_TEST(rep.stragglers == std::vector<int>{slow});
      for (const auto& r : rep.ranks)
        if (r.rank == slow) BOOST_TEST(r.last >= static_cast<std::size_t>(steps));  // half, at least
    }
    for (const auto& r : rep.ranks) {
      BOOST_TEST(r.steps == static_cast<std::size_t>(steps - 1));
      BOOST_TEST(r.gap_us > 0.0);
      BOOST_TEST(r.idle_share >= 0.0);
      BOOST_TEST(r.idle_share < 1.0);
    }
  }
  BOOST_TEST(fc::testing::all_ranks(ok));
}
