// What a backend declares about itself, and what the adapters check at compile time, so that a
// combination that cannot work (a ring on a backend that matches messages in issue order, a
// feed whose batches would live in device memory) fails to compile, saying what goes where.
// Patterns and the pipeline read a backend through these traits; the operations themselves are
// the table in docs/architecture.md.
#pragma once

#include <type_traits>

namespace flexcomm {

enum class memory_space { host, device };

// The execution context of backends that have none (MPI); NCCL's is a cudaStream_t.
struct no_stream {};

// Where B's buffers live: a loader writes batches, and the aggregator reads gathered vectors, in
// host memory.
template <class B>
inline constexpr bool holds_host_memory = B::memory == memory_space::host;

// Whether B's point-to-point receives match sends by tag (MPI, and staged, which is MPI on host
// staging), or in the order both sides issue them (NCCL): only the former can keep several
// buckets and segments in flight to one peer, as overlapped_ring does.
template <class B>
inline constexpr bool matches_by_tag = B::tag_matched_p2p;

// The host backend beside B: B itself, or for a device backend the one its communicators are
// built over (`using host_backend = mpi;`), which carries an adapter's checks and a preset's feed
// and collect.
template <class B, class = void>
struct host_backend_of {
  using type = B;
};
template <class B>
struct host_backend_of<B, std::void_t<typename B::host_backend>> {
  using type = typename B::host_backend;
};
template <class B>
using host_backend_t = typename host_backend_of<B>::type;

}  // namespace flexcomm
