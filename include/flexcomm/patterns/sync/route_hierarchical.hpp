// The hierarchical route: a member whose ranks span hosts reduces each
// bucket within each host to the host's leader, allreduces across the leaders (the only traffic
// that crosses the network, once per host instead of once per rank), and broadcasts within each
// host. Horovod's hierarchical allreduce; NCCL's rings across nodes. Where a host's ranks really
// share memory (sync_options.shared_memory, backends with has_host_shared_memory), the two
// intra-host stages go through shared memory: an allreduce within the host (the leader needs
// the sum; the others' copy is overwritten) and a broadcast from the leader.
#pragma once

#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "../../backend/contract.hpp"
#include "../../core/agreement.hpp"
#include "../../core/datatype.hpp"
#include "../../core/error.hpp"
#include "../../core/hosts.hpp"
#include "../../core/progress.hpp"
#include "../../core/reduce.hpp"
#include "../../core/span.hpp"
#include "flight.hpp"
#include "options.hpp"

namespace flexcomm::detail {

// The shared-memory reducer and its tasks on backends that have one; placeholders elsewhere, so
// that the tiers compile (and stay on messages) on every backend.
template <class B, bool = has_host_shared_memory<B>>
struct tier_shared_memory {
  struct reducer {};
  template <class T>
  struct task {
    bool poll() { return true; }
  };
  template <class T>
  using reduce_task = task<T>;
  template <class T>
  using broadcast_task = task<T>;
};
template <class B>
struct tier_shared_memory<B, true> {
  using reducer = typename B::host_reducer;
  template <class T>
  using reduce_task = typename reducer::template task<T>;
  template <class T>
  using broadcast_task = typename reducer::template broadcast_task<T>;
};

// The member's hosts and the communicators of the three stages, made eagerly and collectively
// in the adapter's constructor. Device backends stay flat: their host map would have to come
// from the MPI twin, and their intra-host path is NCCL's own.
template <class B>
class host_tiers {
 public:
  // `member` is the adapter's private duplicate of the member: construction talks on it.
  host_tiers(const typename B::communicator& member, const sync_options& options, flat_algorithm flat,
             const std::string& who) {
    const hierarchy wanted = options.hierarchical;
    if constexpr (holds_host_memory<B>) {
      // Every rank of the member takes the same branch: `wanted` is checked equal across the
      // member below, and the host map is the same on every rank.
      hosts_ = B::hosts(member);
      agreement same({static_cast<std::int64_t>(wanted), static_cast<std::int64_t>(options.shared_memory),
                      static_cast<std::int64_t>(options.shared_memory_slot_bytes)});
      B::iallreduce(member, same.buffer(), op::max).wait();
      check(same.agreed(0), who,
            cat("sync_options.hierarchical (FLEXCOMM_HIERARCHICAL) differs across the member's ranks; this rank has '",
                name_of(wanted), "'"));
      check(same.agreed(1) && same.agreed(2), who,
            cat("sync_options.shared_memory (FLEXCOMM_SHM) or its slot size differs across the member's ranks; this "
                "rank has '",
                name_of(options.shared_memory), "'"));
      enabled_ = use_hierarchy(wanted, hosts_, flat);
      if (!enabled_) return;
      const int host = hosts_.host_of(member.rank());
      const std::string name = member.name();
      // Separate communicators for the intra-host reduce and broadcast: the trainer posts
      // reductions as buckets fill while the engine posts broadcasts as they come back, and
      // collectives on one communicator must be posted in one order on every rank.
      reduce_ = member.split(host, member.rank(), cat(name, " host ", host, " reduce"));
      bcast_ = reduce_.dup(cat(name, " host ", host, " broadcast"));
      leaders_ = member.split(reduce_.rank() == 0 ? 0 : B::communicator::undefined, member.rank(),
                              cat(name, " host leaders"));
      order_ = std::make_shared<sequencer>();
      if constexpr (has_host_shared_memory<B>) {
        // Decided per host, by that host's ranks alike: the host map may pretend (FLEXCOMM_HOSTS)
        // that ranks on several machines share one, and MPI has the last word.
        if (options.shared_memory != shared_memory_use::off && reduce_.size() > 1 &&
            B::host_reducer::on_one_host(reduce_)) {
          host_reduce_.emplace(reduce_, options.shared_memory_slot_bytes);
          host_bcast_.emplace(bcast_, options.shared_memory_slot_bytes);
        }
      }
    } else {
      static_cast<void>(member);
      static_cast<void>(options);
      static_cast<void>(wanted);
      static_cast<void>(flat);
      static_cast<void>(who);
    }
  }

  bool enabled() const noexcept { return enabled_; }
  const host_map& hosts() const noexcept { return hosts_; }
  bool leader() const noexcept { return static_cast<bool>(leaders_); }
  // Whether this rank's host does the intra-host stages in shared memory.
  bool shared_memory() const noexcept { return host_reduce_.has_value(); }
  const typename B::communicator& leaders() const noexcept { return leaders_; }

  // Bucket `count` x T at `data`, reduced by `o` over the whole member. `across` is the flat
  // route's leg across the leaders (sum, or o), made on the trainer's thread in bucket order:
  // its `poll()` starts it on its first call and is true once done; polled on leaders only, on
  // the engine's thread, in bucket order. Returns the flight the trainer waits on.
  template <class T, class Across>
  flight<B> launch(T* data, std::size_t count, op o, int member_size, Across across);

