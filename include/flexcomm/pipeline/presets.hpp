// The seed's pipeline designs by name (Pittman et al., SC18), each with either sync: going from
// the baseline to a streamlined pipeline is a change of preset, never of trainer code.
//
//   baseline           local_feed: every trainer preprocesses its own batches; gradients
//                      averaged after backward (subgroup_allreduce, all buckets in finish())
//   single_broadcast   one producer preprocesses each step and broadcasts it (one_to_many)
//   multi_broadcast    the same one_to_many with several producers taking turns as root
//   all_shared         no producers: trainers take turns preprocessing, shared by broadcast
//   adaptive           each step preprocessed once by whoever is idle: the producers while they
//                      keep ahead, else the trainers waiting for it (any producer count)
//
// The producer count is the layout's: single_broadcast takes exactly one producer,
// multi_broadcast two or more, adaptive any, the others none (with_producers() derives such a layout).
//
// B is the Sync's backend; the feed and the collect run on its host backend (B itself, or MPI
// for nccl and staged): single_broadcast<subgroup_allreduce, nccl> feeds batches over MPI into
// host memory and averages gradients with NCCL. A third argument names another host backend.
#pragma once

#include <limits>
#include <string>
#include <string_view>
#include <utility>

#include "../backend/contract.hpp"
#include "../backend/mpi.hpp"
#include "../core/error.hpp"
#include "../core/layout.hpp"
#include "../core/setting_values.hpp"
#include "../patterns/feed/adaptive.hpp"
#include "../patterns/feed/all_shared.hpp"
#include "../patterns/feed/local_feed.hpp"
#include "../patterns/collect/many_to_one.hpp"
#include "../patterns/feed/one_to_many.hpp"
#include "../patterns/sync/overlapped_ring.hpp"
#include "../patterns/sync/subgroup_allreduce.hpp"
#include "ensemble_pipeline.hpp"

namespace flexcomm {

// The same members and aggregator with `producers` producer ranks in front: the aggregator stays
// on the same trainer, or, if it was a producer, becomes producer 0 (the first trainer if none).
// A per-host layout must be placed unless its aggregator is world rank 0 (always a producer).
inline ensemble_layout with_producers(const ensemble_layout& layout, int producers) {
  const ensemble_layout out(producers, layout.member_sizes(), 0);
  if (layout.aggregator() == 0 && !layout.is_placed()) return out;
  const rank_role r = layout.role_of(layout.aggregator());
  if (r.kind == role::producer) return out;
  return ensemble_layout(producers, layout.member_sizes(), out.trainer_rank(r.member, r.rank_in_member));
}

namespace presets {

constexpr int many = std::numeric_limits<int>::max();  // producers: no most

namespace detail {
// "1 producer", "no producers", "2 or more producers", "any number of producers".
inline std::string producers_text(int low, int high) {
  if (low == high) return low == 0 ? std::string("no producers") : cat(low, low == 1 ? " producer" : " producers");
  if (high != many) return cat(low, "..", high, " producers");
  return low == 0 ? std::string("any number of producers") : cat(low, " or more producers");
}
}  // namespace detail

// A preset: its pipeline type, its name, and the producer counts its layout may have. Its
// pipeline refuses a layout with the wrong producers (a baseline given a producer would otherwise
// train with that rank idle), naming the preset.
template <class Name, template <class> class Feed, template <class> class Sync, class B, class HostB, int MinProducers,
          int MaxProducers, bool Overlap>
struct preset {
  static_assert(holds_host_memory<HostB>,
                "presets: the feed and the collect run on the host backend (the third argument), and this one's "
                "buffers live in device memory; name the device backend second, as the Sync's, and let the host "
                "backend default (MPI for nccl and staged)");
  static constexpr const char* name = Name::value;
  static constexpr int min_producers = MinProducers;
  static constexpr int max_producers = MaxProducers;

  class pipeline : public ensemble_pipeline<Feed<HostB>, Sync<B>, many_to_one<HostB>> {
    using base = ensemble_pipeline<Feed<HostB>, Sync<B>, many_to_one<HostB>>;

   public:
    using typename base::options;
    pipeline(const typename base::communicator& world, const ensemble_layout& layout, options opt)
        : base(world, checked(layout), std::move(opt)) {}

   private:
    static const ensemble_layout& checked(const ensemble_layout& layout) {
      check_layout(layout, name);
      return layout;
    }
  };
  using options = typename pipeline::options;

  // The options as this design runs: the baseline reduces every bucket after backward, the
  // streamlined designs launch a bucket as soon as backprop fills it (overlapped_ring always
  // overlaps). Everything else is the caller's.
  static options configure(options o) {
    o.sync.launch_when_full = Overlap;
    return o;
  }

