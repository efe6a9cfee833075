// The NCCL backend's communicator: a move-only owner of an NCCL communicator, made collectively
// from an MPI communicator, with the MPI twin (control) that carries its small host exchanges.
#pragma once

#include "../cuda/runtime.hpp"

#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "../../core/error.hpp"
#include "../../core/span.hpp"
#include "../../core/wait.hpp"
#include "../../core/watchdog.hpp"
#include "../cuda/error.hpp"
#include "../mpi.hpp"
#include "state.hpp"
#include "types.hpp"

namespace flexcomm {

struct nccl;

// Move-only owner of an NCCL communicator, made collectively from an MPI communicator.
class nccl_communicator {
 public:
  using backend = nccl;
  static constexpr int undefined = -1;

  nccl_communicator() = default;

  // Collective over `comm`: rank 0 makes the unique id, the MPI backend broadcasts it, and every
  // rank initializes without blocking, polled under the wait policy up to FLEXCOMM_TIMEOUT.
  // Uses the CUDA device current on the calling thread. An empty `comm` gives an empty one.
  nccl_communicator(const mpi_communicator& comm, std::string name) {
    if (!comm) {
      name_ = std::move(name);
      return;
    }
    const auto what = cat("nccl init of '", name, "' (rank ", comm.rank(), " of ", comm.size(), ")");
    // Byte 0 says whether rank 0 got an id, so a failure there is an error everywhere, not a hang.
    std::vector<std::uint8_t> message(1 + sizeof(device::nccl_id_t), 0);
    if (comm.rank() == 0) {
      device::nccl_id_t id;
      const device::nccl_result_t rc = device::nccl_get_unique_id(&id);
      message[0] = rc == device::nccl_success ? 1 : 0;
      if (rc == device::nccl_success) std::memcpy(message.data() + 1, &id, sizeof id);
    }
    mpi::ibcast(comm, span<std::uint8_t>(message), 0).wait();
    check(message[0] == 1, what, "rank 0 could not make an NCCL unique id (ncclGetUniqueId failed there)");
    device::nccl_id_t id;
    std::memcpy(&id, message.data() + 1, sizeof id);

    auto state = std::make_shared<detail::nccl_state>();
    state->name = name;
    check_cuda(device::get_device(&state->device), what, ": cudaGetDevice");
    cuda::engine_on_device(state->device);
    device::nccl_comm_t handle = nullptr;
    const setup_record record(comm.watch_state(), "ncclCommInitRank");
    check_nccl(device::nccl_comm_init(&handle, comm.size(), id, comm.rank(), comm.native()), what);
    adopt(*state, handle, what, record);
    open_point_to_point(*state, what);
    state->stream = cuda::stream_handle::create(what);
    control_ = comm.dup(cat(name, " control"));
    state->watch = watch_over(control_, name);
    state->consistency.open(state->watch->side(), what);
    state_ = std::move(state);
    name_ = std::move(name);
  }

  // An MPI communicator converts (collectively, under its own name), so that an adapter built
  // from the pipeline's MPI communicators can run on NCCL: subgroup_allreduce<nccl>(member_comm).
  nccl_communicator(const mpi_communicator& comm)  // NOLINT: implicit on purpose
      : nccl_communicator(comm, comm.name()) {}

  nccl_communicator(nccl_communicator&&) noexcept = default;
  nccl_communicator& operator=(nccl_communicator&&) noexcept = default;
  nccl_communicator(const nccl_communicator&) = delete;
  nccl_communicator& operator=(const nccl_communicator&) = delete;
  ~nccl_communicator() = default;  // the state is destroyed (finalized) with the last request

  explicit operator bool() const noexcept { return state_ != nullptr; }
  int rank() const noexcept { return state_ ? state_->rank : -1; }
  int size() const noexcept { return state_ ? state_->size : 0; }
  const std::string& name() const noexcept { return name_; }
  device::nccl_comm_t native() const noexcept { return state_ ? state_->comm : nullptr; }
  // The communicator's own stream: where operations go when the caller names none.
  device::stream_t own_stream() const noexcept { return state_ ? state_->stream.get() : nullptr; }
  int device() const noexcept { return state_ ? state_->device : -1; }
  // An MPI communicator over the same ranks, for small host-memory exchanges (an adapter's
  // cross-rank checks) that NCCL, which moves device memory only, cannot carry.
  const mpi_communicator& control() const noexcept { return control_; }

  // Collective over this communicator (ncclCommSplit); `undefined` takes part, gets an empty one.
  nccl_communicator split(int color, int key, std::string name) const {
    const auto what = cat(name_, ": nccl split into '", name, "'");
    auto& st = state(what);
    detail::device_guard guard(st.device, what);
    std::lock_guard<flexcomm::mutex> lock(st.mutex);
    st.flush_locked(what);
    // NCCL may write the new handle while the split settles in the background: the slot lives
    // as long as the parent.
    st.split_slots.push_back(std::make_unique<device::nccl_comm_t>(nullptr));
    device::nccl_comm_t* slot = st.split_slots.back().get();
    const setup_record record(st.watch, "ncclCommSplit");
    check_nccl(device::nccl_comm_split(st.comm, color, key, slot), what);
    if (!detail::nccl_settle(st.comm, what, st.timeout())) {
      // Every rank of the parent takes part: the parent and the half-made child are given up.
      if (*slot) device::nccl_comm_abort(*slot);
      st.abort_locked(cat(what, ": did not finish"));
      record.timed_out(what, st.timeout(), "the parent and the new communicator aborted with ncclCommAbort");
    }
    nccl_communicator out;
    out.control_ = control_.split(color, key, cat(name, " control"));
    out.name_ = std::move(name);
    if (*slot == nullptr) {
      check(color < 0, what, "ncclCommSplit returned no communicator for a rank with a color");
      return out;
    }
    auto state = std::make_shared<detail::nccl_state>();
    state->name = out.name_;
    state->device = st.device;
    adopt(*state, *slot, what, record);
    open_point_to_point(*state, what);
    state->stream = cuda::stream_handle::create(what);
    state->watch = watch_over(out.control_, out.name_);
    state->consistency.open(state->watch->side(), what);
    out.state_ = std::move(state);
    return out;
  }

