// The device benchmarks' baseline: a plain NCCL communicator over the world, made the way NCCL's
// examples make it (rank 0's unique id broadcast, ncclCommInitRank), outside flexcomm's backend.
// On the stand-in the init is nonblocking, as flexcomm's is: polled until every rank has joined.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include <flexcomm/flexcomm.hpp>
#include <flexcomm/backend/cuda/runtime.hpp>

namespace baseline {

inline flexcomm::device::nccl_comm_t nccl_comm(const flexcomm::mpi::communicator& world) {
  namespace dv = flexcomm::device;
  std::vector<std::uint8_t> id_bytes(sizeof(dv::nccl_id_t));
  if (world.rank() == 0) {
    dv::nccl_id_t id;
    flexcomm::check_nccl(dv::nccl_get_unique_id(&id), "ncclGetUniqueId");
    std::memcpy(id_bytes.data(), &id, sizeof id);
  }
  flexcomm::mpi::ibcast(world, flexcomm::span<std::uint8_t>(id_bytes), 0).wait();
  dv::nccl_id_t id;
  std::memcpy(&id, id_bytes.data(), sizeof id);
  dv::nccl_comm_t comm = nullptr;
#if defined(FLEXCOMM_DEVICE_STANDIN)
  dv::nccl_result_t state = dv::nccl_in_progress;
  flexcomm::check_nccl(dv::nccl_comm_init(&comm, world.size(), id, world.rank(), world.native()), "ncclCommInitRank");
  while (state == dv::nccl_in_progress)
    flexcomm::check_nccl(dv::nccl_comm_get_async_error(comm, &state), "ncclCommGetAsyncError");
  flexcomm::check_nccl(state, "ncclCommInitRank");
#else
  flexcomm::check_nccl(ncclCommInitRank(&comm, world.size(), id, world.rank()), "ncclCommInitRank");
#endif
  return comm;
}

}  // namespace baseline