  // Throws, naming the preset, when the layout has the wrong number of producers. A producer per
  // host suits every preset that has producers, however many hosts there are.
  static void check_layout(const ensemble_layout& layout, const char* name) {
    if (layout.per_host()) {
      check(max_producers > 0, cat("preset ", name),
            cat("layout '", layout.str(), "' puts a producer on each host; ", name, " takes none"));
      return;
    }
    const int p = layout.producers();
    check(p >= min_producers && p <= max_producers, cat("preset ", name),
          cat("layout '", layout.str(), "' has ", p, " producers; ", name, " takes ",
              detail::producers_text(min_producers, max_producers)));
  }
  // The layout this preset runs on, from one that gives the members (and the aggregator): one
  // without producers gets the preset's fewest (with_producers keeps the aggregator's trainer);
  // producers it has are kept, never rewritten, so that a count this preset does not take is
  // refused as the user wrote it (check_layout).
  static ensemble_layout layout_for(const ensemble_layout& layout) {
    if (layout.per_host() || layout.producers() > 0 || min_producers == 0) return layout;
    return with_producers(layout, min_producers);
  }
};

namespace detail {
struct baseline_name { static constexpr const char* value = "baseline"; };
struct single_broadcast_name { static constexpr const char* value = "single_broadcast"; };
struct multi_broadcast_name { static constexpr const char* value = "multi_broadcast"; };
struct all_shared_name { static constexpr const char* value = "all_shared"; };
struct adaptive_name { static constexpr const char* value = "adaptive"; };

// local_feed takes no backend: each trainer loads its own batches.
template <class>
using own_loading = local_feed;
}  // namespace detail

template <class B = mpi, class HostB = host_backend_t<B>>
struct baseline
    : preset<detail::baseline_name, detail::own_loading, subgroup_allreduce, B, HostB, 0, 0, false> {};
template <template <class> class Sync = subgroup_allreduce, class B = mpi, class HostB = host_backend_t<B>>
struct single_broadcast : preset<detail::single_broadcast_name, one_to_many, Sync, B, HostB, 1, 1, true> {};
template <template <class> class Sync = subgroup_allreduce, class B = mpi, class HostB = host_backend_t<B>>
struct multi_broadcast : preset<detail::multi_broadcast_name, one_to_many, Sync, B, HostB, 2, many, true> {};
template <template <class> class Sync = subgroup_allreduce, class B = mpi, class HostB = host_backend_t<B>>
struct all_shared : preset<detail::all_shared_name, flexcomm::all_shared, Sync, B, HostB, 0, 0, true> {};
template <template <class> class Sync = subgroup_allreduce, class B = mpi, class HostB = host_backend_t<B>>
struct adaptive : preset<detail::adaptive_name, flexcomm::adaptive, Sync, B, HostB, 0, many, true> {};

// Names a trainer passes on the command line (core/setting_values.hpp holds them, for
// FLEXCOMM_PRESET's check at start).
inline constexpr const auto& names = preset_names;
inline constexpr const char* sync_names[] = {"allreduce", "ring"};

namespace detail {
// f(P<overlapped_ring, B>{}) or f(P<subgroup_allreduce, B>{}); the ring is not even instantiated
// on a backend that matches messages in issue order, where asking for it is refused.
template <template <template <class> class, class, class> class P, class B, class F>
decltype(auto) with_sync(bool ring, F& f) {
  if constexpr (matches_by_tag<B>) {
    if (ring) return f(P<overlapped_ring, B, host_backend_t<B>>{});
  } else {
    check(!ring, "presets",
          "sync 'ring' (overlapped_ring) needs a backend whose messages match by tag; this one's match in issue "
          "order (NCCL): use 'allreduce'");
  }
  return f(P<subgroup_allreduce, B, host_backend_t<B>>{});
}
}  // namespace detail

// Calls f(Preset{}) with the preset named `name` and the sync named `sync` ("allreduce":
// subgroup_allreduce, "ring": overlapped_ring) on Sync backend B. The baseline always uses
// subgroup_allreduce.
template <class B = mpi, class F>
decltype(auto) visit(std::string_view name, std::string_view sync, F&& f) {
  check(sync == "allreduce" || sync == "ring", "presets",
        cat("unknown sync '", sync, "' (known: allreduce, ring)"));
  const bool ring = sync == "ring";
  if (name == "baseline") return f(baseline<B>{});
  if (name == "single_broadcast") return detail::with_sync<single_broadcast, B>(ring, f);
  if (name == "multi_broadcast") return detail::with_sync<multi_broadcast, B>(ring, f);
  if (name == "all_shared") return detail::with_sync<all_shared, B>(ring, f);
  if (name == "adaptive") return detail::with_sync<adaptive, B>(ring, f);
  check_preset_name(name);  // an unknown name: the error lists the known ones
  fail("presets", cat("preset '", name, "' is in presets::names but visit() has no case for it"));
}

}  // namespace presets
}  // namespace flexcomm
