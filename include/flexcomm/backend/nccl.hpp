// The NCCL backend: device buffers, every operation stream-ordered on a CUDA stream the caller
// picks. Communicators come from an MPI communicator; a hang becomes ncclCommAbort and an error.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../core/datatype.hpp"
#include "../core/error.hpp"
#include "../core/reduce.hpp"
#include "../core/span.hpp"
#include "../core/wait.hpp"
#include "cuda/device_buffer.hpp"
#include "cuda/error.hpp"
#include "cuda/reduce_kernels.cuh"
#include "mpi.hpp"

namespace flexcomm {

// Turns an NCCL return code into a flexcomm::error; ncclInProgress is not a failure (nonblocking
// communicators return it while work is still being enqueued).
inline void check_nccl(ncclResult_t code, const std::string& operation) {
  if (code == ncclSuccess || code == ncclInProgress) return;
  const char* last = ncclGetLastError(nullptr);
  fail(operation, cat(ncclGetErrorString(code), last && *last ? cat(" (", last, ")") : std::string()));
}

namespace detail {
inline ncclDataType_t nccl_type(dtype t) {
  switch (t) {
    case dtype::f32: return ncclFloat32;
    case dtype::f64: return ncclFloat64;
    case dtype::i32: return ncclInt32;
    case dtype::i64: return ncclInt64;
    case dtype::u8: return ncclUint8;
    case dtype::f16: return ncclFloat16;
    case dtype::bf16: return ncclBfloat16;
  }
  return ncclFloat32;
}

constexpr bool is_floating(dtype t) {
  return t == dtype::f32 || t == dtype::f64 || t == dtype::f16 || t == dtype::bf16;
}

// ncclAvg for floating types; integers sum and are divided by a kernel afterwards, truncating
// as op::avg does everywhere in flexcomm.
inline ncclRedOp_t nccl_op(op o, dtype t) {
  switch (o) {
    case op::sum: return ncclSum;
    case op::prod: return ncclProd;
    case op::min: return ncclMin;
    case op::max: return ncclMax;
    case op::avg: return is_floating(t) ? ncclAvg : ncclSum;
  }
  return ncclSum;
}

inline bool needs_divide(op o, dtype t) { return o == op::avg && !is_floating(t); }
}  // namespace detail

struct nccl : cuda::device_work {
  static constexpr memory_space memory = memory_space::device;
  // NCCL pairs a send with the peer's receive in the order both were issued, whatever the tags.
  static constexpr bool tag_matched_p2p = false;
  using host_backend = mpi;
  // nullptr (the default) means the communicator's own stream, which is ordered with the
  // legacy default stream; pass the trainer's compute stream to order communication with it.
  using stream = cudaStream_t;
  // An adapter's own scratch space, in device memory like every buffer of this backend.
  template <class T>
  using buffer = cuda::device_buffer<T>;
  class communicator;
  class request;

  // Point-to-point. Sends and receives are deferred and launched together, as one NCCL group,
  // when a request of the communicator is tested or waited or another operation is issued:
  // a ring's send and receive must be in one group or they wait for each other forever.
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
  static request iallreduce(const communicator& comm, span<T> buf, op o, stream s = nullptr);
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

namespace detail {
using cuda::device_guard;

// Holds an NCCL group open; ends it even when a call inside throws.
class nccl_group {
 public:
  explicit nccl_group(const std::string& what) : what_(what) { check_nccl(ncclGroupStart(), cat(what, ": ncclGroupStart")); }
  nccl_group(const nccl_group&) = delete;
  nccl_group& operator=(const nccl_group&) = delete;
  void end() {
    open_ = false;
    check_nccl(ncclGroupEnd(), cat(what_, ": ncclGroupEnd"));
  }
  ~nccl_group() {
    if (open_) ncclGroupEnd();
  }

