// The vocabulary every feed shares: the trainer's loader, the options, the flow-control policy
// and the batch a trainer gets from next(). local_feed, one_to_many and all_shared all speak it.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <string>
#include <vector>

#include "../core/error.hpp"
#include "../core/layout.hpp"
#include "../core/progress.hpp"
#include "../core/span.hpp"
#include "../core/trace.hpp"
#include "../core/wait.hpp"

namespace flexcomm {

// Writes shard `shard` of step `step` into `out` and returns the bytes written (<= out.size()).
// Which rank calls it is the feed's business; it must give the same bytes wherever it runs.
using loader = std::function<std::size_t(std::int64_t step, int shard, span<std::byte> out)>;

// What a feed does when members train at different rates.
struct flow_control {
  enum class policy { lockstep, skip_ahead };
  policy kind = policy::lockstep;
  std::int64_t max_behind = 0;  // skip_ahead: a member more than this many steps behind skips

  // Every member receives every step; a slow member slows the producers (bounded buffering).
  static flow_control lockstep() { return {policy::lockstep, 0}; }
  // A member that finds more than `n` newer steps waiting skips to the newest; the skipped steps
  // are counted (feed.skipped()). Each trainer then buffers up to n + 3 batches.
  static flow_control skip_ahead(std::int64_t n) { return {policy::skip_ahead, n}; }
};

struct feed_options {
  std::int64_t steps = 0;          // the stream's length
  std::size_t shard_capacity = 0;  // the most bytes the loader may write for one shard
  int depth = 2;                   // batches in flight
  flow_control flow = flow_control::lockstep();
};

// One step as a trainer sees it: its shards, concatenated. Valid until the next next().
class batch {
 public:
  batch(std::int64_t step, int first_shard, const std::byte* data, const std::size_t* offsets, int shards)
      : step_(step), first_shard_(first_shard), data_(data), offsets_(offsets), shards_(shards) {}

  std::int64_t step() const noexcept { return step_; }
  span<const std::byte> bytes() const noexcept { return {data_, offsets_[shards_]}; }
  std::size_t size() const noexcept { return offsets_[shards_]; }
  // This trainer's shards are [first_shard(), first_shard() + shards()) of the step.
  int first_shard() const noexcept { return first_shard_; }
  int shards() const noexcept { return shards_; }
  // The bytes of this trainer's i-th shard (global shard first_shard() + i).
  span<const std::byte> shard(int i) const {
    check(i >= 0 && i < shards_, "batch", cat("shard ", i, " of a batch with ", shards_, " shards"));
    return {data_ + offsets_[i], offsets_[i + 1] - offsets_[i]};
  }

 private:
  std::int64_t step_;
  int first_shard_;
  const std::byte* data_;
  const std::size_t* offsets_;  // shards_ + 1 entries, owned by the feed
  int shards_;
};

namespace detail {

// How a feed waits for the progress engine: as the process's policy says, but never spinning,
// because the engine's thread needs the core the waiter would spin on.
inline wait_policy engine_wait() {
  wait_policy p = default_wait();
  return p.kind == wait_kind::spin ? wait_policy::backoff() : p;
}

// Fired when the requests of a step are done (or one failed), so that a feed's thread waiting
// under a backoff policy sleeps until then instead of polling: on a node with more ranks than
// cores, each poll is a context switch charged to the CPU time that feeds are meant to save.
struct wakeup {
  std::mutex mutex;
  std::condition_variable cv;
  std::atomic<bool> fired{false};
  void fire() {
    {
      std::lock_guard<std::mutex> lock(mutex);
      fired.store(true, std::memory_order_release);
    }
    cv.notify_all();
  }
};

// The operations in flight of one feed, polled by one progress-engine task for the feed's whole
// life. (A task per step would restart the engine's backoff at every step, and each of its
// short sleeps is a wake-up.) Owner has `requests`, `wake` and `error`; the pump keeps an owner
// alive while its requests are pending.
template <class Owner>
class pump {
 public:
  pump() = default;
  pump(const pump&) = delete;
  pump& operator=(const pump&) = delete;
  ~pump() { close(); }

  // Starts watching owner->requests, already posted.
  void add(const std::shared_ptr<Owner>& owner, const std::string& what) {
    owner->wake.fired.store(false, std::memory_order_relaxed);
    owner->error = nullptr;
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->queue.push_back(owner);
    if (!task_) task_ = progress_engine::instance().submit([s = state_] { return poll(*s); }, what);
  }

