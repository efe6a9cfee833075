// one_to_many: producers preprocess each step once and broadcast every piece of it to the
// trainer of each member that owns it (Single-Broadcast; Multi-Broadcast deals steps round-robin;
// with a producer per host, each host's producer makes every step for its own host's trainers).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <exception>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "../../core/error.hpp"
#include "../../core/layout.hpp"
#include "../../backend/contract.hpp"
#include "vocabulary.hpp"
#include "agreement.hpp"
#include "claims.hpp"
#include "../../backend/shm/feed/host_slots.hpp"
#include "step_source.hpp"
#include "steps_in_flight.hpp"
#include "wire.hpp"
#include "split_change.hpp"

namespace flexcomm {

// Wire protocol, per step s of producer p = s mod P: a one-int credit from every trainer to the
// producer on the credit communicator of p = {producer p, every trainer} (a trainer sends it
// only once it has a slot free for s, and p ships s only after all of them, which bounds
// buffering), and per piece
// c, on the communicator of (p, c) = {producer p, the owner of c in every member}, the piece
// (header + shard sizes + shards, a fixed-size message) sent by p to each owner.
// With a producer per host (layout.per_host()) the same protocol runs once per host: producer p
// ships every step, the trainers it feeds are its host's (the credit communicator of p and the
// owners in (p, c) are those on p's host), and it loads only the pieces they own, so no batch
// crosses hosts; a (p, c) with no owner on p's host is not made. A flat fan-out
// rather than MPI's broadcast: a tree or scatter-allgather broadcast would make trainers relay
// data and need several progress rounds, each a sleep of the wait policy on a crowded node.
// Credits travel apart from data, so a producer asks for those of its next `depth` steps early.
// Trainers know the stream's length, so its end needs no message.
// A member whose split changed (a hand-over) gets its steps from the change on as one message
// per rank and step, its shards repacked from the pieces, on a duplicate of the world
// (split_change.hpp); with a producer per host, all of them from its rank 0's host's producer,
// which makes afresh the pieces its own trainers do not own.
// On the producer's own host (feed_options.shared_memory, backends with has_host_window) no
// message goes at all: the loader writes each step into a slot of shared memory, the trainers
// there read their pieces in place, and their credits are counters beside the slots
// (host_slots.hpp); the trainers on other hosts get the same bytes as messages, sent from that
// slot. A trainer takes its steps from a step_source (step_source.hpp), which knows which lie in
// shared memory and which come as messages.
template <class B>
class one_to_many : private detail::agreed_feed {
  static_assert(holds_host_memory<B>,
                "one_to_many<B>: the loader writes each batch into host memory and trainers read it there, but B's "
                "buffers live in device memory; feed with a host backend (one_to_many<mpi>) and copy the batch to the "
                "device in the trainer (presets with a device Sync backend do: their feed is on its host backend)");

 public:
  static constexpr bool needs_producers = true;
  using communicator = typename B::communicator;

  // Collective over `world`; builds every (producer, piece) communicator in one fixed order.
  one_to_many(const communicator& world, const ensemble_layout& layout, loader load, feed_options options);
  // adaptive's: the same feed, with trainers that make pieces for their producer while they
  // wait (claims.hpp). Lockstep only.
  one_to_many(const communicator& world, const ensemble_layout& layout, loader load, feed_options options,
              detail::claims_by_message);
  ~one_to_many();
  one_to_many(const one_to_many&) = delete;
  one_to_many& operator=(const one_to_many&) = delete;

  // On producer ranks: preprocesses and ships every step dealt to this producer (a per-host
  // producer: every step, the pieces of its host's trainers; none at all without any), then returns.
  // A loader failure travels to the trainers of that piece as that step; once the rest of the
  // stream is shipped, produce() throws it.
  void produce();

  // On trainer ranks: the next step of this trainer's shards, or nothing at the end of the stream.
  std::optional<batch> next();
  // On trainer ranks: this trainer takes no more steps (its member ended early). It receives the
  // steps it has already asked for, then answers each producer's credits that are still to come
  // with "none", so that no producer waits for it or ships to it again: the others train on.
  // Not under claims (adaptive by message). next() then gives nothing.
  void release();

  // The pipeline's seam for a hand-over (pipeline/handover.hpp, docs/heterogeneous.md), on
  // trainer ranks, lockstep. `each` runs at the top of
  // every next() with the step about to be delivered; position() is that step.
  void between_steps(std::function<void(std::int64_t step)> each) { between_ = std::move(each); }
  std::int64_t position() const noexcept { return next_step_; }
  // The first step whose credit this trainer has not sent: the earliest its member's split can
  // change at (the same on every rank of the member: lockstep posts alike).
  std::int64_t first_unasked() const noexcept { return next_post_; }
  // The member's split changes at `at` (first_unasked()): nothing more is asked on the current
  // split, and each producer's credits still to come on the layout's are answered "moved".
  void fence(std::int64_t at);
  // On the member's rank 0: tells every producer with a step from `at` on that member
  // `member`'s ranks are `ranks` (world ranks, member order) from `at`.
  void announce(int member, std::int64_t at, const std::vector<int>& ranks);
  // From step `from`, this trainer gets `shards` of member `member`'s steps, one message a step
  // from its producer (after fence(from), or release() on a rank that joins).
  void reshard(shard_range shards, std::int64_t from, int member = -1);
  // A split of member `member` announced from `at` that this rank will not be on, because the
  // member ended before `at`: on its own ranks (fenced at `at`, their stream left as release()
  // leaves it) and on the ranks that were to join it (released already). Each producer with a
  // step from `at` on gets one credit for that split, "none, on the split from `at`".
  void leave_split(int member, std::int64_t at);

  // Steps this trainer's member skipped under flow_control::skip_ahead (the same on its ranks).
  std::int64_t skipped() const noexcept { return skipped_; }
  bool is_trainer() const noexcept { return role_.kind == role::trainer; }
  // Whether this rank hands over (producer) or reads (trainer) some steps in shared memory.
  bool shared_memory() const noexcept { return detail::any_shared(host_); }
  // Under claims: the pieces this rank made with its loader (none otherwise: not counted).
  std::int64_t pieces_made() const noexcept { return made_; }

