#define BOOST_TEST_MODULE mpi_watchdog
#include "mpi_fixture.hpp"

#include <chrono>
#include <string>
#include <vector>

namespace fc = flexcomm;
using fc::mpi;
using fc::testing::world;
using namespace std::chrono_literals;

// Faults themselves end the job, so they are tested by tests/fault (under mpiexec); here the
// watchdog's bookkeeping in healthy runs.

BOOST_AUTO_TEST_CASE(each_communicator_has_its_own_timeout) {
  auto member = world().dup("member 0");
  BOOST_TEST(member.timeout().count() == fc::default_timeout().count());
  member.set_timeout(1234ms);
  BOOST_TEST(member.timeout().count() == 1234);
  BOOST_TEST(world().timeout().count() == fc::default_timeout().count());
  member.set_timeout(-1ms);
  BOOST_TEST(member.timeout().count() == fc::default_timeout().count());
  // An operation on it finishes well within its own timeout.
  member.set_timeout(30s);
  int one = 1;
  mpi::iallreduce(member, fc::span<int>(&one, 1), fc::op::sum).wait();
  BOOST_TEST(fc::testing::all_ranks(one == member.size()));
}

BOOST_AUTO_TEST_CASE(the_flight_recorder_follows_every_operation) {
  auto comm = world().dup("feed");
  const auto* rec = comm.recorder();
  BOOST_TEST_REQUIRE(rec != nullptr);
  std::vector<float> grad(100, 1.0f);
  std::vector<int> flag(1, 0);
  auto a = mpi::iallreduce(comm, fc::span<float>(grad), fc::op::avg);
  auto b = mpi::ibcast(comm, fc::span<int>(flag), 0);
  const bool two_in_flight = rec->last_enqueued() == 2 && rec->in_flight() <= 2;
  a.wait();
  b.wait();
  const auto ops = rec->recent();
  bool ok = two_in_flight && rec->in_flight() == 0 && rec->last_completed() == 2 && ops.size() == 2 &&
            std::string(ops[0].op) == "iallreduce" && ops[0].count == 100 && std::string(ops[0].redop) == "avg" &&
            ops[0].state == fc::op_state::completed && std::string(ops[1].op) == "ibcast" && ops[1].peer == 0;
  BOOST_TEST(fc::testing::all_ranks(ok));
  BOOST_TEST(fc::watchdog::instance().in_flight() == 0u);
  BOOST_TEST(!fc::watchdog::instance().job_must_end());
  BOOST_TEST(!comm.poisoned());
}

BOOST_AUTO_TEST_CASE(matching_collectives_pass_the_consistency_check_on_and_off) {
  const int size = world().size(), rank = world().rank();
  for (bool on : {true, false}) {
    fc::set_checks(on);
    std::vector<double> v(37, 1.0), out(37);
    mpi::iallreduce<double>(world(), v, fc::span<double>(out), fc::op::max).wait();
    std::vector<int> counts(static_cast<std::size_t>(size));
    for (int r = 0; r < size; ++r) counts[static_cast<std::size_t>(r)] = r + 1;
    std::vector<std::int64_t> mine(static_cast<std::size_t>(rank + 1), rank), all((size * (size + 1)) / 2);
    mpi::iallgatherv<std::int64_t>(world(), mine, fc::span<std::int64_t>(all), fc::span<const int>(counts)).wait();
    std::vector<std::int64_t> gathered(rank == 0 ? all.size() : 0);
    mpi::igatherv<std::int64_t>(world(), mine, fc::span<std::int64_t>(gathered), fc::span<const int>(counts), 0).wait();
    {
      fc::check_label bucket(4);  // the same label everywhere: agreement
      mpi::ibcast(world(), fc::span<double>(out), size - 1).wait();
    }
    bool ok = out[0] == 1.0 && all.back() == size - 1 && (rank != 0 || gathered == all);
    BOOST_TEST(fc::testing::all_ranks(ok), "checks " << (on ? "on" : "off"));
  }
  fc::set_checks(true);
}
