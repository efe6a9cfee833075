// The staged backend: device buffers carried over MPI through pinned host memory, for clusters
// whose MPI is not CUDA-aware; `cuda_aware_mpi` hands device pointers to an MPI that is. The
// public operations are the front end's (backend/operations.hpp); this header is their native
// half: each operation cut into chunks, staged, sent as MPI operations, and brought back.
#pragma once

#include "../cuda/runtime.hpp"
#include <mpi.h>

#include <algorithm>
#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>

#include "../../core/datatype.hpp"
#include "../../core/error.hpp"
#include "../../core/hosts.hpp"
#include "../../core/span.hpp"
#include "../contract.hpp"
#include "../cuda/device_backend.hpp"
#include "../cuda/capture.hpp"
#include "../cuda/device_buffer.hpp"
#include "../cuda/error.hpp"
#include "../cuda/local_work.hpp"
#include "../cuda/pinned_pool.hpp"
#include "../mpi.hpp"
#include "../operations.hpp"
#include "communicator.hpp"
#include "lane.hpp"
#include "request.hpp"

namespace flexcomm {

namespace detail {
// Builds one staged operation: its chunks, its pinned buffers, its copies to the host.
template <bool Direct, class T>
class staged_builder : public unchecked_calls {
 public:
  // The type, op, peer and tag are recorded by the MPI operations of each chunk.
  staged_builder(const staged_communicator<Direct>& comm, device::stream_t s, const char* name, std::size_t count, dtype,
                 const char*, int, int, const call_detail& extra)
      : comm_(comm),
        lane_(lane_of(comm, name)),
        guard_(lane_.device, comm.name()) {
    op_ = std::make_shared<staged_op>();
    op_->what = describe_operation(Direct ? "cuda_aware_mpi" : "staged", name, comm.name(),
                                   mutable_comm(comm.transport()).next_sequence(), count, dtype_of<T>, extra);
    stream_ = s ? s : lane_.own.get();
    // Its chunks go through MPI, called on the host when each copy lands: a graph replays kernels
    // and copies only. A caller's capturing stream is refused before anything is posted.
    if (s)
      cuda::refuse_capture(s, op_->what,
                           "its chunks travel by MPI, called from the host as each copy lands, which a replay of "
                           "the graph never does; capture steps on nccl");
  }

  const std::string& what() const { return op_->what; }
  device::stream_t stream() const { return stream_; }

  // Elements per chunk: FLEXCOMM_STAGE_CHUNK's worth when split, else the whole buffer.
  void chunks(std::size_t n, bool split) {
    const std::size_t per = split ? lane_.chunk_elements<T>() : (n ? n : 1);
    const std::size_t pieces = n == 0 ? 1 : (n + per - 1) / per;
    op_->chunks.resize(pieces);
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
  T* host(std::size_t n) {
    op_->pieces.push_back(cuda::pinned_pool::instance().take_piece(std::max<std::size_t>(n, 1) * sizeof(T), op_->what));
    return reinterpret_cast<T*>(op_->pieces.back().get());
  }

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
    op_->issued = lane_.events.take(op_->what);
    op_->issued.record(stream_, op_->what);
    op_->start = std::move(start);
    device::event_t issued = op_->issued.get();
    const std::string what = op_->what;
    op_->finish = [finish = std::move(finish), issued, what](staged_chunk& c, device::stream_t back) {
      check_cuda(device::stream_wait(back, issued), what, ": cudaStreamWaitEvent");
      return finish(c, back);
    };
    auto shared = comm_.shared_lane();
    {
      std::lock_guard<flexcomm::mutex> lock(lane_.mutex);
      lane_.post_locked(op_, stream_);  // chunks go as far as they can now
    }
    return staged_request<Direct>(shared, op_);
  }

 private:
  void mark(staged_chunk& c) {
    c.staged = lane_.events.take(op_->what);
    c.staged.record(stream_, op_->what);
  }

  // The communicator's lane; an empty communicator is an error naming the operation (formatted
  // only then: a name made for every operation would cost more than the rest of the call).
  static staged_lane& lane_of(const staged_communicator<Direct>& comm, const char* name) {
    if (!comm) comm.lane(cat(Direct ? "cuda_aware_mpi " : "staged ", name, " on ", comm.name()));
    return *comm.shared_lane();
  }

