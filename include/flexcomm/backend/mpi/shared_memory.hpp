// The MPI backend's intra-host allreduce through one shared-memory segment (MPI-3: a shared
// split and MPI_Win_allocate_shared), the capability contract.hpp calls has_host_shared_memory:
// mpi::host_reducer. Made collectively over a communicator whose ranks all share one host.
//
// The segment holds one progress counter per rank (a cache line each) and one slot per rank.
// A bucket goes through it in chunks of at most a slot; for chunk c (numbered from 1 over the
// reducer's life) every rank r
//   1. copies its chunk into slot r and publishes progress 3c-2 (release);
//   2. once every rank's progress is >= 3c-2 (acquire), reduces its share of the chunk (a 64-byte
//      aligned 1/N of it) into slot 0 in rank order, slot 0 op slot 1 op ... op slot N-1 (avg:
//      then divides its share), and publishes 3c-1;
//   3. once every rank's progress is >= 3c-1, copies the whole reduced chunk out of slot 0 and
//      publishes 3c.
// Every element is reduced by one rank, so every rank ends with the same bits. Reuse is safe: a
// peer reads slot r (r > 0) only in step 2, which it finishes before publishing 3c-1, and rank r
// does not write slot r again before seeing that; slot 0 is read by everyone in step 3 too, so
// rank 0 waits for every progress >= 3c before writing chunk c+1 into it.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <new>
#include <string>

#include "../../core/datatype.hpp"
#include "../../core/error.hpp"
#include "../../core/reduce.hpp"
#include "../../core/span.hpp"
#include "../../core/wait.hpp"
#include "communicator.hpp"
#include "types.hpp"

namespace flexcomm {

class mpi_host_reducer {
 public:
  // Bytes of each rank's slot unless told otherwise: a bucket larger than this goes in chunks.
  static constexpr std::size_t default_slot_bytes = std::size_t{16} << 20;

  mpi_host_reducer() = default;

  // Collective over `comm`, whose ranks must all share one host (MPI decides: a communicator
  // that MPI_COMM_TYPE_SHARED would split is an error on every rank). Allocates
  // comm.size() x slot_bytes of shared memory on the first rank's side of the window.
  mpi_host_reducer(const mpi_communicator& comm, std::size_t slot_bytes = default_slot_bytes)
      : comm_(comm.dup(cat(comm.name(), " shared memory"))),
        rank_(comm_.rank()),
        ranks_(comm_.size()),
        slot_bytes_(std::max<std::size_t>(slot_bytes / line * line, line)) {
    const std::string who = cat(comm_.name(), ": shared-memory setup");
    MPI_Comm shared = MPI_COMM_NULL;
    check_mpi(MPI_Comm_split_type(comm_.native(), MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &shared), who);
    int shared_size = 0;
    MPI_Comm_size(shared, &shared_size);
    MPI_Comm_free(&shared);
    check(shared_size == ranks_, who,
          cat("the communicator's ", ranks_, " ranks are not all on one host (", shared_size,
              " share this rank's); shared memory needs one host"));
    const std::size_t header = static_cast<std::size_t>(ranks_) * line;
    const std::size_t total = header + static_cast<std::size_t>(ranks_) * slot_bytes_;
    void* mine = nullptr;
    check_mpi(MPI_Win_allocate_shared(static_cast<MPI_Aint>(rank_ == 0 ? total : 0), 1, MPI_INFO_NULL,
                                      comm_.native(), &mine, &window_),
              cat(who, " (MPI_Win_allocate_shared of ", total, " bytes)"));
    MPI_Aint size = 0;
    int unit = 0;
    void* base = nullptr;
    check_mpi(MPI_Win_shared_query(window_, 0, &size, &unit, &base), cat(who, " (MPI_Win_shared_query)"));
    base_ = static_cast<std::byte*>(base);
    static_assert(std::atomic<std::uint64_t>::is_always_lock_free, "shared-memory counters must be lock-free");
    if (rank_ == 0)
      for (int r = 0; r < ranks_; ++r) new (base_ + static_cast<std::size_t>(r) * line) std::atomic<std::uint64_t>(0);
    check_mpi(MPI_Barrier(comm_.native()), cat(who, " (barrier)"));
  }

  mpi_host_reducer(mpi_host_reducer&& o) noexcept { swap(o); }
  mpi_host_reducer& operator=(mpi_host_reducer&& o) noexcept {
    mpi_host_reducer(std::move(o)).swap(*this);
    return *this;
  }
  mpi_host_reducer(const mpi_host_reducer&) = delete;
  mpi_host_reducer& operator=(const mpi_host_reducer&) = delete;
  ~mpi_host_reducer() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    // MPI_Win_free is collective: a reducer that failed (a peer never arrived) leaks its window
    // rather than hang in the destructor.
    if (window_ != MPI_WIN_NULL && !finalized && !broken_) MPI_Win_free(&window_);
  }

