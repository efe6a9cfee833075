// shm::host_reducer: the intra-host allreduce and broadcast through shared memory, the capability
// contract.hpp calls has_host_shared_memory (a backend offers it as B::host_reducer; the MPI
// backend's is mpi/shared_memory.hpp). Made collectively over a group whose ranks all share one
// host (host_group.hpp): the backend's communicator serves only to set it up.
//
// Each rank owns a region of the segment: its progress counter (a cache line), two small slots
// and two large slots. Every allreduce is a fixed number of steps (the same on every rank, from n
// alone), and a rank publishes the last step it finished with a release store; a peer that needs
// it waits with acquire loads, through the wait policy. Two paths:
//   small (at most small_bytes): one round. Every rank copies its data into a small slot
//     (alternating, so a fast rank never overwrites what a slow one still reads) and publishes;
//     once all have, every rank reduces all slots itself, in rank order: identical bits
//     everywhere, one synchronisation, no progress-thread hop.
//   large: in chunks of at most a large slot, three steps each, chunk c in large slot c mod 2.
//     For chunk c rank r
//     1. copies into its slot the parts of the chunk its peers reduce (not its own share);
//     2. once all have, reduces its share (a cache-line aligned 1/N) from its own buffer and the
//        peers' slots into its own buffer, then copies the result into its slot;
//     3. once all have, copies the peers' reduced shares out of their slots.
//     Each element is reduced by one rank, so every rank ends with the same bits; the user's
//     buffer is read and written once and only (N-1)/N of it crosses the segment each way.
//     Slot writes go through a slot_writer (slot_writer.hpp: ordinary or streaming stores,
//     whichever this rank measures faster). Two slots pipeline the chunks: a rank copies chunk
//     c + 1 in while its peers still copy chunk c out, and waits only for chunk c - 1 to be out of
//     the slot it reuses (with one slot, every chunk was three full stops, and a rank that lost
//     its core for a moment held all).
//   in place (start_in_place): the data already lies in shared memory (host_reducer::allocate,
//     the same offset in every rank's region), so nothing is copied in or out. Two steps: every
//     rank describes what it reduces (step, offset, count, type, op) and publishes; once all
//     have, each checks the others' descriptions against its own, reduces its share from every
//     rank's region into its own and writes the result into every peer's, and publishes; once
//     all have, every rank holds the result. Per rank that reads the data once and writes it once,
//     where the slots above read and write it about twice. A rank whose data is not where it
//     should be, or that reduces something else, is an error on every rank before anyone writes.
//   registered (start_registered): the same in a trainer's own memory made shared where it lies
//     (register_range, registered_range.hpp), each rank's at its own address; the partial edge
//     pages are copied next to the description and reduced by every rank in the second step. A
//     rank whose memory is no longer the registered pages says so in its description, and the
//     whole allreduce then takes the large path, in steps it reserved for that.
// An allreduce may carry a landing: what to do with its result (a fused bucket's copy back into
// its gradients), run by the thread that finishes it, right then, so that a bucket the engine
// reduces during backward is also copied out during backward, not in finish().
// An allreduce is a task (host_allreduce): poll() does what it can without waiting and returns,
// so the progress engine can drive it during backward; allreduce() drives one on the caller's
// thread. Tasks run in the order they were started, and polling any task drives the segment:
// every task started before it, then itself, as far as they go (one thread at a time; another
// that finds it busy returns at once). So a trainer waiting on a blocking allreduce (the step's
// check in finish()) finishes the buckets still queued before it on its own thread, instead of
// waiting for the engine's thread to be scheduled between each of their steps.
// A broadcast (host_broadcast) takes two steps per chunk, on the same segment and in the same order.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <mutex>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "../../core/cache_line.hpp"
#include "../../core/datatype.hpp"
#include "../../core/error.hpp"
#include "../../core/reduce.hpp"
#include "../../core/span.hpp"
#include "../../core/trace.hpp"
#include "../../core/wait.hpp"
#include "../../core/watchdog.hpp"
#include "host_group.hpp"
#include "host_window.hpp"
#include "registered_range.hpp"
#include "slot_writer.hpp"

namespace flexcomm {

namespace detail {

// How long a task has waited for its peers at one stage, against the communicator's timeout. The
// clock is read at the second poll that finds the peers not there and then one poll in 64:
// reading it on every step and poll cost a third of a 4-byte allreduce, and at the first miss
// still a tenth (most small waits end before a second full poll, see drive_until_done).
class stall_clock {
 public:
  // The task moved on: the next wait starts afresh.
  void moved() noexcept {
    polls_ = 0;
    long_ = false;
  }
  // Another poll found the peers not there: true once that wait has lasted longer than `limit`
  // (zero: no limit).
  bool past(std::chrono::milliseconds limit) {
    const std::uint64_t poll = polls_++;
    if (poll <= 1) {
      if (poll == 1) since_ = std::chrono::steady_clock::now();
      return false;
    }
    if (polls_ % 64 != 0) return false;
    const auto waited = std::chrono::steady_clock::now() - since_;
    long_ = waited > answer_queries_after;
    return limit.count() > 0 && waited > limit;
  }
  // Whether this wait is long enough to note whom it waits on (stall.hpp), as of the last look.
  bool long_wait() const noexcept { return long_; }

 private:
  std::uint64_t polls_ = 0;
  bool long_ = false;
  std::chrono::steady_clock::time_point since_;
};

// A task of one host_segment (an allreduce or a broadcast).
class segment_task {
 public:
  segment_task() = default;
  segment_task(const segment_task&) = delete;
  segment_task& operator=(const segment_task&) = delete;
  virtual ~segment_task() = default;

  // Whether this rank's part is finished; readable from any thread.
  bool done() const noexcept { return done_.load(std::memory_order_acquire); }

 protected:
  void finished() noexcept { done_.store(true, std::memory_order_release); }

 private:
  friend class host_segment;
  // Advances as far as it can without waiting; true once finished. Called by one thread at a
  // time (the segment's driver), in start order.
  virtual bool step() = 0;

  std::atomic<bool> done_{false};
};

// Shared memory that allreduces reduce where it lies (host_reducer::allocate): one window, a
// region of the same size per rank. Each region starts with a cache line that describes the
// owner's current in-place allreduce, which peers check before they touch its data.
struct shared_arena {
  struct description {
    std::uint64_t first;   // the allreduce's first step: names it on every rank
    std::uint64_t offset;  // its data's bytes into the region; `misplaced` where it is elsewhere
    std::uint64_t count;
    std::uint64_t kind;  // dtype and op
  };
  static constexpr std::uint64_t misplaced = ~std::uint64_t{0};
  static constexpr std::size_t line = cache_line;
  // Words an in-place allreduce can carry, max-reduced in its round: after the description.
  static constexpr std::size_t carried_words = (line - sizeof(description)) / sizeof(std::int64_t);

