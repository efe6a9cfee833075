// The staged backend: device buffers carried over MPI through pinned host memory, for clusters
// whose MPI is not CUDA-aware; `cuda_aware_mpi` hands device pointers to an MPI that is.
#pragma once

#include <cuda_runtime.h>
#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../core/datatype.hpp"
#include "../core/error.hpp"
#include "../core/settings.hpp"
#include "../core/reduce.hpp"
#include "../core/span.hpp"
#include "../core/wait.hpp"
#include "cuda/device_buffer.hpp"
#include "cuda/error.hpp"
#include "cuda/reduce_kernels.cuh"
#include "arguments.hpp"
#include "mpi.hpp"

namespace flexcomm {

// Whether this MPI library reads and writes device memory (asked of MPICH or Open MPI).
inline bool mpi_is_cuda_aware() {
#if defined(MPIX_GPU_SUPPORT_CUDA)
  int supported = 0;
  return MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &supported) == MPI_SUCCESS && supported != 0;
#elif defined(MPIX_CUDA_AWARE_SUPPORT) && MPIX_CUDA_AWARE_SUPPORT
  return MPIX_Query_cuda_support() == 1;
#else
  return false;
#endif
}

// Direct = false: staged through pinned host buffers. A transfer is cut into chunks of
// FLEXCOMM_STAGE_CHUNK bytes (default 1 MiB; the same on every rank): the device-to-host copy of
// chunk i+1 runs while chunk i is on the wire, and chunk i comes back while i+1 travels.
// Direct = true: device pointers go to MPI as they are (reductions of 16-bit floats, which MPI
// does with flexcomm's host operators, still go through host memory).
// Completion is on the host: once test() says true, the result is on the device.
template <bool Direct>
struct basic_staged : cuda::device_work {
  static constexpr memory_space memory = memory_space::device;
  static constexpr bool tag_matched_p2p = true;  // MPI's matching, on the staged copies
  using host_backend = mpi;
  // nullptr (the default) means the communicator's own stream, ordered with the legacy default
  // stream; the data an operation reads is taken after the work already queued on that stream.
  using stream = cudaStream_t;
  // An adapter's own scratch space, in device memory like every buffer of this backend.
  template <class T>
  using buffer = cuda::device_buffer<T>;
  class communicator;
  class request;

  template <class T>
  static request isend(const communicator& comm, span<T> buf, int dest, int tag, stream s = nullptr);
  template <class T>
  static request irecv(const communicator& comm, span<T> buf, int source, int tag, stream s = nullptr);
  template <class T>
  static request ibcast(const communicator& comm, span<T> buf, int root, stream s = nullptr);
  template <class T>
  static request iallreduce(const communicator& comm, span<const detail::identity_t<T>> send, span<T> recv,
                            op o, stream s = nullptr);
  template <class T>
  static request iallreduce(const communicator& comm, span<T> buf, op o, stream s = nullptr) {
    return iallreduce<T>(comm, span<const T>(buf), buf, o, s);
  }
  template <class T>
  static request ireduce(const communicator& comm, span<const detail::identity_t<T>> send, span<T> recv,
                         op o, int root, stream s = nullptr);
  template <class T>
  static request igatherv(const communicator& comm, span<const detail::identity_t<T>> send, span<T> recv,
                          span<const int> counts, int root, stream s = nullptr);
  template <class T>
  static request iallgather(const communicator& comm, span<const detail::identity_t<T>> send, span<T> recv,
                            stream s = nullptr);
  template <class T>
  static request iallgatherv(const communicator& comm, span<const detail::identity_t<T>> send, span<T> recv,
                             span<const int> counts, stream s = nullptr);
  template <class T>
  static request ireduce_scatter(const communicator& comm, span<const detail::identity_t<T>> send,
                                 span<T> recv, span<const int> counts, op o, stream s = nullptr);

  // Local work (combine, divide, copy): kernels on the stream, from cuda::device_work.
};

using staged = basic_staged<false>;
using cuda_aware_mpi = basic_staged<true>;

