// ensemble_pipeline<Feed, Sync, Collect>: wires a feed, a sync and a collect to a layout and runs
// each rank's role, so that the trainer's code is the same whichever adapters fill the slots.
//
//   Pipeline pipe{env.world(), layout, {feed_options, sync_options}};
//   pipe.run(loader,
//            [&](auto& ctx) {      // trainers: ctx.member(), ctx.feed(), ctx.sync(), ctx.collect()
//              while (auto batch = ctx.feed().next()) {...}
//              ctx.collect().submit(predictions);
//            },
//            [&](auto& ctx) {      // the aggregator, after its own role's work
//              auto all = ctx.collect().template gather<float>();
//            });
//
// The constructor builds, collectively over `world`, in one fixed order on every rank: the member
// communicators, a duplicate of `world` for the feed, the collect's, then each member's sync.
// The feed's own communicators are built in run(), on that duplicate, when the feed is made with
// the loader run() is given: run() is collective too, and the duplicate keeps them apart from
// whatever the trainer does on `world` in between. A per-host layout ("producers=per-host") is
// placed on the world's hosts before all of them.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "../core/error.hpp"
#include "../core/layout.hpp"
#include "../core/span.hpp"
#include "../core/stall.hpp"
#include "../backend/contract.hpp"
#include "../patterns/feed/vocabulary.hpp"
#include "../patterns/feed/agreement.hpp"
#include "../patterns/feed/dataset.hpp"
#include "../patterns/sync/core.hpp"
#include "../patterns/feed/typed_feed.hpp"

namespace flexcomm {

template <class T>
struct gathered;  // patterns/collect/many_to_one.hpp

namespace detail {
template <class T, class = void> struct is_feed : std::false_type {};
template <class T>
struct is_feed<T, std::void_t<decltype(std::declval<T&>().next()), decltype(std::declval<T&>().produce()),
                              decltype(T::needs_producers)>> : std::true_type {};

template <class T, class = void> struct is_sync : std::false_type {};
template <class T>
struct is_sync<T, std::void_t<decltype(std::declval<T&>().ready(0, std::declval<span<float>>())),
                              decltype(std::declval<T&>().finish())>> : std::true_type {};

// The element type of an on_round callback, from its second parameter: gathered<T>&.
template <class F> struct round_element;
template <class C, class R, class Round, class T>
struct round_element<R (C::*)(Round, gathered<T>&) const> { using type = T; };
template <class C, class R, class Round, class T>
struct round_element<R (C::*)(Round, gathered<T>&)> { using type = T; };

template <class T, class = void> struct is_collect : std::false_type {};
template <class T>
struct is_collect<T, std::void_t<decltype(std::declval<T&>().submit(std::declval<span<const float>>())),
                                 decltype(std::declval<T&>().template gather<float>())>> : std::true_type {};
}  // namespace detail

// What the pipeline hands each trainer, and the aggregator (the same type: a trainer that also
// aggregates uses one context for both).
template <class Pipeline>
class pipeline_context {
 public:
  using feed_type = typename Pipeline::feed_type;
  using sync_type = typename Pipeline::sync_type;
  using collect_type = typename Pipeline::collect_type;
  using communicator = typename Pipeline::communicator;

  explicit pipeline_context(Pipeline& pipe) : pipe_(pipe) {}

  // Which member this trainer trains (-1 on a producer), and its rank among the member's ranks.
  int member() const noexcept { return pipe_.role_.member; }
  int rank_in_member() const noexcept { return pipe_.role_.rank_in_member; }
  int member_size() const { return member() < 0 ? 0 : pipe_.layout_.member_size(member()); }
  int members() const noexcept { return pipe_.layout_.members(); }
  // Whether this rank trains: always in the trainer function; in the aggregate function, whether
  // the aggregator is also a trainer (true) or a producer (false).
  bool is_trainer() const noexcept { return pipe_.role_.kind == role::trainer; }
  // Whether this rank is the layout's aggregator (world rank layout().aggregator()): the one rank
  // that runs the aggregate function and may call collect().gather() / reduce().
  bool is_aggregator() const noexcept { return pipe_.collect_.is_aggregator(); }
  const ensemble_layout& layout() const noexcept { return pipe_.layout_; }

