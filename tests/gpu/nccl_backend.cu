// The nccl backend on device buffers: every operation, element type and op against the host
// reference; NCCL-specific behaviour (host pointers refused, a hang becomes an abort and an error).
#define BOOST_TEST_MODULE gpu_nccl_backend
#include "gpu_fixture.hpp"

#include <flexcomm/backend/nccl.hpp>

using backend = flexcomm::nccl;

// Runs first: two ranks on one GPU need the test-only environment of tests/gpu/nccl_env.sh.
BOOST_AUTO_TEST_CASE(ranks_sharing_a_gpu_have_distinct_nccl_host_ids) {
  const auto problem = flexcomm::testing::nccl_gpu_sharing_problem();
  BOOST_TEST_REQUIRE(flexcomm::testing::all_ranks(problem.empty()), problem);
}

#include "device_buffer.hpp"
#include "post_cost.hpp"
#include "../backend_cases.hpp"

BOOST_AUTO_TEST_CASE(host_buffers_are_refused_by_name) {
  std::vector<float> host(8, 1.f);
  BOOST_CHECK_EXCEPTION(backend::iallreduce(comm(), fc::span<float>(host), fc::op::sum), fc::error,
                        [](const fc::error& e) { return std::string(e.cause()).find("host memory") != std::string::npos; });
}

BOOST_AUTO_TEST_CASE(the_communicator_reports_its_shape) {
  BOOST_TEST(fc::testing::all_ranks(comm().rank() == world().rank() && comm().size() == world().size() &&
                                    comm().native() != nullptr && comm().own_stream() != nullptr));
}

// Rank 0 reduces alone on a private duplicate: instead of hanging, the operation times out after
// the communicator's own limit, the error names the ranks that did not arrive (asked over MPI, as
// the MPI backend's watchdog does) and the communicator is aborted (ncclCommAbort); a later
// operation on it is refused by name, and the world communicator still works: since NCCL could
// cancel, the job need not end. On a fresh duplicate the timeout comes in NCCL's enqueue, which
// connects the ranks at a communicator's first collective (the second GPU run: that path ended
// the job, the consistency check of the call already out); on one whose ranks met once, in the
// wait. The other ranks keep their duplicate alive until rank 0 is done with it, so that rank 0
// times out rather than seeing their communicators go away (a remote error on a GPU).
namespace {
void a_missing_rank_times_out(bool connected) {
  if (world().size() < 2) return;
  bool ok = true;
  std::string cause = "(no error)";
  {
    auto lonely = comm().dup("lonely");
    lonely.set_timeout(std::chrono::milliseconds{1500});
    test_buffer<float> x(std::vector<float>(16, 1.f));
    if (connected) backend::iallreduce(lonely, x.span(), fc::op::sum).wait();
    if (world().rank() == 0) {
      try {
        backend::iallreduce(lonely, x.span(), fc::op::sum).wait();
        ok = false;
      } catch (const fc::error& e) {
        cause = e.cause();
        ok = cause.find("ncclCommAbort") != std::string::npos && cause.find("after 1500 ms") != std::string::npos &&
             cause.find("ranks that did not arrive: 1 (world 1)") != std::string::npos;
      }
      // Later operations on it are refused, not hung on.
      BOOST_CHECK_EXCEPTION(backend::iallreduce(lonely, x.span(), fc::op::sum), fc::error, [](const fc::error& e) {
        return std::string(e.cause()).find("was aborted") != std::string::npos;
      });
    }
    if (world().rank() == 0) BOOST_TEST_MESSAGE("rank 0's error: " << cause);
    BOOST_TEST(fc::testing::all_ranks(ok), "rank 0's error: " << cause);
  }
  BOOST_TEST(!fc::watchdog::instance().job_must_end());
  test_buffer<int> one(std::vector<int>{1});
  backend::iallreduce(comm(), one.span(), fc::op::sum).wait();
  BOOST_TEST(fc::testing::all_ranks(one.host()[0] == world().size()));
}
}  // namespace

BOOST_AUTO_TEST_CASE(a_missing_rank_becomes_an_abort_and_an_error) { a_missing_rank_times_out(false); }

