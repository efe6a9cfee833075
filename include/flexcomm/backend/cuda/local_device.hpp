// Which GPU a rank uses: one per rank of its node, by node-local rank, so that a producer on the
// node, a node holding more ranks than another, or a job over several nodes never puts two
// trainers on one GPU while another idles (world rank % devices does as soon as placement is
// uneven). FLEXCOMM_DEVICE overrides the choice (docs/cuda.md, "Which GPU a rank uses").
#pragma once

#include <climits>
#include <string>

#include "../../core/error.hpp"
#include "../../core/setting_values.hpp"
#include "../../core/settings.hpp"
#include "../mpi.hpp"
#include "error.hpp"

namespace flexcomm::cuda {

// Collective over `comm`; call it before any other device work of the rank (communicators,
// memory, streams belong to the device current when they are made). Makes this rank's device
// current on the calling thread and returns its index, as this process numbers its devices
// (after CUDA_VISIBLE_DEVICES):
//   FLEXCOMM_DEVICE unset or `local`: the rank's position among the ranks of `comm` on its node
//     that use a device, modulo the devices this process sees;
//   FLEXCOMM_DEVICE=N: device N.
// A rank that passes `uses_device = false` (a producer, which never touches the GPU) takes part
// without taking or counting a device, and gets -1. Where a rank cannot take its device, every
// rank of `comm` throws, naming it.
inline int use_local_device(const mpi::communicator& comm, bool uses_device = true);

// ---------------------------------------------------------------------------------------------

inline int use_local_device(const mpi::communicator& comm, bool uses_device) {
  const std::string what = cat(comm.name(), ": choose this rank's device");
  comm.post_deferred();  // MPI sees this split directly
  // The ranks of this node that use a device; the others get no communicator.
  MPI_Comm node = MPI_COMM_NULL;
  check_mpi(MPI_Comm_split_type(comm.native(), uses_device ? MPI_COMM_TYPE_SHARED : MPI_UNDEFINED, comm.rank(),
                                MPI_INFO_NULL, &node),
            cat(what, ": split by node"));
  int device = -1;
  std::string problem;
  if (node != MPI_COMM_NULL) {
    int local_rank = 0;
    MPI_Comm_rank(node, &local_rank);
    MPI_Comm_free(&node);
    try {
      int devices = 0;
      check_cuda(device::device_count(&devices), what, ": cudaGetDeviceCount");
      check(devices > 0, what, "this process sees no device");
      const char* text = setting("FLEXCOMM_DEVICE");
      const int chosen = text ? parse_device(text) : device_by_local_rank;
      device = chosen == device_by_local_rank ? local_rank % devices : chosen;
      check(device < devices, what, "FLEXCOMM_DEVICE=", device, " but this process sees ", devices,
            " device(s), numbered from 0 (CUDA_VISIBLE_DEVICES renumbers them)");
      check_cuda(device::set_device(device), what, ": cudaSetDevice(", device, ")");
    } catch (const error& e) {
      problem = e.cause();
    }
  }
  // One rank's failure is every rank's error, not a hang in the next collective.
  int first_failed = problem.empty() ? INT_MAX : comm.rank();
  mpi::iallreduce(comm, span<int>(&first_failed, 1), op::min).wait();
  if (!problem.empty()) fail(what, problem);
  if (first_failed != INT_MAX) fail(what, cat("rank ", first_failed, " of ", comm.name(), " could not take its device"));
  return device;
}

}  // namespace flexcomm::cuda