namespace detail {
inline std::size_t stage_chunk_bytes() {
  const char* text = setting("FLEXCOMM_STAGE_CHUNK");
  if (!text) return std::size_t{1} << 20;
  char* end = nullptr;
  const long long bytes = std::strtoll(text, &end, 10);
  check(end && *end == '\0' && bytes >= 16 && bytes <= (1LL << 34), "FLEXCOMM_STAGE_CHUNK",
        cat("cannot parse '", text, "': expected a chunk size in bytes, 16 .. 2^34"));
  return static_cast<std::size_t>(bytes);
}

// One piece of a staged operation, moving through: staging (device to host), in flight (MPI),
// returning (host to device), done.
struct staged_chunk {
  enum : int { staging, in_flight, returning, done };
  std::size_t offset = 0, count = 0;  // elements
  cuda::event staged;                 // the chunk's data is where MPI reads it (empty: nothing to wait for)
  mpi::request transfer;
  cuda::event returned;
  int phase = staging;
};

struct staged_op {
  std::string what;
  std::vector<cuda::pinned_pool::block> blocks;  // declared first: outlives the transfers using it
  std::vector<staged_chunk> chunks;
  std::size_t started = 0;  // chunks whose transfer has begun, always a prefix
  cuda::event issued;       // the caller's stream at the call: the way back waits for it
  std::function<mpi::request(staged_chunk&)> start;
  // Enqueues the chunk's way back on the given stream; false when there is nothing to bring back.
  std::function<bool(staged_chunk&, cudaStream_t)> finish;
  std::exception_ptr error;
};

// What a communicator and its requests share. Transfers begin strictly in call order, whichever
// request is tested, so every rank issues its MPI operations in the same order.
struct staged_lane {
  mpi::communicator transport;  // a private duplicate; operations that began later still reach it
  std::mutex mutex;
  std::deque<std::shared_ptr<staged_op>> starting;
  cuda::stream_handle own;   // operations' stream when the caller names none
  cuda::stream_handle back;  // host-to-device copies and epilogues
  std::size_t chunk_bytes = std::size_t{1} << 20;
  int device = 0;

  void drive_locked() {
    while (!starting.empty()) {
      auto& op = *starting.front();
      try {
        while (op.started < op.chunks.size()) {
          auto& c = op.chunks[op.started];
          if (c.staged && !c.staged.done(op.what)) return;
          c.transfer = op.start(c);
          c.phase = staged_chunk::in_flight;
          ++op.started;
        }
      } catch (...) {
        op.error = std::current_exception();  // the op's own request reports it
      }
      starting.pop_front();
    }
  }

  // An operation given up on (timed out) must never begin later.
  void forget_locked(const std::shared_ptr<staged_op>& op) {
    for (auto it = starting.begin(); it != starting.end(); ++it)
      if (*it == op) {
        starting.erase(it);
        return;
      }
  }

  // True once every chunk of `op` is back on the device.
  bool progress_locked(staged_op& op) {
    bool all = op.started == op.chunks.size();
    for (auto& c : op.chunks) {
      if (c.phase == staged_chunk::in_flight && c.transfer.test()) {
        if (op.finish(c, back.get())) {
          c.returned = cuda::event::create(op.what);
          c.returned.record(back.get(), op.what);
          c.phase = staged_chunk::returning;
        } else {
          c.phase = staged_chunk::done;
        }
      }
      if (c.phase == staged_chunk::returning && c.returned.done(op.what)) c.phase = staged_chunk::done;
      all = all && c.phase == staged_chunk::done;
    }
    return all;
  }
};
}  // namespace detail

// An MPI communicator (a private duplicate) with the streams and ordering its staged operations need.
template <bool Direct>
class basic_staged<Direct>::communicator {
 public:
  static constexpr int undefined = mpi::communicator::undefined;

  communicator() = default;
  // Collective over `comm`. Uses the CUDA device current on the calling thread.
  communicator(const mpi::communicator& comm, std::string name)
      : communicator(comm ? comm.dup(name) : mpi::communicator(), std::move(name), 0) {
    if (comm) control_ = comm.dup(cat(name_, " control"));
  }
  // An MPI communicator converts (collectively: a private duplicate), as nccl's does.
  communicator(const mpi::communicator& comm)  // NOLINT: implicit on purpose
      : communicator(comm, comm.name()) {}
  ~communicator() = default;

