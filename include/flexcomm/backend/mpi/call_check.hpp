// An operation's record while it is posted, and the consistency check (FLEXCOMM_CHECK) that
// rides beside one collective: what every rank must agree on (operation, type, count, op, root,
// counts, the adapter's label), posted as a small allreduce on the communicator's side channel
// just before the collective, and tested with it (on Open MPI the collective itself waits for its
// verdict: deferred_post.hpp). On a difference the ranks swap signatures, so
// that each names who disagrees, and the communicator is poisoned. MPI collectives carry it, and
// NCCL's, over their control communicator's bookkeeping (NCCL itself would hang on mismatched
// calls; nccl includes it from here).
#pragma once

#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "../../core/datatype.hpp"
#include "../../core/error.hpp"
#include "../../core/span.hpp"
#include "../../core/watchdog.hpp"
#include "../arguments.hpp"
#include "watchdog.hpp"

namespace flexcomm::detail {

// One operation being posted, as every backend whose bookkeeping is an mpi_comm_state records
// it (mpi, and nccl over its control communicator): in the flight recorder at once, under the
// number its errors name (so that a failure while posting is recorded too), and its signature,
// filled in by the front end and posted as the consistency check just before the library call.
// The backend's request takes over the record and the check.
class operation_record {
 public:
  operation_record(std::shared_ptr<mpi_comm_state> state, const char* backend, const std::string& comm,
                   const char* name, std::size_t count, dtype type, const char* redop, int peer, int tag,
                   const std::string& extra, std::uint64_t unrecorded_sequence)
      : state_(std::move(state)) {
    if (state_) {
      if (state_->poisoned())
        fail(cat(backend, " ", name, " on ", comm), cat("communicator '", comm, "' is unusable: ", state_->poison_reason()));
      seq_ = state_->recorder().enqueue(op_record::posting(name, count, type, redop, peer, tag));
    } else {
      seq_ = unrecorded_sequence;
    }
    what_ = describe_operation(backend, name, comm, seq_, count, type, extra);
    signature_.value = {mpi_op_code(name), static_cast<long long>(type), static_cast<long long>(count), -1, -1, 0,
                        check_label::current()};
  }
  operation_record(const operation_record&) = delete;
  operation_record& operator=(const operation_record&) = delete;
  ~operation_record() {
    if (state_ && seq_) state_->recorder().finish(seq_, op_state::failed);  // never reached the library
    if (check_ && check_->req != MPI_REQUEST_NULL) {
      // The check went out but the operation did not: the peers' matching is now off.
      static_cast<void>(check_.release());
      state_->poison(cat("posting ", what_, " failed after its consistency check went out"));
    }
  }

  const std::string& what() const noexcept { return what_; }

  // Fields every rank must agree on, besides the operation, type and count.
  void agree_on(op o) { signature_.value[mpi_signature::redop] = static_cast<long long>(o); }
  void agree_on_root(int root) { signature_.value[mpi_signature::root] = root; }
  void agree_on_counts(span<const int> counts) {
    signature_.value[mpi_signature::counts_hash] = hash_counts(counts.data(), counts.size());
  }
  void count_varies() { signature_.value[mpi_signature::count] = -1; }

  // Posts the check for a collective, just before the collective itself.
  void check_collective(int comm_size) {
    if (!state_ || comm_size < 2 || state_->side() == MPI_COMM_NULL || !checks_enabled()) return;
    check_ = std::make_unique<mpi_signature_check>();
    check_->mine = signature_;
    if (!check_->post(state_->side())) check_.reset();
  }

  // The operation reached the library: its request owns the record and the check from here.
  std::uint64_t take_sequence() noexcept { return std::exchange(seq_, 0); }
  std::uint64_t sequence() const noexcept { return seq_; }
  // The library call itself timed out (an NCCL enqueue waiting for a rank that never came): the
  // record says so, and the check is left to MPI as a timed-out request's is
  // (riding_check::abandon) rather than poisoning the communicator, which the backend aborts.
  void timed_out() noexcept {
    if (state_ && seq_) state_->recorder().finish(std::exchange(seq_, 0), op_state::timed_out);
    if (check_) static_cast<void>(check_.release());
  }
  // The library call failed and the backend cancelled the communicator's work (NCCL's abort):
  // no peer's matching is off, so the check is left to MPI as above, and nothing is poisoned.
  void failed_in_library() noexcept {
    if (state_ && seq_) state_->recorder().finish(std::exchange(seq_, 0), op_state::failed);
    if (check_) static_cast<void>(check_.release());
  }
  std::unique_ptr<mpi_signature_check> take_check() noexcept { return std::move(check_); }
  const std::shared_ptr<mpi_comm_state>& state() const noexcept { return state_; }

 private:
  std::shared_ptr<mpi_comm_state> state_;
  std::uint64_t seq_ = 0;
  std::string what_;
  mpi_signature signature_;
  std::unique_ptr<mpi_signature_check> check_;
};

// After posting: the check in flight beside the operation, owned by its request.
class riding_check {
 public:
  riding_check() = default;
  explicit riding_check(std::unique_ptr<mpi_signature_check> check) : check_(std::move(check)) {}

  bool pending() const noexcept { return check_ && check_->req != MPI_REQUEST_NULL; }

  // Tests the check; on a disagreement, `failed()` (the request's own bookkeeping), the
  // communicator poisoned, and an error naming who disagrees.
  template <class Failed>
  void test(mpi_comm_state& state, std::uint64_t seq, const std::string& what, std::chrono::milliseconds grace,
            Failed&& failed) {
    int flag = 0;
    if (MPI_Test(&check_->req, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS) {
      check_->req = MPI_REQUEST_NULL;  // no side channel: no check
      return;
    }
    if (!flag || check_->agreed()) return;
    failed();
    std::string detail = state.disagreement(check_->mine, grace);
    state.poison(cat("ranks disagreed on #", seq, " (", what, ")"));
    fail(what, cat(detail, " (FLEXCOMM_CHECK)"));
  }

  // The operation itself failed: ranks that disagree on the call explain it better than the
  // library does, so the check gets a grace period to finish.
  template <class Failed>
  void settle(mpi_comm_state& state, std::uint64_t seq, const std::string& what, std::chrono::milliseconds grace,
              Failed&& failed) {
    const auto deadline = std::chrono::steady_clock::now() + grace;
    while (pending() && std::chrono::steady_clock::now() < deadline) {
      test(state, seq, what, grace, failed);
      std::this_thread::yield();
    }
  }

  // The library may still write into the check's buffers: keep them alive; the job ends.
  void abandon() noexcept {
    if (check_) static_cast<void>(check_.release());
  }

  void swap(riding_check& o) noexcept { std::swap(check_, o.check_); }

 private:
  std::unique_ptr<mpi_signature_check> check_;
};

}  // namespace flexcomm::detail
