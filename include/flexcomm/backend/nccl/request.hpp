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
#include "../../core/watchdog.hpp"
#include "../request.hpp"
#include "../mpi/call_check.hpp"
#include "communicator.hpp"
#include "state.hpp"
#include "types.hpp"

namespace flexcomm {

class nccl_request : public basic_request<nccl_request> {
 public:
  nccl_request() = default;
  nccl_request(std::shared_ptr<detail::nccl_state> state, std::shared_ptr<detail::nccl_launch> launch,
               std::string what, detail::riding_check check = {})
      : state_(std::move(state)), launch_(std::move(launch)), what_(std::move(what)), check_(std::move(check)) {}
  nccl_request(nccl_request&& o) noexcept { swap(o); }
  nccl_request& operator=(nccl_request&& o) noexcept { return take(std::move(o)); }
  ~nccl_request() { finish_pending(); }

  bool pending() const noexcept { return launch_ != nullptr; }
  const std::string& what() const noexcept { return what_; }

  bool test() {
    if (!pending()) return true;
    auto& st = *state_;
    if (check_.pending() && st.watch) {
      // Mismatched calls would leave NCCL's kernels waiting for each other: abort, then say who.
      check_.test(*st.watch, launch_->sequence, what_, watchdog::grace(st.timeout()), [&] {
        std::lock_guard<std::mutex> lock(st.mutex);
        st.abort_locked(cat(what_, ": the ranks disagreed on the call"));
        end(op_state::failed);
      });
    }
    {
      std::lock_guard<std::mutex> lock(st.mutex);
      if (st.aborted) {
        end(op_state::failed);
        fail(what_, cat(st.where(), " was aborted: ", st.abort_reason));
      }
      if (!launch_->launched) {
        try {
          st.flush_locked(what_);
        } catch (...) {
          end(op_state::failed);
          throw;
        }
        // An event never recorded reads as reached: an operation lost with a failed group launch
        // must not look finished.
        if (!launch_->launched) {
          end(op_state::failed);
          fail(what_, "its NCCL group launch failed (reported by the operation that launched it)");
        }
      }
    }
    if (reached()) {
      if (check_.pending()) return false;
      end(op_state::completed);
      return true;
    }
    std::lock_guard<std::mutex> lock(st.mutex);
    if (const auto cause = st.failure_locked(what_); !cause.empty()) failed(cause);
    return false;
  }

  // For an operation issued into a stream that was capturing into a CUDA graph: it runs at each
  // replay of the graph, and its event marks a point in the graph, so test() and wait() (an event
  // query) would break the capture. Settles the host side now, once: the consistency check that
  // went out with it (MPI on the control communicator, under the timeout), then its entry in the
  // flight recorder. The request is empty afterwards.
  void release_captured() {
    if (!pending()) return;
    auto& st = *state_;
    if (check_.pending() && st.watch) {
      const auto limit = st.timeout();
      const auto test_check = [&] {
        check_.test(*st.watch, launch_->sequence, what_, watchdog::grace(limit), [&] {
          std::lock_guard<std::mutex> lock(st.mutex);
          st.abort_locked(cat(what_, ": the ranks disagreed on the call"));
          end(op_state::failed);
        });
        return !check_.pending();
      };
      if (!wait_answering(default_wait(), limit, test_check, [&] { answer_queries(); })) timed_out(limit);
    }
    end(op_state::completed);
  }

  // Marks this request as collective `kind` on `comm` in the trace, from now to completion.
  void trace_collective(const char* kind, const nccl_communicator& comm) {
    if (launch_) launch_->trace.begin(kind, comm.name(), comm.next_collective());
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
      std::lock_guard<std::mutex> lock(state_->mutex);
      if (!state_->aborted) return false;
      end(op_state::abandoned);
      check_.abandon();
      return true;
    } catch (...) {
      return false;
    }
  }

  // Whether the completion event was reached. A poisoned CUDA context (a kernel that faulted) is
  // this rank's failure: the communicator aborted, the peers told (nccl_state::fail_locked).
  bool reached() {
    try {
      return launch_->done.done(what_);
    } catch (const error& e) {
      std::lock_guard<std::mutex> lock(state_->mutex);
      failed(state_->fail_locked(what_, e.cause()));
    }
  }

  // Called with the state's mutex held: the operation ends failed, its check left to MPI.
  [[noreturn]] void failed(const std::string& cause) {
    end(op_state::failed);
    check_.abandon();
    fail(what_, cause);
  }

  [[noreturn]] void timed_out(std::chrono::milliseconds limit) {
    auto& st = *state_;
    const auto seq = launch_->sequence;
    end(op_state::timed_out);
    check_.abandon();
    std::string report;
    if (st.watch) {
      st.watch->announce();
      report = cat("\n", st.watch->diagnose(seq, watchdog::grace(limit)));
    }
    std::string place;
    {
      std::lock_guard<std::mutex> lock(st.mutex);
      place = st.where();
      st.abort_locked(cat(what_, ": timed out after ", limit.count(), " ms"));
    }
    fail(what_, cat("timed out after ", limit.count(), " ms (FLEXCOMM_TIMEOUT); ", place,
                    " aborted with ncclCommAbort (a rank did not take part, or the ranks issued operations in ",
                    "different orders)", report));
  }

  // The operation is over, one way or another: recorded as such, its trace span closed.
  void end(op_state how) noexcept {
    state_->finish(launch_->sequence, how);
    launch_->trace.end();
    // A reached event goes back to the communicator for the next operation. (Never called with
    // the state's mutex held when `how` is completed.)
    if (how == op_state::completed && launch_.use_count() == 1) {
      try {
        state_->events.give_back(launch_->done);
      } catch (...) {
      }
    }
    launch_.reset();
  }

  void swap(nccl_request& o) noexcept {
    std::swap(state_, o.state_);
    std::swap(launch_, o.launch_);
    std::swap(what_, o.what_);
    check_.swap(o.check_);
  }

  std::shared_ptr<detail::nccl_state> state_;
  std::shared_ptr<detail::nccl_launch> launch_;
  std::string what_;
  detail::riding_check check_;
};

}  // namespace flexcomm