  // The byte feed (after run(loader, ...), or the one under the typed feed after run(dataset, ...)).
  feed_type& feed() { return pipe_.typed_ ? pipe_.typed_->bytes_feed() : *pipe_.feed_; }
  // The typed, epoch-aware feed, after run(dataset, ...): batch->as<T>(), epochs, on_epoch_end.
  typed_feed<feed_type>& batches() {
    check(pipe_.typed_.has_value(), "ensemble_pipeline", "batches() needs run(dataset, ...); this run has a byte loader");
    return *pipe_.typed_;
  }
  sync_type& sync() {
    check(pipe_.sync_.has_value(), "ensemble_pipeline", "sync() is for trainers; this rank is a producer");
    return *pipe_.sync_;
  }
  collect_type& collect() { return pipe_.collect_; }
  // This member's communicator (empty on producers), for what the trainer does on its own.
  const communicator& comm() const noexcept { return pipe_.member_comm_; }

 private:
  Pipeline& pipe_;
};

template <class Feed, class Sync, class Collect>
class ensemble_pipeline {
  // Slots in the wrong order are the likely mistake: say what goes where.
  static_assert(!detail::is_sync<Feed>::value,
                "ensemble_pipeline<Feed, Sync, Collect>: a Sync adapter is in the Feed slot. The 1st argument is "
                "the Feed (local_feed, one_to_many<B>, all_shared<B>), the 2nd the Sync (subgroup_allreduce<B>, "
                "overlapped_ring<B>), the 3rd the Collect (many_to_one<B>)");
  static_assert(!detail::is_collect<Feed>::value,
                "ensemble_pipeline<Feed, Sync, Collect>: a Collect adapter is in the Feed slot. The 1st argument "
                "is the Feed (local_feed, one_to_many<B>, all_shared<B>), the 3rd the Collect (many_to_one<B>)");
  static_assert(detail::is_feed<Feed>::value || detail::is_sync<Feed>::value || detail::is_collect<Feed>::value,
                "ensemble_pipeline<Feed, Sync, Collect>: the 1st argument is not a Feed; a Feed has produce(), "
                "next() and needs_producers (local_feed, one_to_many<B>, all_shared<B>)");
  static_assert(!detail::is_feed<Sync>::value,
                "ensemble_pipeline<Feed, Sync, Collect>: a Feed adapter is in the Sync slot. The 2nd argument is "
                "the Sync (subgroup_allreduce<B>, overlapped_ring<B>); feeds (local_feed, one_to_many<B>, "
                "all_shared<B>) go 1st");
  static_assert(!detail::is_collect<Sync>::value,
                "ensemble_pipeline<Feed, Sync, Collect>: a Collect adapter is in the Sync slot. The 2nd argument is "
                "the Sync (subgroup_allreduce<B>, overlapped_ring<B>); many_to_one<B> goes 3rd");
  static_assert(detail::is_sync<Sync>::value || detail::is_feed<Sync>::value || detail::is_collect<Sync>::value,
                "ensemble_pipeline<Feed, Sync, Collect>: the 2nd argument is not a Sync; a Sync has "
                "ready(index, span<T>) and finish() (subgroup_allreduce<B>, overlapped_ring<B>)");
  static_assert(!detail::is_feed<Collect>::value,
                "ensemble_pipeline<Feed, Sync, Collect>: a Feed adapter is in the Collect slot. The 3rd argument is "
                "the Collect (many_to_one<B>); feeds go 1st");
  static_assert(!detail::is_sync<Collect>::value,
                "ensemble_pipeline<Feed, Sync, Collect>: a Sync adapter is in the Collect slot. The 3rd argument is "
                "the Collect (many_to_one<B>); syncs (subgroup_allreduce<B>, overlapped_ring<B>) go 2nd");
  static_assert(detail::is_collect<Collect>::value || detail::is_feed<Collect>::value ||
                    detail::is_sync<Collect>::value,
                "ensemble_pipeline<Feed, Sync, Collect>: the 3rd argument is not a Collect; a Collect has "
                "submit(span<const T>) and gather<T>() (many_to_one<B>)");