 private:
  using request = typename B::request;
  using source = detail::step_source<B>;
  static constexpr int piece_tag = 17, credit_tag = 18;
  static constexpr int credit_none = 0;  // a credit that says "no more steps for me" (release())
  // On the layout's split, "my member's split changed; ask me no more here": -(1 + member).
  static int credit_moved(int member) { return -(1 + member); }

  // A producer's k-th step in flight: the credits it waits for and the sends of its pieces.
  struct shipment {
    detail::in_flight<request> credits, sends;
    std::vector<int> credits_in;                 // one per trainer
    std::vector<std::vector<std::byte>> pieces;  // one per piece it ships, where not in shared memory
    std::vector<std::vector<std::byte>> split_out;  // the messages of members whose split changed
    std::int64_t step = -1;                      // of its sends, named when they fail
  };

  std::size_t index_of(int producer, int piece) const {
    return static_cast<std::size_t>(producer) * pieces_.size() + static_cast<std::size_t>(piece);
  }
  const communicator& comm_of(int producer, int piece) const { return comms_[index_of(producer, piece)]; }
  // The producer that ships step `step` to this trainer.
  int producer_of(std::int64_t step) const { return layout_.producer_for(role_.member, role_.rank_in_member, step); }
  // The producer that ships step `step` of member `member`'s changed split to every rank of it:
  // round-robin, the step's; with a producer per host, the one of the member's rank 0's host,
  // whose credits from that rank tell it of the split before it ships the step it changes at.
  int split_producer(int member, std::int64_t step) const { return layout_.producer_for(member, 0, step); }
  std::size_t piece_bytes(int piece) const {
    return detail::piece_bytes(pieces_[static_cast<std::size_t>(piece)].shards, options_.shard_capacity);
  }

  // Producer side.
  struct production;
  // Shared memory on producers' hosts.
  void setup_host_slots(const communicator& world);
  // Where piece c lies in producer p's shared slot.
  std::size_t slot_offset(int producer, int piece) const {
    return slot_offsets_[static_cast<std::size_t>(producer)][static_cast<std::size_t>(piece)];
  }

  // Trainer side.
  void setup_source();
  std::size_t ring_size() const;
  void post_free_slots();
  void post_messages();
  std::int64_t choose_step();
  void drain() noexcept;
  // release()'s: receives what was asked, posts nothing more; next() gives nothing.
  void leave_stream();
  // Sends `value` as the credits each producer still asks of this trainer from step `from`: on
  // member `split`'s changed split (one per producer), or on the layout's (`split` -1).
  void answer_asked(std::int64_t from, int value, int split);

  // Claims (trainer side): asks step s's producer for work while s has not come, and makes
  // what it grants; answers that came meanwhile are acted on first.
  void claim_while_waiting(std::int64_t s);
  void act_on_answers();
  // Makes the piece the answer that came grants and sends it; false if it grants none.
  bool make_granted(detail::claimant<B>& c);
  detail::answer_message take_answer(detail::claimant<B>& c);
  void make(detail::claimant<B>& c, const detail::answer_message& a);
  // How many steps from the awaited one a claim may take (claims.hpp): the awaited step only
  // while the producers keep pace with training, else the window of the steps in flight.
  std::int64_t reach() const;
  // Tells step s's producer that this trainer will claim no more, if s is its last step.
  void finish_claims_after(std::int64_t s);

  std::vector<communicator> comms_;  // [producer][piece]; empty where this rank takes no part
  std::vector<bool> ships_;          // [producer][piece]: some trainer that producer feeds owns it
  std::vector<communicator> credit_comms_;  // [producer]
  std::vector<int> producer_world_rank_;    // [producer], named when a receive times out; -1 if not ours
  std::vector<detail::host_slots<B>> host_;  // [producer]: its slots, where this rank shares them
  std::vector<std::vector<std::size_t>> slot_offsets_;  // [producer][piece]: the layout of its slots
  std::vector<std::size_t> slot_bytes_;                 // [producer]
  communicator member_comm_;

  detail::batch_assembly assembly_;  // trainer: its pieces, and its batches made of them
  source source_;
  std::int64_t next_post_ = 0, next_step_ = 0, lent_ = -1, skipped_ = 0;
  bool produced_ = false;
  bool released_ = false;
  std::deque<int> none_;                       // release(), fence(): the credits that answer the asked ones
  std::vector<request> none_sent_;
  // Hand-overs: a member whose split changed gets its steps as one message per rank on `joins_`
  // (a duplicate of the world, its ranks the world's), from its producers; made only under
  // feed_options.hand_over.
  communicator joins_;
  std::function<void(std::int64_t)> between_;
  std::int64_t fence_ = std::numeric_limits<std::int64_t>::max();  // nothing posted from here
  int split_member_ = -1;       // the member whose changed split this trainer is on, or -1
  std::int64_t split_from_ = 0;  // where that split began
  std::deque<std::pair<std::vector<std::int64_t>, request>> notices_;  // announce()'s sends

