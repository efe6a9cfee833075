// One bucket's reduction in flight, as a route hands it back to the sync core: what the trainer
// waits on in finish().
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>

#include "../../backend/contract.hpp"
#include "../../core/progress.hpp"
#include "../../core/wait.hpp"

namespace flexcomm::detail {

// One bucket reduction in flight: a backend request the trainer waits on itself, a task the
// progress engine drives while the trainer computes, or a shared-memory task that whoever drives
// the segment next finishes (`driven`: polls it; true once done).
template <class B>
struct flight {
  std::optional<typename B::request> request;
  std::shared_ptr<completion> task;
  std::function<bool()> driven;
  void wait() {
    if (request) request->wait();
    if (driven)
      wait_answering(default_wait().driving(), std::chrono::milliseconds{0}, driven,
                     [] { watchdog::instance().answer_queries(); });
    if (task) {
      // The engine's thread does the work meanwhile: spinning here would take its core.
      wait_policy policy = default_wait();
      if (policy.kind == wait_kind::spin) policy = wait_policy::yield();
      task->wait(policy);
    }
  }
  void reset() {
    request.reset();
    task.reset();
    driven = nullptr;
  }
};

}  // namespace flexcomm::detail
