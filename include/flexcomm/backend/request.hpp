// What every backend's request shares: move-only ownership of one operation, a wait that goes
// through the wait policy while answering the watchdog's questions and ends in the backend's
// timeout report, and a destructor that finishes a pending operation (the library may still
// write into its buffers).
//
// A backend's request derives from basic_request<itself> and supplies
//   pending(), test(), what()     the operation's state
//   limit(timeout)                the wait's limit: `timeout`, else the communicator's, else FLEXCOMM_TIMEOUT
//   settled()                     true once waiting can stop (usually test())
//   answer_queries()              the watchdog's side channel, served while waiting
//   timed_out(limit)              [[noreturn]]: the report naming who did not arrive, and the throw
//   after_wait()                  what a settled wait still has to say (a poisoned communicator)
//   abandon() noexcept            true when a pending operation must be left, not waited for
//   end_job() noexcept            static: ends every rank of the job, for a destructor whose pending
//                                 operation failed (the backends over MPI: MPI_Abort)
//   swap(other) noexcept
#pragma once

#include <chrono>
#include <cstdio>
#include <exception>
#include <utility>

#include "../core/wait.hpp"
#include "../core/watchdog.hpp"

namespace flexcomm {

template <class Derived>
class basic_request {
 public:
  basic_request(const basic_request&) = delete;
  basic_request& operator=(const basic_request&) = delete;

  // Waits under the policy; past the limit it is a flexcomm::error that names the ranks that did
  // not arrive (see core/watchdog.hpp), and the backend's communicator is no longer usable.
  void wait(const wait_policy& policy = default_wait(), std::chrono::milliseconds timeout = inherit) {
    auto& self = derived();
    if (!self.pending()) return;
    const auto limit = self.limit(timeout);
    if (!wait_answering(policy, limit, [&] { return self.settled(); }, [&] { self.answer_queries(); }))
      self.timed_out(limit);
    self.after_wait();
  }

  // wait()'s default: the communicator's own timeout, else FLEXCOMM_TIMEOUT.
  static constexpr std::chrono::milliseconds inherit = inherit_timeout;

 protected:
  basic_request() = default;
  ~basic_request() = default;
  basic_request(basic_request&&) noexcept = default;
  basic_request& operator=(basic_request&&) noexcept = default;

  // For Derived's move assignment: a pending operation being overwritten is finished first.
  Derived& take(Derived&& other) noexcept {
    Derived(std::move(other)).swap(derived());
    return derived();
  }

  // For Derived's destructor. A destructor cannot throw: an operation that fails here ends the job.
  void finish_pending() noexcept {
    auto& self = derived();
    if (!self.pending() || self.abandon()) return;
    try {
      wait();
    } catch (const std::exception& e) {
      if (self.abandon()) return;
      std::fprintf(stderr, "%s\n(while destroying a pending request; aborting)\n", e.what());
      std::fflush(stderr);
      Derived::end_job();
    }
  }

  // Defaults for backends without the hook.
  void after_wait() {}
  bool abandon() noexcept { return false; }
  void answer_queries() { watchdog::instance().answer_queries(); }

 private:
  Derived& derived() noexcept { return static_cast<Derived&>(*this); }
};

}  // namespace flexcomm
