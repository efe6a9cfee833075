// Ending the whole job from one rank: after a failure the rank cannot handle, or a call MPI
// cannot leave. Only MPI_Abort ends peers that wait on this rank.
#pragma once

#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "../../core/error.hpp"
#include "../../core/progress.hpp"
#include "../../core/stall.hpp"

namespace flexcomm {

namespace detail {

// Before an abort, peers that follow a stall through this rank still learn whom it waited on
// (core/stall.hpp).
inline void answer_stall_questions_for(std::chrono::milliseconds span) noexcept {
  const auto until = std::chrono::steady_clock::now() + span;
  while (std::chrono::steady_clock::now() < until) {
    stall_registry::instance().answer();
    std::this_thread::sleep_for(std::chrono::milliseconds{5});
  }
}

// Lets the launcher forward what the ranks wrote last before MPI_Abort tears the job down: Hydra
// may act on an abort first, and a job that ends without its first flexcomm line hides its cause.
inline void before_abort() noexcept {
  std::fflush(stdout);
  std::fflush(stderr);
  answer_stall_questions_for(std::chrono::milliseconds{200});
}

}  // namespace detail

// Ends every rank of the job with `code`, through MPI_Abort, once flexcomm's own threads have left
// MPI: the progress engine and the stall channel's answerer go quiet first, since a call made
// while the abort tears MPI down may touch what is gone. Also what a request's destructor does
// when its pending operation fails there (it cannot throw, and the peers would wait for ever).
inline void abort_mpi_job(int code) noexcept {
  progress_engine::instance().halt(std::chrono::milliseconds{500});
  stall_registry::instance().hush();
  MPI_Abort(MPI_COMM_WORLD, code);
}

// Ends every rank of the job after a failure this rank cannot handle: what a trainer's main does
// with a flexcomm::error it catches (its peers wait on it, and only MPI_Abort ends them). Prints
// `message` and the ending, then aborts with `code`.
[[noreturn]] inline void abort_job(const std::string& message, int code = 1) noexcept {
  std::fprintf(stderr, "%s\nflexcomm: rank %d: ending the job with MPI_Abort(%d)\n", message.c_str(),
               process_rank(), code);
  detail::before_abort();
  abort_mpi_job(code);
  std::_Exit(code);
}

}  // namespace flexcomm