BOOST_AUTO_TEST_CASE(a_missing_rank_after_the_first_collective_becomes_an_abort_and_an_error) {
  a_missing_rank_times_out(true);
}

// Sends and receives run on the communicator's blocking child (issue 52): a ring both ways and
// pairs give the right data, on a fresh duplicate (its first sends connect the pairs, blocking
// the host until the peer posts its side) and again once connected.
BOOST_AUTO_TEST_CASE(sends_and_receives_on_the_blocking_child_give_the_right_data) {
  auto c = comm().dup("blocking sends");
  const int n = c.size(), me = c.rank(), next = (me + 1) % n, prev = (me + n - 1) % n;
  const int partner = (me ^ 1) < n ? me ^ 1 : -1;
  BOOST_TEST(c.shared_state()->p2p != nullptr);
  bool ok = true;
  for (int round = 0; round < 2; ++round) {
    test_buffer<int> mine(std::vector<int>(64, me * 100 + round)), left(std::vector<int>(64, -1)),
        right(std::vector<int>(64, -1)), paired(std::vector<int>(32, -1));
    std::vector<backend::request> pending;
    pending.push_back(backend::irecv(c, left.span(), prev, 0));
    pending.push_back(backend::irecv(c, right.span(), next, 0));
    pending.push_back(backend::isend(c, mine.cspan(), next, 0));
    pending.push_back(backend::isend(c, mine.cspan(), prev, 0));
    for (auto& r : pending) r.wait();
    pending.clear();
    if (partner >= 0) {
      pending.push_back(backend::isend(c, mine.cspan().subspan(0, 32), partner, 0));
      pending.push_back(backend::irecv(c, paired.span(), partner, 0));
      for (auto& r : pending) r.wait();
    }
    ok = ok && left.host() == std::vector<int>(64, prev * 100 + round) &&
         right.host() == std::vector<int>(64, next * 100 + round) &&
         (partner < 0 || paired.host() == std::vector<int>(32, partner * 100 + round));
  }
  BOOST_TEST(fc::testing::all_ranks(ok));
}

// A peer that never posts its receive: on the blocking child the send's ncclGroupEnd waits for it
// (connecting the pair); past the communicator's timeout the watcher aborts the child, and the
// send becomes an error naming the rank that did not take part; the communicator is aborted, the
// job goes on. Rank 1 keeps its duplicate alive until rank 0 is done with it.
BOOST_AUTO_TEST_CASE(a_peer_that_never_posts_its_receive_is_a_named_error) {
  if (world().size() < 2) return;
  bool ok = true;
  std::string cause = "(no error)";
  test_buffer<float> x(std::vector<float>(16, 1.f));
  {
    auto lonely = comm().dup("lonely sends");
    lonely.set_timeout(std::chrono::milliseconds{1500});
    if (world().rank() == 0) {
      const auto start = std::chrono::steady_clock::now();
      try {
        backend::isend(lonely, x.cspan(), 1, 0).wait();
        ok = false;
      } catch (const fc::error& e) {
        cause = e.cause();
        ok = cause.find("the receive of rank 1") != std::string::npos &&
             cause.find("1500 ms (FLEXCOMM_TIMEOUT)") != std::string::npos &&
             cause.find("aborted with ncclCommAbort") != std::string::npos;
      }
      ok = ok && std::chrono::steady_clock::now() - start < std::chrono::seconds{10};
      BOOST_CHECK_EXCEPTION(backend::isend(lonely, x.cspan(), 1, 0), fc::error, [](const fc::error& e) {
        return std::string(e.cause()).find("was aborted") != std::string::npos;
      });
      BOOST_TEST_MESSAGE("rank 0's error: " << cause);
    }
    BOOST_TEST(fc::testing::all_ranks(ok), "rank 0's error: " << cause);
  }
  BOOST_TEST(!fc::watchdog::instance().job_must_end());
  test_buffer<int> one(std::vector<int>{1});
  backend::iallreduce(comm(), one.span(), fc::op::sum).wait();
  BOOST_TEST(fc::testing::all_ranks(one.host()[0] == world().size()));
}

