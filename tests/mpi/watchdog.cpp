#define BOOST_TEST_MODULE mpi_watchdog
#include "mpi_fixture.hpp"

#include <flexcomm/backend/mpi/batched_check.hpp>

#include <chrono>
#include <cstdint>
#include <string>
#include <thread>
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

// The batched consistency check (nccl's: backend/mpi/batched_check.hpp) closes with messages
// of its left rank unreceived: here every rank finds the difference itself, so the verdict each
// passes on is never taken. MPI keeps them, and gives the freed side channel's context to the
// next duplicate; that one's check is judged on its own calls only (issue 52), not on the
// verdict of the one before.
namespace {
fc::detail::mpi_signature allreduce_of(long long count) {
  fc::detail::mpi_signature s;
  s.value = {fc::detail::mpi_op_code("iallreduce"), static_cast<long long>(fc::dtype::f32), count,
             static_cast<long long>(fc::op::sum), -1, 0, -1};
  return s;
}
// Polls until a verdict comes; bounded, so that a missing one fails rather than hangs.
std::string verdict_of(fc::detail::batched_check& check) {
  const auto give_up = std::chrono::steady_clock::now() + 20s;
  while (check.poll(true).empty() && std::chrono::steady_clock::now() < give_up) std::this_thread::yield();
  return check.poll(true);
}
}  // namespace

BOOST_AUTO_TEST_CASE(a_freed_batched_check_leaves_nothing_the_next_one_takes) {
  if (world().size() < 2) return;
  const int me = world().rank(), last = world().size() - 1;
  MPI_Comm side = MPI_COMM_NULL;
  MPI_Comm_dup(MPI_COMM_WORLD, &side);
  {
    fc::detail::batched_check first;
    first.open(side, "first");
    for (std::uint64_t n = 1; n <= fc::detail::batched_check::batch; ++n) first.add(n, allreduce_of(me + 1));
    const std::string verdict = verdict_of(first);
    BOOST_TEST(verdict.find("on collective #1: rank ") != std::string::npos, verdict);
    MPI_Barrier(MPI_COMM_WORLD);  // every verdict is out
  }
  MPI_Comm_free(&side);
  MPI_Comm_dup(MPI_COMM_WORLD, &side);
  {
    fc::detail::batched_check next;
    next.open(side, "next");
    for (std::uint64_t n = 1; n <= fc::detail::batched_check::batch; ++n)
      next.add(n, allreduce_of(me == last && n == 5 ? 2 : 1));
    const std::string verdict = verdict_of(next);
    BOOST_TEST(fc::testing::all_ranks(verdict.find("on collective #5: rank ") != std::string::npos),
               "rank " << me << ": " << verdict);
  }
  MPI_Comm_free(&side);
}
