// The front end every backend operation passes through, written once. A backend is
//
//   struct mpi : operations<mpi, mpi_communicator, mpi_request, no_stream> { ... };
//
// and supplies the native half: op_start<T>, its record of one operation (number, flight
// recorder, what every rank must agree on), and post_*(), the call into MPI, NCCL or a staging
// lane. This half checks the arguments against the communicator (roots, peers, counts, sizes,
// memory space) before anything is posted that a peer could wait for, names the operation for
// errors, says what the ranks must agree on, and marks collectives in the trace: mpi, nccl and
// staged refuse the same bad call with the same error, and their operations read the same in
// flight recorders and traces.
#pragma once

#include <cstddef>
#include <string>
#include <type_traits>

#include "../core/datatype.hpp"
#include "../core/error.hpp"
#include "../core/span.hpp"
#include "arguments.hpp"
#include "contract.hpp"

namespace flexcomm {

namespace detail {
// Keeps T out of deduction in `send` parameters: T comes from the receive buffer alone, so a
// span<T> passed as a send converts to span<const T>.
template <class T>
struct identity {
  using type = T;
};
template <class T>
using identity_t = typename identity<T>::type;

// The agreement hooks of a backend whose calls are checked elsewhere: staged's chunks are MPI
// operations on its transport, each checked there by the MPI backend (mpi/call_check.hpp).
struct unchecked_calls {
  void agree_on(op) noexcept {}
  void agree_on_root(int) noexcept {}
  void agree_on_counts(span<const int>) noexcept {}
  void count_varies() noexcept {}
  void check_collective(int) noexcept {}
};

// Every rank of a collective gets the same span in the trace, numbered alike (see core/trace.hpp).
template <class Request, class Communicator>
Request traced(Request r, const char* kind, const Communicator& comm) {
  r.trace_collective(kind, comm);
  return r;
}
}  // namespace detail

template <class Backend, class Communicator, class Request, class Stream>
struct operations {
 private:
  // Said once, before the errors a type without a dtype would cause further in.
  template <class T>
  static constexpr bool element() {
    static_assert(carries<Backend, T>,
                  "flexcomm operations carry float, double, std::int32_t, std::int64_t, std::uint8_t, flexcomm::half "
                  "and flexcomm::bfloat16 (and what the backend's `carries` allows); convert other element types "
                  "first");
    return true;
  }

 public:
  using communicator = Communicator;
  using request = Request;
  // The execution context an operation is ordered on: no_stream for host backends; for device
  // ones nullptr (the default) is the communicator's own stream.
  using stream = Stream;

  // Point-to-point. A receive into a buffer smaller than what arrives is an error, never an
  // overrun. Tag-matched backends (contract.hpp: matches_by_tag) match by tag; others in the
  // order both sides issue their calls.
  template <class T>
  static request isend(const communicator& comm, span<T> buf, int dest, int tag, stream s = {}) {
    static_assert(element<std::remove_const_t<T>>());
    using E = std::remove_const_t<T>;
    typename Backend::template op_start<E> start(comm, s, "isend", buf.size(), dtype_of<E>, "", dest, tag,
                                                 detail::call_detail::point_to_point("to", dest, tag));
    detail::check_rank_of(dest, comm.size(), "peer", start.what());
    Backend::check_buffer(buf.data(), buf.size_bytes(), start.what(), "send");
    return Backend::post_isend(comm, start, span<const E>(buf.data(), buf.size()), dest, tag, s);
  }

  template <class T>
  static request irecv(const communicator& comm, span<T> buf, int source, int tag, stream s = {}) {
    static_assert(element<std::remove_const_t<T>>());
    static_assert(!std::is_const_v<T>, "irecv writes into its buffer: pass a span of non-const elements");
    typename Backend::template op_start<T> start(comm, s, "irecv", buf.size(), dtype_of<T>, "", source, tag,
                                                 detail::call_detail::point_to_point("from", source, tag));
    detail::check_rank_of(source, comm.size(), "peer", start.what());
    Backend::check_buffer(buf.data(), buf.size_bytes(), start.what(), "receive");
    return Backend::post_irecv(comm, start, buf, source, tag, s);
  }

  template <class T>
  static request ibcast(const communicator& comm, span<T> buf, int root, stream s = {}) {
    static_assert(element<std::remove_const_t<T>>());
    typename Backend::template op_start<T> start(comm, s, "ibcast", buf.size(), dtype_of<T>, "", root, -1,
                                                 detail::call_detail::rooted_at(root));
    detail::check_rank_of(root, comm.size(), "root", start.what());
    Backend::check_buffer(buf.data(), buf.size_bytes(), start.what(), "broadcast");
    start.agree_on_root(root);
    start.check_collective(comm.size());
    return detail::traced(Backend::post_ibcast(comm, start, buf, root, s), "ibcast", comm);
  }

  // avg is sum divided by the communicator's size, for every element type.
  template <class T>
  static request iallreduce(const communicator& comm, span<const detail::identity_t<T>> send, span<T> recv, op o,
                            stream s = {}) {
    static_assert(element<std::remove_const_t<T>>());
    typename Backend::template op_start<T> start(comm, s, "iallreduce", recv.size(), dtype_of<T>, name_of(o), -1, -1,
                                                 detail::call_detail::reduction(name_of(o)));
    detail::check_same_size(send.size(), recv.size(), start.what());
    Backend::check_buffer(send.data(), send.size_bytes(), start.what(), "send");
    Backend::check_buffer(recv.data(), recv.size_bytes(), start.what(), "receive");
    start.agree_on(o);
    start.check_collective(comm.size());
    return detail::traced(Backend::post_iallreduce(comm, start, send, recv, o, s), "iallreduce", comm);
  }
  template <class T>
  static request iallreduce(const communicator& comm, span<T> buf, op o, stream s = {}) {
    return iallreduce<T>(comm, span<const T>(buf), buf, o, s);
  }

