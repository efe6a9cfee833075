// The staged backend's communicator: an MPI communicator (a private duplicate, the transport)
// with the streams and ordering its staged operations need, and an MPI twin for control traffic.
#pragma once

#include "../cuda/runtime.hpp"

#include <chrono>
#include <memory>
#include <string>
#include <utility>

#include "../../core/error.hpp"
#include "../../core/wait.hpp"
#include "../cuda/error.hpp"
#include "../mpi.hpp"
#include "lane.hpp"

namespace flexcomm {

template <bool Direct>
struct basic_staged;

// An MPI communicator (a private duplicate) with the streams and ordering its staged operations need.
template <bool Direct>
class staged_communicator {
 public:
  using backend = basic_staged<Direct>;
  static constexpr int undefined = mpi_communicator::undefined;

  staged_communicator() = default;
  // Collective over `comm`. Uses the CUDA device current on the calling thread.
  staged_communicator(const mpi_communicator& comm, std::string name)
      : staged_communicator(comm ? comm.dup(name) : mpi_communicator(), std::move(name), 0) {
    if (comm) control_ = comm.dup(cat(name_, " control"));
  }
  // An MPI communicator converts (collectively: a private duplicate), as nccl's does.
  staged_communicator(const mpi_communicator& comm)  // NOLINT: implicit on purpose
      : staged_communicator(comm, comm.name()) {}
  ~staged_communicator() = default;

  staged_communicator(staged_communicator&&) noexcept = default;
  staged_communicator& operator=(staged_communicator&&) noexcept = default;
  staged_communicator(const staged_communicator&) = delete;
  staged_communicator& operator=(const staged_communicator&) = delete;

  explicit operator bool() const noexcept { return lane_ != nullptr; }
  int rank() const noexcept { return lane_ ? lane_->transport.rank() : -1; }
  int size() const noexcept { return lane_ ? lane_->transport.size() : 0; }
  const std::string& name() const noexcept { return name_; }
  MPI_Comm native() const noexcept { return lane_ ? lane_->transport.native() : MPI_COMM_NULL; }
  const mpi_communicator& transport() const { return lane(name_).transport; }
  device::stream_t own_stream() const noexcept { return lane_ ? lane_->own.get() : nullptr; }

  // An MPI communicator over the same ranks for small host-memory exchanges, apart from the
  // staged traffic (whose MPI operations begin later, in their own order).
  const mpi_communicator& control() const noexcept { return control_; }

  staged_communicator split(int color, int key, std::string name) const {
    const auto what = cat(name_, ": split into '", name, "'");
    staged_communicator out(lane(what).transport.split(color, key, name), name, 0);
    out.control_ = control_.split(color, key, cat(name, " control"));
    return out;
  }
  staged_communicator dup(std::string name) const {
    const auto what = cat(name_, ": dup into '", name, "'");
    staged_communicator out(lane(what).transport.dup(name), name, 0);
    out.control_ = control_.dup(cat(name, " control"));
    return out;
  }

  // How long a wait on this communicator's operations may take; zero: forever. Unset (or
  // negative), FLEXCOMM_TIMEOUT's default_timeout() applies.
  void set_timeout(std::chrono::milliseconds t) {
    if (lane_) detail::mutable_comm(lane_->transport).set_timeout(t);
  }
  std::chrono::milliseconds timeout() const { return lane_ ? lane_->transport.timeout() : default_timeout(); }

  // The recent operations on this communicator, each staged operation once (its chunks' MPI
  // calls are not recorded one by one).
  const flight_recorder* recorder() const noexcept { return lane_ ? lane_->transport.recorder() : nullptr; }

  detail::staged_lane& lane(const std::string& what) const {
    check(lane_ != nullptr, what, "operation on an empty staged communicator '", name_, "'");
    return *lane_;
  }
  const std::shared_ptr<detail::staged_lane>& shared_lane() const noexcept { return lane_; }

 private:
  staged_communicator(mpi_communicator&& comm, std::string name, int) : name_(std::move(name)) {
    if (!comm) return;
    const auto what = cat(Direct ? "cuda_aware_mpi" : "staged", " communicator '", name_, "'");
    if constexpr (Direct)
      check(mpi_is_cuda_aware(), what,
            "this MPI library is not CUDA-aware (MPIX_GPU_query_support says no); use flexcomm::staged");
    auto lane = std::make_shared<detail::staged_lane>();
    check_cuda(device::get_device(&lane->device), what, ": cudaGetDevice");
    cuda::engine_on_device(lane->device);
    lane->own = cuda::stream_handle::create(what);
    lane->back = cuda::stream_handle::create(what, true);
    lane->chunk_bytes = detail::stage_chunk_bytes();
    lane->transport = std::move(comm);
    lane->watch = lane->transport.watch_state().get();
    lane->consistency.open(lane->watch ? lane->watch->side() : MPI_COMM_NULL, what);
    lane_ = std::move(lane);
  }

  std::string name_;
  std::shared_ptr<detail::staged_lane> lane_;
  mpi_communicator control_;
};

}  // namespace flexcomm