  shared_arena(const shm::host_group& group, std::size_t usable, const std::string& who)
      : window(group, line + usable, who), bytes(usable) {
    for (int r = 0; r < window.size(); ++r) bases.push_back(window.region(r) + line);
  }
  // A registration's (shm::registered_range): the window holds the descriptions and each rank's
  // copy of the range's edges (the partial pages, at most two); the data lies where it lies.
  shared_arena(const shm::host_group& group, std::unique_ptr<shm::registered_range> own, std::size_t edge_bytes,
               const std::string& who)
      : window(group, line + edge_bytes, who), bytes(own->interior()), range(std::move(own)) {
    for (int r = 0; r < window.size(); ++r) bases.push_back(range->base(r));
  }

  description& of(int r) const noexcept { return *std::launder(reinterpret_cast<description*>(window.region(r))); }
  std::byte* carried(int r) const noexcept { return window.region(r) + sizeof(description); }
  std::byte* data(int r) const noexcept { return bases[static_cast<std::size_t>(r)]; }
  std::byte* edges(int r) const noexcept { return window.region(r) + line; }
  // Where [p, p + n) lies in this rank's region, if it does.
  bool holds(const void* p, std::size_t n, std::uint64_t& offset) const noexcept {
    const auto* b = static_cast<const std::byte*>(p);
    const std::byte* mine = data(window.rank());
    if (b < mine || b > mine + bytes || n > static_cast<std::size_t>(mine + bytes - b)) return false;
    offset = static_cast<std::uint64_t>(b - mine);
    return true;
  }

  shm::host_window window;
  std::size_t bytes;
  std::vector<std::byte*> bases;  // where each rank's data lies, as this process maps it
  std::unique_ptr<shm::registered_range> range;  // a registration's
  // A registration's last allreduce went through the slots (a rank's range was stale): written by
  // the thread that finished it, read once it is done.
  mutable bool fell_back = false;
};

// The claim of the thread that drives a segment's tasks: only ever try-locked, and released by a
// plain store. Released right after a step's publish, a mutex's unlock (a locked instruction)
// waited for that store to reach the peer's cache: a tenth of a 4-byte allreduce.
class driver_claim {
 public:
  bool try_lock() noexcept {
    return !held_.load(std::memory_order_relaxed) && !held_.exchange(true, std::memory_order_acquire);
  }
  void unlock() noexcept { held_.store(false, std::memory_order_release); }

 private:
  std::atomic<bool> held_{false};
};

// The segment and the bookkeeping every task of one reducer shares; tasks hold it, so a task the
// engine still polls never outlives it.
class host_segment {
 public:
  static constexpr std::size_t line = cache_line;

  // Collective over `group` (the segment's own: it keeps it for its names and timeout).
  host_segment(std::unique_ptr<shm::host_group> own, std::size_t large_bytes, std::size_t small_bytes)
      : group(std::move(own)),
        rank(group->rank()),
        ranks(group->size()),
        large_bytes(round_up(std::max(large_bytes, line))),
        small_bytes(round_up(small_bytes)),
        window(*group, line + 2 * (this->small_bytes + line) + 2 * this->large_bytes,
               cat(group->name(), ": shared-memory setup")) {
    const std::string who = cat(group->name(), ": shared-memory setup");
    for (int r = 0; r < ranks; ++r)
      check(window.region_bytes(r) == window.region_bytes(rank), who,
            cat("the slot sizes differ across the ranks (this rank's region is ", window.region_bytes(rank),
                " bytes, rank ", r, "'s ", window.region_bytes(r), ")"));
    world_ranks = group->world_ranks();
    regions.resize(static_cast<std::size_t>(ranks));
    for (int r = 0; r < ranks; ++r) regions[static_cast<std::size_t>(r)] = window.region(r);
    // Each rank's counter lives in its own region (whose pages the window placed near it).
    static_assert(std::atomic<std::uint64_t>::is_always_lock_free, "shared-memory counters must be lock-free");
    new (regions[static_cast<std::size_t>(rank)]) std::atomic<std::uint64_t>(0);
    group->barrier(who);
  }
  host_segment(const host_segment&) = delete;
  host_segment& operator=(const host_segment&) = delete;

  std::atomic<std::uint64_t>& progress(int r) const noexcept {
    return *std::launder(reinterpret_cast<std::atomic<std::uint64_t>*>(regions[static_cast<std::size_t>(r)]));
  }
  // A small slot is small_bytes of data and a line beside it for carried words: a full slot
  // still carries a step's check (host_reducer::carries).
  std::size_t small_stride() const noexcept { return small_bytes + line; }
  std::byte* small_slot(int r, int which) const noexcept {
    return regions[static_cast<std::size_t>(r)] + line + static_cast<std::size_t>(which) * small_stride();
  }
  std::byte* large_slot(int r, int which) const noexcept {
    return regions[static_cast<std::size_t>(r)] + line + 2 * small_stride() + static_cast<std::size_t>(which) * large_bytes;
  }
  // Chunks of an n-element task of T: at most a large slot each.
  template <class T>
  std::uint64_t chunks_of(std::size_t n) const noexcept {
    const std::size_t per_chunk = large_bytes / sizeof(T);
    return (n + per_chunk - 1) / per_chunk;
  }
  void publish(std::uint64_t step) const noexcept { progress(rank).store(step, std::memory_order_release); }
  // Whether every rank has finished `step`.
  bool reached(std::uint64_t step) const noexcept {
    for (int r = 0; r < ranks; ++r)
      if (progress(r).load(std::memory_order_acquire) < step) return false;
    return true;
  }
  // Whether rank r has finished `step`.
  bool reached_by(int r, std::uint64_t step) const noexcept { return progress(r).load(std::memory_order_acquire) >= step; }
  // "world rank 5 (rank 2, at step 5), world rank 7 (rank 3, at step 4)": the ranks that have
  // not finished `step`.
  std::string behind(std::uint64_t step) const {
    std::string out;
    for (int r = 0; r < ranks; ++r) {
      const std::uint64_t p = progress(r).load(std::memory_order_acquire);
      if (p < step) out += cat(out.empty() ? "" : ", ", "world rank ", world_rank(r), " (rank ", r, ", at step ", p, ")");
    }
    return out;
  }
  int world_rank(int r) const { return world_ranks[static_cast<std::size_t>(r)]; }
  // The world ranks that have not finished `step`.
  std::vector<int> behind_ranks(std::uint64_t step) const {
    std::vector<int> out;
    for (int r = 0; r < ranks; ++r)
      if (progress(r).load(std::memory_order_acquire) < step) out.push_back(world_rank(r));
    return out;
  }

