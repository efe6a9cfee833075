// The NCCL backend: device buffers, every operation stream-ordered on a CUDA stream the caller
// picks. The public operations are the front end's (backend/operations.hpp); this header is
// their native half: the record of one operation, the memory-space check, and the NCCL calls.
#pragma once

#include "../cuda/runtime.hpp"

#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <type_traits>
#include <string>
#include <utility>
#include <vector>

#include "../../core/datatype.hpp"
#include "../../core/error.hpp"
#include "../../core/hosts.hpp"
#include "../../core/span.hpp"
#include "../../core/watchdog.hpp"
#include "../contract.hpp"
#include "../cuda/device_backend.hpp"
#include "../cuda/device_buffer.hpp"
#include "../cuda/error.hpp"
#include "../cuda/local_work.hpp"
#include "../mpi.hpp"
#include "../mpi/call_check.hpp"
#include "../operations.hpp"
#include "communicator.hpp"
#include "request.hpp"
#include "state.hpp"
#include "types.hpp"

namespace flexcomm {

namespace detail {
// One operation being issued: recorded in the flight recorder of the bookkeeping kept over the
// control communicator, named for its errors, and its signature kept for the consistency check
// (mpi/batched_check.hpp), which the launch hands to the communicator. Takes no lock: an aborted
// communicator is refused on the flag its abort sets, before anything is recorded. The name is
// written into a buffer of this thread's and handed to the operation's launch record in exchange
// for that record's old one, so that naming allocates nothing once both have room.
class nccl_op_start {
 public:
  nccl_op_start(const nccl_communicator& comm, device::stream_t, const char* name, std::size_t count, dtype type,
                const char* redop, int peer, int tag, const call_detail& detail)
      : state_(state_of(comm, name)), watch_(state_.watch.get()), unwinding_(std::uncaught_exceptions()) {
    if (state_.aborted.load(std::memory_order_acquire)) refuse(comm, name);
    if (watch_ && watch_->poisoned())
      fail(cat("nccl ", name, " on ", comm.name()),
           cat("communicator '", comm.name(), "' is unusable: ", watch_->poison_reason()));
    seq_ = watch_ ? watch_->recorder().enqueue(op_record::posting(name, count, type, redop, peer, tag)) : 0;
    describe_operation_into(*what_, "nccl", name, comm.name(), seq_, count, type, detail);
    signature_.value = {mpi_op_code(name), static_cast<long long>(type), static_cast<long long>(count), -1, -1, 0,
                        check_label::current()};
  }
  nccl_op_start(const nccl_op_start&) = delete;
  nccl_op_start& operator=(const nccl_op_start&) = delete;
  // Never handed over: the operation failed before or in NCCL. Unwinding from the NCCL call itself
  // where the cause is the communicator's (an asynchronous error the enqueue returned, as NCCL's
  // ncclCommEnsureReady does, or a CUDA context poisoned by a kernel that faulted), it is this
  // rank's failure as a wait would find it: the communicator aborted and the peers told.
  ~nccl_op_start() {
    if (!seq_) return;
    state_.finish(seq_, op_state::failed);
    if (std::uncaught_exceptions() <= unwinding_) return;
    try {
      std::lock_guard<flexcomm::mutex> lock(state_.mutex);
      (void)state_.failure_locked(*what_);
    } catch (...) {  // the error being thrown says what happened
    }
  }

  const std::string& what() const noexcept { return *what_; }
  std::uint64_t sequence() const noexcept { return seq_; }

  // Fields every rank must agree on, besides the operation, type and count.
  void agree_on(op o) { signature_.value[mpi_signature::redop] = static_cast<long long>(o); }
  void agree_on_root(int root) { signature_.value[mpi_signature::root] = root; }
  void agree_on_counts(span<const int> counts) {
    signature_.value[mpi_signature::counts_hash] = hash_counts(counts.data(), counts.size());
  }
  void count_varies() { signature_.value[mpi_signature::count] = -1; }
  void check_collective(int comm_size) { checked_ = comm_size > 1 && checks_enabled(); }

  // Called with the state's mutex held, last: the launch record takes over the operation.
  void hand_over(nccl_launch& l) {
    l.sequence = std::exchange(seq_, 0);
    l.what.swap(*what_);
    if (checked_ && l.collective) state_.consistency.add(l.collective, signature_);
  }
  // NCCL's enqueue itself timed out: recorded so; the communicator is aborted.
  void timed_out() noexcept {
    if (seq_) state_.finish(std::exchange(seq_, 0), op_state::timed_out);
  }

