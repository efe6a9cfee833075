// Hierarchical averaging for the Sync adapters: a member whose ranks span hosts reduces each
// bucket within each host to the host's leader, allreduces across the leaders (the only traffic
// that crosses the network, once per host instead of once per rank), and broadcasts within each
// host. Horovod's hierarchical allreduce; NCCL's rings across nodes.
#pragma once

#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "../backend/contract.hpp"
#include "../core/agreement.hpp"
#include "../core/datatype.hpp"
#include "../core/error.hpp"
#include "../core/hosts.hpp"
#include "../core/progress.hpp"
#include "../core/reduce.hpp"
#include "sync.hpp"

namespace flexcomm::detail {

// The member's hosts and the communicators of the three stages, made eagerly and collectively
// in the adapter's constructor. Device backends stay flat: their host map would have to come
// from the MPI twin, and their intra-host path is NCCL's own.
template <class B>
class host_tiers {
 public:
  // `member` is the adapter's private duplicate of the member: construction talks on it.
  host_tiers(const typename B::communicator& member, hierarchy wanted, flat_algorithm flat, const std::string& who) {
    if constexpr (holds_host_memory<B>) {
      // Every rank of the member takes the same branch: `wanted` is checked equal across the
      // member below, and the host map is the same on every rank.
      hosts_ = B::hosts(member);
      agreement same({static_cast<std::int64_t>(wanted)});
      B::iallreduce(member, same.buffer(), op::max).wait();
      check(same.agreed(0), who,
            cat("sync_options.hierarchical (FLEXCOMM_HIERARCHICAL) differs across the member's ranks; this rank has '",
                name_of(wanted), "'"));
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
    } else {
      static_cast<void>(member);
      static_cast<void>(wanted);
      static_cast<void>(flat);
      static_cast<void>(who);
    }
  }

  bool enabled() const noexcept { return enabled_; }
  const host_map& hosts() const noexcept { return hosts_; }
  bool leader() const noexcept { return static_cast<bool>(leaders_); }
  const typename B::communicator& leaders() const noexcept { return leaders_; }

  // Bucket `count` x T at `data`, reduced by `o` over the whole member. `cross` starts the
  // leaders' allreduce (sum, or o) and returns its poll; called on leaders, on the engine's
  // thread, in bucket order. Returns the flight the trainer waits on.
  template <class T, class Cross>
  flight<B> launch(T* data, std::size_t count, op o, int member_size, Cross cross);

 private:
  // Stages 2 and 3 are posted from the engine's thread, each bucket in its turn: buckets may
  // finish their intra-host reduce out of order. Touched by the engine's thread only.
  struct sequencer {
    std::uint64_t crossed = 0, broadcast = 0;
    bool failed = false;
  };

  template <class T>
  class bucket;

  host_map hosts_;
  bool enabled_ = false;
  typename B::communicator reduce_, bcast_, leaders_;
  std::shared_ptr<sequencer> order_;
  std::uint64_t launched_ = 0;  // trainer's thread only
};

template <class B>
template <class T>
class host_tiers<B>::bucket {
 public:
  bucket(host_tiers& tiers, T* data, std::size_t count, op o, int member_size, std::uint64_t sequence,
         std::function<std::function<bool()>(T*, std::size_t, op)> cross)
      : tiers_(tiers),
        order_(tiers.order_),
        data_(data),
        count_(count),
        op_(o),
        stage_op_(o == op::avg ? op::sum : o),
        member_size_(member_size),
        sequence_(sequence),
        cross_(std::move(cross)),
        what_(cat("hierarchical ", name_of(o), " of ", count, " x ", name_of(dtype_of<T>), " over ",
                  tiers.hosts_.hosts(), " hosts (", tiers.hosts_.str(), ")")) {
    // Stage 1 is posted here, on the trainer's thread, in bucket order like every launch.
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
      if (tiers_.leader()) {
        if (order_->crossed != sequence_) return false;
        if (tiers_.leaders_.size() > 1) crossing_ = cross_(data_, count_, stage_op_);
        ++order_->crossed;
      }
      stage_ = stage::crossing;
    }
    if (stage_ == stage::crossing) {
      if (crossing_ && !crossing_()) return false;
      // Averaged once, by each leader, before the broadcast: every rank ends with the same bits.
      if (tiers_.leader() && op_ == op::avg) B::divide(data_, count_, member_size_);
      stage_ = stage::broadcasting;
    }
    if (stage_ == stage::broadcasting) {
      if (!bcast_) {
        if (order_->broadcast != sequence_) return false;
        ++order_->broadcast;
        if (tiers_.bcast_.size() > 1) bcast_.emplace(B::ibcast(tiers_.bcast_, span<T>(data_, count_), 0));
      }
      if (bcast_ && !bcast_->test()) return false;
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
  std::function<std::function<bool()>(T*, std::size_t, op)> cross_;
  std::function<bool()> crossing_;
  std::optional<typename B::request> reduce_, bcast_;
  stage stage_ = stage::reducing;
  std::string what_;
};

template <class B>
template <class T, class Cross>
flight<B> host_tiers<B>::launch(T* data, std::size_t count, op o, int member_size, Cross cross) {
  flight<B> f;
  if (count == 0) return f;  // every rank agrees on the count: nothing moves anywhere
  auto b = std::make_shared<bucket<T>>(*this, data, count, o, member_size, launched_++, std::move(cross));
  f.task = progress_engine::instance().submit([b] { return b->poll(); }, b->what());
  return f;
}

}  // namespace flexcomm::detail