 private:
  // Stages 2 and 3 are posted from the engine's thread, each bucket in its turn: buckets may
  // finish their intra-host reduce out of order. Touched by the engine's thread only.
  struct sequencer {
    std::uint64_t crossed = 0, broadcast = 0;
    bool failed = false;
  };

  template <class T, class Across>
  class bucket;

  host_map hosts_;
  bool enabled_ = false;
  typename B::communicator reduce_, bcast_, leaders_;
  // Stage 1 and stage 3 in shared memory: separate segments for the reasons reduce_ and bcast_
  // are separate (stage 1 starts on the trainer's thread, stage 3 on the engine's).
  std::optional<typename tier_shared_memory<B>::reducer> host_reduce_, host_bcast_;
  std::shared_ptr<sequencer> order_;
  std::uint64_t launched_ = 0;  // trainer's thread only
};

template <class B>
template <class T, class Across>
class host_tiers<B>::bucket {
 public:
  bucket(host_tiers& tiers, T* data, std::size_t count, op o, int member_size, std::uint64_t sequence, Across across)
      : tiers_(tiers),
        order_(tiers.order_),
        data_(data),
        count_(count),
        op_(o),
        stage_op_(o == op::avg ? op::sum : o),
        member_size_(member_size),
        sequence_(sequence),
        across_(std::move(across)),
        what_(cat("hierarchical ", name_of(o), " of ", count, " x ", name_of(dtype_of<T>), " over ",
                  tiers.hosts_.hosts(), " hosts (", tiers.hosts_.str(), ")")) {
    // Stage 1 is posted here, on the trainer's thread, in bucket order like every launch.
    if constexpr (has_host_shared_memory<B>) {
      if (tiers_.host_reduce_) {
        shm_reduce_ = tiers_.host_reduce_->start(data_, count_, stage_op_);
        return;
      }
    }
    if (tiers_.reduce_.size() > 1)
      reduce_.emplace(B::ireduce(tiers_.reduce_, span<const T>(data_, count_), span<T>(data_, count_), stage_op_, 0));
  }

  const std::string& what() const noexcept { return what_; }

  // On the engine's thread: true once this rank holds the member's result.
  bool poll() {
    try {
      return advance();
    } catch (...) {
      order_->failed = true;  // later buckets would wait for this one's turn forever
      throw;
    }
  }

 private:
  enum class stage { reducing, crossing, broadcasting, done };

  bool advance() {
    if (order_->failed && stage_ != stage::done)
      fail(what_, "an earlier bucket of this member failed; this one cannot keep its place in the order");
    if (stage_ == stage::reducing) {
      if (reduce_ && !reduce_->test()) return false;
      if (shm_reduce_ && !shm_reduce_->poll()) return false;
      if (tiers_.leader()) {
        if (order_->crossed != sequence_) return false;
        crossing_ = tiers_.leaders_.size() > 1;
        ++order_->crossed;
      }
      stage_ = stage::crossing;
    }
    if (stage_ == stage::crossing) {
      if (crossing_ && !across_.poll()) return false;
      // Averaged once, by each leader, before the broadcast: every rank ends with the same bits.
      if (tiers_.leader() && op_ == op::avg) B::divide(data_, count_, member_size_);
      stage_ = stage::broadcasting;
    }
    if (stage_ == stage::broadcasting) {
      if (!broadcast_posted_) {
        if (order_->broadcast != sequence_) return false;
        ++order_->broadcast;
        broadcast_posted_ = true;
        if constexpr (has_host_shared_memory<B>) {
          if (tiers_.host_bcast_) shm_bcast_ = tiers_.host_bcast_->start_broadcast(data_, count_, 0);
        }
        if (!shm_bcast_ && tiers_.bcast_.size() > 1) bcast_.emplace(B::ibcast(tiers_.bcast_, span<T>(data_, count_), 0));
      }
      if (bcast_ && !bcast_->test()) return false;
      if (shm_bcast_ && !shm_bcast_->poll()) return false;
      stage_ = stage::done;
    }
    return true;
  }

  host_tiers& tiers_;
  std::shared_ptr<sequencer> order_;
  T* data_;
  std::size_t count_;
  op op_, stage_op_;
  int member_size_;
  std::uint64_t sequence_;
  Across across_;
  bool crossing_ = false;
  std::optional<typename B::request> reduce_, bcast_;
  std::shared_ptr<typename tier_shared_memory<B>::template reduce_task<T>> shm_reduce_;
  std::shared_ptr<typename tier_shared_memory<B>::template broadcast_task<T>> shm_bcast_;
  bool broadcast_posted_ = false;
  stage stage_ = stage::reducing;
  std::string what_;
};

template <class B>
template <class T, class Across>
flight<B> host_tiers<B>::launch(T* data, std::size_t count, op o, int member_size, Across across) {
  flight<B> f;
  if (count == 0) return f;  // every rank agrees on the count: nothing moves anywhere
  auto b = std::make_shared<bucket<T, Across>>(*this, data, count, o, member_size, launched_++, std::move(across));
  f.task = progress_engine::instance().submit([b] { return b->poll(); }, b->what());
  return f;
}

}  // namespace flexcomm::detail
