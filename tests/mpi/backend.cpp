#define BOOST_TEST_MODULE mpi_backend
#include "mpi_fixture.hpp"
#include "exact_values.hpp"

#include <boost/mpl/list.hpp>

#include <cstdint>
#include <numeric>
#include <vector>

namespace fc = flexcomm;
using fc::testing::world;
using fc::mpi;

using fc::testing::all_ops;
using fc::testing::counts;
using fc::testing::data;
using fc::testing::element_types;
using fc::testing::expected;
using fc::testing::same;

BOOST_AUTO_TEST_CASE_TEMPLATE(allreduce_matches_every_op, T, element_types) {
  const int rank = world().rank(), size = world().size();
  for (std::size_t n : counts)
    for (fc::op o : all_ops) {
      const auto send = data<T>(rank, n);
      std::vector<T> out(n), in_place = send;
      auto a = mpi::iallreduce<T>(world(), send, fc::span<T>(out), o);
      auto b = mpi::iallreduce(world(), fc::span<T>(in_place), o);
      a.wait();
      b.wait();
      const auto want = expected<T>(o, size, n);
      BOOST_TEST(fc::testing::all_ranks(same(out, want, n) && same(in_place, want, n)),
                 "n=" << n << " op=" << fc::name_of(o));
    }
}

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

BOOST_AUTO_TEST_CASE_TEMPLATE(reduce_lands_at_each_root, T, element_types) {
  const int rank = world().rank(), size = world().size();
  for (int root = 0; root < size; ++root)
    for (fc::op o : all_ops) {
      const std::size_t n = 37;
      const auto send = data<T>(rank, n);
      std::vector<T> out(rank == root ? n : 0);
      mpi::ireduce<T>(world(), send, fc::span<T>(out), o, root).wait();
      BOOST_TEST(fc::testing::all_ranks(rank != root || same(out, expected<T>(o, size, n), n)));
    }
}

BOOST_AUTO_TEST_CASE_TEMPLATE(bcast_from_each_root, T, element_types) {
  const int rank = world().rank(), size = world().size();
  for (int root = 0; root < size; ++root)
    for (std::size_t n : counts) {
      auto buf = rank == root ? data<T>(root, n) : std::vector<T>(n);
      mpi::ibcast(world(), fc::span<T>(buf), root).wait();
      BOOST_TEST(fc::testing::all_ranks(same(buf, data<T>(root, n), n)));
    }
}

BOOST_AUTO_TEST_CASE_TEMPLATE(gatherv_and_allgatherv_with_uneven_counts, T, element_types) {
  const int rank = world().rank(), size = world().size();
  std::vector<int> per_rank(static_cast<std::size_t>(size));
  for (int r = 0; r < size; ++r) per_rank[static_cast<std::size_t>(r)] = (r * 5) % 4;  // includes zero
  const int total = std::accumulate(per_rank.begin(), per_rank.end(), 0);
  const auto mine = data<T>(rank, static_cast<std::size_t>(per_rank[static_cast<std::size_t>(rank)]));
  std::vector<T> want;
  for (int r = 0; r < size; ++r) {
    const auto part = data<T>(r, static_cast<std::size_t>(per_rank[static_cast<std::size_t>(r)]));
    want.insert(want.end(), part.begin(), part.end());
  }
  for (int root = 0; root < size; ++root) {
    std::vector<T> out(rank == root ? static_cast<std::size_t>(total) : 0);
    mpi::igatherv<T>(world(), mine, fc::span<T>(out), fc::span<const int>(per_rank), root).wait();
    BOOST_TEST(fc::testing::all_ranks(rank != root || same(out, want, want.size())));
  }
  std::vector<T> all(static_cast<std::size_t>(total));
  mpi::iallgatherv<T>(world(), mine, fc::span<T>(all), fc::span<const int>(per_rank)).wait();
  BOOST_TEST(fc::testing::all_ranks(same(all, want, want.size())));
}