 private:
  std::string what_;
  bool open_ = true;
};

// Polls a nonblocking communicator until NCCL has finished enqueueing (or initializing);
// false on timeout. An asynchronous error is thrown.
inline bool nccl_settle(ncclComm_t comm, const std::string& what, std::chrono::milliseconds timeout) {
  ncclResult_t state = ncclInProgress;
  const bool settled = default_wait().until(
      [&] {
        check_nccl(ncclCommGetAsyncError(comm, &state), cat(what, ": ncclCommGetAsyncError"));
        return state != ncclInProgress;
      },
      timeout);
  if (settled) check_nccl(state, what);
  return settled;
}

// Marks a launched operation: the event is recorded after its kernels, under the state's lock.
struct nccl_launch {
  cuda::event done;
  bool launched = false;
  std::uint64_t sequence = 0;
};

struct nccl_p2p {
  bool send;
  const void* buf;
  std::size_t count;
  ncclDataType_t type;
  int peer;
  cudaStream_t stream;
  std::shared_ptr<nccl_launch> launch;
};

// What a communicator and its requests share: the NCCL handle, its stream, the deferred
// point-to-point operations and the bookkeeping for timeout reports.
struct nccl_state {
  ncclComm_t comm = nullptr;
  cuda::stream_handle stream;
  std::string name;
  int rank = -1, size = 0, device = 0;
  std::mutex mutex;  // one thread at a time issues NCCL calls on this communicator
  std::vector<nccl_p2p> deferred;
  std::atomic<std::uint64_t> enqueued{0};       // sequence of the last operation issued
  std::atomic<std::uint64_t> completed{0};      // highest sequence seen complete
  bool aborted = false;
  std::string abort_reason;
  std::vector<std::unique_ptr<ncclComm_t>> split_slots;

  nccl_state() = default;
  nccl_state(const nccl_state&) = delete;
  nccl_state& operator=(const nccl_state&) = delete;

  ~nccl_state() {
    if (!comm) return;
    // Finalize flushes outstanding work; if that does not settle in time, abort rather than hang.
    try {
      device_guard guard(device, name);
      const ncclResult_t rc = ncclCommFinalize(comm);
      if ((rc != ncclSuccess && rc != ncclInProgress) ||
          !nccl_settle(comm, cat(name, ": ncclCommFinalize"), default_timeout())) {
        ncclCommAbort(comm);
        return;
      }
      ncclCommDestroy(comm);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s\n(while destroying nccl communicator '%s'; aborting it)\n", e.what(), name.c_str());
      ncclCommAbort(comm);
    }
  }

  std::string where() const {
    return cat("nccl communicator '", name, "' (rank ", rank, " of ", size, "; last enqueued #", enqueued.load(),
               ", last completed #", completed.load(), ")");
  }

  // Called with the mutex held.
  void require_usable(const std::string& what) const {
    check(!aborted, what, cat(where(), " was aborted: ", abort_reason));
  }

  // Called with the mutex held: ends the communicator so that kernels stuck in it return.
  void abort_locked(const std::string& reason) {
    if (aborted) return;
    aborted = true;
    abort_reason = reason;
    if (comm) {
      device_guard guard(device, name);
      ncclCommAbort(comm);
      comm = nullptr;
    }
  }

  // Called with the mutex held, after an NCCL call: waits until the work is enqueued, so that an
  // event recorded next really follows it.
  void settle_locked(const std::string& what) {
    if (!nccl_settle(comm, what, default_timeout())) {
      const auto reason = cat("enqueueing did not finish within ", default_timeout().count(), " ms (FLEXCOMM_TIMEOUT)");
      const auto place = where();
      abort_locked(cat(what, ": ", reason));
      fail(what, cat(reason, "; ", place, " aborted with ncclCommAbort"));
    }
  }

