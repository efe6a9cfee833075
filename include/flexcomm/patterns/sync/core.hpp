// Gradient sync, what subgroup_allreduce and overlapped_ring share: options, the bucket plan,
// the per-step bookkeeping behind ready()/finish(), and the cross-rank check of what was handed over.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <cstdlib>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "../../core/agreement.hpp"
#include "../../core/datatype.hpp"
#include "../../core/error.hpp"
#include "../../core/setting_values.hpp"
#include "../../core/settings.hpp"
#include "../../core/hosts.hpp"
#include "../../core/progress.hpp"
#include "../../core/reduce.hpp"
#include "../../core/span.hpp"
#include "../../backend/contract.hpp"
#include "../../core/wait.hpp"

namespace flexcomm {

// PyTorch DDP's default bucket capacity.
inline constexpr std::size_t default_bucket_bytes = std::size_t{25} << 20;
inline constexpr std::size_t default_segment_bytes = std::size_t{1} << 20;

// "26214400", "64K", "25M", "1G" (binary multiples); used for FLEXCOMM_BUCKET_BYTES and
// FLEXCOMM_SEGMENT_BYTES.

// FLEXCOMM_BUCKET_BYTES when set, otherwise 25 MiB.
std::size_t bucket_bytes_from_env();
// FLEXCOMM_SEGMENT_BYTES when set, otherwise 1 MiB.
std::size_t segment_bytes_from_env();

struct sync_options {
  // Gradients are fused into buckets of at most this many bytes (a larger gradient gets a
  // bucket of its own).
  std::size_t bucket_bytes = bucket_bytes_from_env();
  // The reduction left in the gradients; avg divides the sum by the member's rank count.
  ::flexcomm::op op = ::flexcomm::op::avg;
  // overlapped_ring: a bucket travels the ring in segments of this size, `segments_in_flight`
  // of them at once, so that the transfer of one overlaps the reduction of another.
  std::size_t segment_bytes = segment_bytes_from_env();
  int segments_in_flight = 2;
  // subgroup_allreduce: launch each bucket's allreduce as soon as it fills (driven by the
  // progress engine) instead of all of them in finish(), i.e. after backward.
  bool launch_when_full = false;
  // A member whose ranks span hosts averages hierarchically (reduce within each host, allreduce
  // across the host leaders, broadcast within each host): automatic (subgroup_allreduce when the
  // member spans hosts and some host holds more than one of its ranks; overlapped_ring only when,
  // besides, its ranks are not in host blocks: see use_hierarchy), on, or off.
  // FLEXCOMM_HIERARCHICAL=auto|on|off.
  // Host backends only; device backends stay flat.
  hierarchy hierarchical = hierarchy_from_env();
  // A member whose ranks all share one host (2+ ranks) reduces each bucket through shared memory
  // instead of the backend's allreduce (subgroup_allreduce) or the ring (overlapped_ring), on
  // backends that have it (has_host_shared_memory: mpi): on the progress engine when buckets
  // launch as they fill, else on the trainer's thread in finish(). automatic, on (and a member
  // spanning hosts is an error), or off. FLEXCOMM_SHM=auto|on|off. Hierarchical averaging, when
  // on, takes precedence.
  shared_memory_use shared_memory = shared_memory_from_env();
  // Bytes of each of a rank's two large slots of the segment (N ranks: 2N of them); a larger
  // bucket goes through in chunks, alternating between the two. 1 MiB: the slots then stay in
  // cache while the buffers stream through; with 16 MiB slots a 64 MiB allreduce at 2 ranks took
  // twice as long on a quiet machine (docs/benchmarks.md).
  std::size_t shared_memory_slot_bytes = std::size_t{1} << 20;
};

// Which gradients share which bucket. Formed at a member's first step from the order in which
// ready() hands gradients over (backprop order, so the first bucket fills first), then fixed:
// every later step fills the same buckets, and buckets launch in bucket-index order.
class bucket_plan {
 public:
  struct gradient {
    int index;
    dtype type;
    std::size_t count;
    int bucket;
    std::size_t offset;  // elements into its bucket
  };
  struct bucket {
    dtype type;
    std::size_t count;  // elements
    std::size_t first, last;  // its gradients: gradients()[first, last)
  };

  explicit bucket_plan(std::size_t capacity_bytes = default_bucket_bytes) : capacity_(capacity_bytes) {}

  // Appends a gradient; a new bucket starts when this one would overflow or change type.
  void add(int index, dtype type, std::size_t count);

