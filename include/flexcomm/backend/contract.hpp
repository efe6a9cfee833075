// What a backend declares about itself, and what the adapters check at compile time, so that a
// combination that cannot work (a ring on a backend that matches messages in issue order, a
// feed whose batches would live in device memory) fails to compile, saying what goes where.
// Patterns and the pipeline read a backend through these traits; the operations themselves are
// the table in docs/architecture.md.
#pragma once

#include <string>
#include <type_traits>
#include <utility>

#include "../core/datatype.hpp"
#include "../core/error.hpp"
#include "../core/hosts.hpp"
#include "../core/layout.hpp"

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

// Which element types B's operations carry and reduce, with every op (sum, prod, min, max,
// avg): each type flexcomm names a dtype for (core/datatype.hpp) on mpi, nccl and staged alike
// (MPI reduces 16-bit floats with flexcomm's own operators, NCCL natively). A backend that
// carries fewer says so with `template <class T> static constexpr bool carries = ...;`.
template <class B, class T, class = void>
struct carries_type : std::bool_constant<is_element_v<T>> {};
template <class B, class T>
struct carries_type<B, T, std::void_t<decltype(B::template carries<T>)>>
    : std::bool_constant<is_element_v<T> && B::template carries<T>> {};
template <class B, class T>
inline constexpr bool carries = carries_type<B, std::remove_cv_t<T>>::value;

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

// Whether B can allreduce host buffers through shared memory among ranks that share a host: B
// declares `using host_reducer = ...;`, a type made collectively over a communicator whose ranks
// are all on one host, as `host_reducer(comm, slot_bytes)` (collective `on_one_host(comm)` says
// whether they are), with `start(T* data, n, op)` (a task
// whose `poll()` advances without waiting and returns true once done, for the progress engine)
// and a blocking `allreduce(T* data, n, op)`, and `start_broadcast(T* data, n, root)` (a task
// likewise; hierarchical averaging's intra-host stage 3); every rank starts the same n, T and op
// (root) in the same order; avg divides the sum by the rank count; waits time out as the
// communicator's operations do.
template <class B, class = void>
struct host_shared_memory_of : std::false_type {};
template <class B>
struct host_shared_memory_of<B, std::void_t<typename B::host_reducer>> : std::true_type {};
template <class B>
inline constexpr bool has_host_shared_memory = host_shared_memory_of<B>::value;

// Whether B can give the ranks of a communicator that share a host one shared mapping: B declares
// `using host_window = ...;`, made collectively as `host_window(comm, bytes, who)` over a
// communicator whose ranks are all on one host (collective `host_window::on_one_host(comm)` says
// whether they are), each rank with a region of its own size: `region(r)` (page-aligned, zeroed
// when made, valid for the window's life), `rank()`, `size()`. The feeds hand batches to the
// trainers on a producer's host through it.
template <class B, class = void>
struct host_window_of : std::false_type {};
template <class B>
struct host_window_of<B, std::void_t<typename B::host_window>> : std::true_type {};
template <class B>
inline constexpr bool has_host_window = host_window_of<B>::value;

// Whether B's gatherv and allgatherv read the blocks' offsets (MPI's displacements, kept while
// its call runs). One that walks the counts itself while posting says `static constexpr bool
// block_offsets = false;` (nccl), and the front end makes none: no allocation per post.
template <class B, class = void>
struct block_offsets_of : std::true_type {};
template <class B>
struct block_offsets_of<B, std::void_t<decltype(B::block_offsets)>> : std::bool_constant<B::block_offsets> {};
template <class B>
inline constexpr bool reads_block_offsets = block_offsets_of<B>::value;

// CUDA graphs. Whether a step on B can be captured into a CUDA graph and replayed: B declares
// `static constexpr bool graph_capturable = true;` (nccl), and its requests end an operation
// issued into a capturing stream with release_captured() (the host side, once) instead of a
// wait, which would query the device. A backend with streams says whether one is capturing,
// `static bool capturing(stream, what)`; a host backend has no stream to capture.
template <class B, class = void>
struct graph_capture_of : std::false_type {};
template <class B>
struct graph_capture_of<B, std::void_t<decltype(B::graph_capturable)>> : std::bool_constant<B::graph_capturable> {};
template <class B>
inline constexpr bool captures_into_graphs = graph_capture_of<B>::value;

template <class B, class = void>
struct stream_capture_of {
  static bool capturing(const typename B::stream&, const std::string&) { return false; }
};
template <class B>
struct stream_capture_of<B, std::void_t<decltype(B::capturing(std::declval<typename B::stream>(), std::string()))>> {
  static bool capturing(const typename B::stream& s, const std::string& what) { return B::capturing(s, what); }
};
// True while `s` is being captured into a CUDA graph (never on a host backend).
template <class B>
bool stream_capturing(const typename B::stream& s, const std::string& what) {
  return stream_capture_of<B>::capturing(s, what);
}

// The layout as it runs on `comm`: a per-host layout not yet placed is placed on the hosts of
// comm's ranks (collective over comm: every rank calls this at the same point); any other layout
// is returned as it is, without communication. Every backend says which of a communicator's
// ranks share a host: B::hosts(comm) (device backends ask their MPI twin).
template <class Communicator>
ensemble_layout placed_on_hosts(const Communicator& comm, const ensemble_layout& layout) {
  if (layout.is_placed()) return layout;
  return layout.placed_on(Communicator::backend::hosts(comm));
}

namespace detail {
// What the adapters call with their world. What can be checked without communication is
// checked first, on every rank alike.
template <class Communicator>
ensemble_layout placed_for(const Communicator& world, const ensemble_layout& layout, const char* who) {
  check(static_cast<bool>(world), who, "needs a communicator, got an empty one");
  if (layout.is_placed()) return layout;
  layout.validate(world.size());
  return placed_on_hosts(world, layout);
}
}  // namespace detail

}  // namespace flexcomm
