// The test cases every backend runs (mpi on host memory; nccl and staged on device memory):
// every operation, element type and op against the host reference of tests/exact_values.hpp, on
// buffers of the backend's memory space (tests/test_buffer.hpp), on the communicator's own stream
// and on an explicit one, plus the argument checks, communicators and local hooks all backends
// share. A case that holds for some backends only says so in a decorator (reported as disabled
// elsewhere). Include after the program's fixture with `using backend = <backend>;` in scope:
// tests/mpi_fixture.hpp, or tests/gpu/gpu_fixture.hpp and tests/gpu/device_buffer.hpp.
#pragma once

#include <boost/mpl/list.hpp>
#include <boost/test/unit_test.hpp>

#include "exact_values.hpp"
#include "test_buffer.hpp"

#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>
#include <numeric>
#include <string>
#include <type_traits>
#include <vector>

namespace fc = flexcomm;
using fc::testing::all_ops;
using fc::testing::counts;
using fc::testing::data;
using fc::testing::element_types;
using fc::testing::expected;
using fc::testing::same;
using fc::testing::world;

namespace {

const typename backend::communicator& comm() { return fc::testing::backend_world<backend>(); }

template <class T>
using test_buffer = fc::testing::test_buffer<backend::memory, T>;
using side_stream = fc::testing::side_stream<backend::memory>;
// The communicator's own stream.
constexpr typename backend::stream own_stream{};

// How a result under `o` is compared with the reference: exactly, except averages of floating
// types on a device backend, which may scale before summing (ncclAvg; see exact_values.hpp).
// On the host, avg is a sum divided afterwards, as the reference computes it: exact.
constexpr fc::op compared_as(fc::op o) { return fc::holds_host_memory<backend> ? fc::op::sum : o; }

// Device communicators carry an MPI communicator over the same ranks (control()); the MPI
// backend's communicator is one itself.
template <class C>
bool control_matches(const C& c) {
  if constexpr (fc::holds_host_memory<backend>)
    return true;
  else
    return c.control().size() == c.size() && c.control().rank() == c.rank();
}

// Backends built over a host backend take its communicators (nccl and staged over mpi).
constexpr bool built_over_mpi = !std::is_same_v<fc::host_backend_t<backend>, backend>;

}  // namespace

BOOST_AUTO_TEST_CASE_TEMPLATE(allreduce_matches_every_op, T, element_types) {
  const int rank = world().rank(), size = world().size();
  side_stream side;
  for (std::size_t n : counts)
    for (fc::op o : all_ops) {
      const auto host = data<T>(rank, n);
      test_buffer<T> send(host), out(n), in_place(host);
      auto a = backend::template iallreduce<T>(comm(), send.cspan(), out.span(), o);
      auto b = backend::iallreduce(comm(), in_place.span(), o, side.s);
      a.wait();
      b.wait();
      const auto want = expected<T>(o, size, n);
      BOOST_TEST(fc::testing::all_ranks(same(out.host(), want, n, compared_as(o)) &&
                                        same(in_place.host(), want, n, compared_as(o))),
                 "n=" << n << " op=" << fc::name_of(o));
    }
}

BOOST_AUTO_TEST_CASE_TEMPLATE(reduce_lands_at_each_root, T, element_types) {
  const int rank = world().rank(), size = world().size();
  for (int root = 0; root < size; ++root)
    for (fc::op o : all_ops) {
      const std::size_t n = 37;
      test_buffer<T> send(data<T>(rank, n)), out(rank == root ? n : 0);
      backend::template ireduce<T>(comm(), send.cspan(), out.span(), o, root).wait();
      BOOST_TEST(fc::testing::all_ranks(rank != root || same(out.host(), expected<T>(o, size, n), n, compared_as(o))),
                 "root=" << root << " op=" << fc::name_of(o));
    }
}

BOOST_AUTO_TEST_CASE_TEMPLATE(bcast_from_each_root, T, element_types) {
  const int rank = world().rank(), size = world().size();
  side_stream side;
  for (int root = 0; root < size; ++root)
    for (std::size_t n : counts) {
      test_buffer<T> buf(rank == root ? data<T>(root, n) : std::vector<T>(n));
      backend::ibcast(comm(), buf.span(), root, root % 2 ? side.s : own_stream).wait();
      BOOST_TEST(fc::testing::all_ranks(same(buf.host(), data<T>(root, n), n)), "root=" << root << " n=" << n);
    }
}

