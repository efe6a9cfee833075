// The MPI backend's request: one nonblocking MPI operation, with the consistency check that rides
// beside it (on Open MPI, that the collective waits for: mpi/deferred_post.hpp), its place in the
// flight recorder and its span in the trace.
#pragma once

#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "../../core/error.hpp"
#include "../../core/trace.hpp"
#include "../../core/wait.hpp"
#include "../../core/watchdog.hpp"
#include "../request.hpp"
#include "abort.hpp"
#include "call_check.hpp"
#include "communicator.hpp"
#include "deferred_post.hpp"
#include "implementation.hpp"
#include "types.hpp"
#include "watchdog.hpp"

namespace flexcomm {

// Waiting goes through a wait policy; completion runs the operation's epilogue (the division of
// avg). Destroying a pending request waits for it, because MPI may still write into its buffer;
// after a timeout (its communicator poisoned) it is abandoned instead, and the job must end (see
// core/watchdog.hpp).
class mpi_request : public basic_request<mpi_request> {
 public:
  mpi_request() = default;
  mpi_request(MPI_Request req, std::string what, std::function<void()> then = {})
      : req_(req), what_(std::move(what)), then_(std::move(then)) {}
  // Backend-internal: an operation recorded as `seq` in its communicator's flight recorder, with
  // the consistency check that rides beside it (if any).
  mpi_request(MPI_Request req, std::string what, std::function<void()> then,
              std::shared_ptr<detail::mpi_comm_state> state, std::uint64_t seq,
              std::unique_ptr<detail::mpi_signature_check> check)
      : req_(req), what_(std::move(what)), then_(std::move(then)), state_(std::move(state)), seq_(seq),
        check_(std::move(check)) {}
  // Backend-internal, Open MPI: a collective that reaches the library once its check agreed.
  mpi_request(detail::deferred_collective deferred, std::string what, std::function<void()> then,
              std::shared_ptr<detail::mpi_comm_state> state, std::uint64_t seq)
      : what_(std::move(what)), then_(std::move(then)), state_(std::move(state)), seq_(seq),
        deferred_(std::move(deferred)) {}
  mpi_request(mpi_request&& o) noexcept { swap(o); }
  mpi_request& operator=(mpi_request&& o) noexcept { return take(std::move(o)); }
  ~mpi_request() { finish_pending(); }

  bool pending() const noexcept { return req_ != MPI_REQUEST_NULL || check_.pending() || deferred_.pending(); }
  const std::string& what() const noexcept { return what_; }

  // Marks this request as collective `kind` on `comm` in the trace: arrival now, end when it
  // completes (on whichever thread sees it complete).
  void trace_collective(const char* kind, const mpi_communicator& comm) noexcept {
    trace_.begin(kind, comm.name(), comm.next_collective());
  }

  // True once the operation has finished (and its epilogue has run).
  bool test() {
    if (!pending()) return true;
    if constexpr (mpi_implementation::defers_collectives) detail::deferred_queues::instance().advance_all();
    if (deferred_.pending() && !deferred_.test(req_, [&] { record(op_state::failed); })) return false;
    if (check_.pending()) test_check();
    if (req_ != MPI_REQUEST_NULL) {
      int flag = 0;
      // A single-request MPI_Test reports errors (truncation included) in its return code.
      const int rc = MPI_Test(&req_, &flag, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS) {
        req_ = MPI_REQUEST_NULL;
        if (check_.pending())
          check_.settle(*state_, seq_, what_, watchdog::grace(limit(inherit)), [&] { record(op_state::failed); });
        record(op_state::failed);
        trace_.end();
        fail(what_, detail::mpi_error_text(rc));
      }
      if (!flag) return false;
    }
    if (check_.pending()) return false;
    record(op_state::completed);
    trace_.end();
    if (then_) std::exchange(then_, {})();
    return true;
  }

 private:
  friend class basic_request<mpi_request>;

  std::chrono::milliseconds limit(std::chrono::milliseconds t) const {
    return state_ ? state_->limit.for_wait(t) : (t.count() >= 0 ? t : default_timeout());
  }
  bool settled() { return test() || poisoned(); }
  void answer_queries() {
    if (state_) state_->answer_queries();
  }
  void after_wait() const {
    if (pending() && poisoned())
      fail(what_, cat("communicator '", state_->name(), "' is unusable: ", state_->poison_reason()));
  }
  bool poisoned() const noexcept { return state_ && state_->poisoned(); }

  void record(op_state s) noexcept {
    if (state_ && seq_) state_->recorder().finish(seq_, s);
    if (s != op_state::in_flight) seq_ = 0;
  }

  void test_check() {
    check_.test(*state_, seq_, what_, watchdog::grace(limit(inherit)), [&] { record(op_state::failed); });
  }

  [[noreturn]] void timed_out(std::chrono::milliseconds limit) {
    const auto seq = seq_;
    if (state_ && seq_) state_->recorder().finish(seq_, op_state::timed_out);
    std::string stalled;  // the ranks that stopped, first (core/stall.hpp)
    const std::string report = watchdog::instance().timed_out(state_.get(), seq, limit, &stalled);
    const std::string lead = stalled.empty() ? std::string() : cat("; ", stalled);
    if (state_) state_->poison(cat("operation #", seq, " timed out (", what_, ")", lead));
    fail(what_, cat("timed out after ", limit.count(), " ms (FLEXCOMM_TIMEOUT)", lead, "\n", report));
  }

  // A pending operation failed in the destructor: the job ends (backend/request.hpp).
  static void end_job() noexcept { abort_mpi_job(3); }

  bool abandon() noexcept {
    if (!poisoned() && !watchdog::instance().job_must_end()) return false;
    // MPI may still write into the buffers: keep the handles alive; the job ends (environment).
    if (state_ && seq_) state_->recorder().finish(seq_, op_state::abandoned);
    seq_ = 0;
    req_ = MPI_REQUEST_NULL;
    check_.abandon();
    deferred_.abandon();
    watchdog::instance().abandon();
    return true;
  }

  void swap(mpi_request& o) noexcept {
    std::swap(req_, o.req_);
    std::swap(what_, o.what_);
    std::swap(then_, o.then_);
    std::swap(state_, o.state_);
    std::swap(seq_, o.seq_);
    check_.swap(o.check_);
    deferred_.swap(o.deferred_);
    trace_.swap(o.trace_);
  }

  MPI_Request req_ = MPI_REQUEST_NULL;
  std::string what_;
  std::function<void()> then_;
  std::shared_ptr<detail::mpi_comm_state> state_;
  std::uint64_t seq_ = 0;
  detail::riding_check check_;
  detail::deferred_collective deferred_;
  trace::collective_mark trace_;
};

// Waits for every request in turn (each under the policy and timeout).
template <class Requests>
void wait_all(Requests& requests, const wait_policy& policy = default_wait()) {
  for (auto& r : requests) r.wait(policy);
}

}  // namespace flexcomm
