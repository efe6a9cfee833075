// What a staged communicator and its requests share: the MPI transport, the streams, its share of
// the pinned pool, and the operations in flight, cut into chunks that move device -> pinned host ->
// MPI -> device.
#pragma once

#include "../cuda/runtime.hpp"
#include <mpi.h>

#include <algorithm>
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
#include "../cuda/pinned_pool.hpp"
#include "../mpi.hpp"
#include "../mpi/implementation.hpp"

namespace flexcomm {

// Whether this MPI library reads and writes device memory (mpi/implementation.hpp asks it).
inline bool mpi_is_cuda_aware() { return mpi_implementation::cuda_aware(); }

namespace detail {
inline std::size_t stage_chunk_bytes() {
  const char* text = setting("FLEXCOMM_STAGE_CHUNK");
  return text ? parse_stage_chunk(text) : default_stage_chunk;
}
// FLEXCOMM_PINNED_BYTES, or 64 chunks.
inline std::size_t pinned_cap_bytes(std::size_t chunk_bytes) {
  const char* text = setting("FLEXCOMM_PINNED_BYTES");
  return text ? parse_pinned_bytes(text, chunk_bytes) : default_pinned_chunks * chunk_bytes;
}

// One piece of a staged operation, moving through: staging (waiting for its block, then device to
// host), in flight (MPI), returning (host to device), done.
struct staged_chunk {
  enum : int { staging, in_flight, returning, done };
  std::size_t offset = 0, count = 0;  // elements
  cuda::pinned_pool::block block;     // its host copy, when it moves through the pool; outlives the transfer
  cuda::event staged;                 // the chunk's data is where MPI reads it (empty: nothing to wait for)
  mpi_request transfer;
  cuda::event returned;
  int phase = staging;

  template <class T>
  T* host() const noexcept {
    return reinterpret_cast<T*>(block.get());
  }
};

struct staged_op {
  std::string what;
  std::vector<cuda::pinned_pool::piece> pieces;  // host copies of a whole buffer; outlive the transfers
  std::vector<staged_chunk> chunks;
  // Chunks moving through the pool's blocks: each takes a block in call order (waiting, if need
  // be, for one to come back), then its slice of `from` is copied there (nothing when null).
  bool through_blocks = false;
  const std::byte* from = nullptr;
  std::size_t element_bytes = 0;
  std::size_t staged = 0;    // through_blocks: chunks holding their block, their copy enqueued; a prefix
  std::size_t started = 0;   // chunks whose transfer has begun, always a prefix
  std::size_t finished = 0;  // chunks done
  std::size_t open = 0;      // chunks before it are done
  bool stage_ordered = false;  // the staging stream waits for `issued`
  cuda::event issued;          // the caller's stream at the call: the way back waits for it
  std::function<mpi_request(staged_chunk&)> start;
  // Enqueues the chunk's way back on the given stream; false when there is nothing to bring back.
  std::function<bool(staged_chunk&, device::stream_t)> finish;
  std::exception_ptr error;

  bool done() const noexcept { return finished == chunks.size(); }
};

// What a communicator and its requests share. Chunks take blocks and begin their transfers
// strictly in call order, whichever request is tested, so every rank issues its MPI operations in
// the same order, and a chunk waiting for a block waits only for chunks before it, which every rank
// has begun: they finish and give their blocks back.
struct staged_lane {
  // Joins the pinned pool (the first communicator of the process pins its blocks).
  staged_lane() : pinned(chunk_bytes, pinned_cap_bytes(chunk_bytes), "staged communicator") {}

  std::size_t chunk_bytes = stage_chunk_bytes();
  cuda::pinned_pool::user pinned;  // declared before the operations: outlives their blocks
  const std::size_t block_bytes = pinned.block_bytes();
  mpi_communicator transport;      // a private duplicate; operations that began later still reach it
  flexcomm::mutex mutex;
  std::deque<std::shared_ptr<staged_op>> starting;  // some chunk not begun yet
  std::vector<std::shared_ptr<staged_op>> moving;   // some chunk not done yet
  cuda::stream_handle own;   // operations' stream when the caller names none
  cuda::stream_handle back;  // host-to-device copies and epilogues
  cuda::stream_handle stage = cuda::stream_handle::create("staged communicator", true);  // copies into blocks
  int device = 0;
  // Events of finished chunks and operations, for the next ones.
  cuda::event_pool events;
  std::size_t blocks_back = 0;  // blocks given back by finished chunks, ever

  // Elements of T per chunk: FLEXCOMM_STAGE_CHUNK's worth, as much as a block holds.
  template <class T>
  std::size_t chunk_elements() const {
    return std::max<std::size_t>(1, std::min(chunk_bytes, block_bytes) / sizeof(T));
  }

