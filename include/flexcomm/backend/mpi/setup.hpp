// The setup collectives over MPI (duplicates, the host check, barriers), made nonblocking and
// waited through the wait policy: the MPI backend's, and the side channel's every backend over MPI
// ranks keeps (watchdog.hpp).
//
// Why: MPICH's blocking calls busy-poll, and where ranks outnumber cores a spinning rank holds
// the core its peers need to arrive; an adapter's constructor makes about ten such calls
// (benchmarks/history/costs.md, "Wait policy").
#pragma once

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "../../core/error.hpp"
#include "../../core/stall.hpp"
#include "../../core/wait.hpp"
#include "abort.hpp"
#include "types.hpp"

namespace flexcomm::detail {

// The world ranks of `group` but this process's: whom a collective over it waits on.
inline std::vector<int> world_peers_in(MPI_Group group) {
  int size = 0, rank = MPI_UNDEFINED;
  MPI_Group_size(group, &size);
  MPI_Group_rank(group, &rank);
  MPI_Group world = MPI_GROUP_NULL;
  MPI_Comm_group(MPI_COMM_WORLD, &world);
  std::vector<int> ranks, translated(static_cast<std::size_t>(size));
  for (int r = 0; r < size; ++r) ranks.push_back(r);
  MPI_Group_translate_ranks(group, size, ranks.data(), world, translated.data());
  MPI_Group_free(&world);
  std::vector<int> out;
  for (int r = 0; r < size; ++r)
    if (r != rank && translated[static_cast<std::size_t>(r)] != MPI_UNDEFINED) out.push_back(translated[static_cast<std::size_t>(r)]);
  return out;
}

// The world ranks of `comm` but this one: whom a setup collective waits on.
inline std::vector<int> world_peers_of(MPI_Comm comm) {
  if (comm == MPI_COMM_NULL) return {};
  MPI_Group mine = MPI_GROUP_NULL;
  MPI_Comm_group(comm, &mine);
  auto out = world_peers_in(mine);
  MPI_Group_free(&mine);
  return out;
}

// Waits for one setup request over `comm` through the default wait policy, for at most
// FLEXCOMM_TIMEOUT, answering peers that follow a stall (core/stall.hpp). On a timeout the
// request is left to MPI (it may still write its outputs) and `what` fails, naming the ranks
// that stopped answering.
inline void wait_setup(MPI_Request& request, const std::string& what, MPI_Comm comm) {
  const auto limit = default_timeout();
  int rc = MPI_SUCCESS;
  waiting_note note;
  const bool done = wait_answering(
      default_wait(), limit,
      [&] {
        int flag = 0;
        rc = MPI_Test(&request, &flag, MPI_STATUS_IGNORE);
        return rc != MPI_SUCCESS || flag != 0;
      },
      [&] {
        if (!note.set_already()) note.set(what, world_peers_of(comm));
      });
  check_mpi(rc, what);
  if (!done)
    fail(what, cat("timed out after ", limit.count(), " ms (FLEXCOMM_TIMEOUT); ",
                   stall_registry::instance().lead(what, world_peers_of(comm), limit),
                   "not every rank of the communicator took part"));
}

// MPI_Comm_dup, without the busy wait.
inline MPI_Comm duplicate_of(MPI_Comm comm, const std::string& what) {
  // On a timeout MPI may still write the new handle: it then goes to a slot that is never freed.
  auto* copy = new MPI_Comm(MPI_COMM_NULL);
  MPI_Request request = MPI_REQUEST_NULL;
  check_mpi(MPI_Comm_idup(comm, copy, &request), cat(what, ": MPI_Comm_idup"));
  wait_setup(request, cat(what, ": MPI_Comm_idup"), comm);
  const MPI_Comm out = *copy;
  delete copy;
  return out;
}

// MPI_Comm_create_group over `group` (of `comm`), which MPI offers only blocking: a rank of the
// group that stops before or inside it holds the others there for good, where no wait can time
// out and no error can be thrown. A guard thread ends the job once FLEXCOMM_TIMEOUT passes, as
// abort_job does, naming the ranks followed to the stall; zero waits forever.
inline MPI_Comm create_group_within(MPI_Comm comm, MPI_Group group, int tag, const std::string& what) {
  const std::string call = cat(what, ": MPI_Comm_create_group");
  const auto limit = default_timeout();
  const std::vector<int> peers = world_peers_in(group);
  struct watch {
    std::mutex mutex;
    std::condition_variable returned;
    bool done = false;
  };
  auto state = std::make_shared<watch>();
  std::thread guard;
  if (limit.count() > 0 && !peers.empty())
    guard = std::thread([state, limit, call, peers] {
      {
        std::unique_lock<std::mutex> lock(state->mutex);
        if (state->returned.wait_for(lock, limit, [&] { return state->done; })) return;
      }
      abort_job(error(process_rank(), call,
                      cat("timed out after ", limit.count(), " ms (FLEXCOMM_TIMEOUT); ",
                          stall_registry::instance().lead(call, peers, limit),
                          "not every rank of the group entered it, and MPI cannot leave the call"))
                    .what());
    });
  // Peers following a stall through this rank learn that it waits inside the call, and on whom.
  waiting_note note;
  if (!peers.empty()) note.set(call, peers);
  MPI_Comm out = MPI_COMM_NULL;
  const int rc = MPI_Comm_create_group(comm, group, tag, &out);
  if (guard.joinable()) {
    {
      std::lock_guard<std::mutex> lock(state->mutex);
      state->done = true;
    }
    state->returned.notify_one();
    guard.join();
  }
  check_mpi(rc, call);
  return out;
}

// MPI_Comm_split's result (ranks ordered by key, then by rank), made from one nonblocking
// allgather and MPI_Comm_create_group, which waits only for the new communicator's own ranks.
// MPI_UNDEFINED: MPI_COMM_NULL.
inline MPI_Comm split_of(MPI_Comm comm, int color, int key, const std::string& what) {
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  const int mine[2] = {color, key};
  std::vector<int> all(2 * static_cast<std::size_t>(size));
  MPI_Request request = MPI_REQUEST_NULL;
  check_mpi(MPI_Iallgather(mine, 2, MPI_INT, all.data(), 2, MPI_INT, comm, &request), cat(what, ": MPI_Iallgather"));
  wait_setup(request, cat(what, ": MPI_Iallgather"), comm);
  if (color == MPI_UNDEFINED) return MPI_COMM_NULL;
  std::vector<int> ranks;
  for (int r = 0; r < size; ++r)
    if (all[2 * static_cast<std::size_t>(r)] == color) ranks.push_back(r);
  std::stable_sort(ranks.begin(), ranks.end(), [&](int a, int b) {
    return all[2 * static_cast<std::size_t>(a) + 1] < all[2 * static_cast<std::size_t>(b) + 1];
  });
  MPI_Group everyone = MPI_GROUP_NULL, group = MPI_GROUP_NULL;
  MPI_Comm_group(comm, &everyone);
  MPI_Group_incl(everyone, static_cast<int>(ranks.size()), ranks.data(), &group);
  // Tag 0 for every color: the groups of different colors share no rank.
  const MPI_Comm out = create_group_within(comm, group, 0, what);
  MPI_Group_free(&group);
  MPI_Group_free(&everyone);
  return out;
}

inline void barrier(MPI_Comm comm, const std::string& what) {
  MPI_Request request = MPI_REQUEST_NULL;
  check_mpi(MPI_Ibarrier(comm, &request), cat(what, ": MPI_Ibarrier"));
  wait_setup(request, cat(what, ": MPI_Ibarrier"), comm);
}

// This process's host, named by the lowest world rank on it (MPI_COMM_TYPE_SHARED); -1 until
// the environment has learnt it, collectively over the world, once.
inline std::atomic<int>& host_key_slot() {
  static std::atomic<int> key{-1};
  return key;
}

// Collective over `comm`: whether MPI puts all its ranks on one host. From the host each rank
// learnt at start, in one nonblocking allgather; where flexcomm's environment did not learn it,
// MPI_Comm_split_type decides.
inline bool shares_one_host(MPI_Comm comm, const std::string& what) {
  int size = 1;
  MPI_Comm_size(comm, &size);
  if (const int key = host_key_slot().load(std::memory_order_acquire); key >= 0) {
    std::vector<int> keys(static_cast<std::size_t>(size));
    MPI_Request request = MPI_REQUEST_NULL;
    check_mpi(MPI_Iallgather(&key, 1, MPI_INT, keys.data(), 1, MPI_INT, comm, &request),
              cat(what, ": MPI_Iallgather"));
    wait_setup(request, cat(what, ": MPI_Iallgather"), comm);
    return std::all_of(keys.begin(), keys.end(), [&](int k) { return k == key; });
  }
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm shared = MPI_COMM_NULL;
  check_mpi(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &shared),
            cat(what, ": split by host"));
  int shared_size = 0;
  MPI_Comm_size(shared, &shared_size);
  MPI_Comm_free(&shared);
  return shared_size == size;
}

}  // namespace flexcomm::detail
