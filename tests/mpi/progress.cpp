#define BOOST_TEST_MODULE mpi_progress
#include "mpi_fixture.hpp"

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

namespace fc = flexcomm;
using fc::mpi;
using fc::testing::world;

// The trainer thread posts an allreduce, hands it to the progress engine and then only
// computes: the operation must complete although this thread never calls MPI again.
BOOST_AUTO_TEST_CASE(nonblocking_allreduce_completes_while_the_caller_never_enters_mpi) {
  const int size = world().size();
  const std::size_t n = 1 << 18;  // large enough that MPICH needs many progress calls
  std::vector<float> buf(n, 1.0f);
  auto req = std::make_shared<mpi::request>(mpi::iallreduce(world(), fc::span<float>(buf), fc::op::sum));
  auto done = fc::progress_engine::instance().submit([req] { return req->test(); }, "allreduce in background");
  // "Compute": a dependent arithmetic chain, checking only an atomic flag.
  volatile double x = 1.0;
  const auto start = std::chrono::steady_clock::now();
  while (!done->done() && std::chrono::steady_clock::now() - start < std::chrono::seconds(60))
    for (int i = 0; i < 10000; ++i) x = x * 1.0000001 + 1e-9;
  BOOST_TEST_REQUIRE(done->done());
  done->wait();
  bool ok = true;
  for (float v : buf) ok = ok && v == static_cast<float>(size);
  BOOST_TEST(fc::testing::all_ranks(ok));
}

BOOST_AUTO_TEST_CASE(an_mpi_error_in_the_engine_reaches_the_caller) {
  const int rank = world().rank(), size = world().size();
  std::vector<int> send(32, rank), recv(8);
  auto r = std::make_shared<mpi::request>(mpi::irecv(world(), fc::span<int>(recv), (rank + size - 1) % size, 3));
  auto s = mpi::isend(world(), fc::span<const int>(send), (rank + 1) % size, 3);
  auto done = fc::progress_engine::instance().submit([r] { return r->test(); }, "short receive");
  // Alone in the world under Open MPI, the short receive is no error (mpi/implementation.hpp).
  if (size > 1 || fc::mpi_implementation::reports_truncation_to_self)
    BOOST_CHECK_THROW(done->wait(), fc::error);
  else
    done->wait();
  s.wait();
  BOOST_TEST(fc::testing::all_ranks(true));
}