  communicator(communicator&&) noexcept = default;
  communicator& operator=(communicator&&) noexcept = default;
  communicator(const communicator&) = delete;
  communicator& operator=(const communicator&) = delete;

  explicit operator bool() const noexcept { return lane_ != nullptr; }
  int rank() const noexcept { return lane_ ? lane_->transport.rank() : -1; }
  int size() const noexcept { return lane_ ? lane_->transport.size() : 0; }
  const std::string& name() const noexcept { return name_; }
  MPI_Comm native() const noexcept { return lane_ ? lane_->transport.native() : MPI_COMM_NULL; }
  const mpi::communicator& transport() const { return lane(name_).transport; }
  cudaStream_t own_stream() const noexcept { return lane_ ? lane_->own.get() : nullptr; }

  // An MPI communicator over the same ranks for small host-memory exchanges, apart from the
  // staged traffic (whose MPI operations begin later, in their own order).
  const mpi::communicator& control() const noexcept { return control_; }

  communicator split(int color, int key, std::string name) const {
    const auto what = cat(name_, ": split into '", name, "'");
    communicator out(lane(what).transport.split(color, key, name), name, 0);
    out.control_ = control_.split(color, key, cat(name, " control"));
    return out;
  }
  communicator dup(std::string name) const {
    const auto what = cat(name_, ": dup into '", name, "'");
    communicator out(lane(what).transport.dup(name), name, 0);
    out.control_ = control_.dup(cat(name, " control"));
    return out;
  }

  // How long a wait on this communicator's operations may take; zero: forever. Unset (or
  // negative), FLEXCOMM_TIMEOUT's default_timeout() applies.
  void set_timeout(std::chrono::milliseconds t) {
    if (lane_) detail::mutable_comm(lane_->transport).set_timeout(t);
  }
  std::chrono::milliseconds timeout() const { return lane_ ? lane_->transport.timeout() : default_timeout(); }

  // The recent operations on this communicator, chunk by chunk as they went to MPI.
  const flight_recorder* recorder() const noexcept { return lane_ ? lane_->transport.recorder() : nullptr; }

  detail::staged_lane& lane(const std::string& what) const {
    check(lane_ != nullptr, what, cat("operation on an empty staged communicator '", name_, "'"));
    return *lane_;
  }
  const std::shared_ptr<detail::staged_lane>& shared_lane() const noexcept { return lane_; }

 private:
  communicator(mpi::communicator&& comm, std::string name, int) : name_(std::move(name)) {
    if (!comm) return;
    const auto what = cat(Direct ? "cuda_aware_mpi" : "staged", " communicator '", name_, "'");
    if constexpr (Direct)
      check(mpi_is_cuda_aware(), what,
            "this MPI library is not CUDA-aware (MPIX_GPU_query_support says no); use flexcomm::staged");
    auto lane = std::make_shared<detail::staged_lane>();
    check_cuda(cudaGetDevice(&lane->device), cat(what, ": cudaGetDevice"));
    lane->own = cuda::stream_handle::create(what);
    lane->back = cuda::stream_handle::create(what, cudaStreamNonBlocking);
    lane->chunk_bytes = detail::stage_chunk_bytes();
    lane->transport = std::move(comm);
    lane_ = std::move(lane);
  }

  std::string name_;
  std::shared_ptr<detail::staged_lane> lane_;
  mpi::communicator control_;
};

// A staged operation; test() moves every operation of the communicator along (in call order).
template <bool Direct>
class basic_staged<Direct>::request {
 public:
  request() = default;
  request(std::shared_ptr<detail::staged_lane> lane, std::shared_ptr<detail::staged_op> op)
      : lane_(std::move(lane)), op_(std::move(op)) {}
  request(request&& o) noexcept { swap(o); }
  request& operator=(request&& o) noexcept {
    request(std::move(o)).swap(*this);
    return *this;
  }
  request(const request&) = delete;
  request& operator=(const request&) = delete;
  ~request() {
    if (!pending()) return;
    try {
      wait();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s\n(while destroying a pending request; aborting)\n", e.what());
      MPI_Abort(MPI_COMM_WORLD, 3);
    }
  }

  bool pending() const noexcept { return op_ != nullptr && !failed_; }
  const std::string& what() const noexcept {
    static const std::string none;
    return op_ ? op_->what : none;
  }