 private:
  // This thread's buffer for a name, or one of its own for an operation named while another is;
  // given back however the start ends (a constructor that throws included).
  class name_buffer {
   public:
    name_buffer() : mine_(!in_use()) {
      in_use() = true;
    }
    name_buffer(const name_buffer&) = delete;
    name_buffer& operator=(const name_buffer&) = delete;
    ~name_buffer() {
      if (mine_) in_use() = false;
    }
    std::string& get() noexcept { return mine_ ? shared() : own_; }

   private:
    static std::string& shared() {
      thread_local std::string s;
      return s;
    }
    static bool& in_use() {
      thread_local bool used = false;
      return used;
    }
    bool mine_;
    std::string own_;
  };
  // An empty communicator is an error naming the operation.
  static nccl_state& state_of(const nccl_communicator& comm, const char* name) {
    if (!comm) comm.state(cat("nccl ", name, " on ", comm.name()));
    return *comm.shared_state();
  }
  // The aborted communicator's error, naming the operation (formatted only here).
  [[noreturn]] void refuse(const nccl_communicator& comm, const char* name) {
    std::lock_guard<flexcomm::mutex> lock(state_.mutex);
    state_.require_usable(cat("nccl ", name, " on ", comm.name()));
    fail(cat("nccl ", name, " on ", comm.name()), "the communicator was aborted");
  }

  nccl_state& state_;
  mpi_comm_state* watch_;
  int unwinding_;
  name_buffer name_;
  std::string* what_ = &name_.get();
  std::uint64_t seq_ = 0;
  mpi_signature signature_;
  bool checked_ = false;
};

// NCCL connects a communicator's ranks at its first collective, so on a nonblocking communicator
// a rank missing there leaves the enqueue itself in progress. That is reported as a wait that
// timed out is (nccl_request::timed_out): the ranks that did not arrive, asked over the side
// channel, and the communicator aborted with the job free to go on. Called with the state's
// mutex held.
[[noreturn]] inline void enqueue_timed_out(nccl_state& st, nccl_op_start& start) {
  const auto limit = st.timeout();
  std::string report;
  if (st.watch) {
    st.watch->announce();
    report = cat("\n", st.watch->diagnose(start.sequence(), watchdog::grace(limit)));
  }
  const auto place = st.where();
  const std::string what = start.what();
  start.timed_out();
  st.abort_locked(cat(what, ": its enqueue timed out after ", limit.count(), " ms"));
  fail(what, cat("timed out after ", limit.count(), " ms (FLEXCOMM_TIMEOUT) in NCCL's enqueue, which connects ",
                 "the ranks at a communicator's first collective; ", place,
                 " aborted with ncclCommAbort (a rank did not take part, or the ranks issued operations in ",
                 "different orders)", report));
}

// Issues one collective: deferred point-to-point first (call order is NCCL order), then the
// enqueue, then local epilogue kernels (integer averages), then the completion event. The
// state's mutex is the one lock of the whole post.
template <class Enqueue, class Epilogue>
nccl_request nccl_launch_op(const nccl_communicator& comm, device::stream_t s, nccl_op_start& start, Enqueue&& enqueue,
                            Epilogue&& epilogue) {
  const auto& what = start.what();
  auto& st = comm.state(what);
  device_guard guard(st.device, what);
  std::lock_guard<flexcomm::mutex> lock(st.mutex);
  st.require_usable(what);
  st.flush_locked(what);
  const device::stream_t stream = s ? s : st.stream.get();
  if (enqueue(st.comm, stream) == device::nccl_in_progress && !nccl_settle(st.comm, what, st.timeout()))
    enqueue_timed_out(st, start);
  epilogue(stream);
  nccl_launch& launch = st.take_launch_locked(what);
  launch.done.record(stream, what);
  launch.launched = true;
  launch.collective = ++st.collectives;
  start.hand_over(launch);
  return nccl_request(comm.shared_state(), &launch);
}

inline auto no_epilogue() {
  return [](device::stream_t) {};
}

template <class T>
auto average_on_device(op o, span<T> out, int ranks) {
  return [o, out, ranks](device::stream_t stream) {
    if (needs_divide(o, dtype_of<T>)) cuda::divide(out.data(), out.size(), ranks, stream);
  };
}

// NCCL has no tags: messages between two ranks match in the order they were issued. Sends and
// receives are deferred and launched together, as one NCCL group, when a request of the
// communicator is tested or waited or another operation is issued: a ring's send and receive
// must be in one group or they wait for each other forever.
template <class T>
nccl_request nccl_point_to_point(const nccl_communicator& comm, nccl_op_start& start, bool send, span<T> buf,
                                 int peer, device::stream_t s) {
  const auto& what = start.what();
  auto& st = comm.state(what);
  device_guard guard(st.device, comm.name());  // the event belongs to the communicator's device
  std::lock_guard<flexcomm::mutex> lock(st.mutex);
  st.require_usable(what);
  nccl_launch& launch = st.take_launch_locked(what);
  st.deferred.push_back({send, buf.data(), buf.size(), dtype_of<std::remove_const_t<T>>, peer, s, &launch});
  ++launch.holders;
  start.hand_over(launch);
  return nccl_request(comm.shared_state(), &launch);
}
}  // namespace detail

// Device memory, local work on the stream and the host map of its MPI twin: cuda::device_backend.
struct nccl : cuda::device_backend<mpi>, operations<nccl, nccl_communicator, nccl_request, device::stream_t> {
  // NCCL pairs a send with the peer's receive in the order both were issued, whatever the tags.
  static constexpr bool tag_matched_p2p = false;
  // NCCL's kernels can be captured into a CUDA graph (since NCCL 2.9): an operation issued into
  // a capturing stream is enqueued there, and its request ends with release_captured().
  static constexpr bool graph_capturable = true;
  // gatherv and allgatherv walk the counts while they post: the front end makes no offsets.
  static constexpr bool block_offsets = false;

