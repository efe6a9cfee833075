// subgroup_allreduce<B>: the baseline Sync. Each bucket is averaged by the backend's own
// nonblocking allreduce on the member's communicator, so gradients never mix across members;
// a member whose ranks all share one host reduces through shared memory instead, where the
// backend can (sync_options.shared_memory).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "../../backend/contract.hpp"
#include "../../core/agreement.hpp"
#include "../../core/datatype.hpp"
#include "../../core/progress.hpp"
#include "route_hierarchical.hpp"
#include "route_shared_memory.hpp"
#include "core.hpp"

namespace flexcomm {

// By default every bucket is launched in finish(), i.e. after backward (the classic "sync after
// backward" that overlapped_ring is measured against). With sync_options.launch_when_full a bucket
// is launched as soon as it fills, in bucket-index order, and the progress engine drives it.
template <class B>
class subgroup_allreduce {
 public:
  using backend = B;

  // Collective over `member` (the member's own communicator); traffic goes on private duplicates.
  explicit subgroup_allreduce(const typename B::communicator& member, sync_options options = {})
      : comm_(member.dup(cat(member.name(), " subgroup_allreduce"))),
        options_(options),
        tiers_(comm_, options_, flat_algorithm::backend_allreduce, "subgroup_allreduce"),
        sync_(member, options_, "subgroup_allreduce", options_.launch_when_full) {
    shm_.setup(comm_, tiers_.hosts(), tiers_.enabled(), options_, "subgroup_allreduce");
    shm_.check_steps_of(sync_);
  }

  // Gradient `index` is final: it joins its bucket (the average lands here by finish()).
  template <class T>
  void ready(int index, span<T> grad) {
    sync_.ready(index, grad, launcher());
  }
  // Before the optimizer step: every bucket reduced, averages in place; mismatches across the
  // member's ranks (order, sizes) are a flexcomm::error on every rank.
  void finish() { sync_.finish(launcher()); }

  const bucket_plan& plan() const noexcept { return sync_.plan(); }
  const sync_options& options() const noexcept { return options_; }
  // True when buckets are averaged hierarchically across hosts (decided at construction).
  bool hierarchical() const noexcept { return tiers_.enabled(); }
  const host_map& hosts() const noexcept { return tiers_.hosts(); }
  // True when buckets are reduced through shared memory (decided at construction): on one host,
  // or, averaging hierarchically, in this rank's host's stages.
  bool shared_memory() const noexcept { return static_cast<bool>(shm_) || tiers_.shared_memory(); }

 private:
  auto launcher() {
    return [this](dtype type, void* data, std::size_t count) { return launch(type, data, count); };
  }

  detail::flight<B> launch(dtype type, void* data, std::size_t count) {
    return visit_dtype(type, [&](auto element) {
      using T = decltype(element);
      if (tiers_.enabled()) {
        // The backend's allreduce across the host leaders; the stages are chained by the engine,
        // whether the bucket was launched when full or in finish().
        const auto* leaders = &tiers_.leaders();
        return tiers_.launch(static_cast<T*>(data), count, options_.op, comm_.size(),
                             [leaders](T* d, std::size_t n, op o) {
                               auto across = std::make_shared<typename B::request>(B::iallreduce(*leaders, span<T>(d, n), o));
                               return std::function<bool()>([across] { return across->test(); });
                             });
      }
      detail::flight<B> f;
      if (shm_) return shm_.launch(static_cast<T*>(data), count, options_.op, options_.launch_when_full);
      auto request = B::iallreduce(comm_, span<T>(static_cast<T*>(data), count), options_.op);
      if (options_.launch_when_full) {
        auto shared = std::make_shared<typename B::request>(std::move(request));
        f.task = progress_engine::instance().submit([shared] { return shared->test(); }, shared->what());
      } else {
        f.request.emplace(std::move(request));
      }
      return f;
    });
  }

  typename B::communicator comm_;
  sync_options options_;
  detail::host_tiers<B> tiers_;  // the allreduce runs across host leaders when enabled
  detail::host_shared<B> shm_;  // buckets go through shared memory when set
  detail::bucket_sync<B> sync_;  // last: destroyed first, so buckets in flight end before comm_
};

}  // namespace flexcomm
