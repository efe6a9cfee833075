// The ring route: flexcomm's own ring allreduce (reduce-scatter, then allgather) over the
// backend's isend/irecv, segmented and pipelined, driven by the progress engine during backward.
// overlapped_ring's flat route, and its leg across the host leaders when averaging in tiers.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "../../backend/contract.hpp"
#include "../../core/datatype.hpp"
#include "../../core/error.hpp"
#include "../../core/hosts.hpp"
#include "../../core/progress.hpp"
#include "../../core/reduce.hpp"
#include "../../core/span.hpp"
#include "../../core/trace.hpp"
#include "flight.hpp"
#include "options.hpp"

namespace flexcomm::detail {

// Tags stay within what every MPI guarantees (MPI_TAG_UB >= 32767); a tag names a segment, and
// consecutive buckets take consecutive tags, so only segments 32767 launches apart share one.
inline constexpr int ring_tags = 32767;

// One bucket's trip round the ring. The bucket is cut into `ranks` chunks, each chunk into
// segments; segment k of every chunk makes the 2(ranks-1) steps together (a lane), and
// `lanes` segments are in flight at once: while one lane reduces what it received, another's
// transfer proceeds. Rank r sends to r+1 and receives from r-1. Reduce-scatter step s sends
// chunk r-s and adds chunk r-s-1 into place; afterwards rank r owns the total of chunk r+1.
// Allgather step t sends chunk r+1-t and receives chunk r-t where it belongs.
template <class B, class T>
class ring_allreduce {
 public:
  ring_allreduce(const typename B::communicator& comm, T* data, std::size_t count, op o, std::size_t segment,
                 int lanes, int first_tag)
      : comm_(comm),
        data_(data),
        count_(count),
        op_(o),
        ranks_(comm.size()),
        rank_(comm.rank()),
        first_tag_(first_tag),
        lanes_(static_cast<std::size_t>(lanes)) {
    const std::size_t largest_chunk = (count + static_cast<std::size_t>(ranks_) - 1) / static_cast<std::size_t>(ranks_);
    segment_ = std::max<std::size_t>(1, std::min(segment, largest_chunk));
    segments_ = ranks_ > 1 && count > 0 ? (largest_chunk + segment_ - 1) / segment_ : 0;
    what_ = cat("overlapped_ring on ", comm.name(), ": ", count, " x ", name_of(dtype_of<T>), ", ", name_of(o),
                ", ", segments_, " segments of ", segment_);
  }

  std::size_t segments() const noexcept { return segments_; }
  const std::string& what() const noexcept { return what_; }

  // One round of progress, on the engine's thread; true once the whole bucket is reduced.
  bool poll() {
    for (auto& l : lanes_) {
      for (;;) {
        if (!l.active) {
          if (next_segment_ == segments_) break;
          l.active = true;
          l.segment = next_segment_++;
          l.step = 0;
          l.trace_id = trace::collective_begin(trace::names::segment, comm_.name(), l.segment, "ring segment");
          post(l);
        }
        if (!l.recv.test() || !l.send.test()) break;
        complete(l);
        if (++l.step == 2 * (ranks_ - 1)) {
          l.active = false;
          trace::collective_end(trace::names::segment, std::exchange(l.trace_id, 0), "ring segment");
          ++finished_;
          continue;
        }
        post(l);
      }
    }
    if (finished_ != segments_) return false;
    trace::collective_end(trace::names::bucket_reduce, std::exchange(trace_id_, 0));  // tracing
    return true;
  }

  // Tracing: this bucket's collective marker, ended when the last segment is done.
  void traced(std::uint64_t id) noexcept { trace_id_ = id; }

 private:
  struct lane {
    bool active = false;
    std::size_t segment = 0;
    int step = 0;
    typename B::request send, recv;
    typename B::template buffer<T> scratch;  // where B's buffers live (device memory for nccl)
    std::uint64_t trace_id = 0;               // tracing: this segment's slice
  };

  int wrap(int chunk) const { return ((chunk % ranks_) + ranks_) % ranks_; }
  std::size_t chunk_begin(int chunk) const {
    return count_ * static_cast<std::size_t>(chunk) / static_cast<std::size_t>(ranks_);
  }
  // Segment k of chunk c: possibly empty (short chunks, count < ranks); empty messages keep
  // every rank's sequence of messages identical.
  span<T> piece(int chunk, std::size_t k) const {
    const std::size_t begin = chunk_begin(chunk), end = chunk_begin(chunk + 1);
    const std::size_t lo = std::min(end, begin + k * segment_);
    const std::size_t hi = std::min(end, lo + segment_);
    return {data_ + lo, hi - lo};
  }
  bool reducing(const lane& l) const { return l.step < ranks_ - 1; }
  int send_chunk(const lane& l) const {
    return reducing(l) ? wrap(rank_ - l.step) : wrap(rank_ + 1 - (l.step - (ranks_ - 1)));
  }
  int recv_chunk(const lane& l) const {
    return reducing(l) ? wrap(rank_ - l.step - 1) : wrap(rank_ - (l.step - (ranks_ - 1)));
  }