 private:
  friend struct operations<nccl, nccl_communicator, nccl_request, device::stream_t>;
  template <class T>
  using op_start = detail::nccl_op_start;
  using start = detail::nccl_op_start;

  // NCCL reads and writes through device pointers only: a host pointer is a named error, not a crash.
  // A trainer hands the same buffers over step after step: the last few pointers found on the
  // device are remembered, so that the runtime is asked once per buffer, not twice per operation
  // (a cache of pointer attributes, as MVAPICH2-GDR keeps).
  static void check_buffer(const void* p, std::size_t bytes, const std::string& what, const char* which) {
    if (bytes == 0 || p == nullptr) {
      check(bytes == 0, what, which, " buffer is null");
      return;
    }
    thread_local const void* known[16] = {};
    thread_local unsigned next = 0;
    for (const void* k : known)
      if (k == p) return;
    bool on_device = false;
    check_cuda(device::is_device_memory(p, &on_device), what, ": cudaPointerGetAttributes");
    if (on_device) known[next++ % 16] = p;
    check(on_device, what,
          which, " buffer is host memory; the nccl backend needs device (or managed) buffers");
  }

  template <class T>
  static request post_isend(const communicator& comm, start& st, span<const T> buf, int dest, int, stream s) {
    return detail::nccl_point_to_point(comm, st, true, buf, dest, s);
  }

  template <class T>
  static request post_irecv(const communicator& comm, start& st, span<T> buf, int source, int, stream s) {
    return detail::nccl_point_to_point(comm, st, false, buf, source, s);
  }

  template <class T>
  static request post_ibcast(const communicator& comm, start& st, span<T> buf, int root, stream s) {
    return detail::nccl_launch_op(
        comm, s, st,
        [&](device::nccl_comm_t c, device::stream_t stream) -> device::nccl_result_t {
          if (buf.empty()) return device::nccl_success;
          return checked_nccl(device::nccl_broadcast(buf.data(), buf.data(), buf.size(), dtype_of<T>, root, c, stream),
                     st.what());
        },
        detail::no_epilogue());
  }

  template <class T>
  static request post_iallreduce(const communicator& comm, start& st, span<const T> send, span<T> recv, op o,
                                 stream s) {
    return detail::nccl_launch_op(
        comm, s, st,
        [&](device::nccl_comm_t c, device::stream_t stream) -> device::nccl_result_t {
          if (recv.empty()) return device::nccl_success;
          return checked_nccl(device::nccl_allreduce(send.data(), recv.data(), recv.size(), dtype_of<T>,
                                   detail::nccl_op(o, dtype_of<T>), c, stream),
                     st.what());
        },
        detail::average_on_device(o, recv, comm.size()));
  }

  // `recv` is empty except at the root.
  template <class T>
  static request post_ireduce(const communicator& comm, start& st, span<const T> send, span<T> recv, op o, int root,
                              stream s) {
    const bool at_root = comm.rank() == root;
    return detail::nccl_launch_op(
        comm, s, st,
        [&](device::nccl_comm_t c, device::stream_t stream) -> device::nccl_result_t {
          if (send.empty()) return device::nccl_success;
          return checked_nccl(device::nccl_reduce(send.data(), at_root ? recv.data() : nullptr, send.size(), dtype_of<T>,
                                         detail::nccl_op(o, dtype_of<T>), root, c, stream),
                     st.what());
        },
        detail::average_on_device(o, recv, comm.size()));
  }