  bool test() {
    if (!pending()) return true;
    std::lock_guard<std::mutex> lock(lane_->mutex);
    try {
      cuda::device_guard guard(lane_->device, op_->what);
      lane_->drive_locked();
      if (op_->error) std::rethrow_exception(op_->error);
      if (!lane_->progress_locked(*op_)) return false;
    } catch (...) {
      failed_ = true;
      throw;
    }
    op_.reset();
    return true;
  }

  // Waits under the policy; past `timeout` (the communicator's, else FLEXCOMM_TIMEOUT) it is a
  // flexcomm::error naming the ranks that did not arrive, as the MPI backend's timeouts do: the
  // chunks already on the wire cannot be cancelled, so the job must end (see core/watchdog.hpp).
  void wait(const wait_policy& policy = default_wait(), std::chrono::milliseconds timeout = inherit) {
    if (!pending()) return;
    const auto& transport = lane_->transport;
    const auto limit = timeout.count() >= 0 ? timeout : transport.timeout();
    if (wait_answering(policy, limit, [&] { return test(); }, [] { watchdog::instance().answer_queries(); })) return;
    failed_ = true;
    {
      std::lock_guard<std::mutex> lock(lane_->mutex);
      lane_->forget_locked(op_);
    }
    // Diagnosed on the transport, where the chunks' MPI operations are recorded.
    auto* state = transport.watch_state().get();
    const std::uint64_t seq = state ? state->recorder().oldest_in_flight() : 0;
    const std::string report = watchdog::instance().timed_out(state, seq, limit);
    if (state) state->poison(cat("staged operation timed out (", what(), ")"));
    fail(what(), cat("timed out after ", limit.count(), " ms (FLEXCOMM_TIMEOUT)\n", report));
  }

  // wait()'s default: the communicator's own timeout, else FLEXCOMM_TIMEOUT.
  static constexpr std::chrono::milliseconds inherit = inherit_timeout;

 private:
  void swap(request& o) noexcept {
    std::swap(lane_, o.lane_);
    std::swap(op_, o.op_);
    std::swap(failed_, o.failed_);
  }

  std::shared_ptr<detail::staged_lane> lane_;
  std::shared_ptr<detail::staged_op> op_;
  bool failed_ = false;
};

namespace detail {
// Builds one staged operation: its chunks, its pinned buffers, its copies to the host.
template <bool Direct, class T>
class staged_builder {
 public:
  staged_builder(const typename basic_staged<Direct>::communicator& comm, cudaStream_t s, const char* name,
                 std::size_t count, const std::string& extra)
      : comm_(comm),
        lane_(comm.lane(cat(Direct ? "cuda_aware_mpi " : "staged ", name, " on ", comm.name()))),
        guard_(lane_.device, comm.name()) {
    op_ = std::make_shared<staged_op>();
    op_->what = describe_operation(Direct ? "cuda_aware_mpi" : "staged", name, comm.name(),
                                   mutable_comm(comm.transport()).next_sequence(), count, dtype_of<T>, extra);
    stream_ = s ? s : lane_.own.get();
  }

  const std::string& what() const { return op_->what; }
  cudaStream_t stream() const { return stream_; }

  // Elements per chunk: the whole buffer when direct, else FLEXCOMM_STAGE_CHUNK's worth.
  void chunks(std::size_t n, bool split) {
    const std::size_t per = split ? std::max<std::size_t>(1, lane_.chunk_bytes / sizeof(T)) : (n ? n : 1);
    const std::size_t pieces = n == 0 ? 1 : (n + per - 1) / per;
    op_->chunks.resize(pieces);
    for (std::size_t i = 0; i < pieces; ++i) {
      op_->chunks[i].offset = i * per;
      op_->chunks[i].count = std::min(per, n - std::min(n, i * per));
    }
  }