 public:
  using feed_type = Feed;
  using sync_type = Sync;
  using collect_type = Collect;
  using backend = typename Collect::backend;
  using communicator = typename backend::communicator;
  using context = pipeline_context<ensemble_pipeline>;

  // What a preset's `options` is too (Preset::options): the feed's (patterns/feed/vocabulary.hpp: steps,
  // shard_capacity, depth, flow; every rank must pass the same) and each member's sync's
  // (patterns/sync/options.hpp: bucket_bytes, op, segment_bytes, segments_in_flight, launch_when_full,
  // hierarchical). A preset's configure(o) returns them as that preset runs.
  struct options {
    feed_options feed;
    sync_options sync;
  };

  // Collective over `world`: every rank of the layout constructs the pipeline, in the same order
  // relative to its other collective calls.
  ensemble_pipeline(const communicator& world, const ensemble_layout& layout, options opt);

  ensemble_pipeline(const ensemble_pipeline&) = delete;
  ensemble_pipeline& operator=(const ensemble_pipeline&) = delete;

  const ensemble_layout& layout() const noexcept { return layout_; }
  // This rank's roles, known from construction: a trainer (else a producer), and whether it is
  // the aggregator, which may be either.
  bool is_trainer() const noexcept { return role_.kind == role::trainer; }
  bool is_aggregator() const noexcept { return collect_.is_aggregator(); }

  // Makes the feed with `load`, then runs this rank's role: producers run the feed's loop,
  // trainers `train(ctx)`; then the aggregator runs `aggregate(ctx)`. Collective over the world;
  // once per pipeline.
  template <class Train, class Aggregate>
  void run(loader load, Train&& train, Aggregate&& aggregate);

 private:
  template <class Train, class Aggregate>
  void run_roles(Train& train, Aggregate& aggregate);

 public:
  template <class Train>
  void run(loader load, Train&& train) {
    run(std::move(load), std::forward<Train>(train), [](context&) {});
  }

  // The same with a typed feed made from `data` (patterns/feed/typed_feed.hpp): the steps and shard
  // capacity come from the dataset (options.feed gives depth and flow; leave its steps and
  // shard_capacity 0), trainers read ctx.batches().
  template <class Train, class Aggregate>
  void run(dataset data, Train&& train, Aggregate&& aggregate);
  template <class Train>
  void run(dataset data, Train&& train) {
    run(std::move(data), std::forward<Train>(train), [](context&) {});
  }

  // Per-round collection while training goes on: on the aggregator, each(round, gathered<T>&)
  // runs for every round as it arrives (rounds the trainers submit, e.g. one per epoch from
  // on_epoch_end): between steps when the aggregator trains or loads under run(dataset, ...), and
  // after its own role's work for every round still to come, before aggregate(ctx). T is taken
  // from the callback's parameter; call before run(), on any rank (only the aggregator's is used).
  template <class F>
  void on_round(F each) {
    using T = typename detail::round_element<decltype(&F::operator())>::type;
    on_round<T>(std::move(each));
  }
  template <class T, class F>
  void on_round(F each) {
    check(!ran_, "ensemble_pipeline", "on_round() goes before run()");
    rounds_ = [this, each = std::move(each)](bool wait) mutable {
      if (wait) {
        collect_.template gather_rounds<T>(each);
      } else {
        collect_.template poll_rounds<T>(each);
      }
    };
  }

 private:
  friend class pipeline_context<ensemble_pipeline>;

  // A per-host layout is placed on the world's hosts first (collective, before any other split).
  static ensemble_layout validated(const communicator& world, const ensemble_layout& layout) {
    check(static_cast<bool>(world), "ensemble_pipeline", "needs a communicator, got an empty one");
    auto placed = detail::placed_for(world, layout, "ensemble_pipeline");
    placed.validate(world.size());
    if (Feed::needs_producers) placed.require_producers("ensemble_pipeline");
    // What each world rank does, for reports that name a rank that stopped (core/stall.hpp).
    for (int r = 0; r < world.size(); ++r) {
      const rank_role role = placed.role_of(r);
      stall_registry::instance().set_role(
          world.world_rank_of(r),
          cat(role.kind == role::producer ? cat("producer ", role.producer)
                                          : cat("member ", role.member, "'s rank ", role.rank_in_member),
              r == placed.aggregator() ? ", the aggregator" : ""));
    }
    return placed;
  }

