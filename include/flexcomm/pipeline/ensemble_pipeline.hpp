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

#include <algorithm>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../core/agreement.hpp"
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
#include "handover.hpp"

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

// Feeds that can hand a finished member's ranks on (local_feed, one_to_many, all_shared, adaptive): a hook at each step, a new
// split from a given step, and where the stream is (pipeline/handover.hpp).
template <class T, class = void> struct hands_over : std::false_type {};
template <class T>
struct hands_over<T, std::void_t<decltype(std::declval<T&>().between_steps(std::function<void(std::int64_t)>{})),
                                 decltype(std::declval<T&>().reshard(shard_range{}, std::int64_t{})),
                                 decltype(std::declval<T&>().position())>> : std::true_type {};

// Feeds whose split changes some steps ahead, where no credit has gone out (one_to_many): the
// member fences its stream there and its rank 0 tells the producers (pipeline/handover.hpp).
template <class T, class = void> struct splits_ahead : std::false_type {};
template <class T>
struct splits_ahead<T, std::void_t<decltype(std::declval<T&>().fence(std::int64_t{})),
                                   decltype(std::declval<T&>().first_unasked())>> : std::true_type {};

// Feeds whose ranks take turns loading every step for all members (all_shared): a rank whose
// member ended keeps its turn (step_aside(), then serve() in the hand-over's waits), and a
// grown member's split names its ranks (pipeline/handover.hpp).
template <class T, class = void> struct takes_turns : std::false_type {};
template <class T>
struct takes_turns<T, std::void_t<decltype(std::declval<T&>().step_aside()), decltype(std::declval<T&>().serve())>>
    : std::true_type {};

// Feeds where a joiner's stream must be held at the joining step before the member's ranks go
// on (adaptive's board: its slot would otherwise come free): hold() before their first collective.
template <class T, class = void> struct holds : std::false_type {};
template <class T> struct holds<T, std::void_t<decltype(std::declval<T&>().hold(std::int64_t{}))>> : std::true_type {};

