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
    lonely.set_timeout(std::chrono::milliseconds{3000});
    test_buffer<float> x(std::vector<float>(16, 1.f));
    if (connected) backend::iallreduce(lonely, x.span(), fc::op::sum).wait();
    if (world().rank() == 0) {
      try {
        backend::iallreduce(lonely, x.span(), fc::op::sum).wait();
        ok = false;
      } catch (const fc::error& e) {
        cause = e.cause();
        ok = cause.find("ncclCommAbort") != std::string::npos && cause.find("after 3000 ms") != std::string::npos &&
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

// No tax over NCCL: once a buffer is known and a completion event is at hand, enqueueing an
// allreduce makes three device-layer calls: the device guard's cudaGetDevice, ncclAllReduce and
// the completion event's record (it made seven: two pointer-attribute queries, an event created
// per operation and a poll of the asynchronous error after every call). Counted on the stand-in.
BOOST_AUTO_TEST_CASE(an_allreduce_enqueues_with_three_runtime_calls,
                     *boost::unit_test::enable_if<fc::device::counts_calls>()) {
  test_buffer<float> x(std::vector<float>(1024, 1.f));
  for (int warm = 0; warm < 2; ++warm) backend::iallreduce(comm(), x.span(), fc::op::sum).wait();
  std::uint64_t most = 0;
  for (int i = 0; i < 5; ++i) {
    const auto before = fc::device::calls();
    auto r = backend::iallreduce(comm(), x.span(), fc::op::sum);
    most = std::max<std::uint64_t>(most, fc::device::calls() - before);
    r.wait();
  }
  BOOST_TEST(most <= 3u);
  BOOST_TEST(fc::testing::all_ranks(most <= 3u));
}