  nccl_communicator dup(std::string name) const { return split(0, rank(), std::move(name)); }

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

  // Sequence number of the next collective: equal on every rank for the same collective, so
  // traces can be matched across ranks.
  std::uint64_t next_collective() const {
    auto& st = state(name_);
    std::lock_guard<flexcomm::mutex> lock(st.mutex);
    return ++st.collectives;
  }

  // For the backend's operations.
  detail::nccl_state& state(const std::string& what) const {
    check(state_ != nullptr, what, "operation on an empty nccl communicator '", name_, "'");
    return *state_;
  }
  const std::shared_ptr<detail::nccl_state>& shared_state() const noexcept { return state_; }

 private:
  // Collective over `control`: the bookkeeping of this communicator's operations (see nccl_state).
  static std::shared_ptr<detail::mpi_comm_state> watch_over(const mpi_communicator& control, const std::string& name) {
    auto watch = std::make_shared<detail::mpi_comm_state>(control.native(), name);
    watchdog::instance().add(watch);
    return watch;
  }

  // An init or a split, recorded in the flight recorder of the MPI communicator over the same
  // ranks, so that one that times out names the ranks that did not arrive, asked on its side
  // channel as a timed-out wait asks (the ranks that came time out as well and answer).
  class setup_record {
   public:
    setup_record(std::shared_ptr<detail::mpi_comm_state> watch, const char* name) : watch_(std::move(watch)) {
      if (watch_) seq_ = watch_->recorder().enqueue(op_record::posting(name, 0, dtype::u8, "", -1, -1));
    }
    setup_record(const setup_record&) = delete;
    setup_record& operator=(const setup_record&) = delete;
    ~setup_record() {
      if (watch_) watch_->recorder().finish(seq_, std::uncaught_exceptions() ? op_state::failed : op_state::completed);
    }
    [[noreturn]] void timed_out(const std::string& what, std::chrono::milliseconds limit, const char* done) const {
      std::string report;
      if (watch_) {
        watch_->recorder().finish(seq_, op_state::timed_out);
        watch_->announce();
        report = cat("\n", watch_->diagnose(seq_, watchdog::grace(limit)));
      }
      fail(what, cat("did not finish within ", limit.count(), " ms (FLEXCOMM_TIMEOUT); ", done,
                     ". Every rank of the communicator must create it, in the same order; two ranks on one GPU "
                     "need distinct NCCL_HOSTID", report));
    }

   private:
    std::shared_ptr<detail::mpi_comm_state> watch_;
    std::uint64_t seq_ = 0;
  };

  // Waits for a nonblocking init or split to settle; on timeout aborts the half-made communicator.
  static void adopt(detail::nccl_state& state, device::nccl_comm_t handle, const std::string& what,
                    const setup_record& record) {
    if (!detail::nccl_settle(handle, what, default_timeout())) {
      device::nccl_comm_abort(handle);
      record.timed_out(what, default_timeout(), "aborted with ncclCommAbort");
    }
    state.comm = handle;
    check_nccl(device::nccl_comm_count(handle, &state.size), what, ": ncclCommCount");
    check_nccl(device::nccl_comm_user_rank(handle, &state.rank), what, ": ncclCommUserRank");
  }

  // The blocking child that carries the sends and receives (nccl_state::p2p), split from the new
  // communicator while every rank is there: its init or split has just settled on all of them.
  // Nonblocking, a grouped send and receive posts in 48-59 us, blocking in 8-17 us (docs/cuda.md).
  // The parent is nonblocking, so the split is too: NCCL writes the handle when it settles.
  static void open_point_to_point(detail::nccl_state& state, const std::string& what) {
    const auto which = cat(what, ": ncclCommSplit of its blocking point-to-point communicator");
    state.split_slots.push_back(std::make_unique<device::nccl_comm_t>(nullptr));
    device::nccl_comm_t* slot = state.split_slots.back().get();
    check_nccl(device::nccl_comm_split(state.comm, 0, state.rank, slot, true), which);
    if (!detail::nccl_settle(state.comm, which, default_timeout())) {
      if (*slot) device::nccl_comm_abort(*slot);
      device::nccl_comm_abort(std::exchange(state.comm, nullptr));
      fail(which, cat("did not finish within ", default_timeout().count(),
                      " ms (FLEXCOMM_TIMEOUT); both aborted with ncclCommAbort"));
    }
    const device::nccl_comm_t child = *slot;
    check(child != nullptr, which, "NCCL returned no communicator");
    state.p2p = child;
    state.p2p_watch = std::make_shared<detail::blocking_watch>(child);
    detail::blocking_watcher::instance().add(state.p2p_watch);
  }

  std::shared_ptr<detail::nccl_state> state_;
  mpi_communicator control_;
  std::string name_;
};

}  // namespace flexcomm
