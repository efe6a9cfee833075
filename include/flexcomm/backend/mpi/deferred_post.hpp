// Collectives held back until their consistency check agreed (Open MPI only:
// mpi_implementation::defers_collectives). Posting one starts only its check; testing any MPI
// request (of any communicator: a rank waiting on a receive may be what a peer's collective
// waits for) advances every communicator's queue: from the front, in posting order, each
// collective whose check agreed is handed to the library. MPI needs every rank to post a
// communicator's collectives in the same order, and this keeps the order flexcomm was given
// however the requests are tested. A disagreement stops the queue: that collective and every one
// behind it never reach the library, so none of their buffers is touched.
#pragma once

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

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
  explicit deferred_posts(std::shared_ptr<mpi_comm_state> state) : state_(std::move(state)) {}

  void enqueue(std::shared_ptr<deferred_post> p) {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(std::move(p));
  }

  bool empty() {
    std::lock_guard<std::mutex> lock(mutex_);
    return queue_.empty();
  }

  // Never blocks on a peer, except to swap signatures once a check has disagreed (for the
  // watchdog's grace period at most).
  void advance() {
    std::lock_guard<std::mutex> lock(mutex_);
    mpi_comm_state& state = *state_;
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
        const auto grace = watchdog::grace(state.limit.for_wait(inherit_timeout));
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

  // Its communicator is freed with these still queued: none may reach the library any more (it
  // would post onto a freed communicator), and each request on one says `why`. Whether any was.
  bool refuse_remaining(const std::string& why) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (queue_.empty()) return false;
    refuse_all(why);
    return true;
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

  std::shared_ptr<mpi_comm_state> state_;
  std::mutex mutex_;
  std::deque<std::shared_ptr<deferred_post>> queue_;
};

// Every communicator's queue, so that testing any request advances them all. Holds them weakly:
// a communicator's queue lives as long as it or one of its requests does.
class deferred_queues {
 public:
  static deferred_queues& instance() {
    static auto* all = new deferred_queues;  // never destroyed: requests may outlive static destruction
    return *all;
  }

  std::shared_ptr<deferred_posts> make(std::shared_ptr<mpi_comm_state> state) {
    auto queue = std::make_shared<deferred_posts>(std::move(state));
    std::lock_guard<std::mutex> lock(mutex_);
    queues_.push_back(queue);
    return queue;
  }

  // Called with every test: one atomic load while nothing is deferred anywhere.
  void advance_all() {
    if (waiting_.load(std::memory_order_acquire) == 0) return;
    std::vector<std::shared_ptr<deferred_posts>> live;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      std::size_t kept = 0;
      for (auto& weak : queues_) {
        if (auto queue = weak.lock()) {
          live.push_back(std::move(queue));
          queues_[kept++] = weak;
        }
      }
      queues_.resize(kept);
    }
    for (auto& queue : live) queue->advance();
  }

  // Collectives posted and not yet handed over (or refused), across all communicators.
  void deferred() noexcept { waiting_.fetch_add(1, std::memory_order_acq_rel); }
  void settled() noexcept { waiting_.fetch_sub(1, std::memory_order_acq_rel); }

 private:
  std::mutex mutex_;
  std::vector<std::weak_ptr<deferred_posts>> queues_;
  std::atomic<long> waiting_{0};
};

// A request's handle on its deferred collective until the library has it.
class deferred_collective {
 public:
  deferred_collective() = default;
  deferred_collective(std::shared_ptr<deferred_posts> queue, std::shared_ptr<deferred_post> post)
      : queue_(std::move(queue)), post_(std::move(post)) {
    deferred_queues::instance().deferred();
  }
  deferred_collective(deferred_collective&& o) noexcept { swap(o); }
  deferred_collective& operator=(deferred_collective&& o) noexcept {
    swap(o);
    return *this;
  }
  deferred_collective(const deferred_collective&) = delete;
  deferred_collective& operator=(const deferred_collective&) = delete;
  ~deferred_collective() {
    if (post_) deferred_queues::instance().settled();  // a request moved-from or abandoned keeps no count
  }

  bool pending() const noexcept { return post_ != nullptr; }

  // Advances the queue; once this collective is posted, hands its library request to `req` and
  // returns true. Refused: `failed()` (the request's bookkeeping), then the error.
  template <class Failed>
  bool test(MPI_Request& req, Failed&& failed) {
    queue_->advance();
    std::string refusal;
    const auto now = queue_->stage_of(*post_, req, refusal);
    if (now == deferred_post::stage::checking) return false;
    const std::string what = post_->what;
    post_.reset();
    queue_.reset();
    deferred_queues::instance().settled();
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
    deferred_queues::instance().settled();
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