  // Waits until owner's requests are done and rethrows their failure; a backoff policy sleeps
  // until the engine fires, spin and yield poll (never spinning: the engine needs the core);
  // past default_timeout() it fails. Called by the thread that calls add().
  void await(Owner& owner, const std::string& what) {
    const wait_policy policy = default_wait();
    const auto timeout = default_timeout();
    const auto start = std::chrono::steady_clock::now();
    auto engine_gone = [&] { return task_ && task_->done(); };
    if (policy.kind == wait_kind::backoff) {
      std::unique_lock<std::mutex> lock(owner.wake.mutex);
      while (!owner.wake.fired.load(std::memory_order_acquire)) {
        owner.wake.cv.wait_for(lock, std::chrono::milliseconds(50));
        if (owner.wake.fired.load(std::memory_order_acquire)) break;
        lock.unlock();
        const bool gone = engine_gone();
        lock.lock();
        if (gone) break;
        if (timeout.count() > 0 && std::chrono::steady_clock::now() - start > timeout)
          fail(what, cat("timed out after ", timeout.count(), " ms (FLEXCOMM_TIMEOUT)"));
      }
    } else if (!engine_wait().until(
                   [&] { return owner.wake.fired.load(std::memory_order_acquire) || engine_gone(); }, timeout)) {
      fail(what, cat("timed out after ", timeout.count(), " ms (FLEXCOMM_TIMEOUT)"));
    }
    if (!owner.wake.fired.load(std::memory_order_acquire)) {
      task_->wait();  // rethrows why the engine gave up
      fail(what, "the progress engine stopped before the operation finished");
    }
    if (owner.error) std::rethrow_exception(owner.error);
  }

  // No more operations: the engine's task ends once those in flight are done.
  void close() {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->closed = true;
  }

 private:
  struct state {
    std::mutex mutex;
    std::vector<std::shared_ptr<Owner>> queue;
    bool closed = false;
  };

  static bool poll(state& s) {
    std::lock_guard<std::mutex> lock(s.mutex);
    for (auto it = s.queue.begin(); it != s.queue.end();) {
      Owner& owner = **it;
      bool done = true;
      try {
        for (auto& r : owner.requests)
          if (!r.test()) {
            done = false;
            break;
          }
      } catch (...) {
        owner.error = std::current_exception();
      }
      if (done) {
        const auto keep = *it;
        it = s.queue.erase(it);
        keep->wake.fire();
      } else {
        ++it;
      }
    }
    return s.closed && s.queue.empty();
  }