  const gradient* find(int index) const {
    auto it = position_.find(index);
    return it == position_.end() ? nullptr : &gradients_[it->second];
  }
  std::size_t position(const gradient& g) const { return static_cast<std::size_t>(&g - gradients_.data()); }
  const std::vector<gradient>& gradients() const noexcept { return gradients_; }
  const std::vector<bucket>& buckets() const noexcept { return buckets_; }
  bool empty() const noexcept { return gradients_.empty(); }
  std::size_t capacity_bytes() const noexcept { return capacity_; }
  void clear() {
    gradients_.clear();
    buckets_.clear();
    position_.clear();
  }

  // Equal on two ranks exactly when their plans are (up to hash collisions).
  std::uint64_t signature() const;

 private:
  std::size_t capacity_;
  std::vector<gradient> gradients_;
  std::vector<bucket> buckets_;
  std::unordered_map<int, std::size_t> position_;
};

namespace detail {

// One bucket reduction in flight: a backend request the trainer waits on itself, a task the
// progress engine drives while the trainer computes, or a shared-memory task that whoever drives
// the segment next finishes (`driven`: polls it; true once done).
template <class B>
struct flight {
  std::optional<typename B::request> request;
  std::shared_ptr<completion> task;
  std::function<bool()> driven;
  void wait() {
    if (request) request->wait();
    if (driven)
      wait_answering(default_wait().driving(), std::chrono::milliseconds{0}, driven,
                     [] { watchdog::instance().answer_queries(); });
    if (task) {
      // The engine's thread does the work meanwhile: spinning here would take its core.
      wait_policy policy = default_wait();
      if (policy.kind == wait_kind::spin) policy = wait_policy::yield();
      task->wait(policy);
    }
  }
  void reset() {
    request.reset();
    task.reset();
    driven = nullptr;
  }
};

// The gradients handed over in a step: how many, and the first few (index, count) for a
// mismatch's message, kept as numbers and spelled only when a step goes wrong (formatting them on
// every ready() cost a tenth of a small step).
struct first_handed {
  static constexpr std::size_t kept = 8;
  std::array<std::pair<int, std::size_t>, kept> first{};
  std::size_t handed = 0;
  void add(int index, std::size_t count) {
    if (handed < kept) first[handed] = {index, count};
    ++handed;
  }
  std::string str() const {
    std::string out;
    for (std::size_t i = 0; i < handed && i < kept; ++i)
      out += cat(i ? " " : "", first[i].first, ":", first[i].second);
    return out;
  }
};

// The cross-rank check of one step, one small nonblocking allreduce on the control
// communicator: the step's fingerprint, and the highest misusing rank + 1.
// `agree`, when set, does the max-reduction instead (blocking, on the member's ranks): the adapter's
// shared-memory path, one round of flags instead of an MPI collective per step.
template <class B>
class signature_check {
 public:
  using agree_fn = std::function<void(span<std::int64_t>)>;

  void start(const typename B::communicator& comm, const fingerprint& f, bool misused, const agree_fn& agree = {}) {
    same_.emplace(std::vector<std::int64_t>{f.folded(), misused ? comm.rank() + 1 : 0});
    if (agree)
      agree(same_->buffer());
    else
      request_.emplace(B::iallreduce(comm, same_->buffer(), op::max));
  }
  // Waits; an empty string when every rank handed over the same gradients and none misused.
  // `sequence`: this rank's first hand-overs, for the message (str()).
  template <class Sequence>
  std::string verdict(const std::string& local_misuse, const Sequence& sequence) {
    if (request_) request_->wait();
    request_.reset();
    if (!local_misuse.empty()) return local_misuse;
    if (same_->highest(1) > 0)
      return cat("rank ", same_->highest(1) - 1,
                 " of the member misused ready()/finish() in this step (its error says how)");
    if (!same_->agreed(0))
      return cat("the member's ranks handed gradients over in different orders or with different sizes in this "
                 "step; every rank must call ready() with the same indices, sizes, types and order. This rank's "
                 "sequence (index:count) starts ", sequence.str());
    return {};
  }

 private:
  std::optional<agreement> same_;
  std::optional<typename B::request> request_;
};

// Where the cross-rank check travels: the backend itself for host backends; for device
// backends (whose operations take device memory only) the member's twin on the host backend
// beside it, control().
template <class B>
struct control_channel {
  using backend = host_backend_t<B>;
  static typename backend::communicator make(const typename B::communicator& member, const std::string& name) {
    if constexpr (holds_host_memory<B>)
      return member.dup(name);
    else
      return member.control().dup(name);
  }
};

// The ready()/finish() bookkeeping both adapters share; an adapter supplies how one bucket is
// reduced: launch(dtype, data, count) -> flight<B>. Called from one trainer thread.
template <class B>
class bucket_sync {
 public:
  bucket_sync(const typename B::communicator& member, const sync_options& options, std::string who,
              bool launch_early)
      : control_(control_channel<B>::make(member, cat(member.name(), " ", who, " control"))),
        who_(std::move(who)),
        launch_early_(launch_early),
        plan_(options.bucket_bytes) {
    check(options.bucket_bytes > 0, who_, "sync_options.bucket_bytes must be positive");
  }
  bucket_sync(const bucket_sync&) = delete;
  bucket_sync& operator=(const bucket_sync&) = delete;
  // A bucket may still be travelling (the trainer threw mid-step): it writes into buffers that
  // must outlive it.
  ~bucket_sync() { drain(); }

