// What a benchmark over several ranks measures with: the process's CPU time, the wall clock, and
// a barrier and reduction that wait through flexcomm's wait policy (MPI_Barrier would busy-poll
// the shared cores and show up in every rank's CPU time).
#pragma once

#include <sys/resource.h>

#include <chrono>

#include <flexcomm/flexcomm.hpp>

namespace job_clock {

// User and system CPU time of this process, every thread, in seconds.
inline double cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
}

inline double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

inline void barrier(const flexcomm::mpi::communicator& comm) {
  int x = 0;
  flexcomm::mpi::iallreduce(comm, flexcomm::span<int>(&x, 1), flexcomm::op::sum).wait();
}

inline double reduce(const flexcomm::mpi::communicator& comm, double v, flexcomm::op o) {
  flexcomm::mpi::iallreduce(comm, flexcomm::span<double>(&v, 1), o).wait();
  return v;
}

}  // namespace job_clock