  void post(lane& l) {
    const int tag = (first_tag_ + static_cast<int>(l.segment % ring_tags)) % ring_tags;
    const int next = wrap(rank_ + 1), prev = wrap(rank_ - 1);
    const span<T> in = piece(recv_chunk(l), l.segment);
    if (reducing(l)) {
      if (l.scratch.size() < segment_) l.scratch.resize(segment_);
      l.recv = B::irecv(comm_, span<T>(l.scratch.data(), in.size()), prev, tag);
    } else {
      l.recv = B::irecv(comm_, in, prev, tag);
    }
    l.send = B::isend(comm_, span<const T>(piece(send_chunk(l), l.segment)), next, tag);
  }

  void complete(lane& l) {
    if (!reducing(l)) return;  // allgather received in place
    const span<T> in = piece(recv_chunk(l), l.segment);
    B::combine(op_, in.data(), l.scratch.data(), in.size());
    // The last reduce-scatter step completes this rank's chunk: average it once, before it is
    // sent round, so that every rank ends with the same bits.
    if (l.step == ranks_ - 2 && op_ == op::avg) B::divide(in.data(), in.size(), ranks_);
  }

  const typename B::communicator& comm_;
  T* data_;
  std::size_t count_;
  op op_;
  int ranks_, rank_;
  int first_tag_;
  std::size_t segment_ = 1, segments_ = 0;
  std::size_t next_segment_ = 0, finished_ = 0;
  std::vector<lane> lanes_;
  std::uint64_t trace_id_ = 0;
  std::string what_;
};


// Buckets go round the ring on the adapter's communicator, or across the host leaders' when
// averaging in tiers. Either way each bucket's ring is built on the trainer's thread, so that its
// tags are taken in bucket order on every rank.
template <class B>
class ring_route {
 public:
  static constexpr flat_algorithm algorithm = flat_algorithm::ring;

  static void check_options(const sync_options& options, const std::string& who) {
    check(options.segment_bytes > 0, who, "sync_options.segment_bytes must be positive");
    check(options.segments_in_flight > 0, who,
          cat("sync_options.segments_in_flight must be positive, got ", options.segments_in_flight));
  }
  explicit ring_route(const sync_options& options)
      : segment_bytes_(options.segment_bytes), lanes_(options.segments_in_flight) {}

  // One bucket round `ring`, handed to the engine whether it filled early or in finish().
  template <class T>
  flight<B> launch(const typename B::communicator& ring, T* data, std::size_t count, op o, bool) {
    auto trip = make(ring, data, count, o);
    flight<B> f;
    if (trip->segments() == 0) return f;  // one rank, or an empty bucket: nothing to move
    trip->traced(trace::collective_begin(trace::names::bucket_reduce, ring.name(), buckets_launched_));
    f.task = progress_engine::instance().submit([trip] { return trip->poll(); }, trip->what());
    return f;
  }

  // The leg across the host leaders (host_tiers' `across`): a ring where this rank `crosses`,
  // started by the engine once this host's reduction has arrived.
  template <class T>
  struct leg {
    std::shared_ptr<ring_allreduce<B, T>> trip;
    bool poll() { return trip->poll(); }
  };
  template <class T>
  leg<T> cross(const typename B::communicator& leaders, bool crosses, T* data, std::size_t count, op o) {
    if (!crosses) {
      ++buckets_launched_;
      return {};
    }
    leg<T> l{make(leaders, data, count, o)};
    l.trip->traced(trace::collective_begin(trace::names::bucket_reduce, leaders.name(), buckets_launched_));
    return l;
  }

 private:
  template <class T>
  std::shared_ptr<ring_allreduce<B, T>> make(const typename B::communicator& comm, T* data, std::size_t count, op o) {
    const std::size_t segment = std::max<std::size_t>(1, segment_bytes_ / sizeof(T));
    auto trip = std::make_shared<ring_allreduce<B, T>>(comm, data, count, o, segment, lanes_, next_tag_);
    next_tag_ = static_cast<int>((static_cast<std::size_t>(next_tag_) + trip->segments()) % ring_tags);
    ++buckets_launched_;
    return trip;
  }

  std::size_t segment_bytes_;
  int lanes_;
  int next_tag_ = 0;
  std::uint64_t buckets_launched_ = 0;  // tracing: the buckets' sequence numbers, alike on every rank
};

}  // namespace flexcomm::detail
