// shm::host_reducer: the intra-host allreduce and broadcast through shared memory, the capability
// contract.hpp calls has_host_shared_memory (a backend offers it as B::host_reducer; the MPI
// backend's is mpi/shared_memory.hpp). Made collectively over a group whose ranks all share one
// host (host_group.hpp): the backend's communicator serves only to set it up.
//
// Each rank owns a region of the segment (segment.hpp): its progress counter (a cache line), two
// small slots and two large slots. Every task is a fixed number of steps (the same on every rank),
// and a rank publishes the last step it finished with a release store; a peer that needs it waits
// with acquire loads, through the wait policy. How an allreduce takes its steps: allreduce.hpp; a
// broadcast: broadcast.hpp.
// An allreduce is a task (host_allreduce): poll() does what it can without waiting and returns,
// so the progress engine can drive it during backward; allreduce() drives one on the caller's
// thread. Tasks run in the order they were started, and polling any task drives the segment:
// every task started before it, then itself, as far as they go (one thread at a time; another
// that finds it busy returns at once). So a trainer waiting on a blocking allreduce (the step's
// check in finish()) finishes the buckets still queued before it on its own thread, instead of
// waiting for the engine's thread to be scheduled between each of their steps.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>

#include "../../core/datatype.hpp"
#include "../../core/error.hpp"
#include "../../core/reduce.hpp"
#include "../../core/wait.hpp"
#include "../../core/watchdog.hpp"
#include "allreduce.hpp"
#include "broadcast.hpp"
#include "host_group.hpp"
#include "segment.hpp"
#include "slot_writer.hpp"

namespace flexcomm::shm {

class host_reducer {
 public:
  // Bytes of each rank's large slot unless told otherwise: a larger bucket goes in chunks.
  static constexpr std::size_t default_slot_bytes = std::size_t{1} << 20;
  // Allreduces of at most this many bytes take the one-round path.
  static constexpr std::size_t default_small_bytes = std::size_t{16} << 10;

  template <class T>
  using task = detail::host_allreduce<T>;
  template <class T>
  using broadcast_task = detail::host_broadcast<T>;

  host_reducer() = default;

  // Collective over `group` (the reducer's own, kept for its names and timeout), whose ranks must
  // all share one host (the backend decides: otherwise an error on every rank). Allocates
  // 2 x slot_bytes + 2 x small_bytes (and a cache line) of shared memory per rank.
  explicit host_reducer(std::unique_ptr<host_group> group, std::size_t slot_bytes = default_slot_bytes,
                        std::size_t small_bytes = default_small_bytes)
      : segment_(std::make_shared<detail::host_segment>(std::move(group), slot_bytes, small_bytes)) {}

  explicit operator bool() const noexcept { return segment_ != nullptr; }
  int size() const noexcept { return segment_ ? segment_->ranks : 0; }
  std::size_t slot_bytes() const noexcept { return segment_ ? segment_->large_bytes : 0; }
  std::size_t small_bytes() const noexcept { return segment_ ? segment_->small_bytes : 0; }
  // The limit on each wait (the reducer's own group follows FLEXCOMM_TIMEOUT unless set).
  void set_timeout(std::chrono::milliseconds t) { usable("set_timeout").group->set_timeout(t); }

  // Starts an allreduce of data[0, n) in place: every rank starts the same n, T and o, in the
  // same order. Avg is the sum divided by the rank count (integers truncate, as divide_by does).
  // The task does nothing until polled; tasks run in the order they were started. `data` must
  // stay valid until the task is done.
  template <class T>
  std::shared_ptr<task<T>> start(T* data, std::size_t n, op o) {
    static_assert(is_element_v<T>, "host_reducer: float, double, int32, int64, uint8, half or bfloat16");
    auto& seg = usable("shared-memory allreduce");
    if (n == 0)
      return std::make_shared<task<T>>(segment_, data, n, o, typename task<T>::plan{0, {0, 0}, -1, detail::slot_writer::cached});
    typename task<T>::plan p{steps_, {0, 0}, -1, detail::slot_writer::cached};
    if (n * sizeof(T) <= seg.small_bytes) {
      p.small_slot = static_cast<int>(smalls_++ % 2);
      p.free_after[0] = small_free_[p.small_slot];
      steps_ += 2;
      small_free_[p.small_slot] = steps_;
    } else {
      take_large_slots(p.free_after, seg.template chunks_of<T>(n), 3);
      const int cls = detail::slot_writer::size_class(n * sizeof(T));
      p.stores = seg.writer.choose(cls, timed_[cls]++);
    }
    auto t = std::make_shared<task<T>>(segment_, data, n, o, p);
    seg.enqueue(t);
    return t;
  }

  // Starts a broadcast of root's data[0, n) to every rank's data: every rank starts the same n
  // and T with the same root, in the same order as its other tasks on this reducer.
  template <class T>
  std::shared_ptr<broadcast_task<T>> start_broadcast(T* data, std::size_t n, int root) {
    static_assert(is_element_v<T>, "host_reducer: float, double, int32, int64, uint8, half or bfloat16");
    auto& seg = usable("shared-memory broadcast");
    check(root >= 0 && root < seg.ranks, "shared-memory broadcast",
          cat("root ", root, " is outside the communicator's ", seg.ranks, " ranks"));
    if (n == 0)
      return std::make_shared<broadcast_task<T>>(segment_, data, n, root, typename broadcast_task<T>::plan{0, {0, 0}});
    typename broadcast_task<T>::plan p{steps_, {0, 0}};
    take_large_slots(p.free_after, seg.template chunks_of<T>(n), 2);
    auto t = std::make_shared<broadcast_task<T>>(segment_, data, n, root, p);
    seg.enqueue(t);
    return t;
  }

  // Blocking allreduce on the calling thread: start() and poll until done, answering the
  // watchdog's queries while waiting.
  template <class T>
  void allreduce(T* data, std::size_t n, op o) {
    auto t = start(data, n, o);
    wait_answering(default_wait().driving(), std::chrono::milliseconds{0}, [&] { return t->poll(); },
                   [] { watchdog::instance().answer_queries(); });
  }

 protected:
  // The group it was made over, for the backend's own face of it.
  const host_group& group(const char* what) const { return *usable(what).group; }

 private:
  detail::host_segment& usable(const char* what) const {
    check(segment_ != nullptr, what, "the shared-memory reducer was not set up (moved from?)");
    return *segment_;
  }

  // A task of `chunks` chunks, `per` steps each, chunk c in large slot c mod 2: when the slots it
  // writes are free (out), and its own last use of each becomes the next task's (in).
  void take_large_slots(std::uint64_t (&free_after)[2], std::uint64_t chunks, std::uint64_t per) {
    free_after[0] = large_free_[0];
    free_after[1] = large_free_[1];
    for (std::uint64_t slot = 0; slot < 2 && slot < chunks; ++slot) {
      const std::uint64_t last = (chunks - 1 - slot) / 2 * 2 + slot;  // the last chunk in this slot
      large_free_[slot] = steps_ + per * (last + 1);
    }
    steps_ += per * chunks;
  }

  std::shared_ptr<detail::host_segment> segment_;
  // Set by start() on the caller's thread, in start order: the same on every rank.
  std::uint64_t steps_ = 0, smalls_ = 0;
  std::uint64_t timed_[detail::slot_writer::classes] = {};  // large allreduces started, per size class
  std::uint64_t large_free_[2] = {0, 0};
  std::uint64_t small_free_[2] = {0, 0};
};

}  // namespace flexcomm::shm