  // A task timed out, failed or was dropped: no later one may run, and each that would says
  // why, with the first cause (a secondary error never prints alone).
  void break_with(const std::string& cause) {
    {
      std::lock_guard<std::mutex> lock(queue_mutex_);
      if (broken_cause_.empty()) broken_cause_ = cause;
    }
    broken.store(true, std::memory_order_release);
  }
  [[noreturn]] void fail_unusable(const std::string& who) {
    std::string cause;
    {
      std::lock_guard<std::mutex> lock(queue_mutex_);
      cause = broken_cause_;
    }
    fail(who, cat("earlier, ", cause, "; since then ", group->name(), " is unusable"));
  }

  // Queues a started task behind the others (the caller's thread, in start order).
  void enqueue(const std::shared_ptr<segment_task>& task) {
    std::lock_guard<std::mutex> lock(queue_mutex_);
    queue_.push_back(task);
  }
  // The driver's lock, owned, when no task is queued and no other thread drives: a blocking
  // task may then run unqueued (run_alone). Nothing can be queued meanwhile (tasks are started
  // on the thread that would wait), so the order holds.
  std::unique_lock<driver_claim> alone() {
    std::unique_lock<driver_claim> driving(driving_, std::try_to_lock);
    if (driving.owns_lock()) {
      std::lock_guard<std::mutex> lock(queue_mutex_);
      if (!queue_.empty()) driving.unlock();
    }
    return driving;
  }
  // Runs `t` to its end on the calling thread under alone()'s lock: no queue entry, shared
  // ownership or lock per poll. `wait(step)` calls step() (true once finished) until it returns
  // true. What it throws breaks the segment (where the task's failure did not already), as a
  // queued task dropped unfinished does.
  template <class Wait>
  void run_alone(segment_task& t, const std::unique_lock<driver_claim>& alone, Wait&& wait) {
    static_cast<void>(alone);
    try {
      wait([&] { return t.step(); });
    } catch (...) {
      break_with("a task failed before it finished (its caller has the error)");
      throw;
    }
    t.finished();
  }
  // Drives the queued tasks in start order as far as they go without waiting, unless another
  // thread is driving them now. Throws what a task's step throws (that task stays queued, and
  // throws again when next driven).
  void drive() {
    std::unique_lock<driver_claim> driving(driving_, std::try_to_lock);
    if (!driving.owns_lock()) return;
    for (;;) {
      std::shared_ptr<segment_task> front;
      {
        std::lock_guard<std::mutex> lock(queue_mutex_);
        if (queue_.empty()) return;
        front = queue_.front().lock();
        if (!front) {
          // Dropped before it finished (an engine stopped with it pending): its peers will wait
          // for steps this rank never takes, so nothing after it may run.
          if (broken_cause_.empty())
            broken_cause_ = "a task was dropped before it finished (its progress engine stopped with it pending)";
          broken.store(true, std::memory_order_release);
          queue_.pop_front();
          continue;
        }
      }
      if (!front->step()) return;
      front->finished();
      std::lock_guard<std::mutex> lock(queue_mutex_);
      queue_.pop_front();
    }
  }

  std::unique_ptr<shm::host_group> group;
  int rank = 0, ranks = 0;
  std::size_t large_bytes = 0, small_bytes = 0;
  shm::host_window window;
  std::vector<std::byte*> regions;
  std::vector<int> world_ranks;  // of each rank of the group
  std::atomic<bool> broken{false};         // a task timed out or was dropped: no later one may run
  // host_reducer::allocate's, in allocation order (the same on every rank); only the caller's
  // thread adds to it, and a task keeps a pointer to its own.
  std::vector<std::unique_ptr<shared_arena>> arenas;
  // host_reducer::register_range's, likewise (a registration's data is the user's own memory).
  std::vector<std::unique_ptr<shared_arena>> registered;
  slot_writer writer;                      // how this rank writes its large slots
  slot_writer placer;                      // how it writes results into its peers' in-place data

 private:
  driver_claim driving_;    // held by the thread driving the tasks
  std::mutex queue_mutex_;  // guards queue_ and broken_cause_: start() never waits for a step to end
  std::deque<std::weak_ptr<segment_task>> queue_;  // started, not finished, in start order
  std::string broken_cause_;  // why `broken`: the first task's failure
};

// A task of `seg` waited `limit` for step `needed` (of the group's rank `only`, or of every rank
// behind when -1): the segment breaks with this cause, led by the ranks that stopped (stall.hpp).
[[noreturn]] inline void fail_waiting(const std::shared_ptr<host_segment>& seg, const std::string& who,
                                      std::chrono::milliseconds limit, const char* for_what, std::uint64_t needed,
                                      int only = -1) {
  const std::vector<int> late = only >= 0 ? std::vector<int>{seg->world_rank(only)} : seg->behind_ranks(needed);
  const std::string behind = only >= 0 ? cat(only) : seg->behind(needed);
  const std::string cause = cat("timed out after ", limit.count(), " ms waiting for ", for_what, " (step ", needed,
                                "); ", stall_registry::instance().lead(who, late, limit), "not arrived: ", behind);
  seg->break_with(cat(who, ": ", cause));
  fail(who, cause);
}

// One allreduce through a host_segment: the steps [first + 1, first + steps] of every rank.
template <class T>
class host_allreduce final : public segment_task {
 public:
  struct plan {
    std::uint64_t first;  // steps already taken by earlier tasks
    // The slots this task writes are free once all reach these: the small slot ([0]), or large
    // slots 0 and 1.
    std::uint64_t free_after[2];
    int small_slot;  // -1: the large path (or in place)
    slot_writer::kind stores;  // how the large path writes its slots
    bool in_place = false;
    const shared_arena* arena = nullptr;  // in place: where the data lies (none: it lies elsewhere)
    std::uint64_t offset = shared_arena::misplaced;  // in place: the data's bytes into the arena
  };

  // `landing`, when set, runs once the result is in data (on the thread that finishes the task).
  // `carried` (small path and in place): a few more words, max-reduced in the same round, kept at
  // the end of the small slot or after the description (host_reducer::allreduce_carrying).
  host_allreduce(std::shared_ptr<host_segment> segment, T* data, std::size_t n, op o, plan p,
                 std::function<void()> landing = {}, span<std::int64_t> carried = {})
      : seg_(std::move(segment)), data_(data), n_(n), op_(o), plan_(p), landing_(std::move(landing)),
        carried_(carried) {
    if (n == 0) {  // took no steps, and is not queued
      stage_ = stage::done;
      land();
      finished();
      return;
    }
    // From when this rank posts it to when its result is in place (steps are the same on every
    // rank, so the first one names the same allreduce everywhere).
    traced_ = trace::collective_begin(trace::names::bucket_reduce, seg_->group->name(), plan_.first);
  }