  std::shared_ptr<state> state_ = std::make_shared<state>();
  std::shared_ptr<completion> task_;  // the engine's task, once started
};

// A run of consecutive shards received by the same trainer of every member: the unit a feed
// moves in one message. Owners are monotone in the shard, so equal owner sets are contiguous.
struct piece {
  int first_shard = 0;
  int shards = 0;
  std::vector<int> owner;  // owner[m]: the rank of member m that receives this piece
};

inline std::vector<piece> pieces_of(const ensemble_layout& layout) {
  std::vector<piece> out;
  const int l = layout.shards_per_step();
  for (int k = 0; k < l; ++k) {
    std::vector<int> owner(static_cast<std::size_t>(layout.members()));
    for (int m = 0; m < layout.members(); ++m) owner[static_cast<std::size_t>(m)] = layout.owner_of(m, k);
    if (!out.empty() && out.back().owner == owner) {
      ++out.back().shards;
    } else {
      out.push_back({k, 1, std::move(owner)});
    }
  }
  return out;
}

// The pieces a trainer receives, in shard order.
inline std::vector<int> pieces_of_trainer(const std::vector<piece>& pieces, int member, int rank_in_member) {
  std::vector<int> mine;
  for (std::size_t c = 0; c < pieces.size(); ++c)
    if (pieces[c].owner[static_cast<std::size_t>(member)] == rank_in_member) mine.push_back(static_cast<int>(c));
  return mine;
}

// A piece on the wire: a header, the shard sizes, then the shards packed one after the other.
// Messages have a fixed size (header + shards * capacity) so receivers can post them early.
struct piece_header {
  std::int64_t step;
  std::int32_t status;     // piece_status
  std::int32_t shards;
  std::int32_t bad_shard;  // the shard the loader failed on
  std::int32_t origin;     // world rank that ran the loader
  std::uint64_t bad_size;  // what the loader returned, or the length of its error text
};
enum piece_status : std::int32_t { piece_ok = 0, piece_overfill = 1, piece_threw = 2, piece_guard = 3, piece_none = 4 };

// Rounded to 8 bytes, so that the headers of pieces laid side by side stay aligned.
inline std::size_t piece_bytes(int shards, std::size_t capacity) {
  const std::size_t n = sizeof(piece_header) + static_cast<std::size_t>(shards) * (sizeof(std::uint64_t) + capacity);
  return (n + 7) / 8 * 8;
}

// Bytes after a loader's slot that must survive it: a loader that writes past its span is caught.
constexpr std::size_t guard_bytes = 64;
constexpr std::byte guard_value{0xA5};

// Calls the loader for each shard of a piece and packs the result into `slot`
// (piece_bytes + guard_bytes long). Failures are recorded in the header, never thrown: the
// message must still travel, so that every trainer learns of the failure at that step.
inline void fill_piece(const loader& load, std::int64_t step, int first_shard, int shards, std::size_t capacity,
                       span<std::byte> slot) {
  auto* header = reinterpret_cast<piece_header*>(slot.data());
  auto* sizes = reinterpret_cast<std::uint64_t*>(slot.data() + sizeof(piece_header));
  std::byte* payload = slot.data() + sizeof(piece_header) + static_cast<std::size_t>(shards) * sizeof(std::uint64_t);
  const std::size_t end = piece_bytes(shards, capacity);
  *header = {step, piece_ok, shards, -1, process_rank(), 0};
  std::fill(slot.data() + end, slot.data() + end + guard_bytes, guard_value);
  std::size_t offset = 0;
  for (int i = 0; i < shards; ++i) {
    std::size_t written = 0;
    try {
      trace::span traced(trace::names::loader, step, "step", "feed");
      written = load(step, first_shard + i, span<std::byte>(payload + offset, capacity));
    } catch (const std::exception& e) {
      const std::string what = e.what();
      const std::size_t n = std::min(what.size(), static_cast<std::size_t>(shards) * capacity);
      std::memcpy(payload, what.data(), n);
      *header = {step, piece_threw, shards, first_shard + i, process_rank(), n};
      return;
    }
    const bool guard_intact = std::all_of(slot.data() + end, slot.data() + end + guard_bytes,
                                          [](std::byte b) { return b == guard_value; });
    if (written > capacity || !guard_intact) {
      *header = {step, written > capacity ? piece_overfill : piece_guard, shards, first_shard + i, process_rank(),
                 written};
      return;
    }
    sizes[i] = written;
    offset += written;
  }
}

// A piece that carries no step (past the end of the stream, or drained after a failure).
inline void empty_piece(std::int64_t step, int shards, span<std::byte> slot) {
  *reinterpret_cast<piece_header*>(slot.data()) = {step, piece_none, shards, -1, process_rank(), 0};
}

// The error a failed piece stands for.
[[noreturn]] inline void piece_failure(const char* feed, span<const std::byte> slot, std::size_t capacity) {
  const auto& h = *reinterpret_cast<const piece_header*>(slot.data());
  const std::string where = cat(feed, ": step ", h.step, " shard ", h.bad_shard);
  switch (h.status) {
    case piece_overfill:
      fail(where, cat("loader on rank ", h.origin, " wrote ", h.bad_size, " bytes, slot holds ", capacity));
    case piece_guard:
      fail(where, cat("loader on rank ", h.origin, " wrote past the end of its ", capacity, "-byte slot"));
    case piece_threw: {
      const std::byte* text = slot.data() + sizeof(piece_header) + static_cast<std::size_t>(h.shards) * sizeof(std::uint64_t);
      fail(where, cat("loader on rank ", h.origin, " failed: ",
                      std::string(reinterpret_cast<const char*>(text), static_cast<std::size_t>(h.bad_size))));
    }
    case piece_none:
      fail(cat(feed, ": step ", h.step), cat("rank ", h.origin, " left the stream before this step"));
    default: fail(where, cat("received a piece with unknown status ", h.status));
  }
}

// Checks a received piece against what this trainer expects and returns its shard sizes.
// Whatever a peer sent, nothing is read or copied past the slot.
inline const std::uint64_t* read_piece(const char* feed, span<const std::byte> slot, std::int64_t step, int shards,
                                       std::size_t capacity) {
  const auto& h = *reinterpret_cast<const piece_header*>(slot.data());
  check(h.shards == shards && h.step == step, feed,
        cat("expected step ", step, " with ", shards, " shards, received step ", h.step, " with ", h.shards,
            " (ranks disagree on the layout or the stream)"));
  if (h.status != piece_ok) piece_failure(feed, slot, capacity);
  const auto* sizes = reinterpret_cast<const std::uint64_t*>(slot.data() + sizeof(piece_header));
  for (int i = 0; i < shards; ++i)
    check(sizes[i] <= capacity, feed, cat("step ", step, ": a shard of ", sizes[i], " bytes exceeds capacity ", capacity));
  return sizes;
}

inline const std::byte* piece_payload(span<const std::byte> slot, int shards) {
  return slot.data() + sizeof(piece_header) + static_cast<std::size_t>(shards) * sizeof(std::uint64_t);
}

// A trainer's batch assembled from its pieces: offsets of its shards, bytes contiguous.
struct batch_storage {
  std::vector<std::byte> bytes;
  std::vector<std::size_t> offsets;
  const std::byte* data = nullptr;
};

// Options every rank must agree on, as numbers a reduction can compare.
inline std::vector<std::int64_t> agreement_key(const ensemble_layout& layout, const feed_options& o) {
  const std::string text = layout.str();
  std::uint64_t h = 1469598103934665603ull;  // FNV-1a over the layout text, and a per-host layout's placement
  auto fold = [&h](std::uint64_t v) { h = (h ^ v) * 1099511628211ull; };
  for (char c : text) fold(static_cast<unsigned char>(c));
  if (layout.per_host()) {
    fold(layout.is_placed() ? 1 : 2);
    if (layout.is_placed())
      for (int m = 0; m < layout.members(); ++m)
        for (int r : layout.member_ranks(m)) fold(static_cast<std::uint64_t>(r));
  }
  return {o.steps, static_cast<std::int64_t>(o.shard_capacity), o.depth, static_cast<std::int64_t>(o.flow.kind),
          o.flow.max_behind, static_cast<std::int64_t>(h >> 2)};  // >= 0, so that -h is exact
}

// What is wrong with these options on their own, or "" (the same answer on every rank).
inline std::string option_problem(const feed_options& o) {
  if (o.steps < 0) return cat("steps must be >= 0, got ", o.steps);
  if (o.shard_capacity == 0) return "shard_capacity must be > 0";
  if (o.shard_capacity > (std::size_t{1} << 30)) return cat("shard_capacity ", o.shard_capacity, " exceeds 1 GiB");
  if (o.depth < 1) return cat("depth must be >= 1, got ", o.depth);
  if (o.flow.kind == flow_control::policy::skip_ahead && o.flow.max_behind < 0)
    return cat("skip_ahead needs n >= 0, got ", o.flow.max_behind);
  return "";
}

// Collective over `world`: every rank learns whether any rank rejected the layout or options,
// or whether ranks passed different ones, and throws the same verdict (no rank is left waiting).
template <class B>
void agree(const typename B::communicator& world, const ensemble_layout& layout, const feed_options& options,
           const std::string& local_problem, const char* feed) {
  auto key = agreement_key(layout, options);
  std::vector<std::int64_t> v;
  v.push_back(local_problem.empty() ? 0 : 1);
  for (auto k : key) v.push_back(k);
  for (auto k : key) v.push_back(-k);
  B::template iallreduce<std::int64_t>(world, span<std::int64_t>(v), op::max).wait();
  if (!local_problem.empty()) fail(feed, local_problem);
  check(v[0] == 0, feed, "another rank rejected the layout or the feed options");
  static const char* names[] = {"steps", "shard_capacity", "depth", "flow policy", "skip_ahead n", "layout"};
  const std::size_t n = key.size();
  for (std::size_t i = 0; i < n; ++i)
    check(v[1 + i] == -v[1 + n + i], feed,
          cat("ranks disagree on ", names[i], i == 5 ? cat(" (this rank: '", layout.str(), "')") : cat(
                  ": values range from ", -v[1 + n + i], " to ", v[1 + i])));
}

}  // namespace detail
}  // namespace flexcomm