  const bucket_plan& plan() const noexcept { return plan_; }
  int ranks() const noexcept { return control_.size(); }
  // The step's cross-rank check goes through `agree` (a blocking max-reduction over the member's
  // ranks) instead of the control communicator.
  void check_through(typename signature_check<typename control_channel<B>::backend>::agree_fn agree) {
    agree_ = std::move(agree);
  }

  template <class T, class Launch>
  void ready(int index, span<T> grad, Launch&& launch) {
    static_assert(is_element_v<T>, "ready(): gradients must be float, double, int32, int64, uint8, half or bfloat16");
    static_assert(!std::is_const_v<T>, "ready(): the average is written back into the gradient");
    const dtype type = dtype_of<T>;
    step_hash_.add(static_cast<std::uint64_t>(index)).add(static_cast<std::uint64_t>(type)).add(grad.size());
    sequence_.add(index, grad.size());
    if (planning_) {
      if (!planned_.insert(index).second) return misuse(cat("gradient ", index, " handed over twice in one step"));
      plan_.add(index, type, grad.size());
      pointers_.push_back(grad.data());
      return;
    }
    const auto* g = plan_.find(index);
    if (!g) return misuse(cat("gradient ", index, " is not in the bucket plan fixed at the first step"));
    if (g->type != type || g->count != grad.size())
      return misuse(cat("gradient ", index, " is ", grad.size(), " x ", name_of(type), " but was ", g->count, " x ",
                        name_of(g->type), " at the first step"));
    const std::size_t pos = plan_.position(*g);
    if (pointers_[pos]) return misuse(cat("gradient ", index, " handed over twice in one step"));
    pointers_[pos] = grad.data();
    ++arrived_[static_cast<std::size_t>(g->bucket)];
    if (launch_early_) launch_full(launch);
  }

  template <class Launch>
  void finish(Launch&& launch) {
    trace::span traced(trace::names::finish, -1, "step", "sync");
    std::string verdict;
    signature_check<typename control_channel<B>::backend> step_check;
    if (planning_) {
      // The plan is formed now; every rank must have formed the same one before a bucket moves.
      step_check.start(control_, fingerprint(step_hash_).add(plan_.signature()), !misuse_.empty(), agree_);
      verdict = step_check.verdict(misuse_, sequence_);
      if (!verdict.empty()) {
        plan_.clear();
        pointers_.clear();
        planned_.clear();
        end_step();
        fail(cat(who_, ": finish"), verdict);
      }
      planned_.clear();
      if (plan_.empty()) return end_step();  // nothing handed over: the plan waits for a step that does
      planning_ = false;
      const auto& buckets = plan_.buckets();
      arrived_.assign(buckets.size(), 0);
      for (std::size_t b = 0; b < buckets.size(); ++b) arrived_[b] = buckets[b].last - buckets[b].first;
      staging_.resize(buckets.size());
      flights_.resize(buckets.size());
      launch_full(launch);
    } else {
      if (misuse_.empty() && sequence_.handed < plan_.gradients().size())
        misuse(cat("finish() after ", sequence_.handed, " of the plan's ", plan_.gradients().size(), " gradients"));
      // Every rank launches every bucket, in order, whatever was handed over: no peer waits
      // forever on a bucket this rank skipped.
      while (next_ < plan_.buckets().size()) launch_bucket(next_++, launch);
      step_check.start(control_, step_hash_, !misuse_.empty(), agree_);
      verdict = step_check.verdict(misuse_, sequence_);
    }
    std::exception_ptr failure;
    for (auto& f : flights_) {
      try {
        f.wait();
      } catch (...) {
        if (!failure) failure = std::current_exception();
      }
      f.reset();
    }
    if (!failure && verdict.empty()) copy_out();
    end_step();
    if (failure) std::rethrow_exception(failure);
    if (!verdict.empty()) fail(cat(who_, ": finish"), verdict);
  }

 private:
  void misuse(std::string cause) {
    if (misuse_.empty()) misuse_ = std::move(cause);
  }

