// What an NCCL communicator and its requests share: the NCCL handle, its stream, the deferred
// point-to-point operations (launched on a blocking child, under a watch), and the MPI backend's
// bookkeeping over the same ranks (flight recorder, timeout, the watchdog's side channel), so that
// NCCL's timeouts name ranks as MPI's do.
#pragma once

#include "../cuda/runtime.hpp"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "../../core/error.hpp"
#include "../../core/mutex.hpp"
#include "../../core/trace.hpp"
#include "../../core/wait.hpp"
#include "../cuda/error.hpp"
#include "../mpi/batched_check.hpp"
#include "../mpi/watchdog.hpp"
#include "blocking_watch.hpp"
#include "types.hpp"

namespace flexcomm {

namespace detail {
using cuda::device_guard;

// Holds an NCCL group open; ends it even when a call inside throws.
class nccl_group {
 public:
  explicit nccl_group(const std::string& what) : what_(what) { check_nccl(device::nccl_group_start(), what, ": ncclGroupStart"); }
  nccl_group(const nccl_group&) = delete;
  nccl_group& operator=(const nccl_group&) = delete;
  device::nccl_result_t end() {
    open_ = false;
    return checked_nccl(device::nccl_group_end(), what_, ": ncclGroupEnd");
  }
  // The code as NCCL gave it, for a caller that must look at something else first.
  device::nccl_result_t end_unchecked() {
    open_ = false;
    return device::nccl_group_end();
  }
  ~nccl_group() {
    if (open_) device::nccl_group_end();
  }

 private:
  const std::string& what_;  // outlives the group: the operation's name
  bool open_ = true;
};

// Polls a nonblocking communicator until NCCL has finished enqueueing (or initializing);
// false on timeout. An asynchronous error is thrown.
inline bool nccl_settle(device::nccl_comm_t comm, const std::string& what, std::chrono::milliseconds timeout) {
  device::nccl_result_t state = device::nccl_in_progress;
  const bool settled = default_wait().until(
      [&] {
        check_nccl(device::nccl_comm_get_async_error(comm, &state), what, ": ncclCommGetAsyncError");
        return state != device::nccl_in_progress;
      },
      timeout);
  if (settled) check_nccl(state, what);
  return settled;
}

// Marks a launched operation: the event is recorded after its kernels, under the state's lock.
// Records are the communicator's, reused from operation to operation with their event and the
// room of their name, so that a post allocates nothing once the communicator has warmed up.
struct nccl_launch {
  cuda::event done;
  bool launched = false;
  std::uint64_t sequence = 0;       // in the communicator's flight recorder
  std::uint64_t collective = 0;     // collectives only: numbered alike on every rank
  trace::collective_mark trace;     // collectives only
  std::string what;                 // the operation's name, for its errors
  int holders = 0;                  // its request, and a deferred send or receive; under the lock
};

struct nccl_p2p {
  bool send;
  const void* buf;
  std::size_t count;
  dtype type;
  int peer;
  device::stream_t stream;
  nccl_launch* launch;  // held (holders) until launched
};

// What a communicator and its requests share: the NCCL handle, its stream, the deferred
// point-to-point operations and the bookkeeping for timeout reports.
struct nccl_state {
  device::nccl_comm_t comm = nullptr;
  // Sends and receives go on a blocking child of `comm` (communicator.hpp: open_point_to_point),
  // where a grouped send and receive posts several times faster than on a nonblocking one
  // (docs/cuda.md, issue 52); its watch aborts it when a call on it blocks past the timeout.
  device::nccl_comm_t p2p = nullptr;
  std::shared_ptr<blocking_watch> p2p_watch;
  cuda::stream_handle stream;
  std::string name;
  int rank = -1, size = 0, device = 0;
  flexcomm::mutex mutex;  // one thread at a time issues NCCL calls on this communicator; a post's one lock
  std::vector<nccl_p2p> deferred;
  // The MPI backend's bookkeeping over the same ranks: flight recorder, timeout and the side
  // channel on which a rank that timed out asks its peers where they stand. NCCL operations are
  // recorded there, so a timeout names the ranks that did not arrive, as MPI's do.
  std::shared_ptr<mpi_comm_state> watch;
  std::uint64_t collectives = 0;  // under the mutex; names the same collective on every rank
  std::atomic<bool> aborted{false};  // set under the mutex; read without it by a post's first check
  std::string abort_reason;
  std::vector<std::unique_ptr<device::nccl_comm_t>> split_slots;
  // Every launch record made, and those free for the next operation: as many as were ever in
  // flight at once, each with its reached event (mpi/batched_check.hpp: FLEXCOMM_CHECK).
  std::vector<std::unique_ptr<nccl_launch>> launches;
  std::vector<nccl_launch*> spare;
  batched_check consistency;  // after `watch`: closed before the side channel goes
  // Events recorded inside CUDA graphs: each replay records them again, so they are the graphs'
  // for as long as the communicator lives, never reused for a later operation.
  std::vector<cuda::event> captured;

