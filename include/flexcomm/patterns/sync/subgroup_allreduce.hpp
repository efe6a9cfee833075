// subgroup_allreduce<B>: the baseline Sync. Each bucket is averaged by the backend's own
// nonblocking allreduce on the member's communicator, so gradients never mix across members;
// a member whose ranks all share one host reduces through shared memory instead, where the
// backend can (sync_options.shared_memory).
#pragma once

#include "../../backend/contract.hpp"
#include "core.hpp"
#include "route_allreduce.hpp"

namespace flexcomm {

// By default every bucket is launched in finish(), i.e. after backward (the classic "sync after
// backward" that overlapped_ring is measured against). With sync_options.launch_when_full a bucket
// is launched as soon as it fills, in bucket-index order, and the progress engine drives it.
//
// ready(index, grad), finish(), on_stream(s), plan(), options(), hierarchical(), hosts(),
// shared_memory(): see detail::sync_core (core.hpp). On nccl, a trainer that names its stream
// (on_stream) can capture whole steps into a CUDA graph after a first step uncaptured.
template <class B>
class subgroup_allreduce : public detail::sync_core<B, detail::allreduce_route<B>> {
 public:
  using backend = B;

  // Collective over `member` (the member's own communicator); traffic goes on private duplicates.
  explicit subgroup_allreduce(const typename B::communicator& member, sync_options options = {})
      : detail::sync_core<B, detail::allreduce_route<B>>(member, options, "subgroup_allreduce",
                                                         options.launch_when_full) {}
};

}  // namespace flexcomm
