// What a staged communicator and its requests share: the MPI transport, the streams, and the
// operations in flight, cut into chunks that move device -> pinned host -> MPI -> device.
#pragma once

#include "../device/runtime.hpp"
#include <mpi.h>

#include <cstddef>
#include <cstdlib>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "../../core/error.hpp"
#include "../../core/setting_values.hpp"
#include "../../core/settings.hpp"
#include "../cuda/error.hpp"
#include "../mpi.hpp"
#include "../mpi_implementation.hpp"

namespace flexcomm {

// Whether this MPI library reads and writes device memory (mpi_implementation.hpp asks it).
inline bool mpi_is_cuda_aware() { return mpi_implementation::cuda_aware(); }

namespace detail {
inline std::size_t stage_chunk_bytes() {
  const char* text = setting("FLEXCOMM_STAGE_CHUNK");
  return text ? parse_stage_chunk(text) : std::size_t{1} << 20;
}

// One piece of a staged operation, moving through: staging (device to host), in flight (MPI),
// returning (host to device), done.
struct staged_chunk {
  enum : int { staging, in_flight, returning, done };
  std::size_t offset = 0, count = 0;  // elements
  cuda::event staged;                 // the chunk's data is where MPI reads it (empty: nothing to wait for)
  mpi_request transfer;
  cuda::event returned;
  int phase = staging;
};

struct staged_op {
  std::string what;
  std::vector<cuda::pinned_pool::block> blocks;  // declared first: outlives the transfers using it
  std::vector<staged_chunk> chunks;
  std::size_t started = 0;  // chunks whose transfer has begun, always a prefix
  cuda::event issued;       // the caller's stream at the call: the way back waits for it
  std::function<mpi_request(staged_chunk&)> start;
  // Enqueues the chunk's way back on the given stream; false when there is nothing to bring back.
  std::function<bool(staged_chunk&, device::stream_t)> finish;
  std::exception_ptr error;
};

// What a communicator and its requests share. Transfers begin strictly in call order, whichever
// request is tested, so every rank issues its MPI operations in the same order.
struct staged_lane {
  mpi_communicator transport;  // a private duplicate; operations that began later still reach it
  std::mutex mutex;
  std::deque<std::shared_ptr<staged_op>> starting;
  cuda::stream_handle own;   // operations' stream when the caller names none
  cuda::stream_handle back;  // host-to-device copies and epilogues
  std::size_t chunk_bytes = std::size_t{1} << 20;
  int device = 0;
  // Events of finished operations (one or two per chunk), for the next ones.
  cuda::event_pool events{256};

  // The events of a completed operation, every one of them reached.
  void recycle(staged_op& op) {
    events.give_back(op.issued);
    for (auto& c : op.chunks) {
      events.give_back(c.staged);
      events.give_back(c.returned);
    }
  }

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
          c.returned = events.take(op.what);
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

}  // namespace flexcomm
