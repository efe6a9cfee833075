// The MPI backend's shared memory: the transport of backend/shm/ (the mapping, B::host_window,
// and the intra-host allreduce, B::host_reducer), set up over an MPI communicator whose ranks
// share a host. MPI serves only the setup (mpi_host_group: who the ranks are and a few setup
// collectives, nonblocking and waited through the wait policy); every step after it goes through
// the mapping alone.
#pragma once

#include <mpi.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "../../core/error.hpp"
#include "setup.hpp"
#include "types.hpp"
#include "../shm/host_group.hpp"
#include "../shm/host_reducer.hpp"
#include "../shm/host_window.hpp"
#include "communicator.hpp"

namespace flexcomm {

namespace detail {

// An MPI communicator's ranks as the shared-memory transport sees them.
class mpi_host_group final : public shm::host_group {
 public:
  // Borrows `comm` for one setup (a window's). MPI sees the setup collectives directly, after what
  // was posted on it before.
  explicit mpi_host_group(const mpi_communicator& comm) : comm_(&comm) { comm.post_deferred(); }
  // Owns `own` (a reducer's private duplicate), for the reducer's life.
  explicit mpi_host_group(mpi_communicator&& own) : own_(std::move(own)), comm_(&own_) { own_.post_deferred(); }
  mpi_host_group(const mpi_host_group&) = delete;
  mpi_host_group& operator=(const mpi_host_group&) = delete;

  const mpi_communicator& communicator() const noexcept { return *comm_; }

  int rank() const override { return comm_->rank(); }
  int size() const override { return comm_->size(); }
  const std::string& name() const override { return comm_->name(); }
  std::vector<int> world_ranks() const override {
    const int ranks = comm_->size();
    MPI_Group mine = MPI_GROUP_NULL, all = MPI_GROUP_NULL;
    MPI_Comm_group(comm_->native(), &mine);
    MPI_Comm_group(MPI_COMM_WORLD, &all);
    std::vector<int> local(static_cast<std::size_t>(ranks)), world(static_cast<std::size_t>(ranks));
    for (int r = 0; r < ranks; ++r) local[static_cast<std::size_t>(r)] = r;
    MPI_Group_translate_ranks(mine, ranks, local.data(), all, world.data());
    MPI_Group_free(&mine);
    MPI_Group_free(&all);
    return world;
  }
  std::chrono::milliseconds timeout() const override { return comm_->timeout(); }
  // Only an owned group (a reducer's) has a timeout of its own to set.
  void set_timeout(std::chrono::milliseconds t) override { own_.set_timeout(t); }

  bool on_one_host(const std::string& who) const override { return shares_one_host(comm_->native(), who); }
  std::vector<std::uint64_t> allgather(std::uint64_t mine, const std::string& who,
                                       const char* for_what) const override {
    std::vector<std::uint64_t> all(static_cast<std::size_t>(comm_->size()));
    MPI_Request request = MPI_REQUEST_NULL;
    check_mpi(MPI_Iallgather(&mine, 1, MPI_UINT64_T, all.data(), 1, MPI_UINT64_T, comm_->native(), &request),
              cat(who, " (MPI_Iallgather)"));
    wait_setup(request, cat(who, " (", for_what, ")"), comm_->native());
    return all;
  }
  void broadcast(void* data, std::size_t bytes, const std::string& who, const char* for_what) const override {
    MPI_Request request = MPI_REQUEST_NULL;
    check_mpi(MPI_Ibcast(data, mpi_count(bytes, who), MPI_BYTE, 0, comm_->native(), &request),
              cat(who, " (MPI_Ibcast)"));
    wait_setup(request, cat(who, " (", for_what, ")"), comm_->native());
  }
  int sum(int mine, const std::string& who, const char* for_what) const override {
    MPI_Request request = MPI_REQUEST_NULL;
    check_mpi(MPI_Iallreduce(MPI_IN_PLACE, &mine, 1, MPI_INT, MPI_SUM, comm_->native(), &request),
              cat(who, " (MPI_Iallreduce)"));
    wait_setup(request, cat(who, " (", for_what, ")"), comm_->native());
    return mine;
  }
  void barrier(const std::string& who) const override { detail::barrier(comm_->native(), who); }

 private:
  mpi_communicator own_;  // empty when borrowed
  const mpi_communicator* comm_;
};

}  // namespace detail

// B::host_window (contract.hpp: has_host_window): one shared mapping over a communicator whose
// ranks share a host (shm/host_window.hpp).
class mpi_host_window : public shm::host_window {
 public:
  mpi_host_window() = default;
  // Collective over `comm`, whose ranks must all share one host (MPI decides: otherwise an error
  // on every rank).
  mpi_host_window(const mpi_communicator& comm, std::size_t bytes, const std::string& who)
      : shm::host_window(detail::mpi_host_group(comm), bytes, who) {}

  // Collective over `comm`: whether MPI puts all its ranks on one host (the same answer on every
  // rank), i.e. whether a window can be made over it.
  static bool on_one_host(const mpi_communicator& comm) {
    comm.post_deferred();  // MPI sees this allgather directly
    return detail::shares_one_host(comm.native(), cat(comm.name(), ": split by host"));
  }
};

// B::host_reducer (contract.hpp: has_host_shared_memory): the intra-host allreduce and broadcast
// (shm/host_reducer.hpp), over a private duplicate of the communicator.
class mpi_host_reducer : public shm::host_reducer {
 public:
  mpi_host_reducer() = default;

  // Collective over `comm`, whose ranks must all share one host (MPI decides: a communicator
  // that MPI_COMM_TYPE_SHARED would split is an error on every rank). Allocates
  // 2 x slot_bytes + 2 x small_bytes (and three cache lines) of shared memory per rank.
  explicit mpi_host_reducer(const mpi_communicator& comm, std::size_t slot_bytes = default_slot_bytes,
                            std::size_t small_bytes = default_small_bytes)
      : shm::host_reducer(std::make_unique<detail::mpi_host_group>(comm.dup(cat(comm.name(), " shared memory"))),
                          slot_bytes, small_bytes) {}

  // Collective over `comm`: whether MPI puts all its ranks on one host (the same answer on every
  // rank), i.e. whether a reducer can be made over it.
  static bool on_one_host(const mpi_communicator& comm) { return mpi_host_window::on_one_host(comm); }

  // The reducer's own duplicate of the communicator it was made over.
  const mpi_communicator& communicator() const {
    return static_cast<const detail::mpi_host_group&>(group("communicator")).communicator();
  }
};

}  // namespace flexcomm
