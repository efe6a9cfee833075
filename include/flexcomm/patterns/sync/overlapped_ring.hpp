// overlapped_ring<B>: flexcomm's own ring allreduce (reduce-scatter, then allgather) over the
// backend's isend/irecv, segmented and pipelined, driven by the progress engine during backward.
#pragma once

#include "../../backend/contract.hpp"
#include "core.hpp"
#include "route_ring.hpp"

namespace flexcomm {

// A bucket is launched as soon as it fills (in bucket-index order) and handed to the progress
// engine, which moves it around the ring while the trainer computes the next gradients. At a
// member's first step the bucket plan is still being formed, so that step reduces in finish().
// Local work (reduction, averaging) goes through B::combine / B::divide, so a device backend
// whose isend/irecv take device memory can run the same ring. On one host buckets go through
// shared memory instead, and across hosts the ring may run between the host leaders only
// (sync_options; the sync core picks the route).
//
// ready(index, grad), finish(), plan(), options(), hierarchical(), hosts(), shared_memory():
// see detail::sync_core (core.hpp).
template <class B>
class overlapped_ring : public detail::sync_core<B, detail::ring_route<B>> {
  static_assert(matches_by_tag<B>,
                "overlapped_ring<B>: the ring keeps several buckets and segments in flight to each neighbour and "
                "tells them apart by tag, but B pairs sends and receives in the order they are issued (NCCL); "
                "average with subgroup_allreduce<B> (NCCL's own ring) or run this ring on overlapped_ring<staged>");

 public:
  using backend = B;

  // Collective over `member`; the ring's traffic goes on a private duplicate.
  explicit overlapped_ring(const typename B::communicator& member, sync_options options = {})
      : detail::sync_core<B, detail::ring_route<B>>(member, options, "overlapped_ring", true) {}
};

}  // namespace flexcomm
