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
#include "arguments.hpp"
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
  std::uint64_t sequence = 0;       // in the communicator's flight recorder
  trace::collective_mark trace;     // collectives only
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
  // The MPI backend's bookkeeping over the same ranks: flight recorder, timeout and the side
  // channel on which a rank that timed out asks its peers where they stand. NCCL operations are
  // recorded there, so a timeout names the ranks that did not arrive, as MPI's do.
  std::shared_ptr<mpi_comm_state> watch;
  std::uint64_t collectives = 0;  // under the mutex; names the same collective on every rank
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
          !nccl_settle(comm, cat(name, ": ncclCommFinalize"), timeout())) {
        ncclCommAbort(comm);
        return;
      }
      ncclCommDestroy(comm);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s\n(while destroying nccl communicator '%s'; aborting it)\n", e.what(), name.c_str());
      ncclCommAbort(comm);
    }
  }

  std::chrono::milliseconds timeout() const { return watch ? watch->timeout() : default_timeout(); }

  std::uint64_t record(const op_record& r) { return watch ? watch->recorder().enqueue(r) : 0; }
  void finish(std::uint64_t seq, op_state s) {
    if (watch && seq) watch->recorder().finish(seq, s);
  }

  std::string where() const {
    const std::uint64_t enqueued = watch ? watch->recorder().last_enqueued() : 0;
    const std::uint64_t completed = watch ? watch->recorder().last_completed() : 0;
    return cat("nccl communicator '", name, "' (rank ", rank, " of ", size, "; last enqueued #", enqueued,
               ", last completed #", completed, ")");
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
    if (!nccl_settle(comm, what, timeout())) {
      const auto reason = cat("enqueueing did not finish within ", timeout().count(), " ms (FLEXCOMM_TIMEOUT)");
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
    control_ = comm.dup(cat(name, " control"));
    state->watch = watch_over(control_, name);
    state_ = std::move(state);
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
    state->watch = watch_over(out.control_, out.name_);
    out.state_ = std::move(state);
    return out;
  }

  communicator dup(std::string name) const { return split(0, rank(), std::move(name)); }

  // How long a wait on this communicator's operations may take; zero: forever. Unset (or
  // negative), FLEXCOMM_TIMEOUT's default_timeout() applies. Past it the communicator is aborted.
  void set_timeout(std::chrono::milliseconds t) {
    if (state_ && state_->watch) state_->watch->limit.set(t);
  }
  std::chrono::milliseconds timeout() const { return state_ ? state_->timeout() : default_timeout(); }

  // The recent operations on this communicator (a timeout's error prints them).
  const flight_recorder* recorder() const noexcept {
    return state_ && state_->watch ? &state_->watch->recorder() : nullptr;
  }

  // For the backend's operations.
  detail::nccl_state& state(const std::string& what) const {
    check(state_ != nullptr, what, cat("operation on an empty nccl communicator '", name_, "'"));
    return *state_;
  }
  const std::shared_ptr<detail::nccl_state>& shared_state() const noexcept { return state_; }

 private:
  // Collective over `control`: the bookkeeping of this communicator's operations (see nccl_state).
  static std::shared_ptr<detail::mpi_comm_state> watch_over(const mpi::communicator& control, const std::string& name) {
    auto watch = std::make_shared<detail::mpi_comm_state>(control.native(), name);
    watchdog::instance().add(watch);
    return watch;
  }

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
        end(op_state::failed);
        fail(what_, cat(st.where(), " was aborted: ", st.abort_reason));
      }
      if (!launch_->launched) {
        try {
          st.flush_locked(what_);
        } catch (...) {
          end(op_state::failed);
          throw;
        }
        // An event never recorded reads as reached: an operation lost with a failed group launch
        // must not look finished.
        if (!launch_->launched) {
          end(op_state::failed);
          fail(what_, "its NCCL group launch failed (reported by the operation that launched it)");
        }
      }
    }
    if (launch_->done.done(what_)) {
      end(op_state::completed);
      return true;
    }
    ncclResult_t async = ncclSuccess;
    {
      std::lock_guard<std::mutex> lock(st.mutex);
      if (st.comm) check_nccl(ncclCommGetAsyncError(st.comm, &async), cat(what_, ": ncclCommGetAsyncError"));
      if (async != ncclSuccess && async != ncclInProgress) {
        const auto place = st.where();
        st.abort_locked(cat(what_, ": ", ncclGetErrorString(async)));
        end(op_state::failed);
        fail(what_, cat("asynchronous NCCL error: ", ncclGetErrorString(async), "; ", place, " aborted"));
      }
    }
    return false;
  }

  // Waits under the policy; past `timeout` (the communicator's, else FLEXCOMM_TIMEOUT) the
  // peers are asked where they stand, as MPI's timeouts do, and the communicator is aborted.
  // Unlike MPI, NCCL can cancel: the job can go on without this communicator.
  void wait(const wait_policy& policy = default_wait(), std::chrono::milliseconds timeout = inherit) {
    if (!pending()) return;
    auto& st = *state_;
    const auto limit = timeout.count() >= 0 ? timeout : st.timeout();
    auto answer = [&] {
      if (st.watch) st.watch->answer_queries();
    };
    if (wait_answering(policy, limit, [&] { return test(); }, answer)) return;
    const auto seq = launch_->sequence;
    end(op_state::timed_out);
    std::string report;
    if (st.watch) {
      st.watch->announce();
      report = cat("\n", st.watch->diagnose(seq, watchdog::grace(limit)));
    }
    std::string place;
    {
      std::lock_guard<std::mutex> lock(st.mutex);
      place = st.where();
      st.abort_locked(cat(what_, ": timed out after ", limit.count(), " ms"));
    }
    fail(what_, cat("timed out after ", limit.count(), " ms (FLEXCOMM_TIMEOUT); ", place,
                    " aborted with ncclCommAbort (a rank did not take part, or the ranks issued operations in ",
                    "different orders)", report));
  }

  // wait()'s default: the communicator's own timeout, else FLEXCOMM_TIMEOUT.
  static constexpr std::chrono::milliseconds inherit = inherit_timeout;

  // Backend-internal: marks this request as collective `kind` in the trace, from now to completion.
  void trace_collective(const char* kind, std::uint64_t sequence, const std::string& comm) noexcept {
    if (launch_) launch_->trace.begin(kind, comm, sequence);
  }

 private:
  // The operation is over, one way or another: recorded as such, its trace span closed.
  void end(op_state how) noexcept {
    state_->finish(launch_->sequence, how);
    launch_->trace.end();
    launch_.reset();
  }

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
// One operation being issued: in the flight recorder at once, under the number its errors name,
// and marked failed there if it never reaches NCCL (a bad argument, a failed enqueue).
class nccl_op_start {
 public:
  nccl_op_start(const nccl::communicator& comm, const char* name, std::size_t count, dtype type,
                const char* redop = "", int peer = -1, int tag = -1, const std::string& extra = {})
      : state_(comm.state(cat("nccl ", name, " on ", comm.name()))), name_(name) {
    seq_ = state_.record(op_record::posting(name, count, type, redop, peer, tag));
    what = describe_operation("nccl", name, comm.name(), seq_, count, type, extra);
  }
  nccl_op_start(const nccl_op_start&) = delete;
  nccl_op_start& operator=(const nccl_op_start&) = delete;
  ~nccl_op_start() { state_.finish(seq_, op_state::failed); }