BOOST_AUTO_TEST_CASE_TEMPLATE(allgather_and_reduce_scatter, T, element_types) {
  const int rank = world().rank(), size = world().size();
  for (std::size_t n : counts) {
    const auto mine = data<T>(rank, n);
    std::vector<T> all(n * static_cast<std::size_t>(size));
    mpi::iallgather<T>(world(), mine, fc::span<T>(all)).wait();
    bool ok = true;
    for (int r = 0; r < size; ++r) {
      const auto part = data<T>(r, n);
      ok = ok && same(std::vector<T>(all.begin() + static_cast<long>(n) * r, all.end()), part, n);
    }
    BOOST_TEST(fc::testing::all_ranks(ok), "allgather n=" << n);
    // Reduce-scatter of n elements: block sizes that differ when n is not divisible by size.
    std::vector<int> blocks(static_cast<std::size_t>(size));
    for (int r = 0; r < size; ++r)
      blocks[static_cast<std::size_t>(r)] = static_cast<int>(n / size + (static_cast<std::size_t>(r) < n % size));
    for (fc::op o : all_ops) {
      std::vector<T> out(static_cast<std::size_t>(blocks[static_cast<std::size_t>(rank)]));
      mpi::ireduce_scatter<T>(world(), mine, fc::span<T>(out), fc::span<const int>(blocks), o).wait();
      const auto want = expected<T>(o, size, n);
      const std::size_t offset = std::accumulate(blocks.begin(), blocks.begin() + rank, std::size_t{0});
      BOOST_TEST(fc::testing::all_ranks(same(out, std::vector<T>(want.begin() + static_cast<long>(offset), want.end()),
                                             out.size())),
                 "reduce_scatter n=" << n << " op=" << fc::name_of(o));
    }
  }
}

BOOST_AUTO_TEST_CASE(point_to_point_ring) {
  const int rank = world().rank(), size = world().size();
  const auto mine = data<float>(rank, 100);
  std::vector<float> got(100);
  auto r = mpi::irecv(world(), fc::span<float>(got), (rank + size - 1) % size, 7);
  auto s = mpi::isend(world(), fc::span<const float>(mine), (rank + 1) % size, 7);
  s.wait();
  r.wait();
  BOOST_TEST(fc::testing::all_ranks(got == data<float>((rank + size - 1) % size, 100)));
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
  BOOST_TEST(fc::testing::all_ranks(reported && recv[16] == -1));
}

BOOST_AUTO_TEST_CASE(local_size_mistakes_are_named_errors) {
  std::vector<float> a(4), b(5);
  BOOST_CHECK_EXCEPTION(mpi::iallreduce<float>(world(), a, fc::span<float>(b), fc::op::sum), fc::error,
                        [](const fc::error& e) { return std::string(e.cause()) == "send holds 4 elements, receive holds 5"; });
  BOOST_CHECK_THROW(mpi::ibcast(world(), fc::span<float>(a), world().size()), fc::error);
  BOOST_CHECK_THROW(mpi::iallgather<float>(world(), a, fc::span<float>(b)), fc::error);
  std::vector<int> bad_counts(static_cast<std::size_t>(world().size()) + 1, 0);
  BOOST_CHECK_THROW(mpi::iallgatherv<float>(world(), a, fc::span<float>(b), fc::span<const int>(bad_counts)), fc::error);
  // A peer outside the communicator is refused by name, as on the nccl and staged backends.
  const int n = world().size();
  BOOST_CHECK_EXCEPTION(mpi::isend(world(), fc::span<const float>(a), n, 3), fc::error, [n](const fc::error& e) {
    return std::string(e.cause()) == fc::cat("peer ", n, " is not a rank of ", n);
  });
  BOOST_CHECK_EXCEPTION(mpi::irecv(world(), fc::span<float>(b), -1, 3), fc::error, [n](const fc::error& e) {
    return std::string(e.cause()) == fc::cat("peer -1 is not a rank of ", n);
  });
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