// Feeds whose trainer can leave the stream early (one_to_many): a member that ended stops
// holding the producers back (release()).
template <class T, class = void> struct releases : std::false_type {};
template <class T> struct releases<T, std::void_t<decltype(std::declval<T&>().release())>> : std::true_type {};

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
  // The member's ranks now (more than the layout's once other members' ranks joined it).
  int member_size() const { return member() < 0 ? 0 : pipe_.member_comm_.size(); }
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
  // The member's sync. Made anew when ranks join the member; the one it outgrew is kept while the
  // trainer function runs, so its gradient_memory() stays valid (docs/heterogeneous.md).
  sync_type& sync() {
    check(pipe_.sync_ != nullptr, "ensemble_pipeline", "sync() is for trainers; this rank is a producer");
    return *pipe_.sync_;
  }
  collect_type& collect() { return pipe_.collect_; }
  // This member's communicator (empty on producers), for what the trainer does on its own.
  const communicator& comm() const noexcept { return pipe_.member_comm_; }

  // Ends this member here, at a step boundary (after the step's sync().finish(), before the next
  // feed().next()): collective over the member's ranks, which must call it at the same step.
  // The trainer function then returns; the pipeline hands this rank to `target` (default: the
  // running member with the longest expected step) with that member's state
  // (handover_options::state) and calls the trainer function again, ctx.member() now that
  // member; with no member left to join, not again. Joiners it agreed to take at a later step
  // are turned away (they ask another member). Needs pipe.on_handover(...) before run().
  void finish_member(int target = -1) { pipe_.finish_member(target); }
  // The hand-overs of the members this rank finished (each: ended at, joined which, from when).
  const std::vector<handover_record>& handovers() const { return pipe_.handovers(); }
  // The step from which ranks of a finished member join this one, where its ranks agreed to take
  // them at a later step (one_to_many: the first step not yet asked for), until they join; else -1.
  // A trainer function that returns before it lets them go on to another member.
  std::int64_t joiners_at() const noexcept { return pipe_.joining_ ? pipe_.joining_->step : -1; }
  // On the aggregator, in the aggregate function: how each member ended, member by member
  // ({member, ended_at, joined, joined_at}; ended_at -1: it ran to the end of the stream).
  const std::vector<handover_record>& member_ends() const {
    check(is_aggregator() && pipe_.handover_.has_value(), "ensemble_pipeline: member_ends",
          "is for the aggregator of a run with on_handover()");
    return pipe_.handover_->member_ends();
  }

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
  // Whether on_handover() takes this pipeline's feed: a trainer that stops members early can
  // choose its preset by it before any rank starts.
  static constexpr bool can_hand_over = detail::hands_over<Feed>::value;

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
  ~ensemble_pipeline() { drop_retired(); }

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
  template <class Train>
  void train_members(Train& train, context& ctx);

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

  // Lets a member end early and hand its ranks on (ctx.finish_member(); docs/heterogeneous.md):
  // before run(), on every rank alike (run() then makes the hand-over's communicator).
  void on_handover(handover_options o) {
    check(!ran_, "ensemble_pipeline", "on_handover() goes before run()");
    // Refused here, before run() makes the feed: a feed made and never run would wait for its stream.
    check(detail::hands_over<Feed>::value, "ensemble_pipeline: on_handover",
          "this feed does not hand ranks over yet (local_feed, one_to_many, all_shared and adaptive do)");
    if constexpr (detail::takes_turns<Feed>::value) feed_options_.hand_over = true;  // its parts' communicator
    // adaptive takes turns or reads its boards, else runs as one_to_many: it refuses for itself.
    if constexpr (detail::splits_ahead<Feed>::value && !detail::takes_turns<Feed>::value) {
      // A producer learns of a changed split from the credits (trainers reading in shared memory
      // ask in counters there) before it ships the step it changes at (docs/heterogeneous.md).
      check(feed_options_.flow.kind == flow_control::policy::lockstep, "ensemble_pipeline: on_handover",
            "one_to_many hands ranks over under lockstep flow control, not skip_ahead");
      feed_options_.hand_over = true;
    }
    handover_options_ = std::move(o);
  }
  const std::vector<handover_record>& handovers() const {
    static const std::vector<handover_record> none;
    return handover_ ? handover_->records() : none;
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

  void start_handover();
  // The byte feed, the typed feed's where run(dataset, ...) made one: the hand-over hooks it.
  Feed& bytes_feed() { return typed_ ? typed_->bytes_feed() : *feed_; }
  void finish_member(int target);
  void between_steps(std::int64_t step);
  bool join();
  bool adopt(const detail::handover_accept& a);
  void turn_away();
  void exchange_state(const communicator& comm, int member);
  void drop_retired() noexcept;

  ensemble_layout layout_;
  rank_role role_;
  communicator member_comm_;
  communicator feed_world_;  // before feed_: the feed's communicators are split from it
  feed_options feed_options_;
  std::optional<Feed> feed_;  // made by run(loader, ...)
  std::optional<typed_feed<Feed>> typed_;  // made by run(dataset, ...)
  std::function<void(bool wait)> rounds_;  // on_round's collection
  Collect collect_;
  std::unique_ptr<Sync> sync_;
  // The syncs this rank's member outgrew while its trainer function ran on (adopt), oldest first:
  // their gradient_memory() is still the trainer's.
  std::deque<std::unique_ptr<Sync>> retired_;
  bool ran_ = false;
  sync_options sync_options_;
  std::optional<handover_options> handover_options_;
  std::optional<detail::member_handover<backend>> handover_;  // made by run() after on_handover()
  std::vector<int> member_ranks_;  // this rank's member's world ranks, in member order
  std::int64_t finished_at_ = -1;  // the step at which finish_member() ended this rank's member
  int target_ = -1;                // finish_member()'s target
  bool announced_ = false;         // this member's root has told its ranks that joiners come
  std::optional<detail::handover_accept> joining_;  // joiners taken at a later step (splits_ahead)
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
      collect_(world, layout_),
      sync_options_(opt.sync) {
  if (role_.kind == role::trainer) sync_ = std::make_unique<Sync>(member_comm_, opt.sync);
}

template <class Feed, class Sync, class Collect>
template <class Train, class Aggregate>
void ensemble_pipeline<Feed, Sync, Collect>::run(loader load, Train&& train, Aggregate&& aggregate) {
  check(!ran_, "ensemble_pipeline", "run() runs once per pipeline (a feed's stream is consumed once)");
  check(static_cast<bool>(load), "ensemble_pipeline", "run() needs a loader");
  ran_ = true;
  feed_.emplace(feed_world_, layout_, std::move(load), feed_options_);
  if (handover_options_) start_handover();
  run_roles(train, aggregate);
}

template <class Feed, class Sync, class Collect>
template <class Train, class Aggregate>
void ensemble_pipeline<Feed, Sync, Collect>::run(dataset data, Train&& train, Aggregate&& aggregate) {
  check(!ran_, "ensemble_pipeline", "run() runs once per pipeline (a feed's stream is consumed once)");
  ran_ = true;
  typed_.emplace(feed_world_, layout_, std::move(data), feed_options_);
  if (handover_options_) start_handover();  // on the byte feed underneath: typed batches follow its split
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
    train_members(train, ctx);
    drop_retired();  // no trainer function holds their memory any more
    if (handover_) handover_->done();
    // A trainer that returned before the end of a shared stream lets the producers go on without it.
    if constexpr (detail::releases<Feed>::value) {
      if (feed_) feed_->release();
      if (typed_) typed_->bytes_feed().release();
    }
    if (!collect_.closed()) collect_.close();
    collect_.flush();
  }
  if (handover_) handover_->leave();
  if (!collect_.is_aggregator()) return;
  if (rounds_) rounds_(true);
  aggregate(ctx);
  collect_.finish();
}

