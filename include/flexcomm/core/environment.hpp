// flexcomm::environment: brings MPI up with the thread support the progress engine needs,
// picks the process's wait policy from how crowded the node is, and shuts both down in order.
// The one core header that calls MPI: MPI is how every backend (NCCL included) bootstraps.
#pragma once

#include <mpi.h>

#include <cstdio>
#include <exception>
#include <optional>
#include <thread>

#include "../backend/mpi.hpp"
#include "error.hpp"
#include "progress.hpp"
#include "trace_mpi.hpp"
#include "wait.hpp"

namespace flexcomm {

class environment {
 public:
  environment() : environment(nullptr, nullptr) {}
  environment(int& argc, char**& argv) : environment(&argc, &argv) {}

  environment(const environment&) = delete;
  environment& operator=(const environment&) = delete;

  ~environment() {
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
  }

  bool owns_mpi_ = false;
  std::optional<mpi::communicator> world_;
  std::optional<mpi::communicator> node_;
  int ranks_on_node_ = 1;
  wait_policy wait_;
};

}  // namespace flexcomm
