// flexcomm::environment: brings MPI up with the thread support the progress engine needs,
// picks the process's wait policy from how crowded the node is, and shuts both down in order.
// The one core header that calls MPI: MPI is how every backend (NCCL included) bootstraps.
#pragma once

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <optional>
#include <thread>

#include "../backend/mpi.hpp"
#include "error.hpp"
#include "progress.hpp"
#include "trace_mpi.hpp"
#include "wait.hpp"
#include "watchdog.hpp"

namespace flexcomm {

class environment {
 public:
  environment() : environment(nullptr, nullptr) {}
  environment(int& argc, char**& argv) : environment(&argc, &argv) {}

  environment(const environment&) = delete;
  environment& operator=(const environment&) = delete;

  // After a timeout, or ranks that disagreed on a collective, MPI still holds operations that will
  // never finish: MPI_Finalize would hang. The job ends with MPI_Abort instead, once the other
  // surviving ranks had a grace period to print their own reports (core/watchdog.hpp).
  ~environment() {
    alive().store(false);
    auto& dog = watchdog::instance();
    if (dog.job_must_end()) {
      std::fprintf(stderr, "flexcomm: rank %d: ending the job with MPI_Abort(1): a timeout or a disagreement "
                   "between ranks left operations that cannot finish (%zu abandoned)\n", process_rank(),
                   dog.abandoned());
      std::fflush(stderr);
      // Two grace periods: ranks whose waits started a little later still time out and report.
      std::this_thread::sleep_for(2 * watchdog::grace(default_timeout()));
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    progress_engine::instance().stop();
    try {
      trace::stop();  // writes this rank's trace file, when tracing
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s\n", e.what());
    }
    world_.reset();
    if (node_) node_.reset();
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (owns_mpi_ && !finalized) MPI_Finalize();
  }

  // flexcomm's private duplicate of MPI_COMM_WORLD.
  const mpi::communicator& world() const { return *world_; }
  int ranks_on_node() const noexcept { return ranks_on_node_; }
  const wait_policy& wait() const noexcept { return wait_; }

 private:
  environment(int* argc, char*** argv) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    int provided = MPI_THREAD_SINGLE;
    if (!initialized) {
      check_mpi(MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided), "environment: MPI_Init_thread");
      owns_mpi_ = true;
      // MPICH reports a failed MPI_Test (a truncated receive, say) through MPI_COMM_WORLD's handler:
      // make that a return code flexcomm turns into an error, not an abort. A trainer that brought
      // MPI up itself keeps the handlers it chose.
      MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
      MPI_Comm_set_errhandler(MPI_COMM_SELF, MPI_ERRORS_RETURN);
    } else {
      MPI_Query_thread(&provided);  // the trainer brought MPI up itself
    }
    int rank = -1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    detail::process_rank_slot().store(rank);
    if (provided < MPI_THREAD_MULTIPLE) {
      if (owns_mpi_) MPI_Finalize();
      fail("environment", cat("MPI provides thread level ", provided, ", flexcomm's progress engine needs ",
                              "MPI_THREAD_MULTIPLE (", MPI_THREAD_MULTIPLE, ")"));
    }
    world_.emplace(mpi::communicator::duplicate(MPI_COMM_WORLD, "world"));
    MPI_Comm node = MPI_COMM_NULL;
    check_mpi(MPI_Comm_split_type(world_->native(), MPI_COMM_TYPE_SHARED, world_->rank(), MPI_INFO_NULL, &node),
              "environment: split by node");
    node_.emplace(node, "node");
    ranks_on_node_ = node_->size();
    wait_ = wait_policy::automatic(ranks_on_node_);
    set_default_wait(wait_);
    progress_engine::instance().restart();
    if (trace::start_from_environment(*world_)) trace::name_thread("trainer");
    // A rank that calls exit() mid-step would otherwise leave its peers waiting, and Hydra may
    // even report success: end the job instead.
    alive().store(true);
    static const bool hooked = std::atexit(&exit_while_alive) == 0;
    static_cast<void>(hooked);
  }

  static std::atomic<bool>& alive() {
    static std::atomic<bool> flag{false};
    return flag;
  }
  static void exit_while_alive() {
    if (!alive().load()) return;
    std::fprintf(stderr, "flexcomm: rank %d: exit() called while flexcomm's environment is alive (mid-step?); "
                 "ending the job with MPI_Abort(1)\n", process_rank());
    std::fflush(stderr);
    // Lets mpiexec forward the message before MPI_Abort tears the job down.
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Abort(MPI_COMM_WORLD, 1);
  }

  bool owns_mpi_ = false;
  std::optional<mpi::communicator> world_;
  std::optional<mpi::communicator> node_;
  int ranks_on_node_ = 1;
  wait_policy wait_;
};

}  // namespace flexcomm
