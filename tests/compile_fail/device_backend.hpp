// A stand-in for a device backend (as NCCL is): MPI that says its buffers live in device memory.
// In the control build (-DFLEXCOMM_CONTROL) it says host memory, and the snippet must compile.
#pragma once
#include <flexcomm/backend/mpi.hpp>

struct device_backend : flexcomm::mpi {
#ifdef FLEXCOMM_CONTROL
  static constexpr flexcomm::memory_space memory = flexcomm::memory_space::host;
#else
  static constexpr flexcomm::memory_space memory = flexcomm::memory_space::device;
#endif
};