  // Called with the mutex held: launches deferred sends and receives as one group.
  void flush_locked(const std::string& what) {
    if (deferred.empty()) return;
    require_usable(what);
    std::vector<nccl_p2p> batch;
    batch.swap(deferred);
    device_guard guard(device, what);
    nccl_group group(what);
    for (const auto& p : batch) {
      cudaStream_t s = p.stream ? p.stream : stream.get();
      if (p.count == 0) continue;  // both sides know the count: an empty message is no message
      if (p.send)
        check_nccl(ncclSend(p.buf, p.count, p.type, p.peer, comm, s), cat(what, ": ncclSend to ", p.peer));
      else
        check_nccl(ncclRecv(const_cast<void*>(p.buf), p.count, p.type, p.peer, comm, s),
                   cat(what, ": ncclRecv from ", p.peer));
    }
    group.end();
    settle_locked(what);
    for (const auto& p : batch) {
      p.launch->done.record(p.stream ? p.stream : stream.get(), what);
      p.launch->launched = true;
    }
  }
};
}  // namespace detail

// Move-only owner of an NCCL communicator, made collectively from an MPI communicator.
class nccl::communicator {
 public:
  static constexpr int undefined = -1;

  communicator() = default;

  // Collective over `comm`: rank 0 makes the unique id, the MPI backend broadcasts it, and every
  // rank initializes without blocking, polled under the wait policy up to FLEXCOMM_TIMEOUT.
  // Uses the CUDA device current on the calling thread. An empty `comm` gives an empty one.
  communicator(const mpi::communicator& comm, std::string name) {
    if (!comm) {
      name_ = std::move(name);
      return;
    }
    const auto what = cat("nccl init of '", name, "' (rank ", comm.rank(), " of ", comm.size(), ")");
    // Byte 0 says whether rank 0 got an id, so a failure there is an error everywhere, not a hang.
    std::vector<std::uint8_t> message(1 + sizeof(ncclUniqueId), 0);
    if (comm.rank() == 0) {
      ncclUniqueId id;
      const ncclResult_t rc = ncclGetUniqueId(&id);
      message[0] = rc == ncclSuccess ? 1 : 0;
      if (rc == ncclSuccess) std::memcpy(message.data() + 1, &id, sizeof id);
    }
    mpi::ibcast(comm, span<std::uint8_t>(message), 0).wait();
    check(message[0] == 1, what, "rank 0 could not make an NCCL unique id (ncclGetUniqueId failed there)");
    ncclUniqueId id;
    std::memcpy(&id, message.data() + 1, sizeof id);

    auto state = std::make_shared<detail::nccl_state>();
    state->name = name;
    check_cuda(cudaGetDevice(&state->device), cat(what, ": cudaGetDevice"));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t handle = nullptr;
    check_nccl(ncclCommInitRankConfig(&handle, comm.size(), id, comm.rank(), &config), what);
    adopt(*state, handle, what);
    state->stream = cuda::stream_handle::create(what);
    state_ = std::move(state);
    control_ = comm.dup(cat(name, " control"));
    name_ = std::move(name);
  }

  // An MPI communicator converts (collectively, under its own name), so that an adapter built
  // from the pipeline's MPI communicators can run on NCCL: subgroup_allreduce<nccl>(member_comm).
  communicator(const mpi::communicator& comm)  // NOLINT: implicit on purpose
      : communicator(comm, comm.name()) {}

  communicator(communicator&&) noexcept = default;
  communicator& operator=(communicator&&) noexcept = default;
  communicator(const communicator&) = delete;
  communicator& operator=(const communicator&) = delete;
  ~communicator() = default;  // the state is destroyed (finalized) with the last request

  explicit operator bool() const noexcept { return state_ != nullptr; }
  int rank() const noexcept { return state_ ? state_->rank : -1; }
  int size() const noexcept { return state_ ? state_->size : 0; }
  const std::string& name() const noexcept { return name_; }
  ncclComm_t native() const noexcept { return state_ ? state_->comm : nullptr; }
  // The communicator's own stream: where operations go when the caller names none.
  cudaStream_t own_stream() const noexcept { return state_ ? state_->stream.get() : nullptr; }
  int device() const noexcept { return state_ ? state_->device : -1; }
  // An MPI communicator over the same ranks, for small host-memory exchanges (an adapter's
  // cross-rank checks) that NCCL, which moves device memory only, cannot carry.
  const mpi::communicator& control() const noexcept { return control_; }

