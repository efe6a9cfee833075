// Pinned host memory for the staged backend, bounded: blocks of one chunk, as many as the cap holds,
// pinned once and recycled, so that a transfer of any size streams through them and nothing is
// pinned on the hot path; and buffers for operations that move as one piece, kept by size class.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "../../core/error.hpp"
#include "runtime.hpp"
#include "error.hpp"

namespace flexcomm::cuda {

// The process's pinned host memory (cudaMallocHost costs milliseconds; a staged transfer must not).
//
// Blocks: `cap` bytes of chunk-sized blocks, pinned as one piece when the first user joins (the
// warm-up: the first staged communicator's creation) and never freed. A user (a staged
// communicator) takes a block per chunk and gives it back once the chunk is home. A user that holds
// no block can always take one, because the pool keeps a free block for each such user (and pins one
// more, beyond the cap, should a new user find none): communicators never wait on each other's
// blocks, only on their own, which come back as their chunks finish. A user keeps a few blocks it
// gave back for its next chunks, taken and given back without the pool's lock (issue 52: a staged
// post takes one lock, its communicator's); they stay counted as its, and the pool takes them back
// whenever it would refuse a block, and before a new user joins or the cap changes.
//
// Pieces: the host copy of an operation that cannot be cut into chunks (point-to-point, gathers,
// reduce-scatter), recycled per power-of-two size class, outside the cap.
class pinned_pool {
 public:
  class user;
  struct block_return {
    user* owner = nullptr;
    void operator()(std::byte* p) const noexcept;
  };
  // One chunk's pinned block; it goes back to the pool, and off its user's count, when let go.
  using block = std::unique_ptr<std::byte, block_return>;
  struct piece_return {
    pinned_pool* pool = nullptr;
    std::size_t bytes = 0;
    void operator()(std::byte* p) const noexcept { pool->give_back_piece(p, bytes); }
  };
  using piece = std::unique_ptr<std::byte, piece_return>;

  // What the pool pinned, for tests and benchmarks. Peaks count from the last set_cap().
  struct counts {
    std::size_t pinned = 0;      // bytes pinned now: blocks and pieces
    std::size_t peak = 0;        // the most bytes pinned at once
    std::size_t in_blocks = 0;   // of `pinned`, the blocks': the cap (more only with more users than blocks)
    std::size_t taken_peak = 0;  // the most bytes of blocks taken at once
    std::uint64_t pins = 0;      // cudaMallocHost calls
  };

  pinned_pool() = default;
  pinned_pool(const pinned_pool&) = delete;
  pinned_pool& operator=(const pinned_pool&) = delete;

  static pinned_pool& instance() {
    static pinned_pool* pool = new pinned_pool;  // never destroyed: blocks may outlive statics
    return *pool;
  }

  // A block's usable bytes (the chunk size the first user gave), and the cap; 0 before any user.
  std::size_t block_bytes() const {
    std::lock_guard<flexcomm::mutex> lock(mutex_);
    return block_bytes_;
  }
  std::size_t cap_bytes() const {
    std::lock_guard<flexcomm::mutex> lock(mutex_);
    return cap_;
  }
  counts count() const {
    std::lock_guard<flexcomm::mutex> lock(mutex_);
    return counts_;
  }

  // A new cap, at least one block, while no block is taken (a test's; a job sets
  // FLEXCOMM_PINNED_BYTES): the blocks are freed and pinned again at the new size.
  void set_cap(std::size_t bytes, const std::string& what) {
    std::lock_guard<flexcomm::mutex> lock(mutex_);
    take_kept_locked();
    check(taken_ == 0, what, cat("the pinned pool's cap cannot change while ", taken_, " of its blocks are in use"));
    check(block_bytes_ == 0 || bytes >= block_bytes_, what,
          cat("a pinned pool of ", bytes, " bytes holds less than one chunk (", block_bytes_, " bytes)"));
    cap_ = bytes;
    if (block_bytes_ == 0) return;  // the first user pins
    for (auto [p, n] : regions_) {
      device::free_pinned(p);
      counts_.pinned -= n;
      counts_.in_blocks -= n;
    }
    regions_.clear();
    free_.clear();
    pin_locked(std::max<std::size_t>(1, cap_ / stride_), what);
    top_up_locked(idle_users_, what);
    counts_.peak = counts_.pinned;
    counts_.taken_peak = 0;
  }