  // The feed is made by run(), but a mistake in its options is reported here, before the collect
  // and the syncs are set up, and on every rank at once (one reduction, as the feeds agree).
  // A shard_capacity of 0 is left for run(dataset, ...) to derive; run(loader, ...) refuses it then.
  static communicator feed_world(const communicator& world, const ensemble_layout& layout, const feed_options& o) {
    feed_options checked = o;
    if (checked.shard_capacity == 0) checked.shard_capacity = 1;
    detail::agree<backend>(world, layout, o, detail::option_problem(checked), "ensemble_pipeline");
    return world.dup("ensemble_pipeline feed");
  }

  ensemble_layout layout_;
  rank_role role_;
  communicator member_comm_;
  communicator feed_world_;  // before feed_: the feed's communicators are split from it
  feed_options feed_options_;
  std::optional<Feed> feed_;  // made by run(loader, ...)
  std::optional<typed_feed<Feed>> typed_;  // made by run(dataset, ...)
  std::function<void(bool wait)> rounds_;  // on_round's collection
  Collect collect_;
  std::optional<Sync> sync_;
  bool ran_ = false;
};

// ---------------------------------------------------------------------------------------------

template <class Feed, class Sync, class Collect>
ensemble_pipeline<Feed, Sync, Collect>::ensemble_pipeline(const communicator& world, const ensemble_layout& layout,
                                                          options opt)
    : layout_(validated(world, layout)),
      role_(layout_.role_of(world.rank())),
      member_comm_(world.split(role_.kind == role::trainer ? role_.member : communicator::undefined,
                               role_.rank_in_member, cat("member ", role_.member))),
      feed_world_(feed_world(world, layout_, opt.feed)),
      feed_options_(opt.feed),
      collect_(world, layout_) {
  if (role_.kind == role::trainer) sync_.emplace(member_comm_, opt.sync);
}

template <class Feed, class Sync, class Collect>
template <class Train, class Aggregate>
void ensemble_pipeline<Feed, Sync, Collect>::run(loader load, Train&& train, Aggregate&& aggregate) {
  check(!ran_, "ensemble_pipeline", "run() runs once per pipeline (a feed's stream is consumed once)");
  check(static_cast<bool>(load), "ensemble_pipeline", "run() needs a loader");
  ran_ = true;
  feed_.emplace(feed_world_, layout_, std::move(load), feed_options_);
  run_roles(train, aggregate);
}

template <class Feed, class Sync, class Collect>
template <class Train, class Aggregate>
void ensemble_pipeline<Feed, Sync, Collect>::run(dataset data, Train&& train, Aggregate&& aggregate) {
  check(!ran_, "ensemble_pipeline", "run() runs once per pipeline (a feed's stream is consumed once)");
  ran_ = true;
  typed_.emplace(feed_world_, layout_, std::move(data), feed_options_);
  if (rounds_ && collect_.is_aggregator()) typed_->between_steps([this] { rounds_(false); });
  run_roles(train, aggregate);
}

// Producers produce, trainers train and then close their collect (the end round); the
// aggregator collects on_round's rounds to the end, runs aggregate(ctx), and expects the end round.
template <class Feed, class Sync, class Collect>
template <class Train, class Aggregate>
void ensemble_pipeline<Feed, Sync, Collect>::run_roles(Train& train, Aggregate& aggregate) {
  context ctx(*this);
  if (role_.kind == role::producer) {
    if (typed_) {
      typed_->produce();
    } else {
      feed_->produce();
    }
  } else {
    train(ctx);
    if (!collect_.closed()) collect_.close();
    collect_.flush();
  }
  if (!collect_.is_aggregator()) return;
  if (rounds_) rounds_(true);
  aggregate(ctx);
  collect_.finish();
}

}  // namespace flexcomm