  T* host(std::size_t n) {
    op_->blocks.push_back(cuda::pinned_pool::instance().take(std::max<std::size_t>(n, 1) * sizeof(T), op_->what));
    return reinterpret_cast<T*>(op_->blocks.back().get());
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
  typename basic_staged<Direct>::request launch(Start start, Finish finish) {
    op_->issued = cuda::event::create(op_->what);
    op_->issued.record(stream_, op_->what);
    op_->start = std::move(start);
    cudaEvent_t issued = op_->issued.get();
    const std::string what = op_->what;
    op_->finish = [finish = std::move(finish), issued, what](staged_chunk& c, cudaStream_t back) {
      check_cuda(cudaStreamWaitEvent(back, issued, 0), cat(what, ": cudaStreamWaitEvent"));
      return finish(c, back);
    };
    auto shared = comm_.shared_lane();
    {
      std::lock_guard<std::mutex> lock(lane_.mutex);
      lane_.starting.push_back(op_);
      lane_.drive_locked();  // chunks already staged go on the wire now
    }
    return typename basic_staged<Direct>::request(shared, op_);
  }

 private:
  void mark(staged_chunk& c) {
    c.staged = cuda::event::create(op_->what);
    c.staged.record(stream_, op_->what);
  }

  const typename basic_staged<Direct>::communicator& comm_;
  staged_lane& lane_;
  cuda::device_guard guard_;  // events and copies belong to the communicator's device
  std::shared_ptr<staged_op> op_;
  cudaStream_t stream_ = nullptr;
};

// Copies a chunk's result back: `from` (host or, direct, unused) to the device.
template <class T>
bool bring_back(const T* from, T* to, const staged_chunk& c, cudaStream_t back) {
  if (c.count == 0) return false;
  cuda::copy(to + c.offset, from + c.offset, c.count * sizeof(T), back);
  return true;
}

// A gather's elements from the host buffer to the device (staged only); true when queued.
template <bool Direct, class T>
bool copy_gathered_back(const T* into, T* device, std::size_t n, cudaStream_t back) {
  if (Direct || n == 0) return false;
  cuda::copy(device, into, n * sizeof(T), back);
  return true;
}

// Reductions of 16-bit floats use flexcomm's host operators inside MPI: never direct.
template <bool Direct, class T>
constexpr bool direct_reduction = Direct && !is_f16_like<T>;

// After a reduced chunk arrived: direct, MPI summed on the device and a kernel averages;
// staged, MPI averaged on the host and the chunk is copied back. True when work was queued.
template <bool Direct, class T>
bool finish_reduced(const T* wire, T* device, op o, int ranks, const staged_chunk& c, cudaStream_t back) {
  if constexpr (direct_reduction<Direct, T>) {
    if (o != op::avg || c.count == 0) return false;
    cuda::divide(device + c.offset, c.count, ranks, back);
    return true;
  } else {
    return bring_back(wire, device, c, back);
  }
}
}  // namespace detail

template <bool Direct>
template <class T>
typename basic_staged<Direct>::request basic_staged<Direct>::isend(const communicator& comm, span<T> buf, int dest,
                                                                   int tag, stream s) {
  using E = std::remove_const_t<T>;
  detail::staged_builder<Direct, E> b(comm, s, "isend", buf.size(), cat(", to ", dest, ", tag ", tag));
  detail::check_rank_of(dest, comm.size(), "peer", b.what());
  b.chunks(buf.size(), false);
  const E* device = buf.data();
  const E* from = device;
  if constexpr (!Direct) {
    E* h = b.host(buf.size());
    b.stage(h, device);
    from = h;
  } else {
    b.mark_all();
  }
  const auto n = buf.size();
  return b.launch(
      [t = &comm.transport(), from, n, dest, tag](detail::staged_chunk&) {
        return mpi::isend(*t, span<const E>(from, n), dest, tag);
      },
      [](detail::staged_chunk&, cudaStream_t) { return false; });
}

template <bool Direct>
template <class T>
typename basic_staged<Direct>::request basic_staged<Direct>::irecv(const communicator& comm, span<T> buf, int source,
                                                                   int tag, stream s) {
  static_assert(!std::is_const_v<T>, "irecv writes into its buffer");
  detail::staged_builder<Direct, T> b(comm, s, "irecv", buf.size(), cat(", from ", source, ", tag ", tag));
  detail::check_rank_of(source, comm.size(), "peer", b.what());
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
      [into, device](detail::staged_chunk& c, cudaStream_t back) {
        return !Direct && detail::bring_back(into, device, c, back);
      });
}

