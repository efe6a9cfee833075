// What the shared-memory transport (backend/shm/) asks of the ranks that share one mapping: who
// they are, the limit on its waits, and the few collectives it makes while it sets up (the
// regions' sizes, the file's name, an agreement that every rank mapped it, a barrier). A backend
// that offers shared memory implements it over its own communicator (the MPI backend:
// mpi/shared_memory.hpp); once set up, the transport speaks to its peers through the mapping only.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace flexcomm::shm {

class host_group {
 public:
  virtual ~host_group() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // For errors: "member 2 shared memory".
  virtual const std::string& name() const = 0;
  // The world rank of each rank of the group: timeouts name them, as every other wait's do (a
  // member's rank means little in a job's log).
  virtual std::vector<int> world_ranks() const = 0;
  // The limit on each wait for a peer; set_timeout overrides the default (FLEXCOMM_TIMEOUT).
  virtual std::chrono::milliseconds timeout() const = 0;
  virtual void set_timeout(std::chrono::milliseconds t) = 0;

  // Collectives, each failing as `who` names it (`for_what`: which step of the setup waited).
  // Whether every rank is on one host (the same answer everywhere).
  virtual bool on_one_host(const std::string& who) const = 0;
  // Every rank's `mine`, in rank order.
  virtual std::vector<std::uint64_t> allgather(std::uint64_t mine, const std::string& who,
                                               const char* for_what) const = 0;
  // Rank 0's `bytes` bytes at `data`, into every rank's.
  virtual void broadcast(void* data, std::size_t bytes, const std::string& who, const char* for_what) const = 0;
  // The sum of every rank's `mine`.
  virtual int sum(int mine, const std::string& who, const char* for_what) const = 0;
  virtual void barrier(const std::string& who) const = 0;

 protected:
  host_group() = default;
  host_group(const host_group&) = default;
  host_group& operator=(const host_group&) = default;
};

}  // namespace flexcomm::shm
