// The staged backend: device buffers carried over MPI through pinned host memory, for clusters
// whose MPI is not CUDA-aware; `cuda_aware_mpi` hands device pointers to an MPI that is. The
// public operations are the front end's (backend/operations.hpp); this header is their native
// half: each operation cut into chunks, staged, sent as MPI operations, and brought back.
#pragma once

#include "../cuda/runtime.hpp"
#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../../core/datatype.hpp"
#include "../../core/error.hpp"
#include "../../core/hosts.hpp"
#include "../../core/reduce.hpp"
#include "../../core/span.hpp"
#include "../../core/watchdog.hpp"
#include "../contract.hpp"
#include "../cuda/device_backend.hpp"
#include "../cuda/capture.hpp"
#include "../cuda/device_buffer.hpp"
#include "../cuda/error.hpp"
#include "../cuda/local_work.hpp"
#include "../cuda/pinned_pool.hpp"
#include "../mpi.hpp"
#include "../mpi/types.hpp"
#include "../mpi/watchdog.hpp"
#include "../operations.hpp"
#include "communicator.hpp"
#include "lane.hpp"
#include "request.hpp"

namespace flexcomm {

namespace detail {
// Builds one staged operation: its chunks, its pinned buffers, its copies to the host. It holds
// its communicator's lock from the start of the post to its end, the one lock a post takes (but
// the pinned pool's, for a chunk that finds no block its communicator kept, or for a new piece),
// and builds on an operation the lane kept (staged_lane::spare), named in place. The operation,
// not each chunk, is recorded in the transport's flight recorder and checked (one signature, in
// the lane's batched check).
template <bool Direct, class T>
class staged_builder {
 public:
  staged_builder(const staged_communicator<Direct>& comm, device::stream_t s, const char* name, std::size_t count,
                 dtype type, const char* redop, int peer, int tag, const call_detail& extra)
      : comm_(comm),
        lane_(lane_of(comm, name)),
        lock_(lane_.mutex),
        guard_(lane_.device, comm.name()),
        op_(lane_.take_locked()) {
    auto* watch = lane_.watch;
    if (watch && watch->poisoned())
      fail(cat(Direct ? "cuda_aware_mpi " : "staged ", name, " on ", comm.name()),
           cat("communicator '", comm.name(), "' is unusable: ", watch->poison_reason()));
    op_->sequence = watch ? watch->recorder().enqueue(op_record::posting(name, count, type, redop, peer, tag)) : 0;
    describe_operation_into(op_->what, Direct ? "cuda_aware_mpi" : "staged", name, comm.name(),
                            watch ? op_->sequence : mutable_comm(comm.transport()).next_sequence(), count, type, extra);
    signature_.value = {mpi_op_code(name), static_cast<long long>(type), static_cast<long long>(count), -1, -1, 0,
                        check_label::current()};
    stream_ = s ? s : lane_.own.get();
    // Its chunks go through MPI, called on the host when each copy lands: a graph replays kernels
    // and copies only. A caller's capturing stream is refused before anything is posted.
    try {
      if (s)
        cuda::refuse_capture(s, op_->what,
                             "its chunks travel by MPI, called from the host as each copy lands, which a replay of "
                             "the graph never does; capture steps on nccl");
    } catch (...) {
      lane_.finish_record(*op_, op_state::failed);
      throw;
    }
  }
  staged_builder(const staged_builder&) = delete;
  staged_builder& operator=(const staged_builder&) = delete;
  // Never launched: the post failed before its chunks were handed to the lane.
  ~staged_builder() {
    if (op_) lane_.finish_record(*op_, op_state::failed);
  }

  // Fields every rank must agree on, besides the operation, type and count.
  void agree_on(op o) { signature_.value[mpi_signature::redop] = static_cast<long long>(o); }
  void agree_on_root(int root) { signature_.value[mpi_signature::root] = root; }
  void agree_on_counts(span<const int> counts) {
    signature_.value[mpi_signature::counts_hash] = hash_counts(counts.data(), counts.size());
  }
  void count_varies() { signature_.value[mpi_signature::count] = -1; }
  void check_collective(int comm_size) { checked_ = comm_size > 1 && checks_enabled(); }

  // `n` as MPI counts it (an int), or an error naming the operation (formatted only then).
  int mpi_count_of(std::size_t n) const {
    return n <= static_cast<std::size_t>(INT_MAX) ? static_cast<int>(n) : mpi_count(n, op_->what);
  }

