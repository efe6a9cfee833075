// The shared-memory route: a member whose ranks all share one host reduces its buckets through
// shared memory, on backends that can (has_host_shared_memory), whichever adapter it runs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "../../backend/contract.hpp"
#include "../../core/agreement.hpp"
#include "../../core/hosts.hpp"
#include "../../core/progress.hpp"
#include "../../core/reduce.hpp"
#include "../../core/span.hpp"
#include "flight.hpp"
#include "options.hpp"

namespace flexcomm::detail {

template <class B, bool = has_host_shared_memory<B>>
class host_shared {
 public:
  // Collective over `member` (the adapter's private duplicate), after `hosts` was learnt on it.
  // `tiered`: the adapter averages across hosts hierarchically, which takes precedence.
  void setup(const typename B::communicator& member, const host_map& hosts, bool tiered, const sync_options& options,
             const std::string& who) {
    // The choice must be the same on every rank, and so must the op: each rank reduces its own
    // share of every bucket with its own.
    agreement same({static_cast<std::int64_t>(options.shared_memory), static_cast<std::int64_t>(options.op),
                    static_cast<std::int64_t>(options.shared_memory_slot_bytes),
                    static_cast<std::int64_t>(options.share_own_memory)});
    B::iallreduce(member, same.buffer(), op::max).wait();
    check(same.agreed(0), who,
          cat("sync_options.shared_memory (FLEXCOMM_SHM) differs across the member's ranks; this rank has '",
              name_of(options.shared_memory), "'"));
    check(same.agreed(1), who,
          cat("sync_options.op differs across the member's ranks; this rank has '", name_of(options.op), "'"));
    check(same.agreed(2), who, "sync_options.shared_memory_slot_bytes differs across the member's ranks");
    check(same.agreed(3), who, "sync_options.share_own_memory differs across the member's ranks");
    if (options.shared_memory == shared_memory_use::off || tiered) return;
    if (options.shared_memory == shared_memory_use::on)
      check(hosts.hosts() <= 1, who,
            cat("sync_options.shared_memory (FLEXCOMM_SHM) is on, but the member spans ", hosts.hosts(), " hosts (",
                hosts.str(), ")"));
    if (hosts.hosts() != 1 || member.size() < 2) return;
    // FLEXCOMM_HOSTS may pretend one host where MPI knows several: automatic then stays off.
    if (options.shared_memory == shared_memory_use::automatic && !B::host_reducer::on_one_host(member)) return;
    reducer_.emplace(member, options.shared_memory_slot_bytes);
  }
  explicit operator bool() const noexcept { return reducer_.has_value(); }

  // The sync core's per-step check through the same segment (signature_check::through).
  void agree(span<std::int64_t> v) { reducer_->allreduce(v.data(), v.size(), op::max); }

  // Whether a bucket of `bytes` can carry the step's check (`words`) in its own round: one
  // synchronisation for a small step instead of two (the bucket, then the check), which at 4 B
  // left the adapter below MPI_Allreduce in some runs. The same answer on every rank.
  // A bucket reduced in place carries it whatever its size.
  bool carries(std::size_t bytes, std::size_t words, bool in_place) const noexcept {
    if (!reducer_) return false;
    return in_place ? reducer_->carries_in_place(bytes, words) : reducer_->carries(bytes, words);
  }
  // Reduces one bucket and max-reduces `check` with it, here, before returning; `landing` and
  // `in_place` as in launch().
  template <class T>
  void reduce_carrying(T* data, std::size_t count, op o, span<std::int64_t> check, std::function<void()> landing,
                       bool in_place) {
    if (in_place)
      reducer_->allreduce_in_place_carrying(data, count, o, check, std::move(landing));
    else
      reducer_->allreduce_carrying(data, count, o, check, std::move(landing));
  }

  // Memory that buckets are reduced in where they lie (host_reducer::allocate): collective over
  // the member, the same size everywhere.
  span<std::byte> allocate(std::size_t bytes) { return reducer_->allocate(bytes); }
  bool holds(const void* data, std::size_t bytes) const noexcept { return reducer_ && reducer_->holds(data, bytes); }
  // Whether a bucket of `bytes` gains by being reduced in place: above the one-round small path,
  // which takes one synchronisation where in place takes two.
  bool in_place_gains(std::size_t bytes) const noexcept { return reducer_ && bytes > reducer_->small_bytes(); }

