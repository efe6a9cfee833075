// What an NCCL communicator and its requests share: the NCCL handle, its stream, the deferred
// point-to-point operations, and the MPI backend's bookkeeping over the same ranks (flight
// recorder, timeout, the watchdog's side channel), so that NCCL's timeouts name ranks as MPI's do.
#pragma once

#include "../cuda/runtime.hpp"

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "../../core/error.hpp"
#include "../../core/trace.hpp"
#include "../../core/wait.hpp"
#include "../cuda/error.hpp"
#include "../mpi/watchdog.hpp"
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
  ~nccl_group() {
    if (open_) device::nccl_group_end();
  }

 private:
  std::string what_;
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
struct nccl_launch {
  cuda::event done;
  bool launched = false;
  std::uint64_t sequence = 0;       // in the communicator's flight recorder
  trace::collective_mark trace;     // collectives only
};

struct nccl_p2p {
  bool send;
  const void* buf;
  std::size_t count;
  dtype type;
  int peer;
  device::stream_t stream;
  std::shared_ptr<nccl_launch> launch;
};

// What a communicator and its requests share: the NCCL handle, its stream, the deferred
// point-to-point operations and the bookkeeping for timeout reports.
struct nccl_state {
  device::nccl_comm_t comm = nullptr;
  cuda::stream_handle stream;
  std::string name;
  int rank = -1, size = 0, device = 0;
  std::mutex mutex;  // one thread at a time issues NCCL calls on this communicator
  std::vector<nccl_p2p> deferred;
  // The MPI backend's bookkeeping over the same ranks: flight recorder, timeout and the side
  // channel on which a rank that timed out asks its peers where they stand. NCCL operations are
  // recorded there, so a timeout names the ranks that did not arrive, as MPI's do.
  std::shared_ptr<mpi_comm_state> watch;
  std::uint64_t collectives = 0;  // under the mutex; names the same collective on every rank
  bool aborted = false;
  std::string abort_reason;
  std::vector<std::unique_ptr<device::nccl_comm_t>> split_slots;
  // Completion events of finished operations, for the next ones.
  cuda::event_pool events{64};

  nccl_state() = default;
  nccl_state(const nccl_state&) = delete;
  nccl_state& operator=(const nccl_state&) = delete;

  // Finalize flushes outstanding work (ncclCommFinalize, then ncclCommDestroy). Work that waits
  // for a peer that is gone never flushes: past the timeout the communicator is aborted, which
  // ends its kernels, and the rank says so; a destructor cannot throw.
  ~nccl_state() {
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
    check(!aborted, what, where(), " was aborted: ", abort_reason);
  }

  // Called with the mutex held: ends the communicator so that kernels stuck in it return.
  void abort_locked(const std::string& reason) {
    if (aborted) return;
    aborted = true;
    abort_reason = reason;
    if (comm) {
      device_guard guard(device, name);
      device::nccl_comm_abort(comm);
      comm = nullptr;
    }
  }

  // Called with the mutex held, while an operation is not complete: NCCL's asynchronous error on
  // this communicator (this rank's own failure), or a peer's report of its own. "" when neither;
  // otherwise the cause, and the communicator aborted.
  std::string failure_locked(const std::string& what) {
    device::nccl_result_t async = device::nccl_success;
    if (comm) check_nccl(device::nccl_comm_get_async_error(comm, &async), what, ": ncclCommGetAsyncError");
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
    std::vector<nccl_p2p> batch;
    batch.swap(deferred);
    device_guard guard(device, what);
    nccl_group group(what);
    for (const auto& p : batch) {
      device::stream_t s = p.stream ? p.stream : stream.get();
      if (p.count == 0) continue;  // both sides know the count: an empty message is no message
      if (p.send)
        check_nccl(device::nccl_send(p.buf, p.count, p.type, p.peer, comm, s), what, ": ncclSend to ", p.peer);
      else
        check_nccl(device::nccl_recv(const_cast<void*>(p.buf), p.count, p.type, p.peer, comm, s),
                   what, ": ncclRecv from ", p.peer);
    }
    settle_locked(what, group.end());
    for (const auto& p : batch) {
      p.launch->done.record(p.stream ? p.stream : stream.get(), what);
      p.launch->launched = true;
    }
  }
};
}  // namespace detail

}  // namespace flexcomm