  const staged_communicator<Direct>& comm_;
  staged_lane& lane_;
  cuda::device_guard guard_;  // events and copies belong to the communicator's device
  std::shared_ptr<staged_op> op_;
  device::stream_t stream_ = nullptr;
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
// staged, MPI averaged on the host and the chunk is copied back. True when work was queued.
template <bool Direct, class T>
bool finish_reduced(T* device, op o, int ranks, const staged_chunk& c, device::stream_t back) {
  if constexpr (direct_reduction<Direct, T>) {
    if (o != op::avg || c.count == 0) return false;
    cuda::divide(device + c.offset, c.count, ranks, back);
    return true;
  } else {
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
    const auto n = buf.size();
    return b.launch(
        [t = &comm.transport(), from, n, dest, tag](detail::staged_chunk&) {
          return mpi::isend(*t, span<const T>(from, n), dest, tag);
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
    const auto n = buf.size();
    return b.launch(
        [t = &comm.transport(), into, n, source, tag](detail::staged_chunk&) {
          return mpi::irecv(*t, span<T>(into, n), source, tag);
        },
        [into, device](detail::staged_chunk& c, device::stream_t back) {
          return !Direct && detail::bring_back(into, device, c, back);
        });
  }

  template <class T>
  static request post_ibcast(const communicator& comm, op_start<T>& b, span<T> buf, int root, stream) {
    const bool at_root = comm.rank() == root;
    b.chunks(buf.size(), !Direct);
    T* device = buf.data();
    if constexpr (!Direct)
      b.through_blocks(at_root ? device : nullptr);
    else
      b.mark_all();
    return b.launch(
        [t = &comm.transport(), device, root](detail::staged_chunk& c) {
          return mpi::ibcast(*t, span<T>(detail::on_wire<!Direct>(c, device), c.count), root);
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
    const T* from = send.data();
    T* device = recv.data();
    if constexpr (!direct)
      b.through_blocks(from);
    else
      b.mark_all();
    const int ranks = comm.size();
    // Direct: MPI sums on the device, a kernel averages; staged: MPI averages on the host, in place.
    const op on_wire = direct && o == op::avg ? op::sum : o;
    return b.launch(
        [t = &comm.transport(), from, device, on_wire](detail::staged_chunk& c) {
          T* wire = detail::on_wire<!direct>(c, device);
          const T* source = direct ? from + c.offset : wire;
          return mpi::iallreduce<T>(*t, span<const T>(source, c.count), span<T>(wire, c.count), on_wire);
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
    const T* from = send.data();
    T* device = recv.data();
    if constexpr (!direct)
      b.through_blocks(from);
    else
      b.mark_all();
    const int ranks = comm.size();
    const op on_wire = direct && o == op::avg ? op::sum : o;
    return b.launch(
        [t = &comm.transport(), from, device, on_wire, root, at_root](detail::staged_chunk& c) {
          T* wire = detail::on_wire<!direct>(c, device);  // staged: sent from, and in place at the root
          const T* source = direct ? from + c.offset : wire;
          return mpi::ireduce<T>(*t, span<const T>(source, c.count), at_root ? span<T>(wire, c.count) : span<T>(),
                                 on_wire, root);
        },
        [device, o, ranks, at_root](detail::staged_chunk& c, device::stream_t back) {
          return at_root && detail::finish_reduced<Direct, T>(device, o, ranks, c, back);
        });
  }

  template <class T>
  static request post_igatherv(const communicator& comm, op_start<T>& b, span<const T> send, span<T> recv,
                               span<const int> counts, detail::blocks layout, int root, stream) {
    b.chunks(send.size(), false);
    T* device = recv.data();
    const std::size_t n = send.size(), received = layout.total;  // zero except at the root
    const auto buffers = b.gather_buffers(send.data(), n, device, received);
    const T* from = buffers.first;
    T* into = buffers.second;
    return b.launch(
        [t = &comm.transport(), from, n, into, received, counts, root](detail::staged_chunk&) {
          return mpi::igatherv<T>(*t, span<const T>(from, n), span<T>(into, received), counts, root);
        },
        [into, device, received](detail::staged_chunk&, device::stream_t back) {
          return detail::copy_gathered_back<Direct>(into, device, received, back);
        });
  }

  template <class T>
  static request post_iallgather(const communicator& comm, op_start<T>& b, span<const T> send, span<T> recv, stream) {
    return post_gathered(comm, b, send, recv, recv.size(), [](auto* t, auto from, auto into) {
      return mpi::iallgather<T>(*t, from, into);
    });
  }

  template <class T>
  static request post_iallgatherv(const communicator& comm, op_start<T>& b, span<const T> send, span<T> recv,
                                  span<const int> counts, detail::blocks layout, stream) {
    return post_gathered(comm, b, send, recv, layout.total, [counts](auto* t, auto from, auto into) {
      return mpi::iallgatherv<T>(*t, from, into, counts);
    });
  }

  // `recv` is exactly this rank's block.
  template <class T>
  static request post_ireduce_scatter(const communicator& comm, op_start<T>& b, span<const T> send, span<T> recv,
                                      span<const int> counts, detail::blocks, op o, stream) {
    constexpr bool direct = detail::direct_reduction<Direct, T>;
    const std::size_t mine = recv.size();
    b.chunks(send.size(), false);
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
    const std::size_t n = send.size();
    const int ranks = comm.size();
    const op on_wire = direct && o == op::avg ? op::sum : o;
    return b.launch(
        [t = &comm.transport(), from, n, into, mine, counts, on_wire](detail::staged_chunk&) {
          return mpi::ireduce_scatter<T>(*t, span<const T>(from, n), span<T>(into, mine), counts, on_wire);
        },
        [into, device, mine, o, ranks](detail::staged_chunk&, device::stream_t back) {
          if (mine == 0) return false;
          if constexpr (direct) {
            if (o != op::avg) return false;
            cuda::divide(device, mine, ranks, back);
          } else {
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
    const std::size_t n = send.size();
    const auto buffers = b.gather_buffers(send.data(), n, device, total);
    const T* from = buffers.first;
    T* into = buffers.second;
    return b.launch(
        [t = &comm.transport(), from, n, into, total, gather](detail::staged_chunk&) {
          return gather(t, span<const T>(from, n), span<T>(into, total));
        },
        [into, device, total](detail::staged_chunk&, device::stream_t back) {
          return detail::copy_gathered_back<Direct>(into, device, total, back);
        });
  }
};

using staged = basic_staged<false>;
using cuda_aware_mpi = basic_staged<true>;

}  // namespace flexcomm