// The trainer function, again for each member this rank joins after its own finished.
template <class Feed, class Sync, class Collect>
template <class Train>
void ensemble_pipeline<Feed, Sync, Collect>::train_members(Train& train, context& ctx) {
  try {
    train(ctx);
    // A member that agreed to take joiners at a later step and returned first (finished or not)
    // turns them away before it goes on, so that they can ask another member.
    for (;;) {
      if (joining_) turn_away();
      if (finished_at_ < 0 || !join()) return;
      train(ctx);
    }
  } catch (...) {
    if (handover_) handover_->quit();
    throw;
  }
}

// Collective over the world (the hand-over's communicator); trainers hook the feed's steps.
template <class Feed, class Sync, class Collect>
void ensemble_pipeline<Feed, Sync, Collect>::start_handover() {
  if constexpr (detail::hands_over<Feed>::value) {  // on_handover() refused the others
    handover_.emplace(feed_world_, layout_, typed_ ? typed_->plan().steps() : feed_options_.steps, *handover_options_);
    if (role_.kind != role::trainer) return;
    for (int r = 0; r < layout_.member_size(role_.member); ++r)
      member_ranks_.push_back(layout_.trainer_rank(role_.member, r));
    bytes_feed().between_steps([this](std::int64_t step) { between_steps(step); });
    // A rank waiting in the hand-over still takes its turn in the rounds, which the others need.
    if constexpr (detail::takes_turns<Feed>::value) handover_->while_waiting([this] { bytes_feed().serve(); });
  }
}

template <class Feed, class Sync, class Collect>
void ensemble_pipeline<Feed, Sync, Collect>::finish_member(int target) {
  const std::string what = cat("ensemble_pipeline: finish_member (member ", role_.member, ")");
  check(role_.kind == role::trainer, "ensemble_pipeline: finish_member", "is for trainers; this rank is a producer");
  check(handover_.has_value(), what, "needs pipe.on_handover(...) before run()");
  check(finished_at_ < 0, what, cat("called twice (the member ended at step ", finished_at_, ")"));
  check(target >= -1 && target < layout_.members() && target != role_.member, what,
        cat("target ", target, ": not another member of the ", layout_.members()));
  if constexpr (detail::hands_over<Feed>::value) {
    auto& h = *handover_;
    const std::int64_t at = bytes_feed().position();
    const bool root = role_.rank_in_member == 0;
    const int n = member_comm_.size();
    agreement same({at, target, root ? h.choose(role_.member, n, target) + 1 : 0});
    backend::iallreduce(member_comm_, same.buffer(), op::max).wait();
    check(same.agreed(0), what,
          cat("the member's ranks called it at different steps, from ", same.lowest(0), " to ", same.highest(0),
              " (every rank ends the member at the same step boundary)"));
    check(same.agreed(1), what, cat("the member's ranks named different targets, from ", same.lowest(1), " to ",
                                    same.highest(1)));
    // With no member left to join the member ends all the same (its ranks stop training); a
    // target the trainer named that cannot take it is its mistake, refused.
    check(target < 0 || same.highest(2) > 0, what,
          cat("member ", target, " has ended or has no room for ", n, " more rank(s) (a step has ",
              h.shards_per_step(), " shards)"));
    finished_at_ = at;
    target_ = target;
    if (root) h.stop_taking();
  }
}

