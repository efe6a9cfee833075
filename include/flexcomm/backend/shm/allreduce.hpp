// One allreduce on a host_segment (segment.hpp): a fixed number of steps, the same on every rank.
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
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "../../core/datatype.hpp"
#include "../../core/error.hpp"
#include "../../core/reduce.hpp"
#include "segment.hpp"
#include "slot_writer.hpp"

namespace flexcomm::detail {

// One allreduce through a host_segment: the steps [first + 1, first + steps] of every rank.
template <class T>
class host_allreduce final : public segment_task {
 public:
  struct plan {
    std::uint64_t first;  // steps already taken by earlier tasks
    // The slots this task writes are free once all reach these: the small slot ([0]), or large
    // slots 0 and 1.
    std::uint64_t free_after[2];
    int small_slot;  // -1: the large path
    slot_writer::kind stores;  // how the large path writes its slots
  };

  host_allreduce(std::shared_ptr<host_segment> segment, T* data, std::size_t n, op o, plan p)
      : seg_(std::move(segment)), data_(data), n_(n), op_(o), plan_(p) {
    if (n == 0) {  // took no steps, and is not queued
      stage_ = stage::done;
      finished();
    }
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

 private:
  bool step() override {
    if (stage_ == stage::queued) {
      if (seg_->broken.load(std::memory_order_acquire))
        fail(who(), cat(seg_->group->name(), " is unusable after an earlier task timed out or was dropped"));
      stage_ = plan_.small_slot >= 0 ? stage::small_write : stage::large_write;
      stalled_.moved();
    }
    for (;;) {
      switch (stage_) {
        case stage::small_write:
          if (!ready(plan_.free_after[0], "peers to finish reading the previous small allreduce")) return false;
          std::memcpy(seg_->small_slot(seg_->rank, plan_.small_slot), data_, n_ * sizeof(T));
          advance(stage::small_reduce, 1);
          break;
        case stage::small_reduce:
          if (!ready(plan_.first + 1, "peers to copy their data in")) return false;
          reduce_small();
          advance(stage::done, 2);
          return true;
        case stage::large_write:
          // This slot last held chunk c - 2 (or an earlier task's): free once every rank has it out.
          if (!ready(chunk_ < 2 ? plan_.free_after[chunk_] : step(0) - 3, "peers to copy the chunk before out"))
            return false;
          write_chunk();
          advance(stage::large_reduce, 1);
          break;
        case stage::large_reduce:
          if (!ready(step(1), "peers to copy their chunk in")) return false;
          if (chunk_ == 0) timed_from_ = std::chrono::steady_clock::now();  // every rank has arrived
          reduce_share();
          advance(stage::large_gather, 2);
          break;
        case stage::large_gather:
          if (!ready(step(2), "peers to reduce their share")) return false;
          gather_chunk();
          seg_->publish(step(3));
          stalled_.moved();
          if ((++chunk_) * per_chunk() >= n_) {
            stage_ = stage::done;
            const std::chrono::duration<double, std::nano> took = std::chrono::steady_clock::now() - timed_from_;
            const std::size_t bytes = n_ * sizeof(T);
            seg_->writer.learn(slot_writer::size_class(bytes), plan_.stores, took.count() / static_cast<double>(bytes));
            return true;
          }
          stage_ = stage::large_write;
          break;
        case stage::queued:
        case stage::done:
          return true;
      }
    }
  }

  enum class stage { queued, small_write, small_reduce, large_write, large_reduce, large_gather, done };
  static constexpr std::size_t align = host_segment::line / sizeof(T) ? host_segment::line / sizeof(T) : 1;

  std::string who() const { return cat(what(), ", rank ", seg_->rank, " (world ", seg_->world_rank(seg_->rank), ")"); }
  std::size_t per_chunk() const noexcept { return seg_->large_bytes / sizeof(T); }
  // Chunk chunk_'s k-th step (k = 1, 2, 3); k = 0 is the previous chunk's last.
  std::uint64_t step(int k) const noexcept { return plan_.first + 3 * chunk_ + static_cast<std::uint64_t>(k); }

  bool ready(std::uint64_t needed, const char* for_what) {
    if (seg_->reached(needed)) return true;
    const auto limit = seg_->group->timeout();
    if (stalled_.past(limit)) {
      seg_->broken.store(true, std::memory_order_release);
      fail(who(), cat("timed out after ", limit.count(), " ms waiting for ", for_what, " (step ", needed,
                      "); not arrived: ", seg_->behind(needed)));
    }
    return false;
  }
  void advance(stage next, int k) {
    seg_->publish(plan_.small_slot >= 0 ? plan_.first + static_cast<std::uint64_t>(k) : step(k));
    stage_ = next;
    stalled_.moved();
  }

  const T* small_of(int r) const {
    return reinterpret_cast<const T*>(seg_->small_slot(r, plan_.small_slot));
  }
  void reduce_small() {
    std::memcpy(data_, small_of(0), n_ * sizeof(T));
    for (int r = 1; r < seg_->ranks; ++r) combine(op_, data_, small_of(r), n_);
    if (op_ == op::avg) divide_by(data_, n_, seg_->ranks);
  }

  // This chunk's elements [lo, hi) of the data and rank r's share of them, relative to lo.
  std::size_t chunk_lo() const noexcept { return chunk_ * per_chunk(); }
  std::size_t chunk_count() const noexcept { return std::min(per_chunk(), n_ - chunk_lo()); }
  void share_of(int r, std::size_t& lo, std::size_t& hi) const noexcept {
    const std::size_t count = chunk_count(), ranks = static_cast<std::size_t>(seg_->ranks);
    std::size_t share = (count + ranks - 1) / ranks;
    share = (share + align - 1) / align * align;  // no two ranks write one cache line
    lo = std::min(count, share * static_cast<std::size_t>(r));
    hi = std::min(count, lo + share);
  }
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
  stage stage_ = stage::queued;
  std::uint64_t chunk_ = 0;
  stall_clock stalled_;
  std::chrono::steady_clock::time_point timed_from_;
};

}  // namespace flexcomm::detail
