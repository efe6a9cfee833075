// Collectives held back until their consistency check agreed (Open MPI only:
// mpi_implementation::defers_collectives). Posting one starts only its check; testing any request
// of the communicator advances the communicator's queue: from the front, in posting order, each
// collective whose check agreed is handed to the library. MPI needs every rank to post a
// communicator's collectives in the same order, and this keeps the order flexcomm was given
// however the requests are tested. A disagreement stops the queue: that collective and every one
// behind it never reach the library, so none of their buffers is touched.
#pragma once

#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "../../core/error.hpp"
#include "types.hpp"
#include "watchdog.hpp"

namespace flexcomm::detail {

// The library call behind one collective, made when its turn comes.
using native_post = std::function<int(MPI_Request*)>;

// One collective on its way to the library, shared by its request and its communicator's queue;
// the queue's mutex guards every field.
struct deferred_post {
  enum class stage { checking, posted, refused, dropped };

  deferred_post(std::unique_ptr<mpi_signature_check> c, native_post p, std::uint64_t s, std::string w)
      : check(std::move(c)), post(std::move(p)), seq(s), what(std::move(w)) {}

  std::unique_ptr<mpi_signature_check> check;  // null: unchecked, posted as soon as its turn comes
  native_post post;
  std::uint64_t seq;
  std::string what;
  stage now = stage::checking;
  bool verdict_lost = false;  // the check itself failed (no side channel): posted unchecked
  MPI_Request req = MPI_REQUEST_NULL;
  std::string refusal;  // refused: why
};

// A communicator's collectives not yet handed to the library, oldest first.
class deferred_posts {
 public:
  void enqueue(std::shared_ptr<deferred_post> p) {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(std::move(p));
  }

  bool empty() {
    std::lock_guard<std::mutex> lock(mutex_);
    return queue_.empty();
  }

  // Never blocks on a peer, except to swap signatures once a check has disagreed (`grace` at most).
  void advance(mpi_comm_state& state, std::chrono::milliseconds grace) {
    std::lock_guard<std::mutex> lock(mutex_);
    while (!queue_.empty()) {
      deferred_post& p = *queue_.front();
      if (p.now == deferred_post::stage::dropped) {
        refuse_all(cat("not posted: an earlier collective on '", state.name(), "' (#", p.seq, ") was abandoned"));
        return;
      }
      if (state.poisoned()) {
        refuse_all(cat("not posted: communicator '", state.name(), "' is unusable: ", state.poison_reason()));
        return;
      }
      if (p.check && p.check->req != MPI_REQUEST_NULL) {
        int flag = 0;
        if (MPI_Test(&p.check->req, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS) {
          p.check->req = MPI_REQUEST_NULL;
          p.verdict_lost = true;
        } else if (!flag) {
          return;  // some rank has not posted this collective yet
        }
      }
      if (p.check && !p.verdict_lost && !p.check->agreed()) {
        p.refusal = cat(state.disagreement(p.check->mine, grace), " (FLEXCOMM_CHECK)");
        state.poison(cat("ranks disagreed on #", p.seq, " (", p.what, ")"));
        p.now = deferred_post::stage::refused;
        queue_.pop_front();
        refuse_all(cat("not posted: communicator '", state.name(), "' is unusable: ", state.poison_reason()));
        return;
      }
      const int rc = p.post(&p.req);
      if (rc != MPI_SUCCESS) {
        p.req = MPI_REQUEST_NULL;
        p.refusal = mpi_error_text(rc);
        state.poison(cat("posting ", p.what, " failed after its consistency check went out"));
        p.now = deferred_post::stage::refused;
        queue_.pop_front();
        refuse_all(cat("not posted: communicator '", state.name(), "' is unusable: ", state.poison_reason()));
        return;
      }
      p.now = deferred_post::stage::posted;
      queue_.pop_front();
    }
  }

  // What advance() decided for `p`, read under the queue's lock.
  deferred_post::stage stage_of(deferred_post& p, MPI_Request& req, std::string& refusal) {
    std::lock_guard<std::mutex> lock(mutex_);
    req = p.req;
    if (p.now == deferred_post::stage::refused) refusal = p.refusal;
    return p.now;
  }

  // Its request gives `p` up (the job is ending): nothing behind it may be posted any more.
  void drop(deferred_post& p) noexcept {
    try {
      std::lock_guard<std::mutex> lock(mutex_);
      if (p.now == deferred_post::stage::checking) p.now = deferred_post::stage::dropped;
    } catch (...) {
      p.now = deferred_post::stage::dropped;  // the mutex could not be taken: the job ends anyway
    }
  }

 private:
  // Called with the lock held. A check still in flight keeps its buffers: the library may write
  // into them.
  void refuse_all(const std::string& why) {
    for (auto& p : queue_) {
      if (p->check && p->check->req != MPI_REQUEST_NULL) static_cast<void>(p->check.release());
      if (p->now == deferred_post::stage::checking) {
        p->now = deferred_post::stage::refused;
        p->refusal = why;
      }
    }
    queue_.clear();
  }

  std::mutex mutex_;
  std::deque<std::shared_ptr<deferred_post>> queue_;
};

// A request's handle on its deferred collective until the library has it.
class deferred_collective {
 public:
  deferred_collective() = default;
  deferred_collective(std::shared_ptr<deferred_posts> queue, std::shared_ptr<deferred_post> post)
      : queue_(std::move(queue)), post_(std::move(post)) {}

  bool pending() const noexcept { return post_ != nullptr; }

  // Advances the queue; once this collective is posted, hands its library request to `req` and
  // returns true. Refused: `failed()` (the request's bookkeeping), then the error.
  template <class Failed>
  bool test(mpi_comm_state& state, std::chrono::milliseconds grace, MPI_Request& req, Failed&& failed) {
    queue_->advance(state, grace);
    std::string refusal;
    const auto now = queue_->stage_of(*post_, req, refusal);
    if (now == deferred_post::stage::checking) return false;
    const std::string what = post_->what;
    post_.reset();
    queue_.reset();
    if (now == deferred_post::stage::posted) return true;
    failed();
    fail(what, refusal);
  }

  // The library may still write into the check's buffers, or the collective may yet be posted
  // into the caller's: keep everything alive; the job ends.
  void abandon() noexcept {
    if (!post_) return;
    queue_->drop(*post_);
    static_cast<void>(new std::shared_ptr<deferred_post>(std::move(post_)));
    queue_.reset();
  }

  void swap(deferred_collective& o) noexcept {
    std::swap(queue_, o.queue_);
    std::swap(post_, o.post_);
  }

 private:
  std::shared_ptr<deferred_posts> queue_;
  std::shared_ptr<deferred_post> post_;
};

}  // namespace flexcomm::detail