  nccl_state() = default;
  nccl_state(const nccl_state&) = delete;
  nccl_state& operator=(const nccl_state&) = delete;

  // Finalize flushes outstanding work (ncclCommFinalize, then ncclCommDestroy). Work that waits
  // for a peer that is gone never flushes: past the timeout the communicator is aborted, which
  // ends its kernels, and the rank says so; a destructor cannot throw.
  ~nccl_state() {
    close_point_to_point();
    if (!comm) return;
    const auto what = cat("nccl communicator '", name, "' (rank ", rank, " of ", size, "): ncclCommFinalize");
    try {
      device_guard guard(device, name);
      check_nccl(device::nccl_comm_finalize(comm), what);
      if (nccl_settle(comm, what, timeout())) {
        device::nccl_comm_destroy(comm);
        return;
      }
      std::fprintf(stderr, "flexcomm: rank %d: %s: did not finish within %lld ms (FLEXCOMM_TIMEOUT): work on it "
                   "waits for a rank that is gone; aborted with ncclCommAbort\n",
                   process_rank(), what.c_str(), static_cast<long long>(timeout().count()));
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s\n(while destroying nccl communicator '%s'; aborted with ncclCommAbort)\n", e.what(),
                   name.c_str());
    }
    std::fflush(stderr);
    device::nccl_comm_abort(comm);
  }

  std::chrono::milliseconds timeout() const { return watch ? watch->timeout() : default_timeout(); }

  void finish(std::uint64_t seq, op_state s) {
    if (watch && seq) watch->recorder().finish(seq, s);
  }

  std::string where() const {
    const std::uint64_t enqueued = watch ? watch->recorder().last_enqueued() : 0;
    const std::uint64_t completed = watch ? watch->recorder().last_completed() : 0;
    return cat("nccl communicator '", name, "' (rank ", rank, " of ", size, "; last enqueued #", enqueued,
               ", last completed #", completed, ")");
  }

  // Called with the mutex held.
  void require_usable(const std::string& what) const {
    if (aborted) fail(what, cat(where(), " was aborted: ", abort_reason));  // where() only then
  }

  // Called with the mutex held: a record for one operation, with an event to record.
  nccl_launch& take_launch_locked(const std::string& what) {
    if (spare.empty()) {
      launches.push_back(std::make_unique<nccl_launch>());
      spare.push_back(launches.back().get());
    }
    nccl_launch& l = *spare.back();
    if (!l.done) l.done = cuda::event::create(what);
    spare.pop_back();
    l.launched = false;
    l.sequence = l.collective = 0;
    l.holders = 1;
    return l;
  }

  // Called with the mutex held: one holder lets go; the last one gives the record back, its event
  // kept only when `reached` (recording it again captures the next operation).
  void release_locked(nccl_launch& l, bool reached) {
    if (--l.holders > 0) return;
    if (!reached) l.done = cuda::event{};
    spare.push_back(&l);
  }

  // Called with the mutex held: the record's event stays with the graph it was captured into.
  void keep_captured_locked(nccl_launch& l) {
    captured.push_back(std::move(l.done));
    l.done = cuda::event{};
  }

  // Called with the mutex held: ends the communicator so that kernels stuck in it return.
  void abort_locked(const std::string& reason) {
    if (aborted) return;
    aborted = true;
    abort_reason = reason;
    for (auto& p : deferred) release_locked(*p.launch, false);
    deferred.clear();
    if (comm || p2p) {
      device_guard guard(device, name);
      if (comm) device::nccl_comm_abort(std::exchange(comm, nullptr));
      if (p2p) device::nccl_comm_abort(std::exchange(p2p, nullptr));
    }
  }

  // Called with the mutex held, while an operation is not complete: NCCL's asynchronous error on
  // this communicator (this rank's own failure), or a peer's report of its own. "" when neither;
  // otherwise the cause, and the communicator aborted.
  std::string failure_locked(const std::string& what) {
    device::nccl_result_t async = device::nccl_success;
    if (comm) check_nccl(device::nccl_comm_get_async_error(comm, &async), what, ": ncclCommGetAsyncError");
    if (p2p && (async == device::nccl_success || async == device::nccl_in_progress))
      check_nccl(device::nccl_comm_get_async_error(p2p, &async), what, ": ncclCommGetAsyncError");
    if (async != device::nccl_success && async != device::nccl_in_progress)
      return fail_locked(what, cat("asynchronous NCCL error ", device::nccl_error_name(async), ": ",
                                   device::nccl_error_string(async), cuda_cause(async)));
    if (!watch || !watch->peer_failed()) return {};
    const auto place = where();
    const auto peer = watch->peer_failure();
    abort_locked(cat("the communicator of ", peer));
    return cat("the communicator of ", peer, "; ", place, " aborted with ncclCommAbort");
  }

  // Called with the mutex held: this rank's side failed by itself (`cause`). The communicator is
  // aborted, which ends its kernels, and the peers are told at once, so that their operations,
  // which wait for this rank, end naming it instead of timing out. Returns the error's cause.
  std::string fail_locked(const std::string& what, const std::string& cause) {
    const auto place = where();
    abort_locked(cat(what, ": ", cause));
    if (watch) watch->report_failure(cat(what, ": ", cause));
    return cat(cause, "; ", place, " aborted with ncclCommAbort");
  }