  // Collective over this communicator (ncclCommSplit); `undefined` takes part, gets an empty one.
  communicator split(int color, int key, std::string name) const {
    const auto what = cat(name_, ": nccl split into '", name, "'");
    auto& st = state(what);
    detail::device_guard guard(st.device, what);
    std::lock_guard<std::mutex> lock(st.mutex);
    st.flush_locked(what);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    // NCCL may write the new handle while the split settles in the background: the slot lives
    // as long as the parent.
    st.split_slots.push_back(std::make_unique<ncclComm_t>(nullptr));
    ncclComm_t* slot = st.split_slots.back().get();
    check_nccl(ncclCommSplit(st.comm, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, slot, &config), what);
    st.settle_locked(what);
    communicator out;
    out.control_ = control_.split(color, key, cat(name, " control"));
    out.name_ = std::move(name);
    if (*slot == nullptr) {
      check(color < 0, what, "ncclCommSplit returned no communicator for a rank with a color");
      return out;
    }
    auto state = std::make_shared<detail::nccl_state>();
    state->name = out.name_;
    state->device = st.device;
    adopt(*state, *slot, what);
    state->stream = cuda::stream_handle::create(what);
    out.state_ = std::move(state);
    return out;
  }

  communicator dup(std::string name) const { return split(0, rank(), std::move(name)); }

  // For the backend's operations.
  detail::nccl_state& state(const std::string& what) const {
    check(state_ != nullptr, what, cat("operation on an empty nccl communicator '", name_, "'"));
    return *state_;
  }
  const std::shared_ptr<detail::nccl_state>& shared_state() const noexcept { return state_; }

 private:
  // Waits for a nonblocking init or split to settle; on timeout aborts the half-made communicator.
  static void adopt(detail::nccl_state& state, ncclComm_t handle, const std::string& what) {
    if (!detail::nccl_settle(handle, what, default_timeout())) {
      ncclCommAbort(handle);
      fail(what, cat("did not finish within ", default_timeout().count(),
                     " ms (FLEXCOMM_TIMEOUT); aborted with ncclCommAbort. Every rank of the communicator must "
                     "create it, in the same order; two ranks on one GPU need distinct NCCL_HOSTID"));
    }
    state.comm = handle;
    check_nccl(ncclCommCount(handle, &state.size), cat(what, ": ncclCommCount"));
    check_nccl(ncclCommUserRank(handle, &state.rank), cat(what, ": ncclCommUserRank"));
  }

  std::shared_ptr<detail::nccl_state> state_;
  mpi::communicator control_;
  std::string name_;
};

// A stream-ordered NCCL operation: complete when the event recorded after its kernels is reached.
// test() also polls the communicator's asynchronous error; wait() past FLEXCOMM_TIMEOUT aborts the
// communicator (ncclCommAbort) and throws, instead of hanging.
class nccl::request {
 public:
  request() = default;
  request(std::shared_ptr<detail::nccl_state> state, std::shared_ptr<detail::nccl_launch> launch, std::string what)
      : state_(std::move(state)), launch_(std::move(launch)), what_(std::move(what)) {}
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

  bool pending() const noexcept { return launch_ != nullptr; }
  const std::string& what() const noexcept { return what_; }

  bool test() {
    if (!pending()) return true;
    auto& st = *state_;
    {
      std::lock_guard<std::mutex> lock(st.mutex);
      if (st.aborted) {
        launch_.reset();
        fail(what_, cat(st.where(), " was aborted: ", st.abort_reason));
      }
      if (!launch_->launched) {
        st.flush_locked(what_);
        // An event never recorded reads as reached: an operation lost with a failed group launch
        // must not look finished.
        if (!launch_->launched) {
          launch_.reset();
          fail(what_, "its NCCL group launch failed (reported by the operation that launched it)");
        }
      }
    }
    if (launch_->done.done(what_)) {
      std::uint64_t seen = st.completed.load();
      while (seen < launch_->sequence && !st.completed.compare_exchange_weak(seen, launch_->sequence)) {}
      launch_.reset();
      return true;
    }
    ncclResult_t async = ncclSuccess;
    {
      std::lock_guard<std::mutex> lock(st.mutex);
      if (st.comm) check_nccl(ncclCommGetAsyncError(st.comm, &async), cat(what_, ": ncclCommGetAsyncError"));
      if (async != ncclSuccess && async != ncclInProgress) {
        const auto place = st.where();
        st.abort_locked(cat(what_, ": ", ncclGetErrorString(async)));
        launch_.reset();
        fail(what_, cat("asynchronous NCCL error: ", ncclGetErrorString(async), "; ", place, " aborted"));
      }
    }
    return false;
  }