  // Built when asked (an error, the engine's list of pending tasks), not per allreduce.
  std::string what() const {
    return cat("shared-memory allreduce on ", seg_->group->name(), " (", n_, " x ", name_of(dtype_of<T>), ", ",
               name_of(op_), ")");
  }

  // Drives the segment (this task and those started before it) as far as it goes without
  // waiting; true once this rank's result is in place. Throws when a peer has not moved for the
  // communicator's timeout, naming it. Any thread; the task's state is touched by one at a time.
  bool poll() {
    if (done()) return true;
    seg_->drive();
    return done();
  }
  // True when a poll would find nothing to do: this task waits for a step its peers have still
  // not all reached (the counters only grow, so it cannot have moved past that wait). Two loads
  // where a poll takes the segment's locks; any thread.
  bool waiting_on_peers() const noexcept {
    const std::uint64_t needed = awaited_.load(std::memory_order_acquire);
    return needed != 0 && !seg_->reached(needed);
  }

 private:
  bool step() override {
    if (stage_ == stage::queued) {
      if (seg_->broken.load(std::memory_order_acquire)) seg_->fail_unusable(who());
      stage_ = plan_.in_place ? stage::place_describe : plan_.small_slot >= 0 ? stage::small_write : stage::large_write;
      stalled_.moved();
    }
    for (;;) {
      std::optional<bool> out;  // step()'s answer, or nothing: on to the next stage
      switch (stage_) {
        case stage::small_write:
        case stage::small_reduce:
          out = step_small();
          break;
        case stage::large_write:
        case stage::large_reduce:
        case stage::large_gather:
          out = step_large();
          break;
        case stage::place_describe:
        case stage::place_reduce:
        case stage::place_wait:
          out = step_in_place();
          break;
        case stage::queued:
        case stage::done:
          return true;
      }
      if (out) return *out;
    }
  }

  // One stage of each path: false while it waits for peers, true once this rank's result is in
  // place, nothing when the next stage can go on at once.
  std::optional<bool> step_small() {
    if (stage_ == stage::small_write) {
      if (!ready(plan_.free_after[0], "peers to finish reading the previous small allreduce")) return false;
      std::memcpy(seg_->small_slot(seg_->rank, plan_.small_slot), data_, n_ * sizeof(T));
      if (!carried_.empty())
        std::memcpy(carried_of(seg_->rank), carried_.data(), carried_.size() * sizeof(std::int64_t));
      advance(stage::small_reduce, 1);
      return std::nullopt;
    }
    if (!ready(plan_.first + 1, "peers to copy their data in")) return false;
    reduce_small();
    advance(stage::done, 2);
    land();
    return true;
  }
  std::optional<bool> step_large() {
    switch (stage_) {
      case stage::large_write:
        // This slot last held chunk c - 2 (or an earlier task's): free once every rank has it out.
        if (!ready(chunk_ < 2 ? plan_.free_after[chunk_] : step(0) - 3, "peers to copy the chunk before out"))
          return false;
        write_chunk();
        advance(stage::large_reduce, 1);
        return std::nullopt;
      case stage::large_reduce:
        if (!ready(step(1), "peers to copy their chunk in")) return false;
        if (chunk_ == 0) timed_from_ = std::chrono::steady_clock::now();  // every rank has arrived
        reduce_share();
        advance(stage::large_gather, 2);
        return std::nullopt;
      default:  // large_gather
        if (!ready(step(2), "peers to reduce their share")) return false;
        gather_chunk();
        seg_->publish(step(3));
        stalled_.moved();
        noted_.clear();
        if ((++chunk_) * per_chunk() >= n_) {
          stage_ = stage::done;
          if (!plan_.in_place) learn(seg_->writer);
          land();
          return true;
        }
        stage_ = stage::large_write;
        return std::nullopt;
    }
  }
  // A registration's allreduce (host_reducer::start_registered) also takes this path while every
  // rank's range is current; where one is stale, every rank sees it in the descriptions and the
  // whole allreduce goes through the large slots, in steps it reserved for that.
  std::optional<bool> step_in_place() {
    switch (stage_) {
      case stage::place_describe:
        describe();
        advance(stage::place_reduce, 1);
        return std::nullopt;
      case stage::place_reduce:
        if (!ready(plan_.first + 1, "peers to describe their data")) return false;
        timed_from_ = std::chrono::steady_clock::now();  // every rank has arrived
        check_descriptions();
        reduce_carried();
        if (registered() && (plan_.arena->fell_back = any_stale())) {
          stage_ = stage::large_write;
          return std::nullopt;
        }
        reduce_in_place(registered() ? plan_.arena->bytes / sizeof(T) : n_);
        if (registered()) reduce_edges();
        advance(stage::place_wait, 2);
        return std::nullopt;
      default:  // place_wait
        if (!ready(plan_.first + 2, "peers to reduce their share")) return false;
        if (registered()) seg_->publish(step(0) + 3 * seg_->template chunks_of<T>(n_));  // the slots' steps, unused
        stage_ = stage::done;
        learn(seg_->placer);
        land();
        return true;
    }
  }

  enum class stage {
    queued,
    small_write,
    small_reduce,
    large_write,
    large_reduce,
    large_gather,
    place_describe,
    place_reduce,
    place_wait,
    done
  };
  static constexpr std::size_t align = host_segment::line / sizeof(T) ? host_segment::line / sizeof(T) : 1;

  std::string who() const { return cat(what(), ", rank ", seg_->rank, " (world ", seg_->world_rank(seg_->rank), ")"); }
  void land() {
    noted_.clear();
    trace::collective_end(trace::names::bucket_reduce, std::exchange(traced_, 0));
    if (!landing_) return;
    const std::int64_t from = trace::enabled() ? trace::now() : 0;
    std::exchange(landing_, nullptr)();
    if (from) trace::complete(trace::names::bucket_landing, "sync", from, trace::now());
  }
  // How long this task took since every rank arrived, per byte, for the stores it used.
  void learn(slot_writer& w) const {
    const std::chrono::duration<double, std::nano> took = std::chrono::steady_clock::now() - timed_from_;
    const std::size_t bytes = n_ * sizeof(T);
    w.learn(slot_writer::size_class(bytes), plan_.stores, took.count() / static_cast<double>(bytes));
  }
  std::size_t per_chunk() const noexcept { return seg_->large_bytes / sizeof(T); }
  // Chunk chunk_'s k-th step (k = 1, 2, 3); k = 0 is the previous chunk's last. A registration's
  // allreduce takes its two in-place steps first.
  std::uint64_t step(int k) const noexcept {
    return plan_.first + (plan_.in_place ? 2 : 0) + 3 * chunk_ + static_cast<std::uint64_t>(k);
  }