  bool claims_ = false;
  std::vector<detail::claimant<B>> claimants_;  // [producer], trainer under claims
  std::int64_t made_ = 0;
  std::int64_t step_make_ns_ = 0;          // a producer's time to make a step, as it last said
  std::int64_t waits_ = 0;                 // the steps this trainer waited for
  detail::training_clock training_;
};

template <class B>
one_to_many<B>::one_to_many(const communicator& world, const ensemble_layout& layout, loader load, feed_options options,
                            detail::claims_by_message)
    : one_to_many(world, layout, std::move(load), options) {
  claims_ = true;
  check(options_.flow.kind == flow_control::policy::lockstep && !layout_.per_host(), "one_to_many",
        "claims by message are for lockstep feeds with round-robin producers");
  if (role_.kind != role::trainer) return;
  std::size_t largest = 0;
  for (const auto& piece : pieces_) largest = std::max(largest, detail::piece_bytes(piece.shards, options_.shard_capacity));
  for (const auto& credits : credit_comms_)
    claimants_.emplace_back(credits ? detail::claimant<B>(credits, largest + detail::guard_bytes, "adaptive")
                                    : detail::claimant<B>());
  // A producer with no step for this trainer hears so at once.
  for (int p = 0; p < layout_.producers(); ++p)
    if (p >= options_.steps && claimants_[static_cast<std::size_t>(p)]) claimants_[static_cast<std::size_t>(p)].finish();
}

template <class B>
one_to_many<B>::one_to_many(const communicator& world, const ensemble_layout& layout, loader load,
                            feed_options options)
    : detail::agreed_feed(world, layout, std::move(load), options, true, "one_to_many") {
  const bool trainer = role_.kind == role::trainer;
  for (int p = 0; p < layout_.producers(); ++p) {
    for (std::size_t c = 0; c < pieces_.size(); ++c) {
      bool ships = false;
      for (int m = 0; m < layout_.members(); ++m) ships = ships || layout_.feeds(p, m, pieces_[c].owner[static_cast<std::size_t>(m)]);
      ships_.push_back(ships);
      if (!ships) {  // every rank knows: nobody takes part
        comms_.emplace_back();
        continue;
      }
      int color = communicator::undefined, key = 0;
      if (role_.kind == role::producer && role_.producer == p) {
        color = 0;
      } else if (trainer && pieces_[c].owner[static_cast<std::size_t>(role_.member)] == role_.rank_in_member &&
                 layout_.feeds(p, role_.member, role_.rank_in_member)) {
        color = 0;
        key = 1 + role_.member;
      }
      comms_.push_back(world.split(color, key, cat("one_to_many producer ", p, " piece ", c)));
    }
  }
  for (int p = 0; p < layout_.producers(); ++p) {
    const bool mine = (trainer && layout_.feeds(p, role_.member, role_.rank_in_member)) || role_.producer == p;
    credit_comms_.push_back(world.split(mine ? 0 : communicator::undefined, mine && role_.kind == role::trainer ? 1 : 0,
                                        cat("one_to_many credits of producer ", p)));
  }
  member_comm_ = world.split(role_.kind == role::trainer ? role_.member : communicator::undefined,
                             role_.rank_in_member, cat("one_to_many member ", role_.member));
  if (options_.hand_over) joins_ = world.dup("one_to_many hand-overs");
  setup_host_slots(world);
  if (role_.kind != role::trainer) return;
  for (const auto& credits : credit_comms_) producer_world_rank_.push_back(credits ? credits.world_rank_of(0) : -1);

  assembly_ = detail::batch_assembly(pieces_, layout_, role_, options_.shard_capacity);
  setup_source();
  post_free_slots();
}

// Where this trainer's steps lie: each producer's in its shared slots where it shares them, else
// as messages. A per-host producer's trainers have one producer for every step.
template <class B>
void one_to_many<B>::setup_source() {
  const std::vector<int>& mine = assembly_.pieces();
  const int turns = layout_.per_host() ? 1 : layout_.producers();
  std::vector<std::vector<typename source::shared_piece>> shared(static_cast<std::size_t>(turns));
  bool any_messages = false;  // some producer's steps come to this trainer as messages
  std::vector<std::size_t> bytes;
  for (int c : mine) bytes.push_back(piece_bytes(c));
  for (int t = 0; t < turns; ++t) {
    const int p = layout_.per_host() ? producer_of(0) : t;
    const auto& slots = host_[static_cast<std::size_t>(p)];
    any_messages = any_messages || !slots;
    for (int c : mine)  // the producer is rank 0 of its group, its pieces side by side in its slot
      shared[static_cast<std::size_t>(t)].push_back({slots ? &slots : nullptr, 0, slots ? slot_offset(p, c) : 0});
  }
  source_.setup(turns, std::move(shared), bytes, 1, ring_size(), [&](typename source::received& r) {
    if (!any_messages) return;  // every step lies in shared memory
    for (std::size_t b : bytes) r.buffers.emplace_back(b);
  }, "one_to_many: receive of step ");
}

template <class B>
one_to_many<B>::~one_to_many() {
  if (role_.kind == role::trainer) drain();
}

template <class B>
std::size_t one_to_many<B>::ring_size() const {
  std::int64_t r = options_.depth;
  // Under skip_ahead the ring holds the batch in use and n + 2 newer ones, so that a member
  // more than n steps behind can see it.
  if (options_.flow.kind == flow_control::policy::skip_ahead) r = std::max<std::int64_t>(r, options_.flow.max_behind + 3);
  return static_cast<std::size_t>(std::min<std::int64_t>(r, std::max<std::int64_t>(options_.steps, 1)));
}

// Posts "ready" and the receive of every step whose ring slot is free, in step order; a step that
// lies in shared memory needs neither.
template <class B>
void one_to_many<B>::post_free_slots() {
  post_messages();
  // Under hand-overs the producers here learn what it asked in shared memory, as from credits.
  if (options_.hand_over && split_member_ < 0 && !released_)
    for (const auto& slots : host_)
      if (slots) slots.ask_up_to(next_post_);
}

template <class B>
void one_to_many<B>::post_messages() {
  for (; next_post_ < std::min(options_.steps, fence_); ++next_post_) {
    const std::int64_t s = next_post_;
    auto* t = source_.claim(s);
    if (!t) return;  // still holds an earlier step
    if (source_.in_shared_memory(s)) continue;
    if (split_member_ >= 0) {  // a changed split: its own tags on joins_, the credit says which split
      const int at = layout_.producer_rank(split_producer(split_member_, s));
      t->credit = static_cast<int>(split_from_ + 1);
      t->post(B::isend(joins_, span<const int>(&t->credit, 1), at, detail::split_credit_tag(split_member_)), at);
      auto& buffer = t->buffers[0];
      t->post(B::irecv(joins_, span<std::uint8_t>(reinterpret_cast<std::uint8_t*>(buffer.data()), buffer.size()), at,
                       detail::split_piece_tag(split_member_)),
              at);
      source_.start(s, *t);
      continue;
    }
    const int producer = producer_of(s);
    const int from = producer_world_rank_[static_cast<std::size_t>(producer)];
    t->post(B::isend(credit_comms_[static_cast<std::size_t>(producer)], span<const int>(&t->credit, 1), 0, credit_tag),
            from);
    const std::vector<int>& mine = assembly_.pieces();
    for (std::size_t i = 0; i < mine.size(); ++i) {
      auto& buffer = t->buffers[i];
      t->post(B::irecv(comm_of(producer, mine[i]),
                       span<std::uint8_t>(reinterpret_cast<std::uint8_t*>(buffer.data()), buffer.size()), 0, piece_tag),
              from);
    }
    source_.start(s, *t);
  }
}

// Under skip_ahead, rank 0 of the member picks the step, so that all its ranks deliver the same.
template <class B>
std::int64_t one_to_many<B>::choose_step() {
  std::int64_t target = next_step_;
  if (options_.flow.kind != flow_control::policy::skip_ahead) return target;
  if (member_comm_.rank() == 0) {
    target = std::max(target, source_.newest_arrived());
    if (target - next_step_ <= options_.flow.max_behind) target = next_step_;
  }
  if (member_comm_.size() > 1) B::ibcast(member_comm_, span<std::int64_t>(&target, 1), 0).wait();
  return target;
}

template <class B>
std::optional<batch> one_to_many<B>::next() {
  check(role_.kind == role::trainer, "one_to_many", "next() is for trainer ranks; this rank is a producer");
  if (between_) between_(std::min(next_step_, options_.steps));
  if (released_) return std::nullopt;
  if (lent_ >= 0) {
    source_.release(lent_);
    lent_ = -1;
    post_free_slots();
    if (claims_) training_.back();
  }
  if (next_step_ >= options_.steps) return std::nullopt;
  const std::int64_t target = choose_step();
  if (claims_) {
    act_on_answers();
    claim_while_waiting(target);
  }
  for (; next_step_ < target; ++next_step_, ++skipped_) {
    // A skipped step is received all the same (broadcasts are collective) and then dropped.
    source_.skip(next_step_, assembly_, "one_to_many");
    source_.release(next_step_);
    post_free_slots();
  }
  const batch out = source_.take(target, assembly_, "one_to_many");
  lent_ = target;
  next_step_ = target + 1;
  if (claims_) {
    finish_claims_after(target);
    training_.handed_out();
  }
  return out;
}

template <class B>
void one_to_many<B>::claim_while_waiting(std::int64_t s) {
  detail::claimant<B>& c = claimants_[static_cast<std::size_t>(producer_of(s))];
  if (!c || source_.here(s)) return;
  // Only a claim ahead can be worth its messages (a step's own pieces are mostly the producer's
  // already); while the producer's time per step, which decides, is not known yet, and one wait
  // in 16 after, it asks all the same. Asking at every wait cost 1.6x one_to_many's CPU at 1 ms
  // of preprocessing, 4 members.
  if (!c.asking() && reach() == 1 && step_make_ns_ > 0 && waits_++ % 16 != 0) return;
  bool denied = false;
  waiting_note note;  // once long: whom this wait is on (core/stall.hpp)
  while (!source_.here(s)) {
    if (!c.asking()) {
      if (denied) return;  // nothing left to make: take() waits for the step
      c.ask(s, s + reach());
    }
    if (!wait_answering(detail::engine_wait(), default_timeout(), [&] { return source_.here(s) || c.answered(); },
                        [&] {
                          note.set(cat("one_to_many: claim for step ", s), {c.producer()});
                          watchdog::instance().answer_queries();
                        }))
      c.await_answer(s);  // names the producer
    if (!c.answered()) continue;
    const detail::answer_message a = take_answer(c);
    if (a[1] < 0) {
      denied = true;
      continue;
    }
    // The producer answers between pieces of its own: the next claim goes before this piece is
    // made, so that its answer is there when the piece is done, where a claim's reach is more than
    // the awaited step (preprocessing outweighs training). Asking after the piece left the
    // trainers idle for up to a piece's time per piece: 1.3x the best fixed feed at 2 members.
    if (reach() > 1) c.ask(s, s + reach());
    make(c, a);
  }
}

template <class B>
void one_to_many<B>::act_on_answers() {
  for (auto& c : claimants_)
    if (c && c.answered()) make_granted(c);
}

template <class B>
detail::answer_message one_to_many<B>::take_answer(detail::claimant<B>& c) {
  const detail::answer_message a = c.take_answer();
  step_make_ns_ = a[2];
  return a;
}

template <class B>
bool one_to_many<B>::make_granted(detail::claimant<B>& c) {
  const detail::answer_message a = take_answer(c);
  if (a[1] < 0) return false;
  make(c, a);
  return true;
}

template <class B>
void one_to_many<B>::make(detail::claimant<B>& c, const detail::answer_message& a) {
  const detail::piece& piece = pieces_[static_cast<std::size_t>(a[1])];
  const std::size_t bytes = detail::piece_bytes(piece.shards, options_.shard_capacity);
  detail::fill_piece(load_, a[0], piece.first_shard, piece.shards, options_.shard_capacity, c.piece(bytes));
  c.send(bytes);
  ++made_;
}

template <class B>
std::int64_t one_to_many<B>::reach() const {
  const std::int64_t P = layout_.producers();
  const double train_ns = training_.ns();
  if (step_make_ns_ == 0 || train_ns == 0) return 1;  // the first steps: the producers' work
  // Preprocessing clearly outweighs training: any step the producer lets it have (its window
  // bounds it). A piece made far ahead delays this trainer's own step by a whole piece, which
  // pays only where the producers are well behind: with them just keeping pace (50 ms of each
  // at 4 members), claiming at a ratio of 1 made the job 1.26x slower than one_to_many. And a
  // claimed piece travels twice more than a made one (to the producer, and its copy into the
  // step): at 1 ms a step that cost as much as the making, 1.12-1.21x one_to_many's wall at 2
  // and 4 members; so not for steps made in under 2 ms.
  const double per_producer = static_cast<double>(step_make_ns_) / static_cast<double>(P);
  return per_producer > 1.5 * train_ns && step_make_ns_ > 2000000 ? options_.steps : 1;
}

template <class B>
void one_to_many<B>::finish_claims_after(std::int64_t s) {
  const int p = producer_of(s);
  for (std::int64_t later = s + 1; later < options_.steps && later <= s + layout_.producers(); ++later)
    if (producer_of(later) == p) return;
  detail::claimant<B>& c = claimants_[static_cast<std::size_t>(p)];
  if (!c || c.finished()) return;
  if (c.asking()) {
    c.await_answer(s);
    make_granted(c);
  }
  c.finish();
}

// A producer's run of produce(): the pieces it ships, where the trainers read them, and its steps
// in flight. The steps are addressed by k, this producer's k-th step, not by the step: its steps
// are P apart, and every one of the slots is to be used. Entry k holds the pieces (or, in shared
// memory, the sends from its slot) and the credits of step k, asked for `depth` <= slots steps
// ahead: the credits of k + depth go into an entry whose credits of earlier step were awaited.
template <class B>
struct one_to_many<B>::production {
  production(one_to_many& feed, const communicator& credits);
  production(const production&) = delete;  // the desk's maker points at it
  production& operator=(const production&) = delete;