  template <class Launch>
  void launch_full(Launch& launch) {
    const auto& buckets = plan_.buckets();
    while (next_ < buckets.size() && arrived_[next_] == buckets[next_].last - buckets[next_].first)
      launch_bucket(next_++, launch);
  }

  template <class Launch>
  void launch_bucket(std::size_t b, Launch& launch) {
    trace::instant(trace::names::bucket_ready, "sync", static_cast<std::int64_t>(b), "bucket");
    const auto& spec = plan_.buckets()[b];
    const std::size_t width = size_of(spec.type);
    void* data = nullptr;
    if (spec.last - spec.first == 1 && pointers_[spec.first]) {
      data = pointers_[spec.first];  // a bucket of one gradient is reduced where it lies
    } else {
      auto& stage = staging_[b];
      stage.resize(spec.count * width);
      for (std::size_t i = spec.first; i < spec.last; ++i) {
        const auto& g = plan_.gradients()[i];
        if (pointers_[i]) B::copy(stage.data() + g.offset * width, pointers_[i], g.count * width);
      }
      data = stage.data();
    }
    flights_[b] = launch(spec.type, data, spec.count);
  }

  void copy_out() {
    const auto& buckets = plan_.buckets();
    for (std::size_t b = 0; b < buckets.size(); ++b) {
      const auto& spec = buckets[b];
      if (spec.last - spec.first == 1 && pointers_[spec.first]) continue;  // reduced in place
      const std::size_t width = size_of(spec.type);
      for (std::size_t i = spec.first; i < spec.last; ++i) {
        const auto& g = plan_.gradients()[i];
        if (pointers_[i]) B::copy(pointers_[i], staging_[b].data() + g.offset * width, g.count * width);
      }
    }
  }

  void end_step() {
    if (planning_) {
      pointers_.clear();
    } else {
      std::fill(pointers_.begin(), pointers_.end(), nullptr);
      if (pointers_.size() != plan_.gradients().size()) pointers_.assign(plan_.gradients().size(), nullptr);
      std::fill(arrived_.begin(), arrived_.end(), 0);
    }
    next_ = 0;
    step_hash_ = fingerprint();
    sequence_ = {};
    misuse_.clear();
  }

  void drain() noexcept {
    for (auto& f : flights_) {
      try {
        f.wait();
      } catch (...) {
      }
      f.reset();
    }
  }

  // The signature exchange, kept apart from bucket traffic.
  typename control_channel<B>::backend::communicator control_;
  typename signature_check<typename control_channel<B>::backend>::agree_fn agree_;
  std::string who_;
  bool launch_early_;
  bucket_plan plan_;
  bool planning_ = true;
  std::unordered_set<int> planned_;
  std::vector<void*> pointers_;  // per plan gradient: where this step's gradient lies
  std::vector<std::size_t> arrived_;  // per bucket: gradients handed over this step
  // Per bucket fusing several gradients, in the backend's memory (device memory for nccl and
  // staged, where B::copy is a stream-ordered device copy).
  std::vector<typename B::template buffer<std::byte>> staging_;
  std::vector<flight<B>> flights_;
  std::size_t next_ = 0;  // the next bucket to launch: buckets launch in index order only
  fingerprint step_hash_;
  first_handed sequence_;
  std::string misuse_;
};

}  // namespace detail

inline void bucket_plan::add(int index, dtype type, std::size_t count) {
  const std::size_t bytes = count * size_of(type);
  const bool fits = !buckets_.empty() && buckets_.back().type == type &&
                    (buckets_.back().count * size_of(type) + bytes <= capacity_);
  if (!fits) buckets_.push_back({type, 0, gradients_.size(), gradients_.size()});
  auto& b = buckets_.back();
  position_[index] = gradients_.size();
  gradients_.push_back({index, type, count, static_cast<int>(buckets_.size() - 1), b.count});
  b.count += count;
  b.last = gradients_.size();
}

inline std::uint64_t bucket_plan::signature() const {
  fingerprint f;
  f.add(capacity_);
  for (const auto& g : gradients_)
    f.add(static_cast<std::uint64_t>(g.index)).add(static_cast<std::uint64_t>(g.type)).add(g.count).add(
        static_cast<std::uint64_t>(g.bucket));
  return f.value();
}

inline std::size_t bucket_bytes_from_env() {
  const char* text = setting("FLEXCOMM_BUCKET_BYTES");
  return text ? parse_setting_bytes(text, "FLEXCOMM_BUCKET_BYTES") : default_bucket_bytes;
}

inline std::size_t segment_bytes_from_env() {
  const char* text = setting("FLEXCOMM_SEGMENT_BYTES");
  return text ? parse_setting_bytes(text, "FLEXCOMM_SEGMENT_BYTES") : default_segment_bytes;
}

}  // namespace flexcomm
