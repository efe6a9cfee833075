// The MPI backend on host memory: the cases every backend runs (tests/backend_cases.hpp), and
// what only MPI has: agreement with plain MPI calls, truncation reported as an error, and
// communicators that are MPI communicators (congruent duplicates, world ranks, moves).
#define BOOST_TEST_MODULE mpi_backend
#include "mpi_fixture.hpp"

#include <cstdint>
#include <string>
#include <vector>

using backend = flexcomm::mpi;

#include "backend_cases.hpp"

using fc::mpi;

// The same operations through plain blocking MPI on MPI_COMM_WORLD, for the types MPI knows.
BOOST_AUTO_TEST_CASE(every_operation_agrees_with_plain_mpi) {
  const int rank = world().rank(), size = world().size();
  const int root = size - 1;
  for (std::size_t n : counts) {
    const int count = static_cast<int>(n);
    const auto send = data<float>(rank, n);
    const auto isend = data<std::int32_t>(rank, n);
    bool ok = true;
    std::vector<float> ours(n), theirs(n);
    mpi::iallreduce<float>(world(), send, fc::span<float>(ours), fc::op::max).wait();
    MPI_Allreduce(send.data(), theirs.data(), count, MPI_FLOAT, MPI_MAX, MPI_COMM_WORLD);
    ok = ok && ours == theirs;
    std::vector<std::int32_t> iours(n), itheirs(n);
    mpi::ireduce<std::int32_t>(world(), isend, fc::span<std::int32_t>(iours), fc::op::prod, root).wait();
    MPI_Reduce(isend.data(), itheirs.data(), count, MPI_INT32_T, MPI_PROD, root, MPI_COMM_WORLD);
    ok = ok && (rank != root || iours == itheirs);
    auto bours = send, btheirs = send;
    mpi::ibcast(world(), fc::span<float>(bours), root).wait();
    MPI_Bcast(btheirs.data(), count, MPI_FLOAT, root, MPI_COMM_WORLD);
    ok = ok && bours == btheirs;
    std::vector<float> gours(n * static_cast<std::size_t>(size)), gtheirs(gours.size());
    mpi::iallgather<float>(world(), send, fc::span<float>(gours)).wait();
    MPI_Allgather(send.data(), count, MPI_FLOAT, gtheirs.data(), count, MPI_FLOAT, MPI_COMM_WORLD);
    ok = ok && gours == gtheirs;
    std::vector<int> each(static_cast<std::size_t>(size), count);
    std::vector<int> displs(static_cast<std::size_t>(size));
    for (int r = 0; r < size; ++r) displs[static_cast<std::size_t>(r)] = r * count;
    std::vector<std::int32_t> vours(n * static_cast<std::size_t>(size)), vtheirs(vours.size());
    mpi::igatherv<std::int32_t>(world(), isend, fc::span<std::int32_t>(vours), fc::span<const int>(each), root).wait();
    MPI_Gatherv(isend.data(), count, MPI_INT32_T, vtheirs.data(), each.data(), displs.data(), MPI_INT32_T, root,
                MPI_COMM_WORLD);
    ok = ok && (rank != root || vours == vtheirs);
    // reduce_scatter: rank r gets n elements of the sum of everyone's n*size elements.
    const auto big = data<std::int32_t>(rank, n * static_cast<std::size_t>(size));
    std::vector<std::int32_t> rours(n), rtheirs(n);
    mpi::ireduce_scatter<std::int32_t>(world(), big, fc::span<std::int32_t>(rours), fc::span<const int>(each),
                                       fc::op::sum).wait();
    MPI_Reduce_scatter(big.data(), rtheirs.data(), each.data(), MPI_INT32_T, MPI_SUM, MPI_COMM_WORLD);
    ok = ok && rours == rtheirs;
    BOOST_TEST(fc::testing::all_ranks(ok), "n=" << n);
  }
}

BOOST_AUTO_TEST_CASE(a_larger_message_than_the_buffer_is_an_error_not_an_overrun) {
  const int rank = world().rank(), size = world().size();
  std::vector<int> send(64, 1), recv(16 + 1, -1);
  auto r = mpi::irecv(world(), fc::span<int>(recv.data(), 16), (rank + size - 1) % size, 9);
  auto s = mpi::isend(world(), fc::span<const int>(send), (rank + 1) % size, 9);
  bool reported = false;
  try {
    r.wait();
  } catch (const fc::error& e) {
    reported = std::string(e.what()).find("irecv") != std::string::npos && e.rank() == rank;
  }
  s.wait();
  // Alone in the world, only the absence of an overrun can be checked under Open MPI.
  const bool reportable = size > 1 || fc::mpi_implementation::reports_truncation_to_self;
  BOOST_TEST(fc::testing::all_ranks((reported || !reportable) && recv[16] == -1));
}