  std::string what;
  const char* name() const noexcept { return name_; }
  // The operation reached NCCL: its request owns the record from here.
  std::uint64_t take() noexcept { return std::exchange(seq_, 0); }

 private:
  nccl_state& state_;
  const char* name_;
  std::uint64_t seq_ = 0;
};

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
nccl::request nccl_launch_op(const nccl::communicator& comm, cudaStream_t s, nccl_op_start& start,
                             Enqueue&& enqueue, Epilogue&& epilogue) {
  const auto& what = start.what;
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
  launch->done = cuda::event::create(what);
  launch->done.record(stream, what);
  launch->launched = true;
  launch->sequence = start.take();
  nccl::request r(comm.shared_state(), std::move(launch), what);
  r.trace_collective(start.name(), ++st.collectives, comm.name());
  return r;
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
  nccl_op_start start(comm, send ? "isend" : "irecv", buf.size(), dtype_of<E>, "", peer, tag,
                      cat(send ? ", to " : ", from ", peer, ", tag ", tag));
  const auto& what = start.what;
  auto& st = comm.state(what);
  device_guard guard(st.device, comm.name());  // the event belongs to the communicator's device
  std::lock_guard<std::mutex> lock(st.mutex);
  st.require_usable(what);
  check_rank_of(peer, st.size, "peer", what);
  // NCCL has no tags: messages between two ranks match in the order they were issued.
  require_device_memory(buf.data(), buf.size_bytes(), what, send ? "send" : "receive");
  auto launch = std::make_shared<nccl_launch>();
  launch->done = cuda::event::create(what);
  launch->sequence = start.take();
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
  detail::nccl_op_start start(comm, "ibcast", buf.size(), dtype_of<T>, "", root, -1, cat(", root ", root));
  const auto& what = start.what;
  detail::check_rank_of(root, comm.size(), "root", what);
  detail::require_device_memory(buf.data(), buf.size_bytes(), what, "broadcast");
  return detail::nccl_launch_op(
      comm, s, start,
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
  detail::nccl_op_start start(comm, "iallreduce", recv.size(), dtype_of<T>, name_of(o), -1, -1,
                              cat(", ", name_of(o)));
  const auto& what = start.what;
  detail::check_same_size(send.size(), recv.size(), what);
  detail::require_device_memory(send.data(), send.size_bytes(), what, "send");
  detail::require_device_memory(recv.data(), recv.size_bytes(), what, "receive");
  return detail::nccl_launch_op(
      comm, s, start,
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
  detail::nccl_op_start start(comm, "ireduce", send.size(), dtype_of<T>, name_of(o), root, -1,
                              cat(", ", name_of(o), ", root ", root));
  const auto& what = start.what;
  detail::check_rank_of(root, comm.size(), "root", what);
  const bool at_root = comm.rank() == root;
  detail::check_root_receive(at_root, send.size(), recv.size(), what);
  detail::require_device_memory(send.data(), send.size_bytes(), what, "send");
  if (at_root) detail::require_device_memory(recv.data(), recv.size_bytes(), what, "receive");
  return detail::nccl_launch_op(
      comm, s, start,
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
  detail::nccl_op_start start(comm, "igatherv", send.size(), dtype_of<T>, "", root, -1, cat(", root ", root));
  const auto& what = start.what;
  detail::check_rank_of(root, comm.size(), "root", what);
  const bool at_root = comm.rank() == root;
  std::vector<int> displs;
  if (at_root) {
    displs = detail::gather_layout(counts, comm.size(), root, send.size(), recv.size(), what).offsets;
    detail::require_device_memory(recv.data(), recv.size_bytes(), what, "receive");
  }
  detail::require_device_memory(send.data(), send.size_bytes(), what, "send");
  const auto type = detail::nccl_type(dtype_of<T>);
  return detail::nccl_launch_op(
      comm, s, start,
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
  detail::nccl_op_start start(comm, "iallgather", send.size(), dtype_of<T>);
  const auto& what = start.what;
  detail::check_allgather_sizes(send.size(), recv.size(), comm.size(), what);
  detail::require_device_memory(send.data(), send.size_bytes(), what, "send");
  detail::require_device_memory(recv.data(), recv.size_bytes(), what, "receive");
  return detail::nccl_launch_op(
      comm, s, start,
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
  detail::nccl_op_start start(comm, "iallgatherv", send.size(), dtype_of<T>);
  const auto& what = start.what;
  const int me = comm.rank();
  const auto displs = detail::allgatherv_layout(counts, comm.size(), me, send.size(), recv.size(), what).offsets;
  detail::require_device_memory(send.data(), send.size_bytes(), what, "send");
  detail::require_device_memory(recv.data(), recv.size_bytes(), what, "receive");
  const auto type = detail::nccl_type(dtype_of<T>);
  return detail::nccl_launch_op(
      comm, s, start,
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
  detail::nccl_op_start start(comm, "ireduce_scatter", send.size(), dtype_of<T>, name_of(o), -1, -1,
                              cat(", ", name_of(o)));
  const auto& what = start.what;
  const auto displs = detail::block_layout(counts, comm.size(), send.size(), what).offsets;
  const int me = comm.rank();
  const auto mine = detail::reduce_scatter_share(counts, comm.size(), me, send.size(), recv.size(), what);
  detail::require_device_memory(send.data(), send.size_bytes(), what, "send");
  detail::require_device_memory(recv.data(), mine * sizeof(T), what, "receive");
  bool even = true;
  for (const int count : counts) even = even && count == counts[0];
  const auto type = detail::nccl_type(dtype_of<T>);
  const auto reduction = detail::nccl_op(o, dtype_of<T>);
  return detail::nccl_launch_op(
      comm, s, start,
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
