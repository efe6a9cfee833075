// Learning the host_map of an MPI communicator: which of its ranks share a host (MPI-3's shared
// split), or, under FLEXCOMM_HOSTS, which ranks a test or a one-machine CI pretends share one.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "../../core/error.hpp"
#include "../../core/settings.hpp"
#include "../../core/hosts.hpp"
#include "operations.hpp"
#include "setup.hpp"

namespace flexcomm {

// FLEXCOMM_HOSTS ("2+1+2": world ranks 0-1 on host 0, rank 2 on host 1, ranks 3-4 on host 2) for
// a world of `world_size` ranks; an empty map when unset.
inline host_map hosts_from_env(int world_size) {
  const char* text = setting("FLEXCOMM_HOSTS");
  if (!text) return {};
  auto map = host_map::parse(text);
  check(map.ranks() == world_size, "FLEXCOMM_HOSTS",
        cat("'", text, "' describes ", map.ranks(), " ranks, world has ", world_size));
  return map;
}

// Collective over `comm`: the host of each of its ranks, hosts numbered in order of their lowest
// rank in `comm`. Each rank names its host by the world rank of that host's first rank (real
// hosts) or by its FLEXCOMM_HOSTS index, and the names are allgathered.
inline host_map hosts_of(const mpi::communicator& comm) {
  int world_rank = 0, world_size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world_size);
  std::int64_t key = 0;
  if (const auto pretend = hosts_from_env(world_size); pretend.ranks() > 0) {
    key = pretend.host_of(world_rank);
  } else if (const int known = detail::host_key_slot().load(std::memory_order_acquire); known >= 0) {
    key = known;
  } else {
    comm.post_deferred();  // MPI sees this split directly
    MPI_Comm shared = MPI_COMM_NULL;
    check_mpi(MPI_Comm_split_type(comm.native(), MPI_COMM_TYPE_SHARED, comm.rank(), MPI_INFO_NULL, &shared),
              cat(comm.name(), ": split by host"));
    const mpi::communicator host(shared, cat(comm.name(), " host"));
    int first = world_rank;
    mpi::iallreduce(host, span<int>(&first, 1), op::min).wait();
    key = first;
  }
  std::vector<std::int64_t> keys(static_cast<std::size_t>(comm.size()));
  mpi::iallgather(comm, span<const std::int64_t>(&key, 1), span<std::int64_t>(keys)).wait();
  return host_map::from_keys(keys);
}

inline host_map mpi::hosts(const communicator& comm) { return hosts_of(comm); }

}  // namespace flexcomm