// At the top of each next(): the member's root answers other members; once the sync's check has
// told every rank that joiners come, they all take them at this step.
template <class Feed, class Sync, class Collect>
void ensemble_pipeline<Feed, Sync, Collect>::between_steps(std::int64_t step) {
  check(finished_at_ < 0, "ensemble_pipeline: feed().next()",
        cat("finish_member() ended member ", role_.member, " at step ", finished_at_,
            "; return from the trainer function (the pipeline then hands this rank on)"));
  if (joining_ && step >= joining_->step) {
    adopt(*std::exchange(joining_, std::nullopt));  // the member's own ranks: always taken
    return;
  }
  auto& h = *handover_;
  h.poll();
  if (joining_) return;  // a request that came meanwhile waits until the joiners are in
  const bool root = role_.rank_in_member == 0;
  const bool alone = member_comm_.size() == 1;
  if (root && h.pending() && !announced_) {
    announced_ = true;
    if (!alone) sync_->carry(1);
  }
  const bool told = alone ? announced_ : sync_->carried() != 0;
  if (!told) return;
  announced_ = false;
  // The step the split changes at: this one, or (splits_ahead) the first no credit went out for.
  std::int64_t at = step;
  if constexpr (detail::splits_ahead<Feed>::value) at = bytes_feed().first_unasked();
  if (!root && at >= h.steps()) return;  // the root refuses: the stream is over
  const auto a = root ? h.take(at, member_ranks_) : h.told(member_ranks_.front());
  if (a.member < 0) return;
  if constexpr (detail::splits_ahead<Feed>::value) {
    bytes_feed().fence(a.step);
    if (root) bytes_feed().announce(a.member, a.step, a.ranks);
  }
  if (a.step == step) {
    adopt(a);
    return;
  }
  joining_ = a;  // the steps before it on the old split; the joiners wait in form() until then
}

// After the trainer function returned from a finished member: the member's root asks a target,
// every rank of it joins what was agreed; false when no member took them.
template <class Feed, class Sync, class Collect>
bool ensemble_pipeline<Feed, Sync, Collect>::join() {
  auto& h = *handover_;
  const int finished = role_.member;
  // Its own stream ends here (one_to_many: the producers stop asking it), before it waits for
  // a target that may need those producers to reach the step it joins at.
  // all_shared: its turn in the rounds goes on, unread (every member needs it to the end).
  if constexpr (detail::takes_turns<Feed>::value) {
    bytes_feed().step_aside();
  } else if constexpr (detail::releases<Feed>::value) {
    bytes_feed().release();
  }
  detail::handover_accept a;
  do {  // a target that ended before the step it took them at turns them away: they ask again
    a = role_.rank_in_member == 0 ? h.negotiate(finished, member_ranks_, target_) : h.outcome(member_ranks_.front());
  } while (a.member >= 0 && !adopt(a));
  h.records().push_back({finished, finished_at_, a.member, a.step});
  check(a.member >= 0 || target_ < 0, cat("ensemble_pipeline: finish_member (member ", finished, ")"),
        cat("member ", target_, ", the target, had ended or had no room by the time it was asked"));
  if (a.member < 0) return false;
  finished_at_ = -1;
  return true;
}

// The trainer function returned before the step its member agreed to take joiners at (joining_):
// the joiners hear so in their handshake and ask another member, and the split announced for
// that step is left on every rank of it, so that the producers neither wait for it nor ship to it.
template <class Feed, class Sync, class Collect>
void ensemble_pipeline<Feed, Sync, Collect>::turn_away() {
  const auto a = *std::exchange(joining_, std::nullopt);
  if constexpr (detail::splits_ahead<Feed>::value) bytes_feed().leave_split(a.member, a.step);
  if (role_.rank_in_member == 0) handover_->turn_away(a, member_ranks_.size());
}