  bool in_place(int world_rank) const { return here && here->holds(world_rank); }
  span<std::byte> piece_memory(std::int64_t k, std::size_t i) {
    if (!here) return span<std::byte>(ring.at(k).pieces[i]);
    return span<std::byte>(here->slot(0, k) + feed.slot_offset(me, mine[i]), feed.piece_bytes(mine[i]) + detail::guard_bytes);
  }
  void ask_credits(std::int64_t s, std::int64_t k);
  void make_piece(std::int64_t s, std::size_t i, span<std::byte> slot);
  void await(detail::in_flight<request>& part, const std::string& what) {
    if (desk) desk.serve_until([&] { return ring.done(part); }, [&] { ring.fail_timed_out(part, what, default_timeout()); });
    ring.await(part, what);
  }
  void ship(std::int64_t s, std::int64_t k);

  one_to_many& feed;
  const int me;
  // Round-robin: steps me, me + P, ...; a per-host producer: every step.
  const std::int64_t first, P, depth;
  const communicator& credits;
  std::vector<int> mine;  // the pieces this producer loads and ships
  // The slots of this producer's host, where trainers there read its steps in place; the other
  // trainers get messages sent from the same bytes.
  const detail::host_slots<B>* here;
  detail::steps_in_flight<request, shipment> ring;
  // The world rank behind every rank of each communicator this producer posts on, named when
  // a wait times out.
  std::vector<int> credit_peers;
  std::vector<std::vector<int>> piece_peers;
  bool messages = false;  // credits come as messages only from the trainers that are sent messages
  // The trainers that said "none" (release()), by credit rank and by world rank: not asked,
  // not waited for, not shipped to again.
  std::vector<char> gone;
  std::vector<int> gone_world;
  bool asked(int trainer) const {
    return !gone[static_cast<std::size_t>(trainer)] && !in_place(credit_peers[static_cast<std::size_t>(trainer)]);
  }
  void note_gone(shipment& t);
  // Members whose split changed (hand-overs): their steps, repacked, one message per rank, from
  // every producer round-robin; with a producer per host, from the member's rank 0's producer
  // alone (the others only stop shipping to its ranks on their hosts).
  detail::changed_splits<B> splits;
  bool serves(int member) const { return !feed.layout_.per_host() || feed.split_producer(member, 0) == me; }
  void learn_split(int member, std::int64_t from) {
    if (serves(member)) splits.await_notice(member, from);
  }
  // A per-host producer's changed split may hold shards that none of its own trainers own: it
  // makes those pieces afresh for each step, here.
  std::vector<std::vector<std::byte>> fresh;  // [piece]
  std::vector<std::int64_t> fresh_step;       // [piece]: the step it holds, or -1
  // Where the trainers here read in place: the members they said split anew (and from which
  // step), and how many of them the producer has the notice of.
  std::vector<std::pair<int, std::int64_t>> moved;
  std::size_t moves_known = 0;
  std::vector<int> index_in_mine;  // [piece]: its index in `mine`, or -1
  void ship_splits(std::int64_t s, std::int64_t k);
  std::vector<std::byte> failure;  // the first failed piece, rethrown once the stream is complete
  // Under claims every wait of this producer answers them (claims.hpp): a trainer's claim comes
  // when its step has not, which is when the producer is making or waiting.
  detail::claim_desk<B> desk;
};

template <class B>
one_to_many<B>::production::production(one_to_many& f, const communicator& credit_comm)
    : feed(f), me(f.role_.producer), first(f.layout_.per_host() ? 0 : me), P(f.layout_.per_host() ? 1 : f.layout_.producers()),
      depth(f.options_.depth), credits(credit_comm),
      here(f.host_[static_cast<std::size_t>(me)] ? &f.host_[static_cast<std::size_t>(me)] : nullptr),
      splits(f.joins_, f.layout_), index_in_mine(f.pieces_.size(), -1) {
  for (std::size_t c = 0; c < feed.pieces_.size(); ++c)
    if (feed.ships_[feed.index_of(me, static_cast<int>(c))]) {
      index_in_mine[c] = static_cast<int>(mine.size());
      mine.push_back(static_cast<int>(c));
    }
  ring.allocate(here ? here->slots() : static_cast<std::size_t>(depth), [&](shipment& t) {
    t.credits_in.resize(static_cast<std::size_t>(credits.size()));
    if (here) return;  // the pieces are written into shared memory
    for (int c : mine) t.pieces.emplace_back(feed.piece_bytes(c) + detail::guard_bytes);
  });
  auto world_ranks = [](const communicator& comm) {
    std::vector<int> out(static_cast<std::size_t>(comm.size()));
    for (int r = 0; r < comm.size(); ++r) out[static_cast<std::size_t>(r)] = comm.world_rank_of(r);
    return out;
  };
  credit_peers = world_ranks(credits);
  gone.assign(credit_peers.size(), 0);
  for (int c : mine) piece_peers.push_back(world_ranks(feed.comm_of(me, c)));
  for (std::size_t trainer = 1; trainer < credit_peers.size(); ++trainer) messages = messages || !in_place(credit_peers[trainer]);
  if (feed.claims_) {
    std::vector<std::size_t> bytes;
    for (int c : mine) bytes.push_back(feed.piece_bytes(c));
    desk = detail::claim_desk<B>(credits, mine, std::move(bytes), first, P, feed.options_.steps,
                                 std::max<std::int64_t>(4 * depth, credits.size() - 1),
                                 [this](std::int64_t s, std::size_t i, span<std::byte> slot) { make_piece(s, i, slot); },
                                 "adaptive");
  }
}

// The credits of step s (the k-th of this producer) are asked for `depth` steps ahead.
template <class B>
void one_to_many<B>::production::ask_credits(std::int64_t s, std::int64_t k) {
  shipment& r = ring.at(k);
  r.credits.clear();
  for (int trainer = 1; trainer < credits.size(); ++trainer)
    if (asked(trainer))
      r.credits.post(B::irecv(credits, span<int>(&r.credits_in[static_cast<std::size_t>(trainer)], 1), trainer, credit_tag),
                     credit_peers[static_cast<std::size_t>(trainer)]);
  if (!r.credits.requests.empty()) ring.start(k, r.credits, cat("one_to_many: credits of step ", s));
}

// After the credits of a step came: a trainer that sent "none" is gone from this step on. Its
// "none" answered every credit this producer had asked of it, the later ones included. "Moved"
// is the same on the layout's split, and says that the trainer's member now has a split of its
// own from this step or earlier: its root's notice is awaited, so that no step of it goes amiss.
template <class B>
void one_to_many<B>::production::note_gone(shipment& t) {
  for (int trainer = 1; trainer < credits.size(); ++trainer) {
    const int credit = t.credits_in[static_cast<std::size_t>(trainer)];
    if (!asked(trainer) || credit > credit_none) continue;
    gone[static_cast<std::size_t>(trainer)] = 1;
    gone_world.push_back(credit_peers[static_cast<std::size_t>(trainer)]);
    if (credit < credit_none) learn_split(-credit - 1, 0);
  }
}

// Step s (this producer's k-th) to the members whose split changed: their credits, then a
// message per rank, its shards repacked from the pieces in this step's slot.
template <class B>
void one_to_many<B>::production::ship_splits(std::int64_t s, std::int64_t k) {
  splits.take_credits(s);
  splits.ship(
      s, feed.pieces_,
      [&](int c) {
        const int i = index_in_mine[static_cast<std::size_t>(c)];
        if (i >= 0) return span<const std::byte>(piece_memory(k, static_cast<std::size_t>(i)));
        const auto at = static_cast<std::size_t>(c);
        if (fresh.empty()) {
          fresh.resize(feed.pieces_.size());
          fresh_step.assign(feed.pieces_.size(), -1);
        }
        if (fresh_step[at] != s) {
          const auto& piece = feed.pieces_[at];
          fresh[at].resize(feed.piece_bytes(c) + detail::guard_bytes);
          detail::fill_piece(feed.load_, s, piece.first_shard, piece.shards, feed.options_.shard_capacity,
                             span<std::byte>(fresh[at]));
          fresh_step[at] = s;
        }
        return span<const std::byte>(fresh[at]);
      },
      feed.options_.shard_capacity, ring.at(k).split_out, ring.at(k).sends);
}

// Piece i of mine for step s into `slot`; a failed one travels as that step's verdict, and the
// other pieces and steps go on, so that only its owners stop.
template <class B>
void one_to_many<B>::production::make_piece(std::int64_t s, std::size_t i, span<std::byte> slot) {
  const auto& piece = feed.pieces_[static_cast<std::size_t>(mine[i])];
  const auto start = std::chrono::steady_clock::now();
  detail::fill_piece(feed.load_, s, piece.first_shard, piece.shards, feed.options_.shard_capacity, slot);
  if (desk) {
    desk.note_make_time(std::chrono::steady_clock::now() - start);
    ++feed.made_;
  }
  if (failure.empty() && reinterpret_cast<const detail::piece_header*>(slot.data())->status != detail::piece_ok)
    failure.assign(slot.begin(), slot.end());
}

// Step s, this producer's k-th: once its slot is free, makes its pieces there (or collects those
// trainers made), publishes it to the trainers here and sends it to the others.
template <class B>
void one_to_many<B>::production::ship(std::int64_t s, std::int64_t k) {
  shipment& t = ring.at(k);
  // Its sends finished: the slot can be refilled.
  if (t.sends.started) await(t.sends, cat("one_to_many: send of step ", t.step));
  if (desk) desk.begin(s);
  auto fill = [&] {
    for (std::size_t i = 0; i < mine.size(); ++i)
      if (!desk || desk.take(i)) make_piece(s, i, piece_memory(k, i));  // else a trainer makes it, or made it ahead
    if (desk) {
      desk.all_taken();
      desk.collect(s, [&](std::size_t i) { return piece_memory(k, i); });
    }
  };
  if (here) {  // once the trainers here let go of the slot: fill, publish
    const std::string what = cat("one_to_many: credits of step ", s);
    if (desk) desk.serve_until([&] { return here->is_free(k); }, [&] { here->wait_free(k, what); });
    here->fill_and_publish(k, what, fill);
    // Under hand-overs the trainers here ask for each step too (in shared memory), or say that
    // their member's split changes: its root's notice, then the member's messages.
    if (feed.options_.hand_over) {
      here->await_asked(s, moved, what);
      for (; moves_known < moved.size(); ++moves_known) learn_split(moved[moves_known].first, moved[moves_known].second);
    }
  } else {
    fill();
  }
  t.sends.clear();
  if (!messages && moved.empty()) {
    if (desk) desk.shipped(s);
    return;
  }
  if (messages) {
    await(t.credits, cat("one_to_many: credits of step ", s));
    note_gone(t);
  }
  ship_splits(s, k);
  const auto shipped_to = [&](int world_rank) {
    return !in_place(world_rank) && std::find(gone_world.begin(), gone_world.end(), world_rank) == gone_world.end();
  };
  for (std::size_t i = 0; i < mine.size(); ++i) {
    const span<std::byte> slot = piece_memory(k, i);
    const std::size_t bytes = slot.size() - detail::guard_bytes;
    const communicator& comm = feed.comm_of(me, mine[i]);
    for (int r = 1; r < comm.size(); ++r)
      if (shipped_to(piece_peers[i][static_cast<std::size_t>(r)]))
        t.sends.post(B::isend(comm, span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(slot.data()), bytes), r,
                              piece_tag),
                     piece_peers[i][static_cast<std::size_t>(r)]);
  }
  t.step = s;
  if (!t.sends.requests.empty()) ring.start(k, t.sends, cat("one_to_many: send of step ", s));
  if (desk) desk.shipped(s);
  if (messages && s + depth * P < feed.options_.steps) ask_credits(s + depth * P, k + depth);
}