  // A v-collective's counts and offsets, held by the operation: MPI may read them when a chunk
  // begins, after the call has returned.
  std::pair<const int*, const int*> hold_layout(span<const int> counts, const std::vector<int>& offsets) {
    op_->counts.assign(counts.begin(), counts.end());
    op_->offsets.assign(offsets.begin(), offsets.end());
    return {op_->counts.data(), op_->offsets.empty() ? nullptr : op_->offsets.data()};
  }

  const std::string& what() const { return op_->what; }
  device::stream_t stream() const { return stream_; }

  // Elements per chunk: FLEXCOMM_STAGE_CHUNK's worth when split, else the whole buffer.
  void chunks(std::size_t n, bool split) {
    const std::size_t per = split ? lane_.chunk_elements<T>() : (n ? n : 1);
    const std::size_t pieces = n == 0 ? 1 : (n + per - 1) / per;
    op_->reuse(pieces);
    for (std::size_t i = 0; i < pieces; ++i) {
      op_->chunks[i].offset = i * per;
      op_->chunks[i].count = std::min(per, n - std::min(n, i * per));
    }
  }

  // Split operations on the host: each chunk moves through a block of the pinned pool (the lane
  // takes them in call order as they come back), `from`'s slice copied there first (null: nothing
  // to copy, the chunk receives).
  void through_blocks(const T* from) {
    op_->through_blocks = true;
    op_->from = reinterpret_cast<const std::byte*>(from);
    op_->element_bytes = sizeof(T);
  }

  // A host copy of a whole buffer, for an operation that moves as one piece.
  T* host(std::size_t n) { return reinterpret_cast<T*>(op_->piece(n * sizeof(T))); }

  // Each chunk's slice of `device` is copied to `host` on the caller's stream, marked by an event.
  void stage(T* host_buf, const T* device) {
    for (auto& c : op_->chunks) {
      if (c.count) cuda::copy(host_buf + c.offset, device + c.offset, c.count * sizeof(T), stream_);
      mark(c);
    }
  }
  // MPI reads and writes device memory itself: each chunk waits for the caller's stream.
  void mark_all() {
    for (auto& c : op_->chunks) mark(c);
  }

  // Gathers move whole buffers: staged, the send is copied to pinned host memory and the
  // `received` elements land in another host buffer; direct, MPI uses the device buffers.
  // Returns {where MPI sends from, where it receives into}.
  std::pair<const T*, T*> gather_buffers(const T* send, std::size_t n, T* device, std::size_t received) {
    if constexpr (!Direct) {
      T* h = host(n);
      stage(h, send);
      return {h, received ? host(received) : nullptr};
    } else {
      mark_all();
      return {send, device};
    }
  }

  template <class Start, class Finish>
  staged_request<Direct> launch(Start start, Finish finish) {
    if (!op_->issued) op_->issued = cuda::event::create(op_->what);
    op_->issued.record(stream_, op_->what);
    op_->start.set(start);
    op_->finish.set(finish);
    if (checked_) check_locked();
    lane_.post_locked(op_, stream_);  // chunks go as far as they can now
    return staged_request<Direct>(comm_.shared_lane(), std::move(op_));
  }

 private:
  void mark(staged_chunk& c) { c.mark_staged(stream_, op_->what); }

  // The call's signature: in the lane's batch, or, on Open MPI, in a check its chunks wait for.
  void check_locked() {
    if constexpr (mpi_implementation::defers_collectives) {
      if (lane_.watch && lane_.watch->side() != MPI_COMM_NULL) {
        op_->gate.mine = signature_;
        op_->gated = op_->gate.post(lane_.watch->side());
        return;
      }
    }
    lane_.consistency.add(++lane_.collectives, signature_);
  }

  // The communicator's lane; an empty communicator is an error naming the operation (formatted
  // only then: a name made for every operation would cost more than the rest of the call).
  static staged_lane& lane_of(const staged_communicator<Direct>& comm, const char* name) {
    if (!comm) comm.lane(cat(Direct ? "cuda_aware_mpi " : "staged ", name, " on ", comm.name()));
    return *comm.shared_lane();
  }

