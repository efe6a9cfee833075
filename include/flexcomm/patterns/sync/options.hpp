// What a gradient sync is told: the bucket and segment sizes, the reduction, and which of the
// routes (shared memory, hierarchical tiers) it may take; each with its environment variable.
#pragma once

#include <cstddef>

#include "../../core/reduce.hpp"
#include "../../core/hosts.hpp"
#include "../../core/setting_values.hpp"
#include "../../core/settings.hpp"

namespace flexcomm {

// PyTorch DDP's default bucket capacity.
inline constexpr std::size_t default_bucket_bytes = std::size_t{25} << 20;
inline constexpr std::size_t default_segment_bytes = std::size_t{1} << 20;

// "26214400", "64K", "25M", "1G" (binary multiples); used for FLEXCOMM_BUCKET_BYTES and
// FLEXCOMM_SEGMENT_BYTES.

// FLEXCOMM_BUCKET_BYTES when set, otherwise 25 MiB.
std::size_t bucket_bytes_from_env();
// FLEXCOMM_SEGMENT_BYTES when set, otherwise 1 MiB.
std::size_t segment_bytes_from_env();

struct sync_options {
  // Gradients are fused into buckets of at most this many bytes (a larger gradient gets a
  // bucket of its own).
  std::size_t bucket_bytes = bucket_bytes_from_env();
  // The gradients handed over last in a step (the first layers', ready only as backward ends)
  // get a bucket of their own of at most this many bytes (bucket_plan::seal): only it is left to
  // reduce once backward ends. 0: the last bucket is whatever remains of bucket_bytes.
  std::size_t last_bucket_bytes = std::size_t{64} << 10;
  // The reduction left in the gradients; avg divides the sum by the member's rank count.
  ::flexcomm::op op = ::flexcomm::op::avg;
  // overlapped_ring: a bucket travels the ring in segments of this size, `segments_in_flight`
  // of them at once, so that the transfer of one overlaps the reduction of another.
  std::size_t segment_bytes = segment_bytes_from_env();
  int segments_in_flight = 2;
  // subgroup_allreduce: launch each bucket's allreduce as soon as it fills (driven by the
  // progress engine) instead of all of them in finish(), i.e. after backward.
  bool launch_when_full = false;
  // A member whose ranks span hosts averages hierarchically (reduce within each host, allreduce
  // across the host leaders, broadcast within each host): automatic (subgroup_allreduce when the
  // member spans hosts and some host holds more than one of its ranks; overlapped_ring only when,
  // besides, its ranks are not in host blocks: see use_hierarchy), on, or off.
  // FLEXCOMM_HIERARCHICAL=auto|on|off.
  // Host backends only; device backends stay flat.
  hierarchy hierarchical = hierarchy_from_env();
  // A member whose ranks all share one host (2+ ranks) reduces each bucket through shared memory
  // instead of the backend's allreduce (subgroup_allreduce) or the ring (overlapped_ring), on
  // backends that have it (has_host_shared_memory: mpi): on the progress engine when buckets
  // launch as they fill, else on the trainer's thread in finish(). automatic, on (and a member
  // spanning hosts is an error), or off. FLEXCOMM_SHM=auto|on|off. Hierarchical averaging, when
  // on, takes precedence.
  shared_memory_use shared_memory = shared_memory_from_env();
  // Bytes of each of a rank's two large slots of the segment (N ranks: 2N of them); a larger
  // bucket goes through in chunks, alternating between the two. 1 MiB: the slots then stay in
  // cache while the buffers stream through (benchmarks/history/allreduce.md).
  std::size_t shared_memory_slot_bytes = std::size_t{1} << 20;
  // On that route, a bucket of one gradient in the trainer's own memory (not gradient_memory())
  // has its whole pages made shared where they lie, once, and is reduced in place
  // (registered_range.hpp). false: through the slots, its pages left private (a process forked
  // from the trainer then copies them on write, as before).
  bool share_own_memory = true;
};

inline std::size_t bucket_bytes_from_env() {
  const char* text = setting("FLEXCOMM_BUCKET_BYTES");
  return text ? parse_setting_bytes(text, "FLEXCOMM_BUCKET_BYTES") : default_bucket_bytes;
}

inline std::size_t segment_bytes_from_env() {
  const char* text = setting("FLEXCOMM_SEGMENT_BYTES");
  return text ? parse_setting_bytes(text, "FLEXCOMM_SEGMENT_BYTES") : default_segment_bytes;
}

}  // namespace flexcomm