// Every rank of the new member: its communicator, the state from its rank 0, its sync and its
// share of each step's shards from the agreed step on. False on a joiner that the target turned
// away (it ended first; turn_away()): it leaves the split announced with it and is not taken.
template <class Feed, class Sync, class Collect>
bool ensemble_pipeline<Feed, Sync, Collect>::adopt(const detail::handover_accept& a) {
  auto& h = *handover_;
  const int me = feed_world_.rank();
  auto formed = h.form(a, me);
  if (!formed) {
    if constexpr (detail::splits_ahead<Feed>::value) bytes_feed().leave_split(a.member, a.step);
    return false;
  }
  communicator comm = std::move(*formed);
  if constexpr (detail::holds<Feed>::value) bytes_feed().hold(a.step);
  exchange_state(comm, a.member);
  // The target's own ranks go on in the same trainer function, which may hold spans of the old
  // sync's gradient_memory() and hand them to the new one (averaged as its own vectors are): the
  // old sync is retired, not dropped, while that function runs. A joiner's trainer function has
  // returned: its syncs go now, as its old member's other ranks' do.
  if (role_.member == a.member) {
    retired_.push_back(std::move(sync_));
  } else {
    drop_retired();
    sync_.reset();
  }
  member_comm_ = std::move(comm);
  member_ranks_ = a.ranks;
  role_.member = a.member;
  role_.rank_in_member = static_cast<int>(std::find(a.ranks.begin(), a.ranks.end(), me) - a.ranks.begin());
  sync_ = std::make_unique<Sync>(member_comm_, sync_options_);
  const int n = static_cast<int>(a.ranks.size()), shards = h.shards_per_step(), r = role_.rank_in_member;
  const int first = r * shards / n;
  const shard_range mine{first, (r + 1) * shards / n - first};
  if constexpr (detail::takes_turns<Feed>::value) {
    bytes_feed().reshard(mine, a.step, a.member, a.ranks);
  } else if constexpr (detail::splits_ahead<Feed>::value) {
    bytes_feed().reshard(mine, a.step, a.member);
  } else if constexpr (detail::hands_over<Feed>::value) {
    bytes_feed().reshard(mine, a.step);
  }
  h.set_size(a.member, n);
  return true;
}

// Oldest first, as they were made. Dropping a sync frees its communicators (MPI_Comm_free, which
// MPI calls collective; nccl's ncclCommFinalize flushes work its peers take part in), so the
// ranks must drop their retired syncs in one order that no two of them can cross: the order they
// made them in is one (each was made collectively, so every rank of it agrees on it). Its shared
// memory goes by a local munmap, and no bucket is in flight after a finish(). A retired sync's
// ranks are all still in this member (a member only grows, and its ranks leave it together), so
// they all come here at the same point: the end of their trainer function, or leaving the member.
template <class Feed, class Sync, class Collect>
void ensemble_pipeline<Feed, Sync, Collect>::drop_retired() noexcept {
  while (!retired_.empty()) retired_.pop_front();
}

// The member's state, from its rank 0 to every rank, once all agree on its parts' sizes.
template <class Feed, class Sync, class Collect>
void ensemble_pipeline<Feed, Sync, Collect>::exchange_state(const communicator& comm, int member) {
  const auto& state = handover_options_->state;
  std::vector<span<std::byte>> parts;
  if (state) parts = state(member);
  fingerprint sizes;
  for (const auto& p : parts) sizes.add(static_cast<std::uint64_t>(p.size()));
  agreement same({static_cast<std::int64_t>(parts.size()), sizes.folded()});
  backend::iallreduce(comm, same.buffer(), op::max).wait();
  check(same.all_agreed(), cat("ensemble_pipeline: hand-over to member ", member),
        cat("the member's ranks describe its state differently (handover_options::state); this rank gives ",
            parts.size(), " part(s)"));
  for (const auto& p : parts)
    backend::ibcast(comm, span<std::uint8_t>(reinterpret_cast<std::uint8_t*>(p.data()), p.size()), 0).wait();
}

}  // namespace flexcomm