  // Called with the mutex held, after an NCCL call that returned `rc`: a nonblocking
  // communicator's call that returned ncclInProgress is waited for until the work is enqueued,
  // so that an event recorded next really follows it; one that returned success is enqueued.
  void settle_locked(const std::string& what, device::nccl_result_t rc) {
    if (rc != device::nccl_in_progress) return;
    settle_locked(what);
  }
  void settle_locked(const std::string& what) {
    if (!nccl_settle(comm, what, timeout())) {
      const auto reason = cat("enqueueing did not finish within ", timeout().count(), " ms (FLEXCOMM_TIMEOUT)");
      const auto place = where();
      abort_locked(cat(what, ": ", reason));
      fail(what, cat(reason, "; ", place, " aborted with ncclCommAbort"));
    }
  }

  // Called with the mutex held: launches deferred sends and receives as one group.
  void flush_locked(const std::string& what) {
    if (deferred.empty()) return;
    require_usable(what);
    flushing.swap(deferred);  // both keep their room: a flush allocates nothing
    try {
      launch_flushing_locked(what);
    } catch (...) {
      for (auto& p : flushing) release_locked(*p.launch, false);
      flushing.clear();
      throw;
    }
    flushing.clear();
  }

 private:
  std::vector<nccl_p2p> flushing;

  // On the blocking child, ncclGroupEnd connects a pair at its first send or receive and blocks
  // the host until the peer takes part: armed, so that past the timeout the watcher aborts the
  // child and the call returns.
  void launch_flushing_locked(const std::string& what) {
    device_guard guard(device, what);
    nccl_group group(what);
    for (const auto& p : flushing) {
      device::stream_t s = p.stream ? p.stream : stream.get();
      if (p.count == 0) continue;  // both sides know the count: an empty message is no message
      if (p.send)
        check_nccl(device::nccl_send(p.buf, p.count, p.type, p.peer, p2p, s), what, ": ncclSend to ", p.peer);
      else
        check_nccl(device::nccl_recv(const_cast<void*>(p.buf), p.count, p.type, p.peer, p2p, s),
                   what, ": ncclRecv from ", p.peer);
    }
    p2p_watch->arm(timeout());
    const device::nccl_result_t rc = group.end_unchecked();
    if (p2p_watch->disarm()) point_to_point_timed_out_locked(what);
    check_nccl(rc, what, ": ncclGroupEnd");
    for (const auto& p : flushing) {
      p.launch->done.record(p.stream ? p.stream : stream.get(), what);
      p.launch->launched = true;
      release_locked(*p.launch, true);
    }
  }

  // The watcher aborted the child (it is gone): the peers of the group did not take part. Asked
  // over the side channel as a timed-out wait asks; the communicator is aborted, the job goes on.
  [[noreturn]] void point_to_point_timed_out_locked(const std::string& what) {
    p2p = nullptr;
    std::string peers;
    for (const auto& p : flushing)
      peers += cat(peers.empty() ? "" : ", ", p.send ? "the receive of rank " : "the send of rank ", p.peer);
    const auto limit = timeout();
    std::string report;
    if (watch) {
      watch->announce();
      report = cat("\n", watch->diagnose(flushing.front().launch->sequence, watchdog::grace(limit)));
    }
    const auto place = where();
    abort_locked(cat(what, ": a peer did not take part within ", limit.count(), " ms"));
    fail(what, cat("a peer did not take part: NCCL waited for ", peers, " (matching this rank's in one group) for ",
                   limit.count(), " ms (FLEXCOMM_TIMEOUT) on the blocking point-to-point communicator; ", place,
                   " aborted with ncclCommAbort (a rank did not post its side, or the ranks issued sends and ",
                   "receives in different orders)", report));
  }

  // A blocking finalize waits for the sends and receives still in flight: armed, so that one whose
  // peer is gone ends in an abort past the timeout, said on stderr (a destructor cannot throw).
  void close_point_to_point() noexcept {
    if (!p2p) return;
    const device::nccl_comm_t child = std::exchange(p2p, nullptr);
    try {
      device_guard guard(device, name);
      p2p_watch->arm(timeout());
      const device::nccl_result_t rc = device::nccl_comm_finalize(child);
      if (p2p_watch->disarm()) {
        std::fprintf(stderr, "flexcomm: rank %d: nccl communicator '%s': sends or receives in flight did not finish "
                     "within %lld ms (FLEXCOMM_TIMEOUT): a peer is gone; aborted with ncclCommAbort\n",
                     process_rank(), name.c_str(), static_cast<long long>(timeout().count()));
        return;
      }
      if (rc == device::nccl_success && device::nccl_comm_destroy(child) == device::nccl_success) return;
    } catch (...) {
    }
    device::nccl_comm_abort(child);
  }
};
}  // namespace detail

}  // namespace flexcomm