  explicit operator bool() const noexcept { return base_ != nullptr; }
  int size() const noexcept { return ranks_; }
  std::size_t slot_bytes() const noexcept { return slot_bytes_; }
  const mpi_communicator& communicator() const noexcept { return comm_; }
  // The limit on each wait (the reducer's own duplicate follows FLEXCOMM_TIMEOUT unless set).
  void set_timeout(std::chrono::milliseconds t) { comm_.set_timeout(t); }

  // Blocking allreduce of data[0, n) in place, over the reducer's communicator: every rank calls
  // it with the same n, T and o, in the same order. Avg is the sum divided by the rank count
  // (integers truncate, as divide_by does). Waits go through default_wait() and time out after
  // the communicator's timeout, naming the ranks that had not arrived.
  template <class T>
  void allreduce(T* data, std::size_t n, op o) {
    static_assert(is_element_v<T>, "host_reducer: float, double, int32, int64, uint8, half or bfloat16");
    if (n == 0) return;
    check(static_cast<bool>(*this), "shared-memory allreduce", "the reducer was not set up (moved from?)");
    check(!broken_, "shared-memory allreduce", cat(comm_.name(), " is unusable after an earlier timeout"));
    const std::size_t per_chunk = slot_bytes_ / sizeof(T);
    const std::size_t align = line / sizeof(T);
    for (std::size_t done = 0; done < n; done += per_chunk) {
      const std::size_t count = std::min(per_chunk, n - done);
      T* chunk = data + done;
      const std::uint64_t c = ++chunks_;
      if (rank_ == 0 && c > 1) await(3 * (c - 1), o, n, "peers to copy the previous chunk out of slot 0");
      std::memcpy(slot(rank_), chunk, count * sizeof(T));
      publish(3 * c - 2);
      await(3 * c - 2, o, n, "peers to copy their chunk in");
      // This rank's share, rounded to cache lines so that no two ranks write one line of slot 0.
      std::size_t share = (count + static_cast<std::size_t>(ranks_) - 1) / static_cast<std::size_t>(ranks_);
      share = (share + align - 1) / align * align;
      const std::size_t lo = std::min(count, share * static_cast<std::size_t>(rank_));
      const std::size_t hi = std::min(count, lo + share);
      if (hi > lo) {
        T* out = reinterpret_cast<T*>(slot(0)) + lo;
        for (int r = 1; r < ranks_; ++r) combine(o, out, reinterpret_cast<const T*>(slot(r)) + lo, hi - lo);
        if (o == op::avg) divide_by(out, hi - lo, ranks_);
      }
      publish(3 * c - 1);
      await(3 * c - 1, o, n, "peers to reduce their share");
      std::memcpy(chunk, slot(0), count * sizeof(T));
      publish(3 * c);
    }
  }

 private:
  static constexpr std::size_t line = 64;

  std::atomic<std::uint64_t>& progress(int r) const noexcept {
    return *std::launder(reinterpret_cast<std::atomic<std::uint64_t>*>(base_ + static_cast<std::size_t>(r) * line));
  }
  std::byte* slot(int r) const noexcept {
    return base_ + static_cast<std::size_t>(ranks_) * line + static_cast<std::size_t>(r) * slot_bytes_;
  }
  void publish(std::uint64_t value) noexcept { progress(rank_).store(value, std::memory_order_release); }

  // Waits until every rank's progress is at least `value`.
  void await(std::uint64_t value, op o, std::size_t n, const char* for_what) {
    int from = 0;  // ranks below have arrived: each is checked once per arrival
    const auto arrived = [&] {
      while (from < ranks_ && progress(from).load(std::memory_order_acquire) >= value) ++from;
      return from == ranks_;
    };
    if (arrived()) return;
    if (default_wait().until(arrived, comm_.timeout())) return;
    broken_ = true;
    std::string missing;
    for (int r = 0; r < ranks_; ++r) {
      const std::uint64_t p = progress(r).load(std::memory_order_acquire);
      if (p < value) missing += cat(missing.empty() ? "" : ", ", r, " (at step ", p, ")");
    }
    fail(cat("shared-memory allreduce (", name_of(o), ", ", n, " elements) on ", comm_.name(), ", rank ", rank_),
         cat("timed out after ", comm_.timeout().count(), " ms waiting for ", for_what, " (step ", value,
             "); not arrived: rank ", missing));
  }

  void swap(mpi_host_reducer& o) noexcept {
    std::swap(comm_, o.comm_);
    std::swap(rank_, o.rank_);
    std::swap(ranks_, o.ranks_);
    std::swap(slot_bytes_, o.slot_bytes_);
    std::swap(window_, o.window_);
    std::swap(base_, o.base_);
    std::swap(chunks_, o.chunks_);
    std::swap(broken_, o.broken_);
  }

  mpi_communicator comm_;
  int rank_ = 0, ranks_ = 0;
  std::size_t slot_bytes_ = 0;
  MPI_Win window_ = MPI_WIN_NULL;
  std::byte* base_ = nullptr;
  std::uint64_t chunks_ = 0;  // chunks this reducer has moved: the same on every rank
  bool broken_ = false;
};

}  // namespace flexcomm