template <class B>
void one_to_many<B>::produce() {
  check(role_.kind == role::producer, "one_to_many", "produce() is for producer ranks; this rank is a trainer");
  check(!produced_, "one_to_many", "produce() runs once per feed");
  produced_ = true;
  const communicator& credits = credit_comms_[static_cast<std::size_t>(role_.producer)];
  if (credits.size() == 1) return;  // a host without trainers: nobody to feed
  production run(*this, credits);
  if (run.messages)
    for (std::int64_t k = 0; k < run.depth && run.first + k * run.P < options_.steps; ++k)
      run.ask_credits(run.first + k * run.P, k);
  std::int64_t k = 0;
  for (std::int64_t s = run.first; s < options_.steps; s += run.P, ++k) run.ship(s, k);
  run.ring.for_each([&](shipment& t) {
    if (t.sends.started) run.await(t.sends, cat("one_to_many: send of step ", t.step));
  });
  if (run.desk) run.desk.close();
  if (!run.failure.empty())
    detail::piece_failure("one_to_many", span<const std::byte>(run.failure.data(), run.failure.size()),
                          options_.shard_capacity);
}

// Collective over `world`, in producer order on every rank: for each producer that shares its
// host with trainers it feeds, a group of them (the producer first) and the shared slots of its
// steps. Which ranks share a host is the backend's host map; where FLEXCOMM_HOSTS pretends one
// host that MPI knows to be several, the group stays on messages.
template <class B>
void one_to_many<B>::setup_host_slots(const communicator& world) {
  const auto producers = static_cast<std::size_t>(layout_.producers());
  host_.resize(producers);
  slot_offsets_.assign(producers, std::vector<std::size_t>(pieces_.size(), 0));
  slot_bytes_.assign(producers, 0);
  // Every rank lays out every producer's slot alike: the pieces it ships, one after the other.
  for (std::size_t p = 0; p < producers; ++p)
    for (std::size_t c = 0; c < pieces_.size(); ++c)
      if (ships_[index_of(static_cast<int>(p), static_cast<int>(c))]) {
        slot_offsets_[p][c] = slot_bytes_[p];
        slot_bytes_[p] += detail::round_up(
            detail::piece_bytes(pieces_[c].shards, options_.shard_capacity) + detail::guard_bytes);
      }
  if constexpr (has_host_window<B>) {
    if (options_.shared_memory == shared_memory_use::off) return;
    const host_map hosts = B::hosts(world);
    const int me = world.rank();
    // Under skip_ahead a trainer must see n + 2 steps beyond the one it holds, as its ring does.
    std::size_t slots = static_cast<std::size_t>(options_.depth);
    if (options_.flow.kind == flow_control::policy::skip_ahead)
      slots = std::max(slots, static_cast<std::size_t>(options_.flow.max_behind + 3));
    for (int p = 0; p < layout_.producers(); ++p) {
      const int host = hosts.host_of(layout_.producer_rank(p));
      bool others = false;  // trainers on the producer's host that it feeds
      for (int m = 0; m < layout_.members(); ++m)
        for (int r = 0; r < layout_.member_size(m); ++r)
          others = others || (layout_.feeds(p, m, r) && hosts.host_of(layout_.trainer_rank(m, r)) == host);
      if (!others) continue;  // every rank knows: nobody takes part
      const bool producer = role_.kind == role::producer && role_.producer == p;
      const bool in = producer || (role_.kind == role::trainer && layout_.feeds(p, role_.member, role_.rank_in_member) &&
                                   hosts.host_of(me) == host);
      const communicator group = world.split(in ? 0 : communicator::undefined, producer ? 0 : 1 + me,
                                             cat("one_to_many producer ", p, " host slots"));
      if (!in) continue;
      if (!B::host_window::on_one_host(group)) {
        check(options_.shared_memory != shared_memory_use::on, "one_to_many",
              cat("feed_options.shared_memory (FLEXCOMM_SHM) is on, but producer ", p,
                  "'s host as the host map has it is several hosts to MPI"));
        continue;
      }
      std::vector<int> ranks(static_cast<std::size_t>(group.size()));
      for (int r = 0; r < group.size(); ++r) ranks[static_cast<std::size_t>(r)] = group.world_rank_of(r);
      host_[static_cast<std::size_t>(p)] = detail::host_slots<B>(group, producer, slots, slot_bytes_[static_cast<std::size_t>(p)],
                                                                  std::move(ranks), cat("one_to_many producer ", p));
    }
  } else {
    check(options_.shared_memory != shared_memory_use::on, "one_to_many",
          "feed_options.shared_memory (FLEXCOMM_SHM) is on, but this backend has no shared memory");
  }
}

