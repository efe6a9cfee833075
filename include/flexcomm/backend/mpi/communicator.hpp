// The MPI backend's communicator: a move-only owner of an MPI communicator, its name for
// errors ("member 2"), and the watchdog's bookkeeping for it (watchdog.hpp).
#pragma once

#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "../../core/error.hpp"
#include "../../core/wait.hpp"
#include "../../core/watchdog.hpp"
#include "deferred_post.hpp"
#include "implementation.hpp"
#include "setup.hpp"
#include "types.hpp"
#include "watchdog.hpp"

namespace flexcomm {

struct mpi;

// Move-only owner of an MPI communicator, with a name for error messages ("member 2").
class mpi_communicator {
 public:
  using backend = mpi;

  mpi_communicator() = default;

  // Takes ownership of `comm` (freed on destruction); errors return instead of aborting.
  // Collective over `comm`: it also makes the watchdog's side channel (see watchdog.hpp).
  mpi_communicator(MPI_Comm comm, std::string name) : comm_(comm), name_(std::move(name)) {
    if (comm_ != MPI_COMM_NULL) {
      check_mpi(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), cat(name_, ": set error handler"));
      MPI_Comm_rank(comm_, &rank_);
      MPI_Comm_size(comm_, &size_);
      state_ = std::make_shared<detail::mpi_comm_state>(comm_, name_);
      watchdog::instance().add(state_);
      if constexpr (mpi_implementation::defers_collectives) deferred_ = detail::deferred_queues::instance().make(state_);
    }
  }

  // A private duplicate of `comm`, so flexcomm's traffic never meets the trainer's own.
  static mpi_communicator duplicate(MPI_Comm comm, std::string name) {
    const MPI_Comm copy = detail::duplicate_of(comm, name);
    return mpi_communicator(copy, std::move(name));
  }

  mpi_communicator(mpi_communicator&& o) noexcept { swap(o); }
  mpi_communicator& operator=(mpi_communicator&& o) noexcept {
    mpi_communicator(std::move(o)).swap(*this);
    return *this;
  }
  mpi_communicator(const mpi_communicator&) = delete;
  mpi_communicator& operator=(const mpi_communicator&) = delete;
  ~mpi_communicator() { release(); }

  explicit operator bool() const noexcept { return comm_ != MPI_COMM_NULL; }
  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  MPI_Comm native() const noexcept { return comm_; }
  const std::string& name() const noexcept { return name_; }

  // Collective over this communicator. A rank passing `undefined` as color takes part in the
  // split but gets an empty communicator back.
  static constexpr int undefined = -1;
  mpi_communicator split(int color, int key, std::string name) const {
    post_deferred();
    const MPI_Comm out = detail::split_of(comm_, color < 0 ? MPI_UNDEFINED : color, key,
                                          cat(name_, ": split into '", name, "'"));
    return mpi_communicator(out, std::move(name));
  }

  // A communicator of `ranks` (of this one, in that order; this rank among them), collective
  // over those ranks only (MPI_Comm_create_group): the pipeline's hand-over re-forms a member
  // without the rest of the world. `tag` tells apart groups made at once that share ranks.
  mpi_communicator group(const std::vector<int>& ranks, int tag, std::string name) const {
    post_deferred();
    MPI_Group everyone = MPI_GROUP_NULL, chosen = MPI_GROUP_NULL;
    MPI_Comm_group(comm_, &everyone);
    MPI_Group_incl(everyone, static_cast<int>(ranks.size()), ranks.data(), &chosen);
    const MPI_Comm out = detail::create_group_within(comm_, chosen, tag, cat(name_, ": group '", name, "'"));
    MPI_Group_free(&chosen);
    MPI_Group_free(&everyone);
    return mpi_communicator(out, std::move(name));
  }

  mpi_communicator dup(std::string name) const {
    post_deferred();
    return duplicate(comm_, std::move(name));
  }

  // Before a collective flexcomm hands MPI directly (split, dup, a shared window): the collectives
  // still waiting for their consistency check (Open MPI, mpi/deferred_post.hpp) go first, so that
  // every rank's collectives reach MPI in the same order. Waits under the wait policy and this
  // communicator's timeout.
  void post_deferred() const {
    const auto limit = timeout();
    check(posted_deferred_within(limit), cat(name_, ": posting the collectives deferred for their consistency check"),
          cat("timed out after ", limit.count(), " ms (FLEXCOMM_TIMEOUT): a rank did not make them"));
  }

