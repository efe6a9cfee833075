// The staged backend's request: one staged operation. test() moves every operation of the
// communicator along, in call order, so every rank issues its MPI operations in the same order.
// Completion is on the host: once test() says true, the result is on the device.
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "../../core/error.hpp"
#include "../../core/watchdog.hpp"
#include "../cuda/error.hpp"
#include "../mpi/abort.hpp"
#include "../request.hpp"
#include "communicator.hpp"
#include "lane.hpp"

namespace flexcomm {

template <bool Direct>
class staged_request : public basic_request<staged_request<Direct>> {
  using base = basic_request<staged_request<Direct>>;

 public:
  staged_request() = default;
  staged_request(std::shared_ptr<detail::staged_lane> lane, std::shared_ptr<detail::staged_op> op)
      : lane_(std::move(lane)), op_(std::move(op)) {}
  staged_request(staged_request&& o) noexcept { swap(o); }
  staged_request& operator=(staged_request&& o) noexcept { return base::take(std::move(o)); }
  ~staged_request() { base::finish_pending(); }

  bool pending() const noexcept { return op_ != nullptr && !failed_; }
  const std::string& what() const noexcept {
    static const std::string none;
    return op_ ? op_->what : none;
  }

  bool test() {
    if (!pending()) return true;
    std::lock_guard<flexcomm::mutex> lock(lane_->mutex);
    try {
      cuda::device_guard guard(lane_->device, op_->what);
      lane_->drive_locked(*op_);
      if (op_->error) std::rethrow_exception(op_->error);
      lane_->agreed_locked(op_);
      if (!op_->done()) return false;
    } catch (...) {
      failed_ = true;
      lane_->finish_record(*op_, op_state::failed);
      lane_->keep_if_in_mpi_locked(op_);
      throw;
    }
    lane_->finish_record(*op_, op_state::completed);
    lane_->recycle_locked(std::move(op_));
    op_.reset();
    return true;
  }

  // A staged operation's chunks are MPI operations on the transport, unrecorded and untraced there:
  // the staged operation is recorded in the transport's flight recorder, and adds no span.
  void trace_collective(const char*, const staged_communicator<Direct>&) noexcept {}

 private:
  friend class basic_request<staged_request<Direct>>;

  std::chrono::milliseconds limit(std::chrono::milliseconds t) const {
    return t.count() >= 0 ? t : lane_->transport.timeout();
  }
  bool settled() { return test(); }

  // A pending operation failed in the destructor: the job ends (backend/request.hpp).
  static void end_job() noexcept { abort_mpi_job(3); }

  // Past the limit it is a flexcomm::error naming the ranks that did not arrive, as the MPI
  // backend's timeouts do: the chunks already on the wire cannot be cancelled, so the job must
  // end (see core/watchdog.hpp).
  [[noreturn]] void timed_out(std::chrono::milliseconds limit) {
    failed_ = true;
    std::uint64_t seq = 0;
    {
      std::lock_guard<flexcomm::mutex> lock(lane_->mutex);
      lane_->forget_locked(op_);
      lane_->keep_if_in_mpi_locked(op_);
      seq = op_->sequence;
      lane_->finish_record(*op_, op_state::timed_out);
    }
    // Diagnosed on the transport, where the staged operations are recorded.
    auto* state = lane_->transport.watch_state().get();
    const std::string report = watchdog::instance().timed_out(state, seq, limit);
    if (state) state->poison(cat("staged operation timed out (", what(), ")"));
    fail(what(), cat("timed out after ", limit.count(), " ms (FLEXCOMM_TIMEOUT)\n", report));
  }

  void swap(staged_request& o) noexcept {
    std::swap(lane_, o.lane_);
    std::swap(op_, o.op_);
    std::swap(failed_, o.failed_);
  }

  std::shared_ptr<detail::staged_lane> lane_;
  std::shared_ptr<detail::staged_op> op_;
  bool failed_ = false;
};

}  // namespace flexcomm