// The steps already asked for are received (their credits went out, so their producers ship
// them); a producer asks for a trainer's credits `depth` of its steps ahead (production), so the
// "none" credits answer its next `depth` steps from the first not asked for, and it asks no more.
template <class B>
void one_to_many<B>::release() {
  check(role_.kind == role::trainer, "one_to_many", "release() is for trainer ranks; this rank is a producer");
  check(!claims_, "adaptive", "a trainer cannot leave the stream early under claims by message (not built)");
  if (released_) return;
  const std::int64_t from = next_post_;
  leave_stream();
  // Fenced on the layout's split, its "moved" answered those credits already.
  if (split_member_ >= 0 || fence_ == std::numeric_limits<std::int64_t>::max())
    answer_asked(from, credit_none, split_member_);
}

template <class B>
void one_to_many<B>::leave_stream() {
  released_ = true;
  if (lent_ >= 0) source_.release(lent_);
  lent_ = -1;
  source_.drain([] {});  // leaves the shared slots; awaits what is posted, posts nothing more
  next_post_ = next_step_ = options_.steps;
}

// The producer learns the split from the credit (on a member already split: its ranks' credits
// name the split from `at`; on the layout's split: its ranks' "moved"), and takes this credit
// from every rank of it: all of them gone, it ships that member nothing more.
template <class B>
void one_to_many<B>::leave_split(int member, std::int64_t at) {
  check(role_.kind == role::trainer && options_.hand_over && member >= 0 && (released_ || fence_ == at),
        "one_to_many: hand-over",
        cat("leave_split(", member, ", ", at, "): on a trainer under feed_options.hand_over, released or fenced there"));
  if (!released_) leave_stream();
  answer_asked(at, static_cast<int>(-(1 + at)), member);
}

