// Brings flexcomm (and MPI) up once per test program; every MPI test binary includes this.
#pragma once

#include <boost/test/results_collector.hpp>
#include <boost/test/results_reporter.hpp>
#include <boost/test/unit_test.hpp>

#include <flexcomm/flexcomm.hpp>

#include <type_traits>

namespace flexcomm::testing {

struct mpi_fixture {
  mpi_fixture() { env = new flexcomm::environment(boost::unit_test::framework::master_test_suite().argc,
                                                  boost::unit_test::framework::master_test_suite().argv); }
  ~mpi_fixture() {
    // Should shutdown have to end the process itself, it leaves with the status Boost.Test gives.
    const auto& results = boost::unit_test::results_collector.results(
        boost::unit_test::framework::master_test_suite().p_id);
    // A case that left MPI operations that cannot finish ends the job at shutdown (MPI_Abort),
    // before Boost.Test would print its summary: print it now, so the log still says how every
    // case went.
    if (watchdog::instance().job_must_end()) boost::unit_test::results_reporter::make_report();
    env->set_exit_status(results.passed() ? 0 : 201);
    delete env;
  }
  static inline flexcomm::environment* env = nullptr;
};

inline const flexcomm::mpi::communicator& world() { return mpi_fixture::env->world(); }

// The world communicator of backend B, as tests/gpu/gpu_fixture.hpp gives it for the device
// backends (tests/backend_cases.hpp): for the MPI backend, the environment's own.
template <class B>
const typename B::communicator& backend_world() {
  static_assert(std::is_same_v<B, mpi>, "an MPI test program's world is the MPI backend's");
  return world();
}

// True on every rank when `ok` is true on every rank: a test asserts once, collectively,
// so one failing rank cannot leave the others waiting in the next collective.
inline bool all_ranks(bool ok) {
  int all = ok ? 1 : 0;
  mpi::iallreduce(world(), span<int>(&all, 1), op::min).wait();
  return all == 1;
}

}  // namespace flexcomm::testing

using flexcomm_mpi_fixture = flexcomm::testing::mpi_fixture;
BOOST_TEST_GLOBAL_FIXTURE(flexcomm_mpi_fixture);