  const staged_communicator<Direct>& comm_;
  staged_lane& lane_;
  std::lock_guard<flexcomm::mutex> lock_;
  cuda::device_guard guard_;  // events and copies belong to the communicator's device
  std::shared_ptr<staged_op> op_;
  device::stream_t stream_ = nullptr;
  mpi_signature signature_;
  bool checked_ = false;
};

// Where a chunk's elements are on the wire: its pinned block when staged, `device` when direct.
template <bool Staged, class T>
T* on_wire(const staged_chunk& c, T* device) {
  if constexpr (Staged)
    return c.host<T>();
  else
    return device + c.offset;
}

// Copies a chunk's result from its block back to the device; true when queued.
template <class T>
bool bring_back(const staged_chunk& c, T* device, device::stream_t back) {
  if (c.count == 0) return false;
  cuda::copy(device + c.offset, c.host<T>(), c.count * sizeof(T), back);
  return true;
}

// A whole-buffer operation's result from its host copy to the device; true when queued.
template <class T>
bool bring_back(const T* from, T* to, const staged_chunk& c, device::stream_t back) {
  if (c.count == 0) return false;
  cuda::copy(to + c.offset, from + c.offset, c.count * sizeof(T), back);
  return true;
}

// A gather's elements from the host buffer to the device (staged only); true when queued.
template <bool Direct, class T>
bool copy_gathered_back(const T* into, T* device, std::size_t n, device::stream_t back) {
  if (Direct || n == 0) return false;
  cuda::copy(device, into, n * sizeof(T), back);
  return true;
}

// Floating reductions use flexcomm's host operators inside MPI (mpi/types.hpp): never direct.
template <bool Direct, class T>
constexpr bool direct_reduction = Direct && std::is_integral_v<T>;

// After a reduced chunk arrived: direct, MPI summed on the device and a kernel averages;
// staged, MPI summed on the host, which averages, and the chunk is copied back. True when work was queued.
template <bool Direct, class T>
bool finish_reduced(T* device, op o, int ranks, const staged_chunk& c, device::stream_t back) {
  if constexpr (direct_reduction<Direct, T>) {
    if (o != op::avg || c.count == 0) return false;
    cuda::divide(device + c.offset, c.count, ranks, back);
    return true;
  } else {
    if (o == op::avg && c.count) divide_by(c.host<T>(), c.count, ranks);
    return bring_back(c, device, back);
  }
}
}  // namespace detail

// Direct = false: staged through pinned host buffers. A transfer is cut into chunks of
// FLEXCOMM_STAGE_CHUNK bytes (default 1 MiB; the same on every rank), each through a block of the
// pinned pool (cuda/pinned_pool.hpp, FLEXCOMM_PINNED_BYTES): the device-to-host copy of chunk i+1
// runs while chunk i is on the wire, and chunk i comes back while i+1 travels.
// Direct = true: device pointers go to MPI as they are (reductions of 16-bit floats, which MPI
// does with flexcomm's host operators, still go through host memory).
// Device memory, local work on the stream and the host map of its MPI twin: cuda::device_backend.
template <bool Direct>
struct basic_staged : cuda::device_backend<mpi>,
                      operations<basic_staged<Direct>, staged_communicator<Direct>, staged_request<Direct>,
                                 device::stream_t> {
  using front = operations<basic_staged<Direct>, staged_communicator<Direct>, staged_request<Direct>, device::stream_t>;
  using typename front::communicator;
  using typename front::request;
  using typename front::stream;

  static constexpr bool tag_matched_p2p = true;  // MPI's matching, on the staged copies

 private:
  friend front;
  template <class T>
  using op_start = detail::staged_builder<Direct, T>;

  // The buffers are read and written by cudaMemcpyAsync (or a CUDA-aware MPI), which report a
  // bad pointer through the operation's own error.
  static void check_buffer(const void*, std::size_t, const std::string&, const char*) noexcept {}

  // The chunks' MPI calls, made on the transport as the lane begins each chunk.
  static MPI_Datatype type_of(dtype t) { return detail::mpi_type(t); }
  static const void* or_in_place(const void* send, const void* recv) { return send == recv ? MPI_IN_PLACE : send; }

  template <class T>
  static request post_isend(const communicator& comm, op_start<T>& b, span<const T> buf, int dest, int tag, stream) {
    b.chunks(buf.size(), false);
    const T* from = buf.data();
    if constexpr (!Direct) {
      T* h = b.host(buf.size());
      b.stage(h, buf.data());
      from = h;
    } else {
      b.mark_all();
    }
    const int n = b.mpi_count_of(buf.size());
    return b.launch(
        [c = comm.native(), from, n, dest, tag](detail::staged_chunk&, MPI_Request* r) {
          return MPI_Isend(from, n, type_of(dtype_of<T>), dest, tag, c, r);
        },
        [](detail::staged_chunk&, device::stream_t) { return false; });
  }

  template <class T>
  static request post_irecv(const communicator& comm, op_start<T>& b, span<T> buf, int source, int tag, stream) {
    b.chunks(buf.size(), false);
    T* device = buf.data();
    T* into = device;
    if constexpr (!Direct) {
      // The host copy starts as the device buffer, so a shorter message leaves the rest unchanged.
      into = b.host(buf.size());
      b.stage(into, device);
    } else {
      b.mark_all();
    }
    const int n = b.mpi_count_of(buf.size());
    return b.launch(
        [c = comm.native(), into, n, source, tag](detail::staged_chunk&, MPI_Request* r) {
          return MPI_Irecv(into, n, type_of(dtype_of<T>), source, tag, c, r);
        },
        [into, device](detail::staged_chunk& c, device::stream_t back) {
          return !Direct && detail::bring_back(into, device, c, back);
        });
  }

  template <class T>
  static request post_ibcast(const communicator& comm, op_start<T>& b, span<T> buf, int root, stream) {
    const bool at_root = comm.rank() == root;
    b.chunks(buf.size(), !Direct);
    b.mpi_count_of(buf.size());  // chunks are no larger
    T* device = buf.data();
    if constexpr (!Direct)
      b.through_blocks(at_root ? device : nullptr);
    else
      b.mark_all();
    return b.launch(
        [c = comm.native(), device, root](detail::staged_chunk& k, MPI_Request* r) {
          return MPI_Ibcast(detail::on_wire<!Direct>(k, device), static_cast<int>(k.count), type_of(dtype_of<T>), root,
                            c, r);
        },
        [device, at_root](detail::staged_chunk& c, device::stream_t back) {
          return !Direct && !at_root && detail::bring_back(c, device, back);
        });
  }

  template <class T>
  static request post_iallreduce(const communicator& comm, op_start<T>& b, span<const T> send, span<T> recv, op o,
                                 stream) {
    constexpr bool direct = detail::direct_reduction<Direct, T>;
    b.chunks(recv.size(), !direct);
    b.mpi_count_of(recv.size());
    const T* from = send.data();
    T* device = recv.data();
    if constexpr (!direct)
      b.through_blocks(from);
    else
      b.mark_all();
    const int ranks = comm.size();
    // avg is a sum on the wire: direct, a kernel divides on the device; staged, the host divides the
    // chunk's block before it goes back.
    const MPI_Op mop = detail::mpi_op(o, dtype_of<T>);
    return b.launch(
        [c = comm.native(), from, device, mop](detail::staged_chunk& k, MPI_Request* r) {
          T* wire = detail::on_wire<!direct>(k, device);
          const T* source = direct ? from + k.offset : wire;
          return MPI_Iallreduce(or_in_place(source, wire), wire, static_cast<int>(k.count), type_of(dtype_of<T>), mop,
                                c, r);
        },
        [device, o, ranks](detail::staged_chunk& c, device::stream_t back) {
          return detail::finish_reduced<Direct, T>(device, o, ranks, c, back);
        });
  }

  // `recv` is empty except at the root.
  template <class T>
  static request post_ireduce(const communicator& comm, op_start<T>& b, span<const T> send, span<T> recv, op o,
                              int root, stream) {
    const bool at_root = comm.rank() == root;
    constexpr bool direct = detail::direct_reduction<Direct, T>;
    b.chunks(send.size(), !direct);
    b.mpi_count_of(send.size());
    const T* from = send.data();
    T* device = recv.data();
    if constexpr (!direct)
      b.through_blocks(from);
    else
      b.mark_all();
    const int ranks = comm.size();
    const MPI_Op mop = detail::mpi_op(o, dtype_of<T>);
    return b.launch(
        [c = comm.native(), from, device, mop, root, at_root](detail::staged_chunk& k, MPI_Request* r) {
          T* wire = detail::on_wire<!direct>(k, device);  // staged: sent from, and in place at the root
          const T* source = direct ? from + k.offset : wire;
          return MPI_Ireduce(at_root ? or_in_place(source, wire) : source, at_root ? wire : nullptr,
                             static_cast<int>(k.count), type_of(dtype_of<T>), mop, root, c, r);
        },
        [device, o, ranks, at_root](detail::staged_chunk& c, device::stream_t back) {
          return at_root && detail::finish_reduced<Direct, T>(device, o, ranks, c, back);
        });
  }

  template <class T>
  static request post_igatherv(const communicator& comm, op_start<T>& b, span<const T> send, span<T> recv,
                               span<const int> counts, detail::blocks layout, int root, stream) {
    const bool at_root = comm.rank() == root;
    b.chunks(send.size(), false);
    T* device = recv.data();
    const std::size_t received = layout.total;  // zero except at the root
    const int n = b.mpi_count_of(send.size());
    const auto buffers = b.gather_buffers(send.data(), send.size(), device, received);
    const T* from = buffers.first;
    T* into = buffers.second;
    const auto held = b.hold_layout(counts, layout.offsets);
    const int* per_rank = at_root ? held.first : nullptr;
    const int* at = held.second;
    return b.launch(
        [c = comm.native(), from, n, into, per_rank, at, root](detail::staged_chunk&, MPI_Request* r) {
          const auto type = type_of(dtype_of<T>);
          return MPI_Igatherv(from, n, type, into, per_rank, at, type, root, c, r);
        },
        [into, device, received](detail::staged_chunk&, device::stream_t back) {
          return detail::copy_gathered_back<Direct>(into, device, received, back);
        });
  }

  template <class T>
  static request post_iallgather(const communicator& comm, op_start<T>& b, span<const T> send, span<T> recv, stream) {
    const int n = b.mpi_count_of(send.size());
    return post_gathered(comm, b, send, recv, recv.size(), [n](MPI_Comm c, const T* from, T* into, MPI_Request* r) {
      const auto type = type_of(dtype_of<T>);
      return MPI_Iallgather(from, n, type, into, n, type, c, r);
    });
  }

  template <class T>
  static request post_iallgatherv(const communicator& comm, op_start<T>& b, span<const T> send, span<T> recv,
                                  span<const int> counts, detail::blocks layout, stream) {
    const int n = b.mpi_count_of(send.size());
    const auto held = b.hold_layout(counts, layout.offsets);
    return post_gathered(comm, b, send, recv, layout.total,
                         [n, held](MPI_Comm c, const T* from, T* into, MPI_Request* r) {
                           const auto type = type_of(dtype_of<T>);
                           return MPI_Iallgatherv(from, n, type, into, held.first, held.second, type, c, r);
                         });
  }

  // `recv` is exactly this rank's block.
  template <class T>
  static request post_ireduce_scatter(const communicator& comm, op_start<T>& b, span<const T> send, span<T> recv,
                                      span<const int> counts, detail::blocks, op o, stream) {
    constexpr bool direct = detail::direct_reduction<Direct, T>;
    const std::size_t mine = recv.size();
    b.chunks(send.size(), false);
    b.mpi_count_of(send.size());
    const T* from = send.data();
    T* device = recv.data();
    T* into = device;
    if constexpr (!direct) {
      T* h = b.host(send.size());
      b.stage(h, from);
      from = h;
      into = b.host(mine);
    } else {
      b.mark_all();
    }
    const int ranks = comm.size();
    const int* per_rank = b.hold_layout(counts, {}).first;
    const MPI_Op mop = detail::mpi_op(o, dtype_of<T>);
    return b.launch(
        [c = comm.native(), from, into, per_rank, mop](detail::staged_chunk&, MPI_Request* r) {
          return MPI_Ireduce_scatter(from, into, per_rank, type_of(dtype_of<T>), mop, c, r);
        },
        [into, device, mine, o, ranks](detail::staged_chunk&, device::stream_t back) {
          if (mine == 0) return false;
          if constexpr (direct) {
            if (o != op::avg) return false;
            cuda::divide(device, mine, ranks, back);
          } else {
            if (o == op::avg) divide_by(into, mine, ranks);
            cuda::copy(device, into, mine * sizeof(T), back);
          }
          return true;
        });
  }

  // allgather and allgatherv: the whole send buffer, one chunk, `total` elements back.
  template <class T, class Gather>
  static request post_gathered(const communicator& comm, op_start<T>& b, span<const T> send, span<T> recv,
                               std::size_t total, Gather gather) {
    b.chunks(send.size(), false);
    T* device = recv.data();
    const auto buffers = b.gather_buffers(send.data(), send.size(), device, total);
    const T* from = buffers.first;
    T* into = buffers.second;
    return b.launch(
        [c = comm.native(), from, into, gather](detail::staged_chunk&, MPI_Request* r) mutable {
          return gather(c, from, into, r);
        },
        [into, device, total](detail::staged_chunk&, device::stream_t back) {
          return detail::copy_gathered_back<Direct>(into, device, total, back);
        });
  }
};

using staged = basic_staged<false>;
using cuda_aware_mpi = basic_staged<true>;

}  // namespace flexcomm
