// overlapped_ring<B>: flexcomm's own ring allreduce (reduce-scatter, then allgather) over the
// backend's isend/irecv, segmented and pipelined, driven by the progress engine during backward.
#pragma once

#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "../../backend/contract.hpp"
#include "../../core/datatype.hpp"
#include "../../core/progress.hpp"
#include "../../core/reduce.hpp"
#include "route_hierarchical.hpp"
#include "route_shared_memory.hpp"
#include "core.hpp"

namespace flexcomm {

// A bucket is launched as soon as it fills (in bucket-index order) and handed to the progress
// engine, which moves it around the ring while the trainer computes the next gradients. At a
// member's first step the bucket plan is still being formed, so that step reduces in finish().
// Local work (reduction, averaging) goes through B::combine / B::divide, so a device backend
// whose isend/irecv take device memory can run the same ring.
template <class B>
class overlapped_ring {
  static_assert(matches_by_tag<B>,
                "overlapped_ring<B>: the ring keeps several buckets and segments in flight to each neighbour and "
                "tells them apart by tag, but B pairs sends and receives in the order they are issued (NCCL); "
                "average with subgroup_allreduce<B> (NCCL's own ring) or run this ring on overlapped_ring<staged>");

 public:
  using backend = B;

  // Collective over `member`; the ring's traffic goes on a private duplicate.
  explicit overlapped_ring(const typename B::communicator& member, sync_options options = {})
      : ring_(member.dup(cat(member.name(), " overlapped_ring"))),
        options_(options),
        tiers_(ring_, options_, flat_algorithm::ring, "overlapped_ring"),
        sync_(member, options_, "overlapped_ring", true) {
    check(options_.segment_bytes > 0, "overlapped_ring", "sync_options.segment_bytes must be positive");
    check(options_.segments_in_flight > 0, "overlapped_ring",
          cat("sync_options.segments_in_flight must be positive, got ", options_.segments_in_flight));
    shm_.setup(ring_, tiers_.hosts(), tiers_.enabled(), options_, "overlapped_ring");
    shm_.check_steps_of(sync_);
  }

  template <class T>
  void ready(int index, span<T> grad) {
    sync_.ready(index, grad, launcher());
  }
  void finish() { sync_.finish(launcher()); }

  const bucket_plan& plan() const noexcept { return sync_.plan(); }
  const sync_options& options() const noexcept { return options_; }
  // True when buckets are averaged hierarchically across hosts (decided at construction).
  bool hierarchical() const noexcept { return tiers_.enabled(); }
  const host_map& hosts() const noexcept { return tiers_.hosts(); }
  // True when buckets are reduced through shared memory, not round the ring (decided at
  // construction): the member's ranks all share one host, or, averaging hierarchically, in this
  // rank's host's stages.
  bool shared_memory() const noexcept { return static_cast<bool>(shm_) || tiers_.shared_memory(); }

 private:
  auto launcher() {
    return [this](dtype type, void* data, std::size_t count) { return launch(type, data, count); };
  }

  detail::flight<B> launch(dtype type, void* data, std::size_t count);
  template <class T>
  detail::flight<B> launch_hierarchical(T* data, std::size_t count);

  typename B::communicator ring_;  // touched by the progress engine's thread only, once built
  sync_options options_;
  int next_tag_ = 0;
  std::uint64_t buckets_launched_ = 0;  // tracing: the buckets' sequence numbers
  detail::host_tiers<B> tiers_;  // the ring runs across host leaders when enabled
  detail::host_shared<B> shm_;   // on one host, buckets go through shared memory instead
  detail::bucket_sync<B> sync_;  // last: destroyed first, so buckets in flight end before ring_
};

namespace detail {

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

}  // namespace detail

template <class B>
detail::flight<B> overlapped_ring<B>::launch(dtype type, void* data, std::size_t count) {
  return visit_dtype(type, [&](auto element) {
    using T = decltype(element);
    if (tiers_.enabled()) return launch_hierarchical(static_cast<T*>(data), count);
    // On one host a ring only adds copies: every rank reaches every peer's memory directly.
    if (shm_) return shm_.launch(static_cast<T*>(data), count, options_.op, true);
    const std::size_t segment = std::max<std::size_t>(1, options_.segment_bytes / sizeof(T));
    auto ring = std::make_shared<detail::ring_allreduce<B, T>>(ring_, static_cast<T*>(data), count, options_.op,
                                                                 segment, options_.segments_in_flight, next_tag_);
    next_tag_ = static_cast<int>((static_cast<std::size_t>(next_tag_) + ring->segments()) % detail::ring_tags);
    // Tracing: one marker per bucket, numbered alike on every rank of the ring.
    const std::uint64_t bucket = ++buckets_launched_;
    detail::flight<B> f;
    if (ring->segments() == 0) return f;  // one rank, or an empty bucket: nothing to move
    ring->traced(trace::collective_begin(trace::names::bucket_reduce, ring_.name(), bucket));
    f.task = progress_engine::instance().submit([ring] { return ring->poll(); }, ring->what());
    return f;
  });
}

// The ring runs across the host leaders only; it is built here, on the trainer's thread, so that
// its tags are taken in bucket order like the flat ring's, and started by the engine once this
// host's reduction has arrived.
template <class B>
template <class T>
detail::flight<B> overlapped_ring<B>::launch_hierarchical(T* data, std::size_t count) {
  std::shared_ptr<detail::ring_allreduce<B, T>> ring;
  const std::uint64_t bucket = ++buckets_launched_;
  if (tiers_.leader() && tiers_.leaders().size() > 1 && count > 0) {
    const std::size_t segment = std::max<std::size_t>(1, options_.segment_bytes / sizeof(T));
    const op across = options_.op == op::avg ? op::sum : options_.op;  // averaged once, after the ring
    ring = std::make_shared<detail::ring_allreduce<B, T>>(tiers_.leaders(), data, count, across, segment,
                                                          options_.segments_in_flight, next_tag_);
    next_tag_ = static_cast<int>((static_cast<std::size_t>(next_tag_) + ring->segments()) % detail::ring_tags);
    ring->traced(trace::collective_begin(trace::names::bucket_reduce, tiers_.leaders().name(), bucket));
  }
  return tiers_.launch(data, count, options_.op, ring_.size(), [ring](T*, std::size_t, op) {
    return std::function<bool()>([ring] { return ring->poll(); });
  });
}

}  // namespace flexcomm