template <bool Direct>
template <class T>
typename basic_staged<Direct>::request basic_staged<Direct>::ibcast(const communicator& comm, span<T> buf, int root,
                                                                    stream s) {
  detail::staged_builder<Direct, T> b(comm, s, "ibcast", buf.size(), cat(", root ", root));
  detail::check_rank_of(root, comm.size(), "root", b.what());
  const bool at_root = comm.rank() == root;
  b.chunks(buf.size(), !Direct);
  T* device = buf.data();
  T* wire = device;
  if constexpr (!Direct) {
    wire = b.host(buf.size());
    if (at_root) b.stage(wire, device);
  } else {
    b.mark_all();
  }
  return b.launch(
      [t = &comm.transport(), wire, root](detail::staged_chunk& c) {
        return mpi::ibcast(*t, span<T>(wire + c.offset, c.count), root);
      },
      [wire, device, at_root](detail::staged_chunk& c, cudaStream_t back) {
        return !Direct && !at_root && detail::bring_back(wire, device, c, back);
      });
}

template <bool Direct>
template <class T>
typename basic_staged<Direct>::request basic_staged<Direct>::iallreduce(const communicator& comm,
                                                                        span<const detail::identity_t<T>> send,
                                                                        span<T> recv, op o, stream s) {
  detail::staged_builder<Direct, T> b(comm, s, "iallreduce", recv.size(), cat(", ", name_of(o)));
  detail::check_same_size(send.size(), recv.size(), b.what());
  constexpr bool direct = detail::direct_reduction<Direct, T>;
  b.chunks(recv.size(), !direct);
  const T* from = send.data();
  T* device = recv.data();
  T* wire = device;
  if constexpr (!direct) {
    wire = b.host(recv.size());
    b.stage(wire, from);
    from = wire;
  } else {
    b.mark_all();
  }
  const int ranks = comm.size();
  // Direct: MPI sums on the device, a kernel averages; staged: MPI averages on the host.
  const op on_wire = direct && o == op::avg ? op::sum : o;
  return b.launch(
      [t = &comm.transport(), from, wire, on_wire](detail::staged_chunk& c) {
        return mpi::iallreduce<T>(*t, span<const T>(from + c.offset, c.count),
                                  span<T>(wire + c.offset, c.count), on_wire);
      },
      [wire, device, o, ranks](detail::staged_chunk& c, cudaStream_t back) {
        return detail::finish_reduced<Direct, T>(wire, device, o, ranks, c, back);
      });
}

template <bool Direct>
template <class T>
typename basic_staged<Direct>::request basic_staged<Direct>::ireduce(const communicator& comm,
                                                                     span<const detail::identity_t<T>> send,
                                                                     span<T> recv, op o, int root, stream s) {
  detail::staged_builder<Direct, T> b(comm, s, "ireduce", send.size(), cat(", ", name_of(o), ", root ", root));
  detail::check_rank_of(root, comm.size(), "root", b.what());
  const bool at_root = comm.rank() == root;
  detail::check_root_receive(at_root, send.size(), recv.size(), b.what());
  constexpr bool direct = detail::direct_reduction<Direct, T>;
  b.chunks(send.size(), !direct);
  const T* from = send.data();
  T* device = recv.data();
  T* wire = at_root ? device : nullptr;
  if constexpr (!direct) {
    T* h = b.host(send.size());
    b.stage(h, from);
    from = h;
    wire = h;  // in place at the root
  } else {
    b.mark_all();
  }
  const int ranks = comm.size();
  const op on_wire = direct && o == op::avg ? op::sum : o;
  return b.launch(
      [t = &comm.transport(), from, wire, on_wire, root, at_root](detail::staged_chunk& c) {
        return mpi::ireduce<T>(*t, span<const T>(from + c.offset, c.count),
                               at_root ? span<T>(wire + c.offset, c.count) : span<T>(), on_wire, root);
      },
      [wire, device, o, ranks, at_root](detail::staged_chunk& c, cudaStream_t back) {
        return at_root && detail::finish_reduced<Direct, T>(wire, device, o, ranks, c, back);
      });
}