  // A piece of at least `bytes` (taken by one operation, given back when it ends).
  piece take_piece(std::size_t bytes, const std::string& what) {
    std::size_t size = 4096;
    while (size < bytes) size <<= 1;
    {
      std::lock_guard<flexcomm::mutex> lock(mutex_);
      auto& spare = free_pieces_[size];
      if (!spare.empty()) {
        std::byte* p = spare.back();
        spare.pop_back();
        return piece(p, piece_return{this, size});
      }
    }
    void* p = nullptr;
    check_cuda(device::malloc_pinned(&p, size), what, ": cudaMallocHost(", size, " bytes)");
    std::lock_guard<flexcomm::mutex> lock(mutex_);
    counted_locked(size);
    return piece(static_cast<std::byte*>(p), piece_return{this, size});
  }

 private:
  // Blocks are `stride_` bytes apart, so that every element type is aligned in each of them.
  static constexpr std::size_t alignment = 16;

  // A block for `u`, or none: `u` holds blocks and the free ones are kept for users that hold none.
  block try_take(user& u);
  void give_back(std::byte* p, user& u) noexcept;
  void give_back_locked(std::byte* p, user& u) noexcept;
  void take_kept_locked() noexcept;
  void take_kept_locked(user& u) noexcept;
  void join(user& u, std::size_t chunk_bytes, std::size_t cap_bytes, const std::string& what);
  void leave(user& u) noexcept;

  void give_back_piece(std::byte* p, std::size_t size) noexcept {
    std::lock_guard<flexcomm::mutex> lock(mutex_);
    try {
      free_pieces_[size].push_back(p);
    } catch (...) {
      device::free_pinned(p);
      counts_.pinned -= size;
    }
  }

  // Pins `n` blocks as one region.
  void pin_locked(std::size_t n, const std::string& what) {
    void* p = nullptr;
    const std::size_t bytes = n * stride_;
    check_cuda(device::malloc_pinned(&p, bytes), what, ": cudaMallocHost(", bytes, " bytes) for ", n,
               " pinned blocks of ", block_bytes_, " bytes");
    regions_.emplace_back(static_cast<std::byte*>(p), bytes);
    free_.reserve(free_.size() + n);  // give_back never allocates
    for (std::size_t i = 0; i < n; ++i) free_.push_back(static_cast<std::byte*>(p) + i * stride_);
    counted_locked(bytes);
    counts_.in_blocks += bytes;
  }
  // Pins single blocks until `idle` users, each holding none, would each find one free.
  void top_up_locked(std::size_t idle, const std::string& what) {
    while (free_.size() < idle) pin_locked(1, what);
  }
  void counted_locked(std::size_t bytes) {
    ++counts_.pins;
    counts_.pinned += bytes;
    counts_.peak = std::max(counts_.peak, counts_.pinned);
  }

  mutable flexcomm::mutex mutex_;
  std::size_t block_bytes_ = 0, stride_ = 0, cap_ = 0;
  std::vector<std::pair<std::byte*, std::size_t>> regions_;  // pinned for blocks
  std::vector<std::byte*> free_;                             // blocks not taken
  std::size_t taken_ = 0;
  std::size_t idle_users_ = 0;  // users holding no block: there are always this many free blocks
  std::vector<user*> users_;    // joined, for the blocks they keep
  std::map<std::size_t, std::vector<std::byte*>> free_pieces_;
  counts counts_;
};

// A user of the pool's blocks (a staged communicator): joins at construction (the first user pins
// the blocks), leaves at destruction, once every block it took is back.
class pinned_pool::user {
 public:
  user(std::size_t chunk_bytes, std::size_t cap_bytes, const std::string& what, pinned_pool& pool = instance())
      : pool_(pool) {
    pool_.join(*this, chunk_bytes, cap_bytes, what);
  }
  user(const user&) = delete;
  user& operator=(const user&) = delete;
  ~user() { pool_.leave(*this); }