  // recv is significant at the root only (and may be empty elsewhere).
  template <class T>
  static request ireduce(const communicator& comm, span<const detail::identity_t<T>> send, span<T> recv, op o, int root,
                         stream s = {}) {
    static_assert(element<std::remove_const_t<T>>());
    typename Backend::template op_start<T> start(comm, s, "ireduce", send.size(), dtype_of<T>, name_of(o), root, -1,
                                                 detail::call_detail::rooted_at(root, name_of(o)));
    detail::check_rank_of(root, comm.size(), "root", start.what());
    const bool at_root = comm.rank() == root;
    detail::check_root_receive(at_root, send.size(), recv.size(), start.what());
    Backend::check_buffer(send.data(), send.size_bytes(), start.what(), "send");
    if (at_root) Backend::check_buffer(recv.data(), recv.size_bytes(), start.what(), "receive");
    start.agree_on(o);
    start.agree_on_root(root);
    start.check_collective(comm.size());
    return detail::traced(Backend::post_ireduce(comm, start, send, at_root ? recv : span<T>(), o, root, s), "ireduce",
                          comm);
  }

  // counts[r] elements from rank r, placed one after the other at the root.
  template <class T>
  static request igatherv(const communicator& comm, span<const detail::identity_t<T>> send, span<T> recv,
                          span<const int> counts, int root, stream s = {}) {
    static_assert(element<std::remove_const_t<T>>());
    typename Backend::template op_start<T> start(comm, s, "igatherv", send.size(), dtype_of<T>, "", root, -1,
                                                 detail::call_detail::rooted_at(root));
    detail::check_rank_of(root, comm.size(), "root", start.what());
    const bool at_root = comm.rank() == root;
    detail::blocks layout;
    if (at_root) {
      layout = detail::gather_layout(counts, comm.size(), root, send.size(), recv.size(), start.what(),
                                     reads_block_offsets<Backend>);
      Backend::check_buffer(recv.data(), recv.size_bytes(), start.what(), "receive");
    }
    Backend::check_buffer(send.data(), send.size_bytes(), start.what(), "send");
    start.count_varies();
    start.agree_on_root(root);
    start.check_collective(comm.size());
    return detail::traced(Backend::post_igatherv(comm, start, send, recv, counts, std::move(layout), root, s),
                          "igatherv", comm);
  }

  template <class T>
  static request iallgather(const communicator& comm, span<const detail::identity_t<T>> send, span<T> recv,
                            stream s = {}) {
    static_assert(element<std::remove_const_t<T>>());
    typename Backend::template op_start<T> start(comm, s, "iallgather", send.size(), dtype_of<T>, "", -1, -1, {});
    detail::check_allgather_sizes(send.size(), recv.size(), comm.size(), start.what());
    Backend::check_buffer(send.data(), send.size_bytes(), start.what(), "send");
    Backend::check_buffer(recv.data(), recv.size_bytes(), start.what(), "receive");
    start.check_collective(comm.size());
    return detail::traced(Backend::post_iallgather(comm, start, send, recv, s), "iallgather", comm);
  }

  template <class T>
  static request iallgatherv(const communicator& comm, span<const detail::identity_t<T>> send, span<T> recv,
                             span<const int> counts, stream s = {}) {
    static_assert(element<std::remove_const_t<T>>());
    typename Backend::template op_start<T> start(comm, s, "iallgatherv", send.size(), dtype_of<T>, "", -1, -1, {});
    auto layout = detail::allgatherv_layout(counts, comm.size(), comm.rank(), send.size(), recv.size(), start.what(),
                                            reads_block_offsets<Backend>);
    Backend::check_buffer(send.data(), send.size_bytes(), start.what(), "send");
    Backend::check_buffer(recv.data(), recv.size_bytes(), start.what(), "receive");
    start.count_varies();
    start.agree_on_counts(counts);
    start.check_collective(comm.size());
    return detail::traced(Backend::post_iallgatherv(comm, start, send, recv, counts, std::move(layout), s),
                          "iallgatherv", comm);
  }

  // Rank r receives counts[r] elements of the reduction of every rank's send buffer.
  template <class T>
  static request ireduce_scatter(const communicator& comm, span<const detail::identity_t<T>> send, span<T> recv,
                                 span<const int> counts, op o, stream s = {}) {
    static_assert(element<std::remove_const_t<T>>());
    typename Backend::template op_start<T> start(comm, s, "ireduce_scatter", send.size(), dtype_of<T>, name_of(o), -1,
                                                 -1, detail::call_detail::reduction(name_of(o)));
    auto layout =
        detail::reduce_scatter_layout(counts, comm.size(), comm.rank(), send.size(), recv.size(), start.what());
    const auto mine = static_cast<std::size_t>(counts[static_cast<std::size_t>(comm.rank())]);
    Backend::check_buffer(send.data(), send.size_bytes(), start.what(), "send");
    Backend::check_buffer(recv.data(), mine * sizeof(T), start.what(), "receive");
    start.agree_on(o);
    start.agree_on_counts(counts);
    start.check_collective(comm.size());
    return detail::traced(
        Backend::post_ireduce_scatter(comm, start, send, recv.subspan(0, mine), counts, std::move(layout), o, s),
        "ireduce_scatter", comm);
  }
};

}  // namespace flexcomm
