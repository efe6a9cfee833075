// The NCCL backend's request: one stream-ordered NCCL operation, complete when the event
// recorded after its kernels is reached. test() also polls the communicator's asynchronous
// error; a wait past its limit asks the peers where they stand, as MPI's timeouts do, and aborts
// the communicator (ncclCommAbort) instead of hanging. Unlike MPI, NCCL can cancel: the job can
// go on without this communicator.
#pragma once


#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "../../core/error.hpp"
#include "../../core/mutex.hpp"
#include "../../core/watchdog.hpp"
#include "../mpi/abort.hpp"
#include "../request.hpp"
#include "communicator.hpp"
#include "state.hpp"
#include "types.hpp"

namespace flexcomm {

class nccl_request : public basic_request<nccl_request> {
 public:
  nccl_request() = default;
  nccl_request(std::shared_ptr<detail::nccl_state> state, detail::nccl_launch* launch)
      : state_(std::move(state)), launch_(launch) {}
  nccl_request(nccl_request&& o) noexcept { swap(o); }
  nccl_request& operator=(nccl_request&& o) noexcept { return take(std::move(o)); }
  ~nccl_request() { finish_pending(); }

  bool pending() const noexcept { return launch_ != nullptr; }
  // The operation's name while it is pending (its launch record holds it).
  const std::string& what() const noexcept {
    static const std::string none;
    return launch_ ? launch_->what : none;
  }

  // Under the communicator's one lock: the consistency check's news, an abort, a deferred
  // launch, the completion event, NCCL's asynchronous error, in that order.
  bool test() {
    if (!pending()) return true;
    auto& st = *state_;
    std::lock_guard<flexcomm::mutex> lock(st.mutex);
    agreed_locked(false);
    if (st.aborted) fail_locked(op_state::failed, cat(st.where(), " was aborted: ", st.abort_reason));
    if (!launch_->launched) {
      try {
        st.flush_locked(launch_->what);
      } catch (...) {
        end_locked(op_state::failed);
        throw;
      }
      // An event never recorded reads as reached: an operation lost with a failed group launch
      // must not look finished.
      if (!launch_->launched)
        fail_locked(op_state::failed, "its NCCL group launch failed (reported by the operation that launched it)");
    }
    if (reached_locked()) {
      end_locked(op_state::completed);
      return true;
    }
    if (const auto cause = st.failure_locked(launch_->what); !cause.empty()) fail_locked(op_state::failed, cause);
    agreed_locked(true);
    return false;
  }

  // For an operation issued into a stream that was capturing into a CUDA graph: it runs at each
  // replay of the graph, and its event marks a point in the graph, so test() and wait() (an event
  // query) would break the capture. Settles the host side now, once: the consistency check's news
  // so far (its signature went into the batch at the post), then its entry in the flight recorder.
  // The event stays the graph's: it never goes back to the pool, where a replay would record it
  // under a later operation. The request is empty afterwards.
  void release_captured() {
    if (!pending()) return;
    auto& st = *state_;
    std::lock_guard<flexcomm::mutex> lock(st.mutex);
    agreed_locked(false);
    st.keep_captured_locked(*launch_);
    end_locked(op_state::completed);
  }

  // Marks this request as collective `kind` on `comm` in the trace, from now to completion.
  void trace_collective(const char* kind, const nccl_communicator& comm) {
    if (launch_) launch_->trace.begin(kind, comm.name(), launch_->collective);
  }

 private:
  friend class basic_request<nccl_request>;

  std::chrono::milliseconds limit(std::chrono::milliseconds t) const {
    return t.count() >= 0 ? t : state_->timeout();
  }
  bool settled() { return test(); }
  void answer_queries() {
    if (state_->watch) state_->watch->answer_queries();
  }

  // A pending operation failed in the destructor: the job ends (backend/request.hpp).
  static void end_job() noexcept { abort_mpi_job(3); }

  // A request on an aborted communicator is left, not waited for: ncclCommAbort ended its kernels,
  // and what aborted it was reported where it happened (another request of an unwinding step).
  bool abandon() noexcept {
    if (!launch_) return false;  // ended by the failure being reported
    try {
      std::lock_guard<flexcomm::mutex> lock(state_->mutex);
      if (!state_->aborted) return false;
      end_locked(op_state::abandoned);
      return true;
    } catch (...) {
      return false;
    }
  }

  // Under the lock: whether the completion event was reached. A poisoned CUDA context (a kernel
  // that faulted) is this rank's failure: the communicator aborted, the peers told
  // (nccl_state::fail_locked).
  bool reached_locked() {
    try {
      return launch_->done.done(launch_->what);
    } catch (const error& e) {
      fail_locked(op_state::failed, state_->fail_locked(launch_->what, e.cause()));
    }
  }

  // The consistency check (mpi/batched_check.hpp): what the previous rank sent is compared with
  // this rank's calls, and, while this operation is `stuck`, this rank's unsent signatures leave.
  // Mismatched calls would leave NCCL's kernels waiting for each other: the communicator is
  // aborted and the error says who disagreed on what.
  void agreed_locked(bool stuck) {
    const std::string& verdict = state_->consistency.poll(stuck);
    if (verdict.empty()) return;
    state_->abort_locked(cat("the ranks disagreed on the calls: ", verdict));
    fail_locked(op_state::failed, verdict);
  }

  [[noreturn]] void timed_out(std::chrono::milliseconds limit) {
    auto& st = *state_;
    const auto seq = launch_->sequence;
    const std::string what = launch_->what;
    {
      std::lock_guard<flexcomm::mutex> lock(st.mutex);
      end_locked(op_state::timed_out);
    }
    std::string report;
    if (st.watch) {
      st.watch->announce();
      report = cat("\n", st.watch->diagnose(seq, watchdog::grace(limit)));
    }
    std::string place;
    {
      std::lock_guard<flexcomm::mutex> lock(st.mutex);
      place = st.where();
      st.abort_locked(cat(what, ": timed out after ", limit.count(), " ms"));
    }
    fail(what, cat("timed out after ", limit.count(), " ms (FLEXCOMM_TIMEOUT); ", place,
                   " aborted with ncclCommAbort (a rank did not take part, or the ranks issued operations in ",
                   "different orders)", report));
  }

  // The operation is over, one way or another: recorded as such, its trace span closed, its
  // launch record back to the communicator (with its event, when reached). Under the lock.
  void end_locked(op_state how) noexcept {
    state_->finish(launch_->sequence, how);
    launch_->trace.end();
    state_->release_locked(*launch_, how == op_state::completed);
    launch_ = nullptr;
  }
  [[noreturn]] void fail_locked(op_state how, const std::string& cause) {
    std::string what = launch_->what;
    end_locked(how);
    fail(std::move(what), cause);
  }

  void swap(nccl_request& o) noexcept {
    std::swap(state_, o.state_);
    std::swap(launch_, o.launch_);
  }

  std::shared_ptr<detail::nccl_state> state_;
  detail::nccl_launch* launch_ = nullptr;
};

}  // namespace flexcomm