  void wait(const wait_policy& policy = default_wait(), std::chrono::milliseconds timeout = default_timeout()) {
    if (policy.until([&] { return test(); }, timeout)) return;
    auto& st = *state_;
    std::lock_guard<std::mutex> lock(st.mutex);
    const auto place = st.where();
    const auto reason = cat("timed out after ", timeout.count(), " ms (FLEXCOMM_TIMEOUT)");
    st.abort_locked(cat(what_, ": ", reason));
    launch_.reset();
    fail(what_, cat(reason, "; ", place, " aborted with ncclCommAbort (a rank did not take part, or ",
                    "the ranks issued operations in different orders)"));
  }

 private:
  void swap(request& o) noexcept {
    std::swap(state_, o.state_);
    std::swap(launch_, o.launch_);
    std::swap(what_, o.what_);
  }

  std::shared_ptr<detail::nccl_state> state_;
  std::shared_ptr<detail::nccl_launch> launch_;
  std::string what_;
};

namespace detail {
template <class T>
std::string nccl_describe(nccl_state& st, const std::string& comm_name, const char* name, std::size_t count,
                          const std::string& extra = {}) {
  return cat("nccl ", name, " on ", comm_name, " #", st.enqueued.load() + 1, " (", count, " x ", name_of(dtype_of<T>), extra,
             ")");
}

// NCCL reads and writes through device pointers only; a host pointer is a named error, not a crash.
inline void require_device_memory(const void* p, std::size_t bytes, const std::string& what, const char* which) {
  if (bytes == 0 || p == nullptr) {
    check(bytes == 0, what, cat(which, " buffer is null"));
    return;
  }
  cudaPointerAttributes attr{};
  check_cuda(cudaPointerGetAttributes(&attr, p), cat(what, ": cudaPointerGetAttributes"));
  check(attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged, what,
        cat(which, " buffer is host memory; the nccl backend needs device (or managed) buffers"));
}

// Issues one operation: deferred point-to-point first (call order is NCCL order), then the
// enqueue, then local epilogue kernels (integer averages), then the completion event.
template <class Enqueue, class Epilogue>
nccl::request nccl_launch_op(const nccl::communicator& comm, cudaStream_t s, const std::string& what,
                             Enqueue&& enqueue, Epilogue&& epilogue) {
  auto& st = comm.state(what);
  device_guard guard(st.device, what);
  std::lock_guard<std::mutex> lock(st.mutex);
  st.require_usable(what);
  st.flush_locked(what);
  const cudaStream_t stream = s ? s : st.stream.get();
  enqueue(st.comm, stream);
  st.settle_locked(what);
  epilogue(stream);
  auto launch = std::make_shared<nccl_launch>();
  launch->sequence = ++st.enqueued;
  launch->done = cuda::event::create(what);
  launch->done.record(stream, what);
  launch->launched = true;
  return nccl::request(comm.shared_state(), std::move(launch), what);
}

inline auto no_epilogue() {
  return [](cudaStream_t) {};
}

template <class T>
auto average_on_device(op o, span<T> out, int ranks) {
  return [o, out, ranks](cudaStream_t stream) {
    if (needs_divide(o, dtype_of<T>)) cuda::divide(out.data(), out.size(), ranks, stream);
  };
}

template <class T>
nccl::request nccl_point_to_point(const nccl::communicator& comm, bool send, span<T> buf, int peer, int tag,
                                  cudaStream_t s) {
  using E = std::remove_const_t<T>;
  auto& st = comm.state(cat("nccl ", send ? "isend" : "irecv", " on ", comm.name()));
  device_guard guard(st.device, comm.name());  // the event belongs to the communicator's device
  std::lock_guard<std::mutex> lock(st.mutex);
  const auto what = nccl_describe<E>(st, comm.name(), send ? "isend" : "irecv", buf.size(),
                                     cat(send ? ", to " : ", from ", peer, ", tag ", tag));
  st.require_usable(what);
  check(peer >= 0 && peer < st.size, what, cat("peer ", peer, " is not a rank of ", st.size));
  // NCCL has no tags: messages between two ranks match in the order they were issued.
  require_device_memory(buf.data(), buf.size_bytes(), what, send ? "send" : "receive");
  auto launch = std::make_shared<nccl_launch>();
  launch->sequence = ++st.enqueued;
  launch->done = cuda::event::create(what);
  st.deferred.push_back({send, buf.data(), buf.size(), nccl_type(dtype_of<E>), peer, s, launch});
  return nccl::request(comm.shared_state(), std::move(launch), what);
}
}  // namespace detail

template <class T>
nccl::request nccl::isend(const communicator& comm, span<T> buf, int dest, int tag, stream s) {
  return detail::nccl_point_to_point(comm, true, buf, dest, tag, s);
}

template <class T>
nccl::request nccl::irecv(const communicator& comm, span<T> buf, int source, int tag, stream s) {
  static_assert(!std::is_const_v<T>, "irecv writes into its buffer");
  return detail::nccl_point_to_point(comm, false, buf, source, tag, s);
}

template <class T>
nccl::request nccl::ibcast(const communicator& comm, span<T> buf, int root, stream s) {
  auto& st = comm.state("nccl ibcast");
  const auto what = detail::nccl_describe<T>(st, comm.name(), "ibcast", buf.size(), cat(", root ", root));
  check(root >= 0 && root < comm.size(), what, cat("root ", root, " is not a rank of ", comm.size()));
  detail::require_device_memory(buf.data(), buf.size_bytes(), what, "broadcast");
  return detail::nccl_launch_op(
      comm, s, what,
      [&](ncclComm_t c, cudaStream_t stream) {
        if (buf.empty()) return;
        check_nccl(ncclBroadcast(buf.data(), buf.data(), buf.size(), detail::nccl_type(dtype_of<T>), root, c, stream),
                   what);
      },
      detail::no_epilogue());
}

template <class T>
nccl::request nccl::iallreduce(const communicator& comm, span<const detail::identity_t<T>> send, span<T> recv, op o,
                               stream s) {
  auto& st = comm.state("nccl iallreduce");
  const auto what = detail::nccl_describe<T>(st, comm.name(), "iallreduce", recv.size(), cat(", ", name_of(o)));
  check(send.size() == recv.size(), what, cat("send holds ", send.size(), " elements, receive holds ", recv.size()));
  detail::require_device_memory(send.data(), send.size_bytes(), what, "send");
  detail::require_device_memory(recv.data(), recv.size_bytes(), what, "receive");
  return detail::nccl_launch_op(
      comm, s, what,
      [&](ncclComm_t c, cudaStream_t stream) {
        if (recv.empty()) return;
        check_nccl(ncclAllReduce(send.data(), recv.data(), recv.size(), detail::nccl_type(dtype_of<T>),
                                 detail::nccl_op(o, dtype_of<T>), c, stream),
                   what);
      },
      detail::average_on_device(o, recv, comm.size()));
}

template <class T>
nccl::request nccl::iallreduce(const communicator& comm, span<T> buf, op o, stream s) {
  return iallreduce<T>(comm, span<const T>(buf), buf, o, s);
}

template <class T>
nccl::request nccl::ireduce(const communicator& comm, span<const detail::identity_t<T>> send, span<T> recv, op o,
                            int root, stream s) {
  auto& st = comm.state("nccl ireduce");
  const auto what =
      detail::nccl_describe<T>(st, comm.name(), "ireduce", send.size(), cat(", ", name_of(o), ", root ", root));
  check(root >= 0 && root < comm.size(), what, cat("root ", root, " is not a rank of ", comm.size()));
  const bool at_root = comm.rank() == root;
  check(!at_root || recv.size() == send.size(), what,
        cat("send holds ", send.size(), " elements, the root's receive holds ", recv.size()));
  detail::require_device_memory(send.data(), send.size_bytes(), what, "send");
  if (at_root) detail::require_device_memory(recv.data(), recv.size_bytes(), what, "receive");
  return detail::nccl_launch_op(
      comm, s, what,
      [&](ncclComm_t c, cudaStream_t stream) {
        if (send.empty()) return;
        check_nccl(ncclReduce(send.data(), at_root ? recv.data() : nullptr, send.size(),
                              detail::nccl_type(dtype_of<T>), detail::nccl_op(o, dtype_of<T>), root, c, stream),
                   what);
      },
      detail::average_on_device(o, at_root ? recv : span<T>(), comm.size()));
}

template <class T>
nccl::request nccl::igatherv(const communicator& comm, span<const detail::identity_t<T>> send, span<T> recv,
                             span<const int> counts, int root, stream s) {
  auto& st = comm.state("nccl igatherv");
  const auto what = detail::nccl_describe<T>(st, comm.name(), "igatherv", send.size(), cat(", root ", root));
  check(root >= 0 && root < comm.size(), what, cat("root ", root, " is not a rank of ", comm.size()));
  const bool at_root = comm.rank() == root;
  std::vector<int> displs;
  if (at_root) {
    check(counts.size() == static_cast<std::size_t>(comm.size()), what,
          cat("root needs one count per rank (", comm.size(), "), got ", counts.size()));
    check(static_cast<std::size_t>(counts[static_cast<std::size_t>(root)]) == send.size(), what,
          cat("root sends ", send.size(), " elements but counts say ", counts[static_cast<std::size_t>(root)]));
    displs = detail::displacements(counts, what, recv.size());
    detail::require_device_memory(recv.data(), recv.size_bytes(), what, "receive");
  }
  detail::require_device_memory(send.data(), send.size_bytes(), what, "send");
  const auto type = detail::nccl_type(dtype_of<T>);
  return detail::nccl_launch_op(
      comm, s, what,
      [&](ncclComm_t c, cudaStream_t stream) {
        detail::nccl_group group(what);
        if (!at_root) {
          if (!send.empty()) check_nccl(ncclSend(send.data(), send.size(), type, root, c, stream), what);
        } else {
          for (int r = 0; r < comm.size(); ++r) {
            const auto n = static_cast<std::size_t>(counts[static_cast<std::size_t>(r)]);
            T* at = recv.data() + displs[static_cast<std::size_t>(r)];
            if (n == 0) continue;
            if (r == root) cuda::copy(at, send.data(), n * sizeof(T), stream);
            else check_nccl(ncclRecv(at, n, type, r, c, stream), cat(what, ": receive from ", r));
          }
        }
        group.end();
      },
      detail::no_epilogue());
}

template <class T>
nccl::request nccl::iallgather(const communicator& comm, span<const detail::identity_t<T>> send, span<T> recv,
                               stream s) {
  auto& st = comm.state("nccl iallgather");
  const auto what = detail::nccl_describe<T>(st, comm.name(), "iallgather", send.size());
  check(recv.size() == send.size() * static_cast<std::size_t>(comm.size()), what,
        cat("receive holds ", recv.size(), " elements, needs ", send.size(), " x ", comm.size(), " ranks"));
  detail::require_device_memory(send.data(), send.size_bytes(), what, "send");
  detail::require_device_memory(recv.data(), recv.size_bytes(), what, "receive");
  return detail::nccl_launch_op(
      comm, s, what,
      [&](ncclComm_t c, cudaStream_t stream) {
        if (send.empty()) return;
        check_nccl(ncclAllGather(send.data(), recv.data(), send.size(), detail::nccl_type(dtype_of<T>), c, stream),
                   what);
      },
      detail::no_epilogue());
}

template <class T>
nccl::request nccl::iallgatherv(const communicator& comm, span<const detail::identity_t<T>> send, span<T> recv,
                                span<const int> counts, stream s) {
  auto& st = comm.state("nccl iallgatherv");
  const auto what = detail::nccl_describe<T>(st, comm.name(), "iallgatherv", send.size());
  check(counts.size() == static_cast<std::size_t>(comm.size()), what,
        cat("needs one count per rank (", comm.size(), "), got ", counts.size()));
  const int me = comm.rank();
  check(static_cast<std::size_t>(counts[static_cast<std::size_t>(me)]) == send.size(), what,
        cat("this rank sends ", send.size(), " elements but counts say ", counts[static_cast<std::size_t>(me)]));
  const auto displs = detail::displacements(counts, what, recv.size());
  detail::require_device_memory(send.data(), send.size_bytes(), what, "send");
  detail::require_device_memory(recv.data(), recv.size_bytes(), what, "receive");
  const auto type = detail::nccl_type(dtype_of<T>);
  return detail::nccl_launch_op(
      comm, s, what,
      [&](ncclComm_t c, cudaStream_t stream) {
        detail::nccl_group group(what);
        for (int r = 0; r < comm.size(); ++r) {
          const auto n = static_cast<std::size_t>(counts[static_cast<std::size_t>(r)]);
          T* at = recv.data() + displs[static_cast<std::size_t>(r)];
          if (r == me) {
            cuda::copy(at, send.data(), n * sizeof(T), stream);
            continue;
          }
          if (!send.empty()) check_nccl(ncclSend(send.data(), send.size(), type, r, c, stream), cat(what, ": send to ", r));
          if (n > 0) check_nccl(ncclRecv(at, n, type, r, c, stream), cat(what, ": receive from ", r));
        }
        group.end();
      },
      detail::no_epilogue());
}

template <class T>
nccl::request nccl::ireduce_scatter(const communicator& comm, span<const detail::identity_t<T>> send, span<T> recv,
                                    span<const int> counts, op o, stream s) {
  auto& st = comm.state("nccl ireduce_scatter");
  const auto what =
      detail::nccl_describe<T>(st, comm.name(), "ireduce_scatter", send.size(), cat(", ", name_of(o)));
  check(counts.size() == static_cast<std::size_t>(comm.size()), what,
        cat("needs one count per rank (", comm.size(), "), got ", counts.size()));
  const auto displs = detail::displacements(counts, what, send.size());
  const int me = comm.rank();
  const auto mine = static_cast<std::size_t>(counts[static_cast<std::size_t>(me)]);
  check(recv.size() >= mine, what, cat("receive holds ", recv.size(), " elements, this rank gets ", mine));
  detail::require_device_memory(send.data(), send.size_bytes(), what, "send");
  detail::require_device_memory(recv.data(), mine * sizeof(T), what, "receive");
  bool even = true;
  for (const int count : counts) even = even && count == counts[0];
  const auto type = detail::nccl_type(dtype_of<T>);
  const auto reduction = detail::nccl_op(o, dtype_of<T>);
  return detail::nccl_launch_op(
      comm, s, what,
      [&](ncclComm_t c, cudaStream_t stream) {
        if (even) {
          if (mine > 0) check_nccl(ncclReduceScatter(send.data(), recv.data(), mine, type, reduction, c, stream), what);
          return;
        }
        // Uneven blocks: one reduce per block, to the rank that owns it, in one group.
        detail::nccl_group group(what);
        for (int r = 0; r < comm.size(); ++r) {
          const auto n = static_cast<std::size_t>(counts[static_cast<std::size_t>(r)]);
          if (n == 0) continue;
          check_nccl(ncclReduce(send.data() + displs[static_cast<std::size_t>(r)], r == me ? recv.data() : nullptr, n,
                                type, reduction, r, c, stream),
                     cat(what, ": block of rank ", r));
        }
        group.end();
      },
      detail::average_on_device(o, recv.subspan(0, mine), comm.size()));
}

}  // namespace flexcomm