  bool ready(std::uint64_t needed, const char* for_what) {
    if (seg_->reached(needed)) return true;
    awaited_.store(needed, std::memory_order_release);
    const auto limit = seg_->group->timeout();
    if (stalled_.past(limit)) fail_waiting(seg_, who(), limit, for_what, needed);
    // Long: noted, for peers that follow a stall through this rank (core/stall.hpp).
    if (stalled_.long_wait() && !noted_.set_already()) noted_.set(what(), seg_->behind_ranks(needed));
    return false;
  }
  void advance(stage next, int k) {
    const bool large = stage_ == stage::large_write || stage_ == stage::large_reduce;
    seg_->publish(large ? step(k) : plan_.first + static_cast<std::uint64_t>(k));
    stage_ = next;
    stalled_.moved();
    noted_.clear();
  }

  const T* small_of(int r) const {
    return reinterpret_cast<const T*>(seg_->small_slot(r, plan_.small_slot));
  }
  // Where rank r's carried words lie: the end of its small slot's stride, whatever the data's
  // size, or after its description.
  std::byte* carried_of(int r) const {
    if (plan_.in_place) return plan_.arena->carried(r);
    return seg_->small_slot(r, plan_.small_slot) + seg_->small_stride() - carried_.size() * sizeof(std::int64_t);
  }
  // Every rank folds the slots in rank order: the same bits everywhere. The rule makes each op
  // commutative bit for bit (reduce_rule.hpp), so ranks 0 and 1 start from their own data (their
  // slot's bits) and fold in the other of the first two, instead of copying slot 0 back first.
  void reduce_small() {
    const int me = seg_->rank;
    if (me >= 2) {
      std::memcpy(data_, small_of(0), n_ * sizeof(T));
      combine(op_, data_, small_of(1), n_);
    } else if (seg_->ranks >= 2) {
      combine(op_, data_, small_of(1 - me), n_);
    }
    for (int r = 2; r < seg_->ranks; ++r) combine(op_, data_, small_of(r), n_);
    if (op_ == op::avg) divide_by(data_, n_, seg_->ranks);
    reduce_carried();
  }
  void reduce_carried() {
    for (int r = 0; r < seg_->ranks; ++r) {
      if (r == seg_->rank) continue;
      for (std::size_t i = 0; i < carried_.size(); ++i) {
        std::int64_t theirs = 0;
        std::memcpy(&theirs, carried_of(r) + i * sizeof(theirs), sizeof(theirs));
        carried_[i] = std::max(carried_[i], theirs);
      }
    }
  }

  // In place: what this rank reduces, where every peer checks it. Data that is not in shared
  // memory is described as misplaced in every arena, whichever one the peers' data lies in.
  std::uint64_t kind() const noexcept {
    return static_cast<std::uint64_t>(dtype_of<T>) << 8 | static_cast<std::uint64_t>(op_);
  }
  void describe() {
    if (registered()) return describe_registered();
    const shared_arena::description mine{plan_.first, plan_.arena ? plan_.offset : shared_arena::misplaced, n_, kind()};
    if (plan_.arena) {
      plan_.arena->of(seg_->rank) = mine;
      if (!carried_.empty()) std::memcpy(carried_of(seg_->rank), carried_.data(), carried_.size() * sizeof(std::int64_t));
      return;
    }
    for (const auto& a : seg_->arenas) a->of(seg_->rank) = mine;
  }
  void check_descriptions() {
    const auto broken = [&](std::string cause) {
      seg_->break_with(cat(who(), ": ", cause));
      fail(who(), std::move(cause));
    };
    if (!plan_.arena)
      broken(cat("its data (", static_cast<const void*>(data_), ", ", n_ * sizeof(T),
                 " bytes) does not lie in the shared memory allocated for in-place allreduces (host_reducer::allocate)"));
    const shared_arena::description& mine = plan_.arena->of(seg_->rank);
    for (int r = 0; r < seg_->ranks; ++r) {
      if (r == seg_->rank) continue;
      const shared_arena::description theirs = plan_.arena->of(r);
      const std::string peer = cat("world rank ", seg_->world_rank(r), " (rank ", r, ")");
      if (theirs.first != mine.first)
        broken(cat(peer, " is not reducing this allreduce in place (its last in-place allreduce here began after step ",
                   theirs.first, ", this one after step ", mine.first, ")"));
      if (theirs.offset == shared_arena::misplaced && registered()) continue;  // stale: any_stale()
      if (theirs.offset == shared_arena::misplaced)
        broken(cat(peer, "'s data does not lie in the shared memory allocated for in-place allreduces"));
      if ((!registered() && theirs.offset != mine.offset) || theirs.count != mine.count || theirs.kind != mine.kind)
        broken(cat(peer, " reduces ", theirs.count, " elements at byte ", theirs.offset, " of its region (kind ",
                   theirs.kind, "), this rank ", mine.count, " at byte ", mine.offset, " (kind ", mine.kind,
                   "): every rank must place the same data at the same offset"));
    }
  }
  // A registration's: this rank's range is current (else described as misplaced, its data going
  // through the slots), and its edges are copied where the peers reduce them.
  bool registered() const noexcept { return plan_.arena && plan_.arena->range; }
  void describe_registered() {
    const shm::registered_range& range = *plan_.arena->range;
    const bool current = range.current(reinterpret_cast<const std::byte*>(data_), n_ * sizeof(T));
    plan_.arena->of(seg_->rank) = {plan_.first, current ? 0 : shared_arena::misplaced, plan_.arena->bytes / sizeof(T), kind()};
    if (!current) return;
    const std::size_t tail = range.head() + range.interior();
    std::byte* edges = plan_.arena->edges(seg_->rank);
    std::memcpy(edges, data_, range.head());
    std::memcpy(edges + range.head(), reinterpret_cast<const std::byte*>(data_) + tail, n_ * sizeof(T) - tail);
  }
  bool any_stale() const noexcept {
    for (int r = 0; r < seg_->ranks; ++r)
      if (plan_.arena->of(r).offset == shared_arena::misplaced) return true;
    return false;
  }
  // The edges: every rank reduces all ranks' copies in rank order (identical bits, as the small
  // path does) into its own partial pages.
  void reduce_edges() {
    const shm::registered_range& range = *plan_.arena->range;
    const std::size_t head = range.head() / sizeof(T), tail = (range.head() + range.interior()) / sizeof(T);
    reduce_edge(data_, 0, head);
    reduce_edge(data_ + tail, head, n_ - tail);
  }
  void reduce_edge(T* out, std::size_t at, std::size_t count) {
    if (count == 0) return;
    const auto edge = [&](int r) { return reinterpret_cast<const T*>(plan_.arena->edges(r)) + at; };
    std::memcpy(out, edge(0), count * sizeof(T));
    for (int r = 1; r < seg_->ranks; ++r) combine(op_, out, edge(r), count);
    if (op_ == op::avg) divide_by(out, count, seg_->ranks);
  }