BOOST_AUTO_TEST_CASE_TEMPLATE(gatherv_and_allgatherv_with_uneven_counts, T, element_types) {
  const int rank = world().rank(), size = world().size();
  std::vector<int> per_rank(static_cast<std::size_t>(size));
  for (int r = 0; r < size; ++r) per_rank[static_cast<std::size_t>(r)] = (r * 5) % 4;  // includes zero
  const int total = std::accumulate(per_rank.begin(), per_rank.end(), 0);
  test_buffer<T> mine(data<T>(rank, static_cast<std::size_t>(per_rank[static_cast<std::size_t>(rank)])));
  std::vector<T> want;
  for (int r = 0; r < size; ++r) {
    const auto part = data<T>(r, static_cast<std::size_t>(per_rank[static_cast<std::size_t>(r)]));
    want.insert(want.end(), part.begin(), part.end());
  }
  for (int root = 0; root < size; ++root) {
    test_buffer<T> out(rank == root ? static_cast<std::size_t>(total) : 0);
    backend::template igatherv<T>(comm(), mine.cspan(), out.span(), fc::span<const int>(per_rank), root).wait();
    BOOST_TEST(fc::testing::all_ranks(rank != root || same(out.host(), want, want.size())), "root=" << root);
  }
  test_buffer<T> all(static_cast<std::size_t>(total));
  backend::template iallgatherv<T>(comm(), mine.cspan(), all.span(), fc::span<const int>(per_rank)).wait();
  BOOST_TEST(fc::testing::all_ranks(same(all.host(), want, want.size())));
}

