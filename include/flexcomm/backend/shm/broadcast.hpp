// One broadcast on a host_segment (segment.hpp), hierarchical averaging's intra-host stage 3.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "../../core/datatype.hpp"
#include "../../core/error.hpp"
#include "segment.hpp"
#include "slot_writer.hpp"

namespace flexcomm::detail {

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
      if (seg_->broken.load(std::memory_order_acquire))
        fail(who(), cat(seg_->group->name(), " is unusable after an earlier task timed out or was dropped"));
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
    if (stalled_.past(limit)) {
      seg_->broken.store(true, std::memory_order_release);
      fail(who(), cat("timed out after ", limit.count(), " ms waiting for ", for_what, " (step ", needed,
                      "); not arrived: ", behind()));
    }
    return false;
  }

  std::shared_ptr<host_segment> seg_;
  T* data_;
  std::size_t n_;
  int root_;
  plan plan_;
  bool started_ = false;
  std::uint64_t chunk_ = 0;
  stall_clock stalled_;
};

}  // namespace flexcomm::detail