  // A bucket of one gradient in the trainer's own memory, made shared where it lies
  // (host_reducer::register_range, shm/registered_range.hpp): collective over the member, in the
  // plan's order; null on every rank where it cannot be. Opaque to the core.
  template <class T>
  const void* register_range(T* data, std::size_t count) {
    return reducer_->register_range(data, count);
  }
  void unregister(const void* r) { reducer_->unregister(static_cast<registration>(r)); }
  // Whether r's last allreduce went through the slots (a rank's gradient was not its registered
  // pages): the same on every rank.
  static bool fell_back(const void* r) noexcept { return B::host_reducer::fell_back(static_cast<registration>(r)); }

  // Buckets of at most this many bytes never go to the engine's thread (see launch).
  static constexpr std::size_t latency_bytes = std::size_t{64} << 10;

  // Reduces one bucket: here, on the trainer's thread, before returning (`on_engine` false), or
  // in the background. `landing` (may be empty) runs once the bucket's average is in data, on
  // the thread that finished it: a fused bucket reduced during backward is copied back into its
  // gradients during backward too, not after it in finish(). A background bucket of at most
  // latency_bytes is only started: whoever drives the segment next finishes it (the engine with
  // a later bucket, or the trainer in finish(), whose step check goes through the same segment),
  // as the flight's `driven`. The hop to the engine's thread and back would cost more than the
  // reduction (docs/architecture.md), and unlike a blocking reduction here it never holds the
  // trainer until its peers reach the bucket.
  // `in_place`: the bucket lies in allocate()'s memory on every rank (fixed with the plan), and is
  // reduced there, with nothing copied in or out; `registered`: the bucket's registration, the
  // same, in the trainer's own memory.
  template <class T>
  flight<B> launch(T* data, std::size_t count, op o, bool on_engine, std::function<void()> landing, bool in_place,
                   const void* registered = nullptr) {
    flight<B> f;
    const auto r = static_cast<registration>(registered);
    if (!on_engine) {
      if (r)
        reducer_->allreduce_registered(data, count, o, r);
      else if (in_place)
        reducer_->allreduce_in_place(data, count, o);
      else
        reducer_->allreduce(data, count, o);
      if (landing) landing();
      return f;
    }
    // Not polled here: that would drive the buckets before it too, on the trainer's time.
    auto task = r          ? reducer_->start_registered(data, count, o, r, std::move(landing))
                : in_place ? reducer_->start_in_place(data, count, o, std::move(landing))
                           : reducer_->start(data, count, o, std::move(landing));
    if (count * sizeof(T) <= latency_bytes)
      f.driven = [task] { return task->poll(); };
    else
      f.task = progress_engine::instance().submit([task] { return task->poll(); }, task->what());
    return f;
  }

 private:
  using registration = typename B::host_reducer::registration;
  std::optional<typename B::host_reducer> reducer_;
};

template <class B>
class host_shared<B, false> {
 public:
  void setup(const typename B::communicator&, const host_map&, bool, const sync_options&, const std::string&) {}
  explicit operator bool() const noexcept { return false; }
  void agree(span<std::int64_t>) {}
  bool carries(std::size_t, std::size_t, bool) const noexcept { return false; }
  template <class T>
  void reduce_carrying(T*, std::size_t, op, span<std::int64_t>, std::function<void()>, bool) {
    fail("shared-memory allreduce", "this backend has no shared-memory path");
  }
  span<std::byte> allocate(std::size_t) { fail("shared-memory allocation", "this backend has no shared-memory path"); }
  bool holds(const void*, std::size_t) const noexcept { return false; }
  bool in_place_gains(std::size_t) const noexcept { return false; }
  template <class T>
  const void* register_range(T*, std::size_t) {
    fail("shared-memory registration", "this backend has no shared-memory path");
  }
  void unregister(const void*) {}
  static bool fell_back(const void*) noexcept { return false; }
  template <class T>
  flight<B> launch(T*, std::size_t, op, bool, std::function<void()>, bool, const void* = nullptr) {
    fail("shared-memory allreduce", "this backend has no shared-memory path");
  }
};

}  // namespace flexcomm::detail