  // A new operation, posted on `caller` (the stream its `issued` is recorded on): its chunks go as
  // far as they can now, those that find a block copied to it on `caller`, as its other work is.
  void post_locked(const std::shared_ptr<staged_op>& op, device::stream_t caller) {
    starting.push_back(op);
    moving.push_back(op);
    stage_locked(op.get(), caller);
    start_locked();
  }

  // Moves the communicator's operations along, for a test of `tested`: its chunks that arrived go
  // back to the device, the next chunks in call order take blocks (settling earlier operations
  // when none is free) and are copied to them, and staged chunks begin. A failure belongs to its
  // operation, which its own request reports.
  void drive_locked(staged_op& tested) {
    settle_locked(tested);
    stage_locked();
    start_locked();
  }

  // The events of a completed operation, every one of them reached.
  void recycle(staged_op& op) {
    events.give_back(op.issued);
    for (auto& c : op.chunks) {
      events.give_back(c.staged);
      events.give_back(c.returned);
    }
  }

  // An operation given up on (timed out) must never begin later.
  void forget_locked(const std::shared_ptr<staged_op>& op) {
    starting.erase(std::remove(starting.begin(), starting.end(), op), starting.end());
    moving.erase(std::remove(moving.begin(), moving.end(), op), moving.end());
  }

 private:
  // Settles one operation; once done or failed it stops moving.
  void settle_locked(staged_op& op) {
    settle_guarded(op);
    if (!op.error && !op.done()) return;
    const auto it = std::find_if(moving.begin(), moving.end(), [&op](const auto& m) { return m.get() == &op; });
    if (it != moving.end()) moving.erase(it);
  }

  // Settles operations, earliest first, until one of them gives a block back: the next chunk needs it.
  void settle_for_a_block_locked() {
    const std::size_t before = blocks_back;
    for (auto& op : moving) {
      settle_guarded(*op);
      if (blocks_back != before) break;
    }
    moving.erase(std::remove_if(moving.begin(), moving.end(), [](const auto& op) { return op->error || op->done(); }),
                 moving.end());
  }

  void settle_guarded(staged_op& op) {
    if (op.error) return;
    try {
      settle(op);
    } catch (...) {
      op.error = std::current_exception();
    }
  }

  // Chunks whose transfer finished go back to the device, and those back there are done.
  void settle(staged_op& op) {
    for (std::size_t i = op.open; i < op.started; ++i) {
      auto& c = op.chunks[i];
      if (c.phase == staged_chunk::in_flight && c.transfer.test()) {
        if (op.finish(c, back.get())) {
          c.returned = events.take(op.what);
          c.returned.record(back.get(), op.what);
          c.phase = staged_chunk::returning;
        } else {
          finished(op, c);
        }
      }
      if (c.phase == staged_chunk::returning && c.returned.done(op.what)) finished(op, c);
    }
    while (op.open < op.started && op.chunks[op.open].phase == staged_chunk::done) ++op.open;
  }

  void finished(staged_op& op, staged_chunk& c) {
    c.phase = staged_chunk::done;
    if (c.block) ++blocks_back;
    c.block.reset();
    events.give_back(c.returned);
    ++op.finished;
  }

  // Blocks go to chunks in call order: when the next chunk cannot have one, no later chunk may. A
  // chunk that takes its block later than its operation's call is copied on the staging stream,
  // after the caller's stream as it was at the call.
  void stage_locked(const staged_op* posting = nullptr, device::stream_t caller = nullptr) {
    for (auto& shared : starting) {
      staged_op& op = *shared;
      if (!op.through_blocks || op.error) continue;
      try {
        while (op.staged < op.chunks.size()) {
          auto& c = op.chunks[op.staged];
          c.block = pinned.try_take();
          if (!c.block) {
            settle_for_a_block_locked();
            c.block = pinned.try_take();
          }
          if (!c.block) return;
          if (op.from && c.count) {
            const device::stream_t s = &op == posting ? caller : stage.get();
            if (s == stage.get() && !op.stage_ordered) {
              check_cuda(device::stream_wait(s, op.issued.get()), op.what, ": cudaStreamWaitEvent");
              op.stage_ordered = true;
            }
            check_cuda(device::copy_async(c.block.get(), op.from + c.offset * op.element_bytes,
                                          c.count * op.element_bytes, s),
                       op.what, ": cudaMemcpyAsync to the host");
            c.staged = events.take(op.what);
            c.staged.record(s, op.what);
          }
          ++op.staged;
        }
      } catch (...) {
        op.error = std::current_exception();
      }
    }
  }

  void start_locked() {
    while (!starting.empty()) {
      auto& op = *starting.front();
      try {
        while (!op.error && op.started < op.chunks.size()) {
          auto& c = op.chunks[op.started];
          if (op.through_blocks && op.started == op.staged) return;
          if (c.staged && !c.staged.done(op.what)) return;
          events.give_back(c.staged);
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
};
}  // namespace detail

}  // namespace flexcomm