  // A block (one it kept, if any), or an empty one while this user must wait for one of its own
  // to come back.
  block try_take() {
    for (auto& k : kept_)
      if (k.load(std::memory_order_relaxed))
        if (std::byte* p = k.exchange(nullptr, std::memory_order_acquire)) return block(p, block_return{this});
    return pool_.try_take(*this);
  }
  // The bytes of a block: a chunk, at most.
  std::size_t block_bytes() const { return pool_.block_bytes(); }

 private:
  friend class pinned_pool;
  // A block given back, kept if a slot is free: false when all are taken.
  bool keep(std::byte* p) noexcept {
    for (auto& k : kept_) {
      std::byte* none = nullptr;
      if (k.compare_exchange_strong(none, p, std::memory_order_release, std::memory_order_relaxed)) return true;
    }
    return false;
  }

  pinned_pool& pool_;
  std::size_t held_ = 0;  // blocks taken (those kept too), under the pool's mutex
  std::array<std::atomic<std::byte*>, 16> kept_{};  // blocks kept for the next chunks (null: none)
};

inline void pinned_pool::block_return::operator()(std::byte* p) const noexcept {
  if (!owner->keep(p)) owner->pool_.give_back(p, *owner);
}

// A refusal first takes back the blocks users keep: a kept block never makes another user wait.
inline pinned_pool::block pinned_pool::try_take(user& u) {
  std::lock_guard<flexcomm::mutex> lock(mutex_);
  const auto refused = [&] { return free_.empty() || (u.held_ > 0 && free_.size() <= idle_users_); };
  if (refused()) take_kept_locked();
  if (refused()) return block(nullptr, block_return{&u});
  if (u.held_ == 0) --idle_users_;
  std::byte* p = free_.back();
  free_.pop_back();
  ++u.held_;
  ++taken_;
  counts_.taken_peak = std::max(counts_.taken_peak, taken_ * stride_);
  return block(p, block_return{&u});
}

inline void pinned_pool::give_back(std::byte* p, user& u) noexcept {
  std::lock_guard<flexcomm::mutex> lock(mutex_);
  give_back_locked(p, u);
}

inline void pinned_pool::give_back_locked(std::byte* p, user& u) noexcept {
  free_.push_back(p);  // within the capacity reserved when it was pinned
  --taken_;
  if (--u.held_ == 0) ++idle_users_;
}

inline void pinned_pool::take_kept_locked() noexcept {
  for (user* u : users_) take_kept_locked(*u);
}

inline void pinned_pool::take_kept_locked(user& u) noexcept {
  for (auto& k : u.kept_)
    if (std::byte* p = k.exchange(nullptr, std::memory_order_acquire)) give_back_locked(p, u);
}

inline void pinned_pool::join(user& u, std::size_t chunk_bytes, std::size_t cap_bytes, const std::string& what) {
  std::lock_guard<flexcomm::mutex> lock(mutex_);
  users_.reserve(users_.size() + 1);  // before anything changes: a failure leaves the pool as it was
  if (block_bytes_ == 0) {
    if (cap_ == 0) cap_ = cap_bytes;
    check(cap_ >= chunk_bytes, what,
          cat("a pinned pool of ", cap_, " bytes (FLEXCOMM_PINNED_BYTES) holds less than one chunk (", chunk_bytes,
              " bytes, FLEXCOMM_STAGE_CHUNK)"));
    block_bytes_ = chunk_bytes;
    stride_ = (chunk_bytes + alignment - 1) / alignment * alignment;
    pin_locked(std::max<std::size_t>(1, cap_ / stride_), what);
  }
  take_kept_locked();  // before pinning more: kept blocks are free for the new user
  top_up_locked(idle_users_ + 1, what);
  ++idle_users_;
  users_.push_back(&u);
}

inline void pinned_pool::leave(user& u) noexcept {
  std::lock_guard<flexcomm::mutex> lock(mutex_);
  take_kept_locked(u);
  users_.erase(std::remove(users_.begin(), users_.end(), &u), users_.end());
  if (u.held_ == 0) --idle_users_;  // a user leaves with every block back (its operations are over)
}

}  // namespace flexcomm::cuda