  T* placed(int r) const { return reinterpret_cast<T*>(plan_.arena->data(r) + plan_.offset); }
  // This rank's share, a block at a time: the block is still in cache when it is copied to the
  // peers, so the share is read from memory once per rank and written once per rank.
  void reduce_in_place(std::size_t count) {
    std::size_t lo = 0, hi = 0;
    share_in(count, seg_->rank, lo, hi);
    constexpr std::size_t block = (std::size_t{16} << 10) / sizeof(T);
    for (std::size_t from = lo; from < hi; from += block) {
      const std::size_t count = std::min(block, hi - from);
      T* mine = placed(seg_->rank) + from;
      for (int r = 0; r < seg_->ranks; ++r)
        if (r != seg_->rank) combine(op_, mine, placed(r) + from, count);
      if (op_ == op::avg) divide_by(mine, count, seg_->ranks);
      for (int r = 0; r < seg_->ranks; ++r)
        if (r != seg_->rank) slot_writer::copy(plan_.stores, placed(r) + from, mine, count * sizeof(T));
    }
  }

  // Rank r's share [lo, hi) of `count` elements: a cache-line aligned 1/N.
  void share_in(std::size_t count, int r, std::size_t& lo, std::size_t& hi) const noexcept {
    const std::size_t ranks = static_cast<std::size_t>(seg_->ranks);
    std::size_t share = (count + ranks - 1) / ranks;
    share = (share + align - 1) / align * align;  // no two ranks write one cache line
    lo = std::min(count, share * static_cast<std::size_t>(r));
    hi = std::min(count, lo + share);
  }
  // This chunk's elements [lo, hi) of the data and rank r's share of them, relative to lo.
  std::size_t chunk_lo() const noexcept { return chunk_ * per_chunk(); }
  std::size_t chunk_count() const noexcept { return std::min(per_chunk(), n_ - chunk_lo()); }
  void share_of(int r, std::size_t& lo, std::size_t& hi) const noexcept { share_in(chunk_count(), r, lo, hi); }
  T* large_of(int r) const { return reinterpret_cast<T*>(seg_->large_slot(r, static_cast<int>(chunk_ % 2))); }

  void write_chunk() {
    std::size_t lo = 0, hi = 0;
    share_of(seg_->rank, lo, hi);
    const T* chunk = data_ + chunk_lo();
    slot_writer::copy(plan_.stores, large_of(seg_->rank), chunk, lo * sizeof(T));
    slot_writer::copy(plan_.stores, large_of(seg_->rank) + hi, chunk + hi, (chunk_count() - hi) * sizeof(T));
  }
  void reduce_share() {
    std::size_t lo = 0, hi = 0;
    share_of(seg_->rank, lo, hi);
    if (hi == lo) return;
    T* mine = data_ + chunk_lo() + lo;
    for (int r = 0; r < seg_->ranks; ++r)
      if (r != seg_->rank) combine(op_, mine, large_of(r) + lo, hi - lo);
    if (op_ == op::avg) divide_by(mine, hi - lo, seg_->ranks);
    slot_writer::copy(plan_.stores, large_of(seg_->rank) + lo, mine, (hi - lo) * sizeof(T));
  }
  void gather_chunk() {
    T* chunk = data_ + chunk_lo();
    for (int r = 0; r < seg_->ranks; ++r) {
      if (r == seg_->rank) continue;
      std::size_t lo = 0, hi = 0;
      share_of(r, lo, hi);
      std::memcpy(chunk + lo, large_of(r) + lo, (hi - lo) * sizeof(T));
    }
  }

  std::shared_ptr<host_segment> seg_;
  T* data_;
  std::size_t n_;
  op op_;
  plan plan_;
  std::function<void()> landing_;
  span<std::int64_t> carried_;
  std::uint64_t traced_ = 0;
  stage stage_ = stage::queued;
  std::uint64_t chunk_ = 0;
  stall_clock stalled_;
  waiting_note noted_;
  std::chrono::steady_clock::time_point timed_from_;
  std::atomic<std::uint64_t> awaited_{0};  // the step ready() last found missing (waiting_on_peers)
};

// One broadcast through a host_segment from `root`: two steps per chunk of at most a large slot.
// For chunk c the root waits until every rank has copied chunk c - 1 out of its slot, copies
// chunk c in and publishes both steps; every other rank waits for the root's first step, copies
// the chunk out and publishes the second. The root's data is read once, and each other rank's
// written once.
template <class T>
class host_broadcast final : public segment_task {
 public:
  struct plan {
    std::uint64_t first;  // steps already taken by earlier tasks
    std::uint64_t free_after[2];  // the root's large slots 0 and 1 are free once all reach these
  };

  host_broadcast(std::shared_ptr<host_segment> segment, T* data, std::size_t n, int root, plan p)
      : seg_(std::move(segment)), data_(data), n_(n), root_(root), plan_(p) {
    if (n == 0) finished();  // took no steps, and is not queued
  }

  std::string what() const {
    return cat("shared-memory broadcast on ", seg_->group->name(), " (", n_, " x ", name_of(dtype_of<T>), " from rank ",
               root_, ")");
  }

  // Drives the segment as host_allreduce::poll does; true once this rank holds the root's data.
  bool poll() {
    if (done()) return true;
    seg_->drive();
    return done();
  }

 private:
  bool step() override {
    if (!started_) {
      if (seg_->broken.load(std::memory_order_acquire)) seg_->fail_unusable(who());
      started_ = true;
      stalled_.moved();
    }
    const std::size_t per_chunk = seg_->large_bytes / sizeof(T);
    while (chunk_ * per_chunk < n_) {
      const std::size_t lo = chunk_ * per_chunk, count = std::min(per_chunk, n_ - lo);
      const std::uint64_t written = plan_.first + 2 * chunk_ + 1, read = written + 1;
      T* slot = reinterpret_cast<T*>(seg_->large_slot(root_, static_cast<int>(chunk_ % 2)));
      if (seg_->rank == root_) {
        // The slot last held chunk c - 2 (or an earlier task's): free once every rank has it out.
        const std::uint64_t free = chunk_ < 2 ? plan_.free_after[chunk_] : written - 3;
        if (!seg_->reached(free)) return late(free, "peers to copy the previous chunk out", [&] { return seg_->behind(free); });
        slot_writer::copy(seg_->writer.preferred(slot_writer::size_class(n_ * sizeof(T))), slot, data_ + lo,
                          count * sizeof(T));
        seg_->publish(read);
      } else {
        if (!seg_->reached_by(root_, written))
          return late(written, "the root to copy its chunk in", [&] { return cat(root_); });
        std::memcpy(data_ + lo, slot, count * sizeof(T));
        seg_->publish(read);
      }
      ++chunk_;
      stalled_.moved();
    }
    return true;
  }