// On the layout's split a producer has asked this trainer the credits of its next `depth` steps
// from `from`; on a changed split it asks one at a time, as it ships (split_change.hpp), so each
// producer with a step from `from` on gets one answer there.
template <class B>
void one_to_many<B>::answer_asked(std::int64_t from, int value, int split) {
  const auto P = static_cast<std::int64_t>(layout_.producers());
  std::vector<std::int64_t> told(static_cast<std::size_t>(P), 0);
  const std::int64_t per_producer = split >= 0 ? 1 : options_.depth;
  for (std::int64_t s = from; s < options_.steps && s < from + per_producer * P; ++s) {
    const int p = split >= 0 ? split_producer(split, s) : producer_of(s);
    auto& n = told[static_cast<std::size_t>(p)];
    // A changed split's credits go by message whether or not the layout's steps lie here.
    if (n == per_producer || (split < 0 && source_.in_shared_memory(s))) continue;
    ++n;
    none_.push_back(value);  // a deque: earlier sends keep pointing at theirs
    if (split >= 0) {
      none_sent_.push_back(B::isend(joins_, span<const int>(&none_.back(), 1), layout_.producer_rank(p),
                                    detail::split_credit_tag(split)));
    } else {
      none_sent_.push_back(B::isend(credit_comms_[static_cast<std::size_t>(p)], span<const int>(&none_.back(), 1), 0,
                                    credit_tag));
    }
  }
}