  // Sequence number of the next operation on this communicator, for error reports.
  std::uint64_t next_sequence() noexcept { return state_ ? state_->recorder().reserve() : ++sequence_; }

  // How long a wait on this communicator's operations may take; zero: forever. Unset (or
  // negative), FLEXCOMM_TIMEOUT's default_timeout() applies.
  void set_timeout(std::chrono::milliseconds t) {
    if (state_) state_->limit.set(t);
  }
  std::chrono::milliseconds timeout() const { return state_ ? state_->timeout() : default_timeout(); }

  // The recent operations on this communicator (the watchdog prints them with a timeout).
  const flight_recorder* recorder() const noexcept { return state_ ? &state_->recorder() : nullptr; }

  // True once a timeout or a disagreement between ranks made this communicator unusable.
  bool poisoned() const noexcept { return state_ && state_->poisoned(); }

  // Watchdog bookkeeping shared with this communicator's requests (backend-internal).
  const std::shared_ptr<detail::mpi_comm_state>& watch_state() const noexcept { return state_; }
  // Its collectives waiting for their consistency check; null where none wait (MPICH).
  const std::shared_ptr<detail::deferred_posts>& deferred_posts() const noexcept { return deferred_; }

  // Sequence number of the next collective only: equal on every rank for the same collective
  // (point-to-point traffic differs by rank), so traces can be matched across ranks.
  std::uint64_t next_collective() const noexcept { return ++collectives_; }

  // The world rank of rank `r` of this communicator.
  int world_rank_of(int r) const {
    MPI_Group mine, world;
    MPI_Comm_group(comm_, &mine);
    MPI_Comm_group(MPI_COMM_WORLD, &world);
    int out = MPI_UNDEFINED;
    MPI_Group_translate_ranks(mine, 1, &r, world, &out);
    MPI_Group_free(&mine);
    MPI_Group_free(&world);
    return out;
  }

 private:
  void swap(mpi_communicator& o) noexcept {
    std::swap(comm_, o.comm_);
    std::swap(name_, o.name_);
    std::swap(rank_, o.rank_);
    std::swap(size_, o.size_);
    std::swap(sequence_, o.sequence_);
    std::swap(state_, o.state_);
    std::swap(collectives_, o.collectives_);
    std::swap(deferred_, o.deferred_);
  }
  bool posted_deferred_within(std::chrono::milliseconds limit) const {
    if (!deferred_ || deferred_->empty()) return true;
    return default_wait().until(
        [&] {
          deferred_->advance();
          return deferred_->empty();
        },
        limit);
  }
  void release() noexcept {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (deferred_ && comm_ != MPI_COMM_NULL && !finalized) settle_deferred_before_free();
    if (comm_ != MPI_COMM_NULL && !finalized) MPI_Comm_free(&comm_);
    comm_ = MPI_COMM_NULL;
  }
  // The collectives still deferred go to the library before the communicator is freed. While an
  // exception unwinds, the job is failing already: they get the watchdog's grace period, not a
  // second whole timeout before the error reaches main. Those left are refused, never posted (a
  // request outliving the communicator would post onto a freed one), and the job must end.
  void settle_deferred_before_free() noexcept {
    try {
      const auto limit = timeout();
      if (posted_deferred_within(std::uncaught_exceptions() > 0 ? watchdog::grace(limit) : limit)) return;
      if (deferred_->refuse_remaining(cat("not posted: communicator '", name_, "' was freed before its turn came")))
        watchdog::instance().abandon();
    } catch (...) {
      watchdog::instance().must_end();  // the queue could not be settled; the job ends anyway
    }
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  std::string name_;
  int rank_ = -1;
  int size_ = 0;
  std::uint64_t sequence_ = 0;
  std::shared_ptr<detail::mpi_comm_state> state_;
  mutable std::uint64_t collectives_ = 0;  // bookkeeping, like sequence_
  std::shared_ptr<detail::deferred_posts> deferred_;
};

namespace detail {
inline mpi_communicator& mutable_comm(const mpi_communicator& c) {
  // Sequence numbers are bookkeeping, not state the caller sees as a change.
  return const_cast<mpi_communicator&>(c);
}
}  // namespace detail

}  // namespace flexcomm