  std::string who() const { return cat(what(), ", rank ", seg_->rank, " (world ", seg_->world_rank(seg_->rank), ")"); }
  // Not there yet: false, or past the communicator's timeout an error naming who is behind.
  template <class Behind>
  bool late(std::uint64_t needed, const char* for_what, Behind&& behind) {
    const auto limit = seg_->group->timeout();
    static_cast<void>(behind);
    if (stalled_.past(limit)) fail_waiting(seg_, who(), limit, for_what, needed, root_ways(needed));
    return false;
  }
  // Who step `needed` waits on: every rank behind, or (a rank copying out) the root alone.
  int root_ways(std::uint64_t needed) const { return seg_->rank == root_ || seg_->reached_by(root_, needed) ? -1 : root_; }

  std::shared_ptr<host_segment> seg_;
  T* data_;
  std::size_t n_;
  int root_;
  plan plan_;
  bool started_ = false;
  std::uint64_t chunk_ = 0;
  stall_clock stalled_;
};

}  // namespace detail

namespace shm {

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
  // 2 x slot_bytes + 2 x small_bytes (and three cache lines) of shared memory per rank.
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
  // stay valid until the task is done. `landing`, when set, runs once the result is in data, on
  // the thread that finishes the task, before the task reports done.
  template <class T>
  std::shared_ptr<task<T>> start(T* data, std::size_t n, op o, std::function<void()> landing = {}) {
    return start_carrying(data, n, o, std::move(landing), {});
  }

  // Collective over the reducer's group: `bytes` of shared memory on every rank (the same number
  // everywhere, else an error on every rank), which start_in_place() reduces where it lies. It
  // lives as long as the reducer and every task started on it. Zeroed.
  span<std::byte> allocate(std::size_t bytes) {
    auto& seg = usable("shared-memory allocation");
    const std::string who = cat(seg.group->name(), ": shared memory for in-place allreduces");
    const std::vector<std::uint64_t> asked = seg.group->allgather(bytes, who, "the sizes asked for");
    for (int r = 0; r < seg.ranks; ++r)
      check(asked[static_cast<std::size_t>(r)] == bytes, who,
            cat("every rank must ask for the same size: this rank asked for ", bytes, " bytes, world rank ",
                seg.world_rank(r), " for ", asked[static_cast<std::size_t>(r)]));
    seg.arenas.push_back(std::make_unique<detail::shared_arena>(*seg.group, bytes, who));
    return {seg.arenas.back()->data(seg.rank), bytes};
  }
  // Whether [data, data + bytes) lies in memory from allocate().
  bool holds(const void* data, std::size_t bytes) const noexcept {
    std::uint64_t offset = 0;
    return segment_ && arena_of(data, bytes, offset);
  }
  // Whether an in-place allreduce of `bytes` can carry `words` more int64 words in its round.
  bool carries_in_place(std::size_t bytes, std::size_t words) const noexcept {
    return segment_ && bytes > 0 && words <= in_place_carried_words;
  }

  // Starts an allreduce of data[0, n) in place where it lies, in memory from allocate(), with
  // nothing copied in or out: every rank starts it alike, its data at the same offset of the same
  // allocation (checked: otherwise, or where this rank's data lies elsewhere, the task fails on
  // every rank before any data is written). Otherwise as start().
  template <class T>
  std::shared_ptr<task<T>> start_in_place(T* data, std::size_t n, op o, std::function<void()> landing = {}) {
    return start_in_place_carrying(data, n, o, std::move(landing), {});
  }
  // Blocking start_in_place() that also max-reduces up to in_place_carried_words more words in
  // its round, as allreduce_carrying() does on the small path.
  static constexpr std::size_t in_place_carried_words = detail::shared_arena::carried_words;
  template <class T>
  void allreduce_in_place_carrying(T* data, std::size_t n, op o, span<std::int64_t> carried,
                                   std::function<void()> landing = {}) {
    if (!carries_in_place(n * sizeof(T), carried.size()))  // the message is built only on failure
      fail("shared-memory allreduce", cat("an in-place allreduce carries up to ", in_place_carried_words,
                                          " words and some data, not ", carried.size(), " and ", n, " elements"));
    drive_until_done(start_in_place_carrying(data, n, o, std::move(landing), carried));
  }

 private:
  template <class T>
  std::shared_ptr<task<T>> start_in_place_carrying(T* data, std::size_t n, op o, std::function<void()> landing,
                                                   span<std::int64_t> carried) {
    static_assert(is_element_v<T>, "host_reducer: float, double, int32, int64, uint8, half or bfloat16");
    auto& seg = usable("shared-memory allreduce");
    typename task<T>::plan p{steps_, {0, 0}, -1, detail::slot_writer::cached};
    if (n == 0) return std::make_shared<task<T>>(segment_, data, n, o, p, std::move(landing));  // as start()
    p.in_place = true;
    const int cls = detail::slot_writer::size_class(n * sizeof(T));
    p.stores = seg.placer.choose(cls, placed_[cls]++);
    p.arena = arena_of(data, n * sizeof(T), p.offset);
    steps_ += 2;
    auto t = std::make_shared<task<T>>(segment_, data, n, o, p, std::move(landing), carried);
    seg.enqueue(t);
    return t;
  }
  // The allocation [data, data + bytes) lies in, and its offset there; null where none holds it.
  const detail::shared_arena* arena_of(const void* data, std::size_t bytes, std::uint64_t& offset) const noexcept {
    for (const auto& a : segment_->arenas)
      if (a->holds(data, bytes, offset)) return a.get();
    return nullptr;
  }

 public:
  // A trainer's own memory registered for in-place allreduces (shm::registered_range): null where
  // it could not be.
  using registration = const detail::shared_arena*;