template <class B>
void one_to_many<B>::fence(std::int64_t at) {
  check(role_.kind == role::trainer && !released_ && !claims_ && options_.flow.kind == flow_control::policy::lockstep &&
            options_.hand_over,
        "one_to_many: hand-over", "a member's split changes only on a lockstep trainer, under feed_options.hand_over");
  check(at == next_post_, "one_to_many: hand-over",
        cat("the split changes at step ", at, " but this trainer has asked up to step ", next_post_));
  fence_ = at;
  // A changed split's credits say which split they ask for: the producer waits for its notice.
  if (split_member_ >= 0) return;
  answer_asked(at, credit_moved(role_.member), -1);
  for (const auto& slots : host_)
    if (slots) slots.move(role_.member, at);
}

template <class B>
void one_to_many<B>::announce(int member, std::int64_t at, const std::vector<int>& ranks) {
  check(member >= 0 && member < detail::split_members_max && !ranks.empty(), "one_to_many: hand-over",
        cat("member ", member, " with ", ranks.size(), " rank(s): no split to announce"));
  for (int p = 0; p < layout_.producers(); ++p) {
    // Only a producer that ships the split a step from `at` on hears of it: it waits for this
    // when a credit says so. With a producer per host that is one, the member's rank 0's.
    if (layout_.per_host() && p != split_producer(member, at)) continue;
    const std::int64_t first =
        layout_.per_host() ? at : at + ((p - at % layout_.producers()) + layout_.producers()) % layout_.producers();
    if (first >= options_.steps) continue;
    notices_.emplace_back(detail::split_notice(member, at, ranks, joins_.size()), request{});
    auto& n = notices_.back();
    n.second = B::isend(joins_, span<const std::int64_t>(n.first.data(), n.first.size()), layout_.producer_rank(p),
                        detail::split_notice_tag);
  }
}

template <class B>
void one_to_many<B>::reshard(shard_range shards, std::int64_t from, int member) {
  check(role_.kind == role::trainer && member >= 0 && shards.count > 0 && options_.hand_over, "one_to_many: hand-over",
        cat("reshard() to member ", member, ", ", shards.count, " shard(s): a trainer needs a member and a shard, and "
            "the feed feed_options.hand_over"));
  if (!released_) {  // the member's own ranks: fenced at `from`, every step before it taken
    check(fence_ == from && next_step_ == from, "one_to_many: hand-over",
          cat("the split changes at step ", from, ", this trainer is at step ", next_step_));
    if (lent_ >= 0) source_.release(lent_);
    lent_ = -1;
    source_.drain([] {});
  }
  released_ = false;
  fence_ = std::numeric_limits<std::int64_t>::max();
  split_member_ = member;
  split_from_ = from;
  next_post_ = next_step_ = from;
  assembly_ = detail::batch_assembly({detail::piece{shards.first, shards.count, {}}}, {0}, shards, options_.shard_capacity);
  const std::size_t bytes = detail::piece_bytes(shards.count, options_.shard_capacity);
  const auto turns = static_cast<std::size_t>(layout_.producers());
  source_.setup(layout_.producers(), std::vector<std::vector<typename source::shared_piece>>(turns, {typename source::shared_piece{}}),
                {bytes}, 1, ring_size(), [&](typename source::received& r) { r.buffers.assign(1, std::vector<std::byte>(bytes)); },
                "one_to_many: receive of step ");
  post_free_slots();
}

// Receives what is left of the stream, so that producers and the other members can finish.
template <class B>
void one_to_many<B>::drain() noexcept {
  try {
    for (auto& n : notices_) n.second.wait();
    if (released_) {  // only its "none" credits are still out
      for (auto& r : none_sent_) r.wait();
      return;
    }
    for (auto& r : none_sent_) r.wait();  // fence()'s "moved"
    // A claim out is answered, and a piece it grants made, before the rest of the stream is
    // received: its producer ships nothing more until it has that piece.
    for (auto& c : claimants_)
      if (c && c.asking()) {
        c.await_answer(next_step_);
        make_granted(c);
      }
    if (lent_ >= 0) source_.release(lent_);
    lent_ = -1;
    source_.drain([&] { post_free_slots(); });
    // Producers wait for word that no claim will come.
    for (auto& c : claimants_)
      if (c) c.finish();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n(one_to_many: while draining the stream in the destructor)\n", e.what());
  }
}

}  // namespace flexcomm
