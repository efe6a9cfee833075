// What a staged communicator and its requests share: the MPI transport, the streams, its share of
// the pinned pool, and the operations in flight, cut into chunks that move device -> pinned host ->
// MPI -> device.
#pragma once

#include "../cuda/runtime.hpp"
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "../../core/error.hpp"
#include "../../core/setting_values.hpp"
#include "../../core/settings.hpp"
#include "../cuda/error.hpp"
#include "../cuda/pinned_pool.hpp"
#include "../mpi.hpp"
#include "../mpi/batched_check.hpp"
#include "../mpi/implementation.hpp"
#include "../mpi/types.hpp"
#include "inline_call.hpp"

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
// host), in flight (MPI), returning (host to device), done. Its events stay with it when its
// operation is reused (staged_lane::spare).
struct staged_chunk {
  enum : int { staging, in_flight, returning, done };
  std::size_t offset = 0, count = 0;  // elements
  cuda::pinned_pool::block block;     // its host copy, when it moves through the pool; outlives the transfer
  cuda::event staged;                 // the chunk's data is where MPI reads it, when `wait_staged`
  MPI_Request transfer = MPI_REQUEST_NULL;  // on the transport, unrecorded there: its operation is
  cuda::event returned;
  int phase = staging;
  bool wait_staged = false;

  // Recorded on `s`: MPI waits for it.
  void mark_staged(device::stream_t s, const std::string& what) {
    if (!staged) staged = cuda::event::create(what);
    staged.record(s, what);
    wait_staged = true;
  }

  template <class T>
  T* host() const noexcept {
    return reinterpret_cast<T*>(block.get());
  }
};

// A staged operation. Completed ones are kept by their lane and reused with their name's room,
// their chunks (and the chunks' events), their event `issued` and their small pieces, so that a
// post in steady state allocates nothing.
struct staged_op {
  // Pieces up to this size stay with a reused operation (a send or receive of a small message
  // finds its host copy there, with no trip to the pool); larger ones go back to the pool.
  static constexpr std::size_t kept_piece_bytes = std::size_t{64} << 10;

  std::string what;
  std::vector<cuda::pinned_pool::piece> pieces;  // host copies of a whole buffer; outlive the transfers
  std::size_t pieces_used = 0;                   // of `pieces`, this operation's
  std::vector<staged_chunk> chunks;
  std::vector<int> counts, offsets;  // a v-collective's layout: MPI may read it when a chunk begins
  std::uint64_t sequence = 0;        // in the transport's flight recorder (0: not recorded)
  // Open MPI only (mpi_implementation::defers_collectives): a collective's chunks reach MPI once
  // this check of its call has agreed, as the MPI backend's collectives do (docs/reliability.md:
  // libnbc writes a mismatched peer's bytes past the buffers). Kept with the operation: MPI may
  // use its buffers until it completes.
  mpi_signature_check gate;
  bool gated = false;
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
  // Begins the chunk's MPI operation on the transport: the library's return code.
  inline_call<int(staged_chunk&, MPI_Request*)> start;
  // Enqueues the chunk's way back on the given stream (after `issued`); false when there is
  // nothing to bring back.
  inline_call<bool(staged_chunk&, device::stream_t)> finish;
  std::exception_ptr error;

  bool done() const noexcept { return finished == chunks.size(); }

  // `n` chunks for a new post, their events kept.
  void reuse(std::size_t n) {
    chunks.resize(n);
    for (auto& c : chunks) {
      c.offset = c.count = 0;
      c.phase = staged_chunk::staging;
      c.wait_staged = false;
    }
    through_blocks = stage_ordered = gated = false;
    from = nullptr;
    element_bytes = staged = started = finished = open = 0;
    pieces_used = 0;  // `sequence` is the builder's, set before
  }

  // A pinned piece of at least `bytes`: this operation's next kept one when it is big enough.
  std::byte* piece(std::size_t bytes) {
    if (pieces_used == pieces.size())
      pieces.emplace_back();
    auto& p = pieces[pieces_used++];
    if (!p || p.get_deleter().bytes < bytes) {
      p.reset();  // back to the pool first: its size class may be the one taken now
      p = cuda::pinned_pool::instance().take_piece(std::max<std::size_t>(bytes, 1), what);
    }
    return p.get();
  }