  // Collective over the reducer's group (every rank registers its own data of the same n and T,
  // in the same order): makes the whole pages of data[0, n) shared where they lie, so that
  // start_registered() reduces them in place. Null on every rank where the pages common to all
  // ranks are no more than a small slot, where the data lies in allocate()'s memory on any rank,
  // or where a rank could not share its pages.
  template <class T>
  registration register_range(T* data, std::size_t n) {
    auto& seg = usable("shared-memory registration");
    const std::string who = cat(seg.group->name(), ": registering a gradient's pages");
    std::uint64_t offset = 0;
    const bool elsewhere = !data || arena_of(data, n * sizeof(T), offset) != nullptr;
    auto range = shm::registered_range::make(*seg.group, reinterpret_cast<std::byte*>(data), elsewhere ? 0 : n * sizeof(T),
                                             sizeof(T), seg.small_bytes + 1, who);
    if (!range) return nullptr;
    const std::size_t edges = n * sizeof(T) - range->interior();
    try {
      seg.registered.push_back(std::make_unique<detail::shared_arena>(*seg.group, std::move(range), edges, who));
    } catch (const error&) {
      return nullptr;  // no room in /dev/shm for the descriptions: every rank failed alike
    }
    return seg.registered.back().get();
  }
  // Local: forgets a registration whose tasks are done (the user's pages stay as they are).
  void unregister(registration r) {
    auto& all = usable("shared-memory registration").registered;
    all.erase(std::remove_if(all.begin(), all.end(), [&](const auto& a) { return a.get() == r; }), all.end());
  }
  // Whether the last allreduce of `r`, now done, went through the slots: a rank's data was not
  // the registered pages (freed and reallocated, or another vector). The same on every rank.
  static bool fell_back(registration r) noexcept { return r->fell_back; }

  // Starts an allreduce of data[0, n), registered as `r` on every rank: in place where every
  // rank's data is still its registered pages (checked each time), else through the slots;
  // otherwise as start().
  template <class T>
  std::shared_ptr<task<T>> start_registered(T* data, std::size_t n, op o, registration r,
                                            std::function<void()> landing = {}) {
    auto& seg = usable("shared-memory allreduce");
    typename task<T>::plan p{steps_, {0, 0}, -1, detail::slot_writer::cached};
    p.in_place = true;
    p.arena = r;
    p.offset = 0;
    const int cls = detail::slot_writer::size_class(r->bytes);
    p.stores = seg.placer.choose(cls, placed_[cls]++);
    steps_ += 2;
    take_large_slots(p.free_after, seg.template chunks_of<T>(n), 3);  // for the slots, when stale
    auto t = std::make_shared<task<T>>(segment_, data, n, o, p, std::move(landing));
    seg.enqueue(t);
    return t;
  }
  template <class T>
  void allreduce_registered(T* data, std::size_t n, op o, registration r) {
    drive_until_done(start_registered(data, n, o, r));
  }

  // Blocking start_in_place(), as allreduce() is to start().
  template <class T>
  void allreduce_in_place(T* data, std::size_t n, op o) {
    drive_until_done(start_in_place(data, n, o));
  }

  // Whether an allreduce of `bytes` can carry `words` more int64 words in its one round: it
  // takes the small path, and the words fit the rest of its slot's stride (a step's check fits
  // beside a full slot, so a 16 KiB step is one round, not two).
  bool carries(std::size_t bytes, std::size_t words) const noexcept {
    return segment_ && bytes > 0 && bytes <= segment_->small_bytes &&
           bytes + words * sizeof(std::int64_t) <= segment_->small_stride();
  }

  // Blocking allreduce that also max-reduces `carried` in the same round (where carries(): every
  // rank must call it alike): a small step's last bucket and the step's check, in one
  // synchronisation instead of two.
  template <class T>
  void allreduce_carrying(T* data, std::size_t n, op o, span<std::int64_t> carried, std::function<void()> landing = {}) {
    if (!carries(n * sizeof(T), carried.size()))  // the message is built only on failure (it cost a tenth of a step)
      fail("shared-memory allreduce", cat(n, " x ", name_of(dtype_of<T>), " and ", carried.size(),
                                          " carried words do not fit a small slot of ", small_bytes(), " bytes"));
    run_here(data, n, o, std::move(landing), carried);
  }

 private:
  // A blocking allreduce: on the stack and unqueued where the segment is idle (run_alone),
  // else started and driven as any other.
  template <class T>
  void run_here(T* data, std::size_t n, op o, std::function<void()> landing, span<std::int64_t> carried) {
    static_assert(is_element_v<T>, "host_reducer: float, double, int32, int64, uint8, half or bfloat16");
    auto& seg = usable("shared-memory allreduce");
    if (n == 0) return drive_until_done(start_carrying(data, n, o, std::move(landing), carried));
    const auto alone = seg.alone();
    if (!alone.owns_lock()) return drive_until_done(start_carrying(data, n, o, std::move(landing), carried));
    task<T> t(segment_, data, n, o, plan_for<T>(n), std::move(landing), carried);
    seg.run_alone(t, alone, [&](auto&& step) { wait_driving(t, step); });
  }
  template <class T>
  std::shared_ptr<task<T>> start_carrying(T* data, std::size_t n, op o, std::function<void()> landing,
                                          span<std::int64_t> carried) {
    static_assert(is_element_v<T>, "host_reducer: float, double, int32, int64, uint8, half or bfloat16");
    auto& seg = usable("shared-memory allreduce");
    if (n == 0)
      return std::make_shared<task<T>>(segment_, data, n, o, typename task<T>::plan{0, {0, 0}, -1, detail::slot_writer::cached},
                                       std::move(landing));
    auto t = std::make_shared<task<T>>(segment_, data, n, o, plan_for<T>(n), std::move(landing), carried);
    seg.enqueue(t);
    return t;
  }
  // The next allreduce's steps and slots (n > 0), in start order: the same on every rank.
  template <class T>
  typename task<T>::plan plan_for(std::size_t n) {
    auto& seg = *segment_;
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
    return p;
  }
  template <class Task>
  static void drive_until_done(const std::shared_ptr<Task>& t) {
    wait_driving(*t, [&] { return t->poll(); });
  }
  // Calls poll() until it returns true, answering the watchdog's queries meanwhile. The first
  // rounds only peek at the peers' counters while the task waits on them, polling once they
  // moved: a small allreduce's wait is a few hundred ns, and full polls in it (the segment's
  // locks, the queue, the stall clock) doubled the time from a peer's publish to this rank's
  // reduction. Past them every round polls, as the timeout needs.
  template <class Task, class Poll>
  static void wait_driving(const Task& t, Poll&& poll) {
    unsigned peeks = 0;
    wait_answering(
        default_wait().driving(), std::chrono::milliseconds{0},
        [&] { return peeks < 64 && ++peeks && t.waiting_on_peers() ? false : poll(); },
        [] { watchdog::instance().answer_queries(); });
  }

 public:
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
    run_here(data, n, o, {}, {});
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
  std::uint64_t placed_[detail::slot_writer::classes] = {};  // in-place ones, per size class
  std::uint64_t large_free_[2] = {0, 0};
  std::uint64_t small_free_[2] = {0, 0};
};

}  // namespace shm

}  // namespace flexcomm