template <bool Direct>
template <class T>
typename basic_staged<Direct>::request basic_staged<Direct>::igatherv(const communicator& comm,
                                                                      span<const detail::identity_t<T>> send,
                                                                      span<T> recv, span<const int> counts, int root,
                                                                      stream s) {
  detail::staged_builder<Direct, T> b(comm, s, "igatherv", send.size(), cat(", root ", root));
  detail::check_rank_of(root, comm.size(), "root", b.what());
  const bool at_root = comm.rank() == root;
  const std::size_t total =
      at_root ? detail::gather_layout(counts, comm.size(), root, send.size(), recv.size(), b.what()).total : 0;
  b.chunks(send.size(), false);
  T* device = recv.data();
  const std::size_t n = send.size(), received = at_root ? total : 0;
  const auto buffers = b.gather_buffers(send.data(), n, device, received);
  const T* from = buffers.first;
  T* into = buffers.second;
  return b.launch(
      [t = &comm.transport(), from, n, into, received, counts, root](detail::staged_chunk&) {
        return mpi::igatherv<T>(*t, span<const T>(from, n), span<T>(into, received), counts, root);
      },
      [into, device, received](detail::staged_chunk&, cudaStream_t back) {
        return detail::copy_gathered_back<Direct>(into, device, received, back);
      });
}

template <bool Direct>
template <class T>
typename basic_staged<Direct>::request basic_staged<Direct>::iallgather(const communicator& comm,
                                                                        span<const detail::identity_t<T>> send,
                                                                        span<T> recv, stream s) {
  detail::staged_builder<Direct, T> b(comm, s, "iallgather", send.size(), "");
  const std::size_t total = send.size() * static_cast<std::size_t>(comm.size());
  detail::check_allgather_sizes(send.size(), recv.size(), comm.size(), b.what());
  b.chunks(send.size(), false);
  T* device = recv.data();
  const std::size_t n = send.size();
  const auto buffers = b.gather_buffers(send.data(), n, device, total);
  const T* from = buffers.first;
  T* into = buffers.second;
  return b.launch(
      [t = &comm.transport(), from, n, into, total](detail::staged_chunk&) {
        return mpi::iallgather<T>(*t, span<const T>(from, n), span<T>(into, total));
      },
      [into, device, total](detail::staged_chunk&, cudaStream_t back) {
        return detail::copy_gathered_back<Direct>(into, device, total, back);
      });
}

template <bool Direct>
template <class T>
typename basic_staged<Direct>::request basic_staged<Direct>::iallgatherv(const communicator& comm,
                                                                         span<const detail::identity_t<T>> send,
                                                                         span<T> recv, span<const int> counts,
                                                                         stream s) {
  detail::staged_builder<Direct, T> b(comm, s, "iallgatherv", send.size(), "");
  const std::size_t total =
      detail::allgatherv_layout(counts, comm.size(), comm.rank(), send.size(), recv.size(), b.what()).total;
  b.chunks(send.size(), false);
  T* device = recv.data();
  const std::size_t n = send.size();
  const auto buffers = b.gather_buffers(send.data(), n, device, total);
  const T* from = buffers.first;
  T* into = buffers.second;
  return b.launch(
      [t = &comm.transport(), from, n, into, total, counts](detail::staged_chunk&) {
        return mpi::iallgatherv<T>(*t, span<const T>(from, n), span<T>(into, total), counts);
      },
      [into, device, total](detail::staged_chunk&, cudaStream_t back) {
        return detail::copy_gathered_back<Direct>(into, device, total, back);
      });
}

template <bool Direct>
template <class T>
typename basic_staged<Direct>::request basic_staged<Direct>::ireduce_scatter(const communicator& comm,
                                                                             span<const detail::identity_t<T>> send,
                                                                             span<T> recv, span<const int> counts,
                                                                             op o, stream s) {
  detail::staged_builder<Direct, T> b(comm, s, "ireduce_scatter", send.size(), cat(", ", name_of(o)));
  const auto mine =
      detail::reduce_scatter_share(counts, comm.size(), comm.rank(), send.size(), recv.size(), b.what());
  constexpr bool direct = detail::direct_reduction<Direct, T>;
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
      [into, device, mine, o, ranks](detail::staged_chunk&, cudaStream_t back) {
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

}  // namespace flexcomm