  // Completed: large pieces and those not used go back to the pool.
  void retire() noexcept {
    pieces.resize(pieces_used);
    pieces.erase(std::remove_if(pieces.begin(), pieces.end(),
                                [](const auto& p) { return p.get_deleter().bytes > kept_piece_bytes; }),
                 pieces.end());
  }
};

// What a communicator and its requests share. Chunks take blocks and begin their transfers
// strictly in call order, whichever request is tested, so every rank issues its MPI operations in
// the same order, and a chunk waiting for a block waits only for chunks before it, which every rank
// has begun: they finish and give their blocks back.
struct staged_lane {
  // Joins the pinned pool (the first communicator of the process pins its blocks).
  staged_lane() : pinned(chunk_bytes, pinned_cap_bytes(chunk_bytes), "staged communicator") {}
  staged_lane(const staged_lane&) = delete;
  staged_lane& operator=(const staged_lane&) = delete;
  // An abandoned operation whose chunks MPI may still write keeps its buffers for good.
  ~staged_lane() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    for (auto& op : abandoned) {
      bool quiet = !finalized;
      auto test = [&quiet](MPI_Request& r) {
        int done = 1;
        if (quiet && r != MPI_REQUEST_NULL && MPI_Test(&r, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) done = 0;
        quiet = quiet && done;
      };
      test(op->gate.req);
      for (auto& c : op->chunks) test(c.transfer);
      if (!quiet) static_cast<void>(new std::shared_ptr<staged_op>(std::move(op)));
    }
  }

  std::size_t chunk_bytes = stage_chunk_bytes();
  cuda::pinned_pool::user pinned;  // declared before the operations: outlives their blocks
  const std::size_t block_bytes = pinned.block_bytes();
  mpi_communicator transport;      // a private duplicate; operations that began later still reach it
  mpi_comm_state* watch = nullptr;  // the transport's flight recorder and side channel (null: watchdog off)
  // The consistency check of the staged collectives, one signature per operation (not per chunk),
  // in batches on the transport's side channel; numbered alike on every rank.
  batched_check consistency;
  std::uint64_t collectives = 0;
  bool disagreed = false;  // the check found the ranks' calls differ, at `disagreed_at`
  std::chrono::steady_clock::time_point disagreed_at{};
  static constexpr std::chrono::milliseconds disagreement_grace{1000};
  flexcomm::mutex mutex;
  // Vectors, not deques: a deque's push and pop allocate and free its nodes in steady state.
  std::vector<std::shared_ptr<staged_op>> starting;  // some chunk not begun yet, in call order
  std::vector<std::shared_ptr<staged_op>> moving;    // some chunk not done yet
  std::vector<std::shared_ptr<staged_op>> spare;     // completed, for the next posts
  // Failed with chunks still in MPI (timed out, or the ranks disagreed): their buffers stay theirs.
  std::vector<std::shared_ptr<staged_op>> abandoned;
  cuda::stream_handle own;   // operations' stream when the caller names none
  cuda::stream_handle back;  // host-to-device copies and epilogues
  cuda::stream_handle stage = cuda::stream_handle::create("staged communicator", true);  // copies into blocks
  int device = 0;
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

  // An operation for a new post: a completed one, or the first of its kind.
  std::shared_ptr<staged_op> take_locked() {
    if (spare.empty()) return std::make_shared<staged_op>();
    auto op = std::move(spare.back());
    spare.pop_back();
    return op;
  }

  // A completed operation, its events all reached, kept for the next post (its request's is the
  // last reference: the lane let go of it when it was done).
  void recycle_locked(std::shared_ptr<staged_op>&& op) {
    if (op.use_count() != 1) return;
    op->retire();
    spare.push_back(std::move(op));
  }