  // Point-to-point in one group: the root receives each rank's block in place.
  template <class T>
  static request post_igatherv(const communicator& comm, start& st, span<const T> send, span<T> recv,
                               span<const int> counts, detail::blocks, int root, stream s) {
    constexpr dtype type = dtype_of<T>;
    return detail::nccl_launch_op(
        comm, s, st,
        [&](device::nccl_comm_t c, device::stream_t stream) -> device::nccl_result_t {
          detail::nccl_group group(st.what());
          if (comm.rank() != root) {
            if (!send.empty()) check_nccl(device::nccl_send(send.data(), send.size(), type, root, c, stream), st.what());
          } else {
            T* at = recv.data();
            for (int r = 0; r < comm.size(); at += counts[static_cast<std::size_t>(r)], ++r) {
              const auto n = static_cast<std::size_t>(counts[static_cast<std::size_t>(r)]);
              if (n == 0) continue;
              if (r == root) cuda::copy(at, send.data(), n * sizeof(T), stream);
              else check_nccl(device::nccl_recv(at, n, type, r, c, stream), st.what(), ": receive from ", r);
            }
          }
          return group.end();
        },
        detail::no_epilogue());
  }

  template <class T>
  static request post_iallgather(const communicator& comm, start& st, span<const T> send, span<T> recv, stream s) {
    return detail::nccl_launch_op(
        comm, s, st,
        [&](device::nccl_comm_t c, device::stream_t stream) -> device::nccl_result_t {
          if (send.empty()) return device::nccl_success;
          return checked_nccl(device::nccl_allgather(send.data(), recv.data(), send.size(), dtype_of<T>, c, stream),
                     st.what());
        },
        detail::no_epilogue());
  }

  template <class T>
  static request post_iallgatherv(const communicator& comm, start& st, span<const T> send, span<T> recv,
                                  span<const int> counts, detail::blocks, stream s) {
    constexpr dtype type = dtype_of<T>;
    const int me = comm.rank();
    return detail::nccl_launch_op(
        comm, s, st,
        [&](device::nccl_comm_t c, device::stream_t stream) -> device::nccl_result_t {
          detail::nccl_group group(st.what());
          T* at = recv.data();
          for (int r = 0; r < comm.size(); at += counts[static_cast<std::size_t>(r)], ++r) {
            const auto n = static_cast<std::size_t>(counts[static_cast<std::size_t>(r)]);
            if (r == me) {
              cuda::copy(at, send.data(), n * sizeof(T), stream);
              continue;
            }
            if (!send.empty())
              check_nccl(device::nccl_send(send.data(), send.size(), type, r, c, stream), st.what(), ": send to ", r);
            if (n > 0) check_nccl(device::nccl_recv(at, n, type, r, c, stream), st.what(), ": receive from ", r);
          }
          return group.end();
        },
        detail::no_epilogue());
  }

  // `recv` is exactly this rank's block.
  template <class T>
  static request post_ireduce_scatter(const communicator& comm, start& st, span<const T> send, span<T> recv,
                                      span<const int> counts, detail::blocks, op o, stream s) {
    bool even = true;
    for (const int count : counts) even = even && count == counts[0];
    constexpr dtype type = dtype_of<T>;
    const auto reduction = detail::nccl_op(o, dtype_of<T>);
    return detail::nccl_launch_op(
        comm, s, st,
        [&](device::nccl_comm_t c, device::stream_t stream) -> device::nccl_result_t {
          if (even) {
            if (recv.empty()) return device::nccl_success;
            return checked_nccl(device::nccl_reduce_scatter(send.data(), recv.data(), recv.size(), type, reduction, c, stream),
                                st.what());
          }
          // Uneven blocks: one reduce per block, to the rank that owns it, in one group.
          detail::nccl_group group(st.what());
          std::size_t offset = 0;
          for (int r = 0; r < comm.size(); ++r) {
            const auto n = static_cast<std::size_t>(counts[static_cast<std::size_t>(r)]);
            offset += n;
            if (n == 0) continue;
            check_nccl(device::nccl_reduce(send.data() + offset - n, r == comm.rank() ? recv.data() : nullptr, n, type,
                                           reduction, r, c, stream),
                       st.what(), ": block of rank ", r);
          }
          return group.end();
        },
        detail::average_on_device(o, recv, comm.size()));
  }
};

}  // namespace flexcomm
