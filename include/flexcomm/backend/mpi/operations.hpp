// The MPI backend: host buffers (device buffers too where MPI is CUDA-aware) over MPICH. The
// public operations are the front end's (backend/operations.hpp); this header is their native
// half: the record of one operation being posted, and the MPI call behind each.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "../../core/datatype.hpp"
#include "../../core/error.hpp"
#include "../../core/hosts.hpp"
#include "../../core/reduce.hpp"
#include "../../core/span.hpp"
#include "../../core/trace.hpp"
#include "../../core/watchdog.hpp"
#include "../contract.hpp"
#include "../operations.hpp"
#include "call_check.hpp"
#include "communicator.hpp"
#include "deferred_post.hpp"
#include "implementation.hpp"
#include "request.hpp"
#include "types.hpp"
#include "watchdog.hpp"

namespace flexcomm {

namespace detail {
// One operation being posted (call_check.hpp), handed to its request with its check.
class mpi_op_start : public operation_record {
 public:
  mpi_op_start(const mpi_communicator& comm, no_stream, const char* name, std::size_t count, dtype type,
               const char* redop, int peer, int tag, const call_detail& extra)
      : operation_record(comm.watch_state(), "mpi", comm.name(), name, count, type, redop, peer, tag, extra,
                         comm.watch_state() ? 0 : mutable_comm(comm).next_sequence()) {}

  mpi_request finish(MPI_Request r, std::function<void()> then = {}) {
    const auto seq = take_sequence();
    return mpi_request(r, what(), std::move(then), state(), seq, take_check());
  }

  // A collective: `native(&request)` is the library call. Where collectives wait for their check
  // (mpi_implementation::defers_collectives), it joins the communicator's queue and is made when
  // its turn comes (mpi/deferred_post.hpp); elsewhere it is made now, its check riding beside it.
  mpi_request post_collective(const mpi_communicator& comm, native_post native, std::function<void()> then = {}) {
    if constexpr (mpi_implementation::defers_collectives) {
      if (const auto& queue = comm.deferred_posts()) {
        const auto seq = take_sequence();
        auto post = std::make_shared<deferred_post>(take_check(), std::move(native), seq, what());
        queue->enqueue(post);
        mpi_request r(deferred_collective(queue, std::move(post)), what(), std::move(then), state(), seq);
        // Whatever the queue can hand the library at once (this collective too, when unchecked
        // and alone) goes now; a refusal waits for the request's test.
        queue->advance();
        return r;
      }
    }
    MPI_Request r;
    check_mpi(native(&r), what());
    return finish(r, std::move(then));
  }
};

// The per-rank counts and offsets of a v-collective, held until it completes: the caller's
// counts may be gone by the time a deferred post is made.
struct held_layout {
  held_layout(span<const int> c, blocks b) : counts(c.begin(), c.end()), offsets(std::move(b.offsets)) {}
  std::vector<int> counts;
  std::vector<int> offsets;
};

template <class T>
std::function<void()> average_epilogue(op o, span<T> out, int ranks) {
  if (o != op::avg || out.empty()) return {};
  return [out, ranks] { divide_by(out.data(), out.size(), ranks); };
}
}  // namespace detail

class mpi_host_reducer;  // mpi/shared_memory.hpp
class mpi_host_window;   // mpi/shared_memory.hpp

struct mpi : operations<mpi, mpi_communicator, mpi_request, no_stream> {
  static constexpr memory_space memory = memory_space::host;
  static constexpr bool tag_matched_p2p = true;
  // An allreduce through one shared-memory segment for a communicator on one host (contract.hpp:
  // has_host_shared_memory; mpi/shared_memory.hpp).
  using host_reducer = mpi_host_reducer;
  // One shared mapping for the ranks of a communicator on one host (contract.hpp: has_host_window).
  using host_window = mpi_host_window;
  // An adapter's own scratch space, in the memory this backend's buffers live in.
  template <class T>
  using buffer = std::vector<T>;

  // The rank that sent a message with `tag` now waiting on `comm`, if any (MPI_Iprobe, any
  // source): the pipeline's hand-over looks once per step on a member's first rank, where a
  // receive posted ahead would be left pending when the job ends early.
  static std::optional<int> probe(const communicator& comm, int tag) {
    int flag = 0;
    MPI_Status status;
    check_mpi(MPI_Iprobe(MPI_ANY_SOURCE, tag, comm.native(), &flag, &status), cat(comm.name(), ": MPI_Iprobe"));
    if (!flag) return std::nullopt;
    return status.MPI_SOURCE;
  }

  // Collective over `comm`: which of its ranks share a host (mpi/hosts.hpp).
  static host_map hosts(const communicator& comm);

  // Local work adapters need besides communication, done where this backend's buffers live
  // (host loops here; kernels on the stream in device backends).
  template <class T>
  static void combine(op o, T* inout, const T* in, std::size_t n, stream = {}) {
    flexcomm::combine(o, inout, in, n);
  }
  template <class T>
  static void divide(T* buf, std::size_t n, int ranks, stream = {}) {
    flexcomm::divide_by(buf, n, ranks);
  }
  static void copy(void* dst, const void* src, std::size_t bytes, stream = {}) {
    if (bytes) std::memcpy(dst, src, bytes);
  }

 private:
  friend struct operations<mpi, mpi_communicator, mpi_request, no_stream>;
  template <class T>
  using op_start = detail::mpi_op_start;
  using start = detail::mpi_op_start;

  // Host memory, or device memory where this MPI is CUDA-aware: MPI itself is the judge.
  static void check_buffer(const void*, std::size_t, const std::string&, const char*) noexcept {}