  // The consistency check's news, from a test of `op` after it was driven. Once the ranks
  // disagreed, each operation tested fails, naming the calls, once it is done: it goes on for
  // `disagreement_grace`, its chunks beginning as on every rank, so that what every rank posted
  // completes; past it, it keeps its buffers for good and the transport is poisoned (MPI cannot
  // cancel it: the job must end, core/watchdog.hpp). Ranks that go on posting alike (a sum
  // against a max) keep the job going.
  void agreed_locked(const std::shared_ptr<staged_op>& op) {
    const bool stuck = !op->done();
    const std::string& verdict = consistency.poll(stuck);
    if (verdict.empty()) return;
    const auto now = std::chrono::steady_clock::now();
    if (!disagreed) {
      disagreed = true;
      disagreed_at = now;
    }
    if (stuck && now - disagreed_at < disagreement_grace) return;
    forget_locked(op);
    if (keep_if_in_mpi_locked(op) && watch) watch->poison(cat("the ranks disagreed on the calls: ", verdict));
    fail(op->what, verdict);
  }

  // A failed operation that MPI may still read or write (a chunk's transfer, Open MPI's check)
  // keeps its buffers while the lane lives (and for good, should MPI still hold them then).
  bool keep_if_in_mpi_locked(const std::shared_ptr<staged_op>& op) {
    const bool in_mpi = op->gate.req != MPI_REQUEST_NULL ||
                        std::any_of(op->chunks.begin(), op->chunks.end(),
                                    [](const staged_chunk& c) { return c.transfer != MPI_REQUEST_NULL; });
    if (in_mpi) abandoned.push_back(op);
    return in_mpi;
  }

  // Its entry in the transport's flight recorder, once it ends.
  void finish_record(staged_op& op, op_state s) noexcept {
    if (watch && op.sequence) watch->recorder().finish(std::exchange(op.sequence, 0), s);
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
      if (c.phase == staged_chunk::in_flight && arrived(op, c)) {
        check_cuda(device::stream_wait(back.get(), op.issued.get()), op.what, ": cudaStreamWaitEvent");
        if (op.finish(c, back.get())) {
          if (!c.returned) c.returned = cuda::event::create(op.what);
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

  // Whether the call check of `op` came back agreeing; a disagreement poisons the transport (the
  // job must end, as on the MPI backend) and is an error naming who disagrees.
  bool gate_agreed(staged_op& op) {
    int flag = 0;
    if (MPI_Test(&op.gate.req, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS) {
      op.gate.req = MPI_REQUEST_NULL;  // no side channel: no check
      flag = 1;
    } else if (flag && !op.gate.agreed() && watch) {
      const std::string detail = watch->disagreement(op.gate.mine, watchdog::grace(transport.timeout()));
      watch->poison(cat("ranks disagreed on #", op.sequence, " (", op.what, ")"));
      fail(op.what, cat(detail, " (FLEXCOMM_CHECK)"));
    }
    if (flag) op.gated = false;
    return flag != 0;
  }

  // A single-request MPI_Test reports errors (truncation included) in its return code.
  static bool arrived(const staged_op& op, staged_chunk& c) {
    int flag = 0;
    const int rc = MPI_Test(&c.transfer, &flag, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) {
      c.transfer = MPI_REQUEST_NULL;
      fail(op.what, mpi_error_text(rc));
    }
    return flag != 0;
  }

  void finished(staged_op& op, staged_chunk& c) {
    c.phase = staged_chunk::done;
    if (c.block) ++blocks_back;
    c.block.reset();
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
            c.mark_staged(s, op.what);
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
          if (op.gated && !gate_agreed(op)) return;
          if (c.wait_staged && !c.staged.done(op.what)) return;
          c.wait_staged = false;
          check_mpi(op.start(c, &c.transfer), op.what);
          c.phase = staged_chunk::in_flight;
          ++op.started;
        }
      } catch (...) {
        op.error = std::current_exception();  // the op's own request reports it
      }
      starting.erase(starting.begin());
    }
  }
};
}  // namespace detail

}  // namespace flexcomm