BOOST_AUTO_TEST_CASE_TEMPLATE(allgather_and_reduce_scatter, T, element_types) {
  const int rank = world().rank(), size = world().size();
  for (std::size_t n : counts) {
    test_buffer<T> mine(data<T>(rank, n)), all(n * static_cast<std::size_t>(size));
    backend::template iallgather<T>(comm(), mine.cspan(), all.span()).wait();
    const auto got = all.host();
    bool ok = true;
    for (int r = 0; r < size; ++r)
      ok = ok && same(std::vector<T>(got.begin() + static_cast<long>(n) * r, got.end()), data<T>(r, n), n);
    BOOST_TEST(fc::testing::all_ranks(ok), "allgather n=" << n);
    // Blocks that differ when n is not divisible by size; then all equal (NCCL's native path).
    for (bool even : {false, true}) {
      std::vector<int> blocks(static_cast<std::size_t>(size));
      for (int r = 0; r < size; ++r)
        blocks[static_cast<std::size_t>(r)] =
            static_cast<int>(even ? n / size : n / size + (static_cast<std::size_t>(r) < n % size));
      for (fc::op o : all_ops) {
        test_buffer<T> out(static_cast<std::size_t>(blocks[static_cast<std::size_t>(rank)]));
        backend::template ireduce_scatter<T>(comm(), mine.cspan(), out.span(), fc::span<const int>(blocks), o).wait();
        const auto want = expected<T>(o, size, n);
        const std::size_t offset = std::accumulate(blocks.begin(), blocks.begin() + rank, std::size_t{0});
        BOOST_TEST(fc::testing::all_ranks(same(out.host(), std::vector<T>(want.begin() + static_cast<long>(offset), want.end()),
                                               static_cast<std::size_t>(blocks[static_cast<std::size_t>(rank)]),
                                               compared_as(o))),
                   "reduce_scatter n=" << n << " even=" << even << " op=" << fc::name_of(o));
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(point_to_point_ring) {
  const int rank = world().rank(), size = world().size();
  const int next = (rank + 1) % size, prev = (rank + size - 1) % size;
  side_stream side;
  for (int round = 0; round < 3; ++round) {  // several messages between the same pair keep their order
    test_buffer<float> mine(data<float>(rank + round, 100)), got(100);
    auto r = backend::irecv(comm(), got.span(), prev, 7, round == 1 ? side.s : own_stream);
    auto s = backend::isend(comm(), mine.cspan(), next, 7);
    if (round != 2) {
      r.wait();  // waiting on the receive first must not hang on the unlaunched send
      s.wait();
    } else {
      s.wait();  // nor the send first on the receive
      r.wait();
    }
    BOOST_TEST(fc::testing::all_ranks(same(got.host(), data<float>(prev + round, 100), 100)), "round " << round);
  }
}

// The local work adapters do besides communication (host loops on mpi, kernels on the device
// backends), and the backend's scratch space, in the memory its buffers live in.
BOOST_AUTO_TEST_CASE(local_hooks_combine_divide_copy) {
  const std::size_t n = 1001;
  test_buffer<float> a(data<float>(1, n)), b(data<float>(2, n)), c(n);
  typename backend::template buffer<float> scratch;
  scratch.resize(7);
  scratch.resize(n);
  backend::combine(fc::op::sum, a.span().data(), b.cspan().data(), n);
  backend::divide(a.span().data(), n, 2);
  backend::copy(scratch.data(), a.cspan().data(), n * sizeof(float));
  backend::copy(c.span().data(), scratch.data(), n * sizeof(float));
  BOOST_TEST(scratch.size() == n);
  auto want = data<float>(1, n);
  const auto other = data<float>(2, n);
  fc::combine(fc::op::sum, want.data(), other.data(), n);
  fc::divide_by(want.data(), n, 2);
  BOOST_TEST(fc::testing::all_ranks(same(c.host(), want, n)));
}

BOOST_AUTO_TEST_CASE(local_size_mistakes_are_named_errors) {
  test_buffer<float> a(4), b(5);
  BOOST_CHECK_EXCEPTION(backend::template iallreduce<float>(comm(), a.cspan(), b.span(), fc::op::sum), fc::error,
                        [](const fc::error& e) { return std::string(e.cause()) == "send holds 4 elements, receive holds 5"; });
  BOOST_CHECK_THROW(backend::ibcast(comm(), a.span(), world().size()), fc::error);
  BOOST_CHECK_THROW(backend::template iallgather<float>(comm(), a.cspan(), b.span()), fc::error);
  std::vector<int> bad_counts(static_cast<std::size_t>(world().size()) + 1, 0);
  BOOST_CHECK_THROW(backend::template iallgatherv<float>(comm(), a.cspan(), b.span(), fc::span<const int>(bad_counts)),
                    fc::error);
  // A peer outside the communicator is refused by name.
  const int n = world().size();
  BOOST_CHECK_EXCEPTION(backend::isend(comm(), a.cspan(), n, 3), fc::error, [n](const fc::error& e) {
    return std::string(e.cause()) == fc::cat("peer ", n, " is not a rank of ", n);
  });
  BOOST_CHECK_EXCEPTION(backend::irecv(comm(), b.span(), -1, 3), fc::error, [n](const fc::error& e) {
    return std::string(e.cause()) == fc::cat("peer -1 is not a rank of ", n);
  });
  // The operations still line up across ranks afterwards.
  test_buffer<int> one(std::vector<int>{1});
  backend::iallreduce(comm(), one.span(), fc::op::sum).wait();
  BOOST_TEST(fc::testing::all_ranks(one.host()[0] == world().size()));
}

BOOST_AUTO_TEST_CASE(split_into_halves_and_dup) {
  const int rank = world().rank(), size = world().size();
  // Odd ranks of a world of 3 or more sit out: they take part in the split and get nothing.
  const bool sits_out = size >= 3 && rank == size - 1;
  auto halves = comm().split(sits_out ? backend::communicator::undefined : rank % 2, rank, "half");
  bool ok = static_cast<bool>(halves) == !sits_out;
  if (halves) {
    test_buffer<int> x(std::vector<int>{rank, 1});
    backend::iallreduce(halves, x.span(), fc::op::sum).wait();
    int want_sum = 0, want_count = 0;
    for (int r = 0; r < size; ++r)
      if (r % 2 == rank % 2 && !(size >= 3 && r == size - 1)) want_sum += r, ++want_count;
    const auto got = x.host();
    ok = ok && got[0] == want_sum && got[1] == want_count && halves.size() == want_count && halves.name() == "half" &&
         control_matches(halves);
  }
  auto copy = comm().dup("copy");
  test_buffer<int> y(std::vector<int>{rank});
  backend::iallreduce(copy, y.span(), fc::op::max).wait();
  ok = ok && y.host()[0] == size - 1 && copy.size() == size;
  BOOST_TEST(fc::testing::all_ranks(ok));
}

// set_timeout and the flight recorder, the same on every backend (the MPI backend's watchdog
// itself: tests/mpi/watchdog.cpp).
BOOST_AUTO_TEST_CASE(each_communicator_keeps_its_own_timeout_and_flight_recorder) {
  using std::chrono::milliseconds;
  auto timed = comm().dup("timed");
  timed.set_timeout(milliseconds{1234});
  bool ok = timed.timeout() == milliseconds{1234} && comm().timeout() == fc::default_timeout();
  test_buffer<int> x(std::vector<int>{1});
  backend::iallreduce(timed, x.span(), fc::op::sum).wait();
  const fc::flight_recorder* recorder = timed.recorder();
  ok = ok && recorder != nullptr && recorder->last_completed() >= 1 && recorder->in_flight() == 0;
  timed.set_timeout(milliseconds{-1});
  ok = ok && timed.timeout() == fc::default_timeout();
  BOOST_TEST(fc::testing::all_ranks(ok));
}

BOOST_AUTO_TEST_CASE(operations_on_an_empty_communicator_are_errors) {
  typename backend::communicator empty;
  test_buffer<float> a(std::vector<float>{1.f});
  BOOST_CHECK_THROW(backend::iallreduce(empty, a.span(), fc::op::sum), fc::error);
}

// An MPI communicator converts to the device backend's (collectively), as the pipeline's
// Sync slot needs: overlapped_ring<B>(member_comm) with member_comm an mpi::communicator.
BOOST_AUTO_TEST_CASE(an_mpi_communicator_converts, *boost::unit_test::enable_if<built_over_mpi>()) {
  auto sum_of_ranks = [](const typename backend::communicator& c) {
    test_buffer<int> x(std::vector<int>{c.rank()});
    backend::iallreduce(c, x.span(), fc::op::sum).wait();
    return x.host()[0];
  };
  const int size = world().size();
  BOOST_TEST(fc::testing::all_ranks(sum_of_ranks(world()) == size * (size - 1) / 2));
}

// Several operations in flight at once, waited for in reverse: every backend completes them
// whatever order they are waited in, and matches none with the wrong operation (on staged, with
// FLEXCOMM_STAGE_CHUNK small, dozens of chunks each, whose transfers still begin in call order).
BOOST_AUTO_TEST_CASE(many_operations_in_flight_waited_out_of_order) {
  const int rank = world().rank(), size = world().size();
  const std::size_t n = 3001;  // 12 kB of floats
  std::vector<std::unique_ptr<test_buffer<float>>> bufs;
  std::vector<typename backend::request> requests;
  for (int k = 0; k < 4; ++k) {
    bufs.push_back(std::make_unique<test_buffer<float>>(data<float>(rank + k, n)));
    requests.push_back(backend::iallreduce(comm(), bufs.back()->span(), fc::op::max));
  }
  for (int k = 3; k >= 0; --k) requests[static_cast<std::size_t>(k)].wait();
  bool ok = true;
  for (int k = 0; k < 4; ++k) {
    std::vector<float> want = data<float>(k, n);
    for (int r = 1; r < size; ++r) {
      const auto other = data<float>(r + k, n);
      fc::combine(fc::op::max, want.data(), other.data(), n);
    }
    ok = ok && same(bufs[static_cast<std::size_t>(k)]->host(), want, n);
  }
  BOOST_TEST(fc::testing::all_ranks(ok));
}

// Backends with MPI's message matching (mpi, and staged on its host copies): the receive buffer
// keeps what a shorter message does not cover. NCCL needs both sides to name the same count.
BOOST_AUTO_TEST_CASE(a_shorter_message_leaves_the_rest_of_the_buffer,
                     *boost::unit_test::enable_if<fc::matches_by_tag<backend>>()) {
  const int rank = world().rank(), size = world().size();
  test_buffer<int> send(std::vector<int>(10, rank)), recv(std::vector<int>(20, -7));
  auto r = backend::irecv(comm(), recv.span(), (rank + size - 1) % size, 3);
  auto s = backend::isend(comm(), send.cspan(), (rank + 1) % size, 3);
  r.wait();
  s.wait();
  const auto got = recv.host();
  bool ok = true;
  for (std::size_t i = 0; i < 20; ++i) ok = ok && got[i] == (i < 10 ? (rank + size - 1) % size : -7);
  BOOST_TEST(fc::testing::all_ranks(ok));
}