  static MPI_Datatype type_of(dtype t) { return detail::mpi_type(t); }

  template <class T>
  static request post_isend(const communicator& comm, start& st, span<const T> buf, int dest, int tag, stream) {
    MPI_Request r;
    check_mpi(MPI_Isend(buf.data(), detail::mpi_count(buf.size(), st.what()), type_of(dtype_of<T>), dest, tag,
                        comm.native(), &r),
              st.what());
    return st.finish(r);
  }

  template <class T>
  static request post_irecv(const communicator& comm, start& st, span<T> buf, int source, int tag, stream) {
    MPI_Request r;
    check_mpi(MPI_Irecv(buf.data(), detail::mpi_count(buf.size(), st.what()), type_of(dtype_of<T>), source, tag,
                        comm.native(), &r),
              st.what());
    return st.finish(r);
  }

  template <class T>
  static request post_ibcast(const communicator& comm, start& st, span<T> buf, int root, stream) {
    const int n = detail::mpi_count(buf.size(), st.what());
    return st.post_collective(comm, [data = buf.data(), n, root, c = comm.native()](MPI_Request* r) {
      return MPI_Ibcast(data, n, type_of(dtype_of<T>), root, c, r);
    });
  }

  template <class T>
  static request post_iallreduce(const communicator& comm, start& st, span<const T> send, span<T> recv, op o,
                                 stream) {
    const void* sendbuf = send.data() == recv.data() ? MPI_IN_PLACE : send.data();
    const int n = detail::mpi_count(recv.size(), st.what());
    const MPI_Op mop = detail::mpi_op(o, dtype_of<T>);
    return st.post_collective(
        comm,
        [sendbuf, out = recv.data(), n, mop, c = comm.native()](MPI_Request* r) {
          return MPI_Iallreduce(sendbuf, out, n, type_of(dtype_of<T>), mop, c, r);
        },
        detail::average_epilogue(o, recv, comm.size()));
  }

  // `recv` is empty except at the root.
  template <class T>
  static request post_ireduce(const communicator& comm, start& st, span<const T> send, span<T> recv, op o, int root,
                              stream) {
    const bool at_root = comm.rank() == root;
    const void* sendbuf = at_root && send.data() == recv.data() ? MPI_IN_PLACE : send.data();
    const int n = detail::mpi_count(send.size(), st.what());
    const MPI_Op mop = detail::mpi_op(o, dtype_of<T>);
    return st.post_collective(
        comm,
        [sendbuf, out = at_root ? recv.data() : nullptr, n, mop, root, c = comm.native()](MPI_Request* r) {
          return MPI_Ireduce(sendbuf, out, n, type_of(dtype_of<T>), mop, root, c, r);
        },
        detail::average_epilogue(o, recv, comm.size()));
  }

  template <class T>
  static request post_igatherv(const communicator& comm, start& st, span<const T> send, span<T> recv,
                               span<const int> counts, detail::blocks layout, int root, stream) {
    const bool at_root = comm.rank() == root;
    // MPI reads counts and offsets when the operation starts (which may be later: deferred), but
    // MPICH may keep the pointers: hold them.
    auto keep = std::make_shared<detail::held_layout>(counts, std::move(layout));
    const int n = detail::mpi_count(send.size(), st.what());
    return st.post_collective(
        comm,
        [in = send.data(), out = at_root ? recv.data() : nullptr, n, at_root, keep, root,
         c = comm.native()](MPI_Request* r) {
          const auto type = type_of(dtype_of<T>);
          return MPI_Igatherv(in, n, type, out, at_root ? keep->counts.data() : nullptr,
                              keep->offsets.empty() ? nullptr : keep->offsets.data(), type, root, c, r);
        },
        [keep] {});
  }

  template <class T>
  static request post_iallgather(const communicator& comm, start& st, span<const T> send, span<T> recv, stream) {
    const int n = detail::mpi_count(send.size(), st.what());
    return st.post_collective(comm, [in = send.data(), out = recv.data(), n, c = comm.native()](MPI_Request* r) {
      const auto type = type_of(dtype_of<T>);
      return MPI_Iallgather(in, n, type, out, n, type, c, r);
    });
  }

  template <class T>
  static request post_iallgatherv(const communicator& comm, start& st, span<const T> send, span<T> recv,
                                  span<const int> counts, detail::blocks layout, stream) {
    auto keep = std::make_shared<detail::held_layout>(counts, std::move(layout));
    const int n = detail::mpi_count(send.size(), st.what());
    return st.post_collective(
        comm,
        [in = send.data(), out = recv.data(), n, keep, c = comm.native()](MPI_Request* r) {
          const auto type = type_of(dtype_of<T>);
          return MPI_Iallgatherv(in, n, type, out, keep->counts.data(), keep->offsets.data(), type, c, r);
        },
        [keep] {});
  }

  // `recv` is exactly this rank's block.
  template <class T>
  static request post_ireduce_scatter(const communicator& comm, start& st, span<const T> send, span<T> recv,
                                      span<const int> counts, detail::blocks, op o, stream) {
    auto keep = std::make_shared<detail::held_layout>(counts, detail::blocks{});
    const MPI_Op mop = detail::mpi_op(o, dtype_of<T>);
    return st.post_collective(
        comm,
        [in = send.data(), out = recv.data(), keep, mop, c = comm.native()](MPI_Request* r) {
          return MPI_Ireduce_scatter(in, out, keep->counts.data(), type_of(dtype_of<T>), mop, c, r);
        },
        [keep, avg = detail::average_epilogue(o, recv, comm.size())] {
          if (avg) avg();
        });
  }
};

}  // namespace flexcomm