// No tax over NCCL (issue 31, then 52): once the communicator has warmed up, a post allocates
// nothing beyond the raw calls it makes, takes one lock (its communicator's), and makes only the
// calls it needs: for a collective the device guard's cudaGetDevice, the NCCL call and the
// completion event's record, as a raw caller recording an event makes; for a send or receive,
// launched later in one group with the others, cudaGetDevice alone. With checks and timeouts at
// their defaults, at every rank count (the consistency check travels in batches). Counted on the
// stand-in (tests/gpu/post_cost.hpp).
BOOST_AUTO_TEST_CASE(a_post_allocates_nothing_and_takes_one_lock,
                     *boost::unit_test::enable_if<fc::device::counts_calls>()) {
  const auto& c = comm();
  const int ranks = c.size(), me = c.rank(), to = (me + 1) % ranks, from = (me + ranks - 1) % ranks;
  constexpr std::size_t n = 256;
  test_buffer<float> a(std::vector<float>(n, 1.f)), b(std::vector<float>(n * ranks, 1.f));
  const std::vector<int> blocks(static_cast<std::size_t>(ranks), static_cast<int>(n));
  std::vector<backend::request> pending;
  pending.reserve(64);
  auto settle = [&] {
    for (auto& r : pending) r.wait();
    pending.clear();
  };
  const auto stream = c.own_stream();
  fc::device::event_t event = nullptr;
  fc::check_cuda(fc::device::event_create(&event), "test: cudaEventCreate");
  // The raw calls of a collective: what a hand-written one makes, on the same communicator.
  auto raw = [&](auto nccl_call) {
    return [&, nccl_call] {
      int d = 0;
      fc::device::get_device(&d);
      fc::check_nccl(nccl_call(), "test: raw NCCL call");
      fc::check_cuda(fc::device::event_record(event, stream), "test: cudaEventRecord");
    };
  };
  // `post` posts `ops` operations; each may take one lock.
  auto row = [&](const char* name, auto post, auto raw_post, std::uint64_t calls, std::uint64_t ops = 1) {
    for (int warm = 0; warm < 3; ++warm) {
      for (int i = 0; i < 12; ++i) post();
      settle();
    }
    const auto ours = fc::testing::cost_of(post);
    settle();
    const auto theirs = fc::testing::cost_of(raw_post);
    fc::check_cuda(fc::device::stream_synchronize(stream), "test: cudaStreamSynchronize");
    BOOST_TEST_MESSAGE("rank " << me << " " << name << ": " << ours.allocations << " allocations (raw calls "
                               << theirs.allocations << "), " << ours.locks << " locks, " << ours.calls
                               << " device calls");
    BOOST_TEST(ours.allocations <= theirs.allocations, name);
    BOOST_TEST(ours.locks <= ops, name);
    BOOST_TEST(ours.calls <= calls, name);
  };
  const auto dt = fc::dtype::f32;
  row("allreduce in place", [&] { pending.push_back(backend::iallreduce(c, a.span(), fc::op::sum)); },
      raw([&] { return fc::device::nccl_allreduce(a.span().data(), a.span().data(), n, dt, fc::op::sum, c.native(), stream); }), 3);
  row("allreduce", [&] { pending.push_back(backend::iallreduce<float>(c, a.cspan(), b.span().subspan(0, n), fc::op::sum)); },
      raw([&] { return fc::device::nccl_allreduce(a.span().data(), b.span().data(), n, dt, fc::op::sum, c.native(), stream); }), 3);
  row("bcast", [&] { pending.push_back(backend::ibcast(c, a.span(), 0)); },
      raw([&] { return fc::device::nccl_broadcast(a.span().data(), a.span().data(), n, dt, 0, c.native(), stream); }), 3);
  row("reduce", [&] { pending.push_back(backend::ireduce<float>(c, a.cspan(), b.span().subspan(0, me == 0 ? n : 0), fc::op::max, 0)); },
      raw([&] { return fc::device::nccl_reduce(a.span().data(), me == 0 ? b.span().data() : nullptr, n, dt, fc::op::max, 0, c.native(), stream); }), 3);
  row("allgather", [&] { pending.push_back(backend::iallgather<float>(c, a.cspan(), b.span())); },
      raw([&] { return fc::device::nccl_allgather(a.span().data(), b.span().data(), n, dt, c.native(), stream); }), 3);
  row("reduce_scatter", [&] {
        pending.push_back(backend::ireduce_scatter<float>(c, b.cspan(), a.span(), fc::span<const int>(blocks), fc::op::sum));
      },
      raw([&] { return fc::device::nccl_reduce_scatter(b.span().data(), a.span().data(), n, dt, fc::op::sum, c.native(), stream); }), 3);
  // The v-variants (issue 52): their counts walked in place, no offsets made per post; the raw
  // caller groups the same sends, receives and own block's copy.
  const auto gathered = [&](int r) { return b.span().data() + static_cast<std::size_t>(r) * n; };
  auto group = [&](bool all) {
    return [&, all] {
      fc::check_nccl(fc::device::nccl_group_start(), "test: ncclGroupStart");
      for (int r = 0; r < ranks; ++r) {
        if (r == me && (all || me == 0))
          fc::check_cuda(fc::device::copy_async(gathered(r), a.span().data(), n * sizeof(float), stream), "test: copy");
        if (r == me) continue;
        if (all || r == 0) fc::check_nccl(fc::device::nccl_send(a.span().data(), n, dt, r, c.native(), stream), "test: send");
        if (all || me == 0) fc::check_nccl(fc::device::nccl_recv(gathered(r), n, dt, r, c.native(), stream), "test: recv");
      }
      return fc::device::nccl_group_end();
    };
  };
  row("gatherv", [&] { pending.push_back(backend::igatherv<float>(c, a.cspan(), b.span(), fc::span<const int>(blocks), 0)); },
      raw(group(false)), static_cast<std::uint64_t>(me == 0 ? ranks + 4 : 5));
  row("allgatherv", [&] { pending.push_back(backend::iallgatherv<float>(c, a.cspan(), b.span(), fc::span<const int>(blocks))); },
      raw(group(true)), static_cast<std::uint64_t>(2 * ranks + 3));
  row("send and receive", [&] {
        pending.push_back(backend::isend(c, a.cspan(), to, 0));
        pending.push_back(backend::irecv(c, b.span().subspan(0, n), from, 0));
      },
      [&] {
        int d = 0;
        fc::device::get_device(&d);
        fc::device::get_device(&d);
      }, 2, 2);
  fc::device::event_destroy(event);
}