BOOST_AUTO_TEST_CASE(split_dup_and_private_traffic) {
  const int rank = world().rank();
  auto halves = world().split(rank % 2, rank, "half");
  BOOST_TEST(halves.size() == (world().size() + 1 - rank % 2) / 2);
  BOOST_TEST(halves.name() == "half");
  auto none = world().split(rank == 0 ? mpi::communicator::undefined : 1, rank, "not rank 0");
  BOOST_TEST(static_cast<bool>(none) == (rank != 0));
  auto copy = halves.dup("half copy");
  int sum = 1;
  mpi::iallreduce(copy, fc::span<int>(&sum, 1), fc::op::sum).wait();
  BOOST_TEST(sum == copy.size());
  BOOST_TEST(copy.world_rank_of(copy.rank()) == rank);
  // The trainer's own traffic on MPI_COMM_WORLD with the same tag does not meet ours.
  int result = MPI_UNDEFINED;
  MPI_Comm_compare(world().native(), MPI_COMM_WORLD, &result);
  BOOST_TEST(result == MPI_CONGRUENT);
  mpi::communicator moved = std::move(copy);
  BOOST_TEST(!copy);
  BOOST_TEST(static_cast<bool>(moved));
}

// Two collectives posted back to back on one communicator reach MPI in posting order on every
// rank, whichever request is tested first: on Open MPI a collective is posted only once its
// consistency check agreed (mpi/deferred_post.hpp), and here even ranks test the second request
// first while odd ranks test the first, so a post made by the request being tested would pair
// an allreduce with a broadcast. Then the same pair left to their destructors (the second
// destroyed first), and moved before either is tested.
BOOST_AUTO_TEST_CASE(collectives_reach_mpi_in_posting_order_whichever_is_tested_first) {
  const int rank = world().rank(), size = world().size();
  auto comm = world().dup("posting order");
  const float expected = static_cast<float>(size * (size + 1) / 2);
  bool ok = true;
  for (int round = 0; round < 3; ++round) {
    std::vector<float> sum(1000, static_cast<float>(rank + 1));
    std::vector<std::int64_t> value(3, rank == 0 ? 42 + round : -1);
    {
      auto first = mpi::iallreduce(comm, fc::span<float>(sum), fc::op::sum);
      auto second = mpi::ibcast(comm, fc::span<std::int64_t>(value), 0);
      if (round == 0) {
        if (rank % 2 == 0) {
          second.wait();
          first.wait();
        } else {
          first.wait();
          second.wait();
        }
      } else if (round == 2) {
        mpi::request later = std::move(second);
        mpi::request earlier = std::move(first);
        ok = ok && !first.pending() && !second.pending();
        later.wait();
      }
      // round 1 (and what round 2 left): destroyed in reverse order, each destructor waits.
    }
    for (float x : sum) ok = ok && x == expected;
    for (auto v : value) ok = ok && v == 42 + round;
  }
  BOOST_TEST(fc::testing::all_ranks(ok));
}

// A posted collective keeps going while its rank waits on something else: rank 0 receives from
// every peer before waiting on the allreduce, and each peer sends only once its allreduce is
// done. Where collectives wait for their check (Open MPI), waiting on the receives must still
// hand rank 0's allreduce to MPI.
BOOST_AUTO_TEST_CASE(a_collective_progresses_while_its_rank_waits_on_another_request) {
  const int rank = world().rank(), size = world().size();
  auto comm = world().dup("progress elsewhere");
  std::vector<std::int32_t> sum(16, 1);
  auto reduce = mpi::iallreduce(comm, fc::span<std::int32_t>(sum), fc::op::sum);
  std::vector<std::int32_t> heard(static_cast<std::size_t>(size), 0);
  if (rank == 0) {
    for (int peer = 1; peer < size; ++peer)
      mpi::irecv(world(), fc::span<std::int32_t>(&heard[static_cast<std::size_t>(peer)], 1), peer, 11).wait();
    reduce.wait();
  } else {
    reduce.wait();
    std::int32_t done = sum[0];
    mpi::isend(world(), fc::span<const std::int32_t>(&done, 1), 0, 11).wait();
  }
  bool ok = true;
  for (auto x : sum) ok = ok && x == size;
  for (int peer = 1; rank == 0 && peer < size; ++peer) ok = ok && heard[static_cast<std::size_t>(peer)] == size;
  BOOST_TEST(fc::testing::all_ranks(ok));
}