// Ranks that disagree on a call are told so, on every rank, naming the collective and both
// calls, long before the timeout: the last rank takes the max where the others sum (NCCL would
// complete it, with wrong results). The signatures go round the ring in batches; the first rank
// that finds the difference sends its verdict on; the communicator is aborted, the job goes on.
BOOST_AUTO_TEST_CASE(ranks_that_disagree_on_a_collective_are_told_which_and_how) {
  if (world().size() < 2) return;
  std::string cause = "(no error)";
  const auto start = std::chrono::steady_clock::now();
  {
    // The buffer outlives the communicator: the aborted collectives still reach MPI on the
    // stand-in until its destruction, and must find their memory there.
    test_buffer<float> x(std::vector<float>(16, 1.f));
    auto mixed = comm().dup("mixed");
    mixed.set_timeout(std::chrono::milliseconds{20000});
    const bool odd = world().rank() == world().size() - 1;
    try {
      for (int i = 0; i < 40; ++i)
        backend::iallreduce(mixed, x.span(), odd && i == 2 ? fc::op::max : fc::op::sum).wait();
    } catch (const fc::error& e) {
      cause = e.cause();
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const bool named = cause.find("ranks disagree on collective #3: rank ") != std::string::npos &&
                     cause.find("iallreduce 16 x float max") != std::string::npos &&
                     cause.find("iallreduce 16 x float sum") != std::string::npos;
  BOOST_TEST(fc::testing::all_ranks(named && seconds < 10), "rank " << world().rank() << " after " << seconds
                                                                     << " s: " << cause);
  BOOST_TEST(!fc::watchdog::instance().job_must_end());
  test_buffer<int> one(std::vector<int>{1});
  backend::iallreduce(comm(), one.span(), fc::op::sum).wait();
  BOOST_TEST(fc::testing::all_ranks(one.host()[0] == world().size()));
}
