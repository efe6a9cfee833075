// adaptive: each step is preprocessed once, by whoever is idle, with nothing to tune. Which fixed
// feed wins depends on how preprocessing compares with training, which a user cannot know ahead
// and which changes during a run (augmentation schedules, another job on the node); this one
// follows it.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "../../core/error.hpp"
#include "../../core/layout.hpp"
#include "../../core/trace.hpp"
#include "../../core/wait.hpp"
#include "../../backend/contract.hpp"
#include "vocabulary.hpp"
#include "agreement.hpp"
#include "all_shared.hpp"
#include "../../backend/shm/feed/board_courier.hpp"
#include "../../backend/shm/feed/claim_board.hpp"
#include "one_to_many.hpp"
#include "split_change.hpp"
#include "step_source.hpp"
#include "wire.hpp"

namespace flexcomm {

// The ranks of a host share a claim board (claim_board.hpp): the slots of the next 4 x depth
// steps, cut into pieces as one_to_many cuts them. Producers claim and make the pieces in step
// order, as far ahead as the slots allow, so while they keep ahead the trainers only read. A
// trainer whose next step is not made yet claims the first piece nobody has (of that step, else
// of one of the 2 x depth after it) and makes it itself, rather than wait; with no producer in
// the layout the trainers make everything that way, which is all_shared balanced by who is free.
// The board is twice a trainer's window so that while trainers are slow (busy making a piece, or
// training) the producers prefetch deeper than the trainers reach: on 2 cores, a board of
// 2 x depth left the producers waiting for slots and the job 1.14-1.28x slower than two fixed
// producers where preprocessing dominates; 4 x depth, 0.88-0.99x (benchmarks/feed_sweep).
// Every piece is made exactly once, by the loader, from the step and the shard alone, so the
// members get the same bytes as from one_to_many whoever made them. A trainer releases a step at
// its next next(), and a slot is refilled only once every trainer here released it (lockstep).
//
// A board serves the readers of a host: on a single host it holds every step; with a producer per
// host, each host makes every step for its own trainers, as one_to_many does. With no producer
// across hosts, each step has a home host whose trainers make it on their board, and the hosts'
// couriers carry it to the others' boards (board_courier.hpp): all_shared's split of the making,
// by host, balanced within each host by who is idle. Elsewhere (a member across hosts fed by
// round-robin producers, shared memory off) claims go by message: the feed is one_to_many whose
// producers grant pieces to trainers that wait (claims.hpp). Without producers and with shared
// memory off it is all_shared; with per-host producers and shared memory off, one_to_many.
template <class B>
class adaptive : private detail::agreed_feed {
  static_assert(holds_host_memory<B>,
                "adaptive<B>: the loader writes each batch into host memory and trainers read it there, but B's "
                "buffers live in device memory; feed with a host backend (adaptive<mpi>) and copy the batch to the "
                "device in the trainer (presets with a device Sync backend do: their feed is on its host backend)");

 public:
  static constexpr bool needs_producers = false;  // producers help when the layout has them
  using communicator = typename B::communicator;

  // Collective over `world`.
  adaptive(const communicator& world, const ensemble_layout& layout, loader load, feed_options options);
  ~adaptive();
  adaptive(const adaptive&) = delete;
  adaptive& operator=(const adaptive&) = delete;

  // On producer ranks: makes pieces in step order while there are unclaimed ones, then returns.
  // A loader failure travels to the trainers as that step; produce() throws it once done.
  void produce();
  // On trainer ranks: the next step of this trainer's shards, or nothing at the end of the stream.
  std::optional<batch> next();

  // Every member gets every step (the board holds a step until its last reader lets go).
  std::int64_t skipped() const noexcept { return 0; }
  bool is_trainer() const noexcept { return role_.kind == role::trainer; }
  bool shared_memory() const noexcept {
    return balancing_ || (by_producers_ ? by_producers_->shared_memory() : by_turns_ && by_turns_->shared_memory());
  }
  // Whether steps are made by whoever is idle (a claim board on every host, or claims by message
  // to the producers); false where the feed runs as one_to_many or all_shared (see above). The
  // same on every rank.
  bool balancing() const noexcept { return balancing_ || by_message_; }
  // Whether steps are made on their home host and carried between hosts by couriers.
  bool crosses_hosts() const noexcept { return courier_line_ > 0; }
  // Whether claims go by message to the step's producer (claims.hpp) rather than to a board.
  bool claims_by_message() const noexcept { return by_message_; }
  // The pieces this rank made with its loader.
  std::int64_t pieces_made() const noexcept { return by_message_ ? by_producers_->pieces_made() : made_; }

  // A member that finishes early hands its ranks on (pipeline/handover.hpp; options.hand_over,
  // which on_handover() sets), where the feed balances on boards or takes turns (all_shared's
  // hand-over, unchanged). On a board the pieces never change and every host's board holds every
  // piece: a rank whose member ended lets its reader line go (step_aside()), holds the step it
  // joins at before the member's ranks can pass it (hold()), and reads its new shards out of the
  // pieces, repacked (reshard()). With producers and no board (shared memory off, round-robin
  // producers across hosts) it runs as one_to_many, whose hand-over goes by credits, which claims
  // by message do not send: no trainer makes pieces then. docs/heterogeneous.md says why.
  // `each(step)` runs at the top of each next(), before the step is taken; it may reshard().
  void between_steps(std::function<void(std::int64_t step)> each);
  // The next step next() delivers (of the member this trainer trains now).
  std::int64_t position() const noexcept {
    return by_turns_ ? by_turns_->position() : by_producers_ ? by_producers_->position() : next_step_;
  }
  // Where the split of this trainer's member can change: one_to_many's first_unasked() (a few
  // steps ahead), else its position. fence(), announce() and leave_split() are one_to_many's
  // (nothing to do on a board or in turns).
  std::int64_t first_unasked() const noexcept { return by_producers_ ? by_producers_->first_unasked() : position(); }
  void fence(std::int64_t at) {
    if (by_producers_) by_producers_->fence(at);
  }
  void announce(int member, std::int64_t at, const std::vector<int>& ranks) {
    if (by_producers_) by_producers_->announce(member, at, ranks);
  }
  void leave_split(int member, std::int64_t at) {
    if (by_producers_) by_producers_->leave_split(member, at);
  }
  // This trainer reads its member's stream no more (all_shared: it keeps its turn in the rounds).
  void step_aside();
  // all_shared: takes part in the rounds without waiting; on a board, nothing to do.
  void serve() {
    if (by_turns_) by_turns_->serve();
  }
  // After step_aside(): this trainer reads steps from `from` again (the board keeps their slots).
  void hold(std::int64_t from);
  // From step `from` on, this trainer trains `member`, over world ranks `ranks` (member order), on
  // `shards`; every rank in `ranks` calls it with the same `from`.
  void reshard(shard_range shards, std::int64_t from, int member = -1, const std::vector<int>& ranks = {});
  // A trainer done for good: nobody waits for it again (all_shared: it takes its turn to the end).
  void release();

 private:
  bool set_up_board(const communicator& world);
  // set_up_board's parts: the pieces each host reads, ascending; the trainers on each host
  // (and producers_here_, trainers_here_ of this one); the names a courier's timeout gives.
  std::vector<std::vector<std::size_t>> pieces_read_on(const host_map& hosts) const;
  std::vector<int> count_trainers(const communicator& world, const host_map& hosts, int host);
  void name_couriers(const communicator& world, const host_map& hosts);
  // The hand-over on a board: this trainer's shards from step `from` on, out of `pieces`, repacked
  // into `bytes` (split_change.hpp's repack) and read from there.
  struct changed_split {
    std::int64_t from = 0;
    shard_range shards;
    std::vector<int> pieces;
    std::vector<std::byte> bytes;
    detail::batch_assembly assembly;
  };
  batch changed_step(std::int64_t k);
  void leave_board();

  // Trainer: makes pieces of the board until this trainer's pieces of step k are all made.
  void make_until_ready(std::int64_t k);
  bool ready(std::int64_t k) const;
  // Claims and makes the first piece nobody has, of step k or a later one in the board; false
  // if there is none.
  bool make_one(std::int64_t k);
  bool can_make(std::int64_t k) const;
  // How many steps from its own a waiting trainer makes pieces of: its own step only while the
  // producers keep pace with its training (a piece of a later step would hold it up for a whole
  // piece's making, when its own step is about to come), else half the board, so that a trainer
  // busy making one still leaves the producers slots to fill.
  std::int64_t reach() const;
  void make(std::int64_t k, std::size_t c);
  // Across hosts: claims and makes a piece of a home step up to k that nobody took, oldest first
  // (other hosts wait for it, and no trainer here reads it); false if there is none to take now.
  bool make_owed(std::int64_t k);
  bool owes(std::int64_t k) const;
  // Whether this host's trainers make step k (else a courier brings it).
  bool made_here(std::int64_t k) const { return courier_line_ == 0 || homes_.of(k) == host_; }
  // Who is late with piece c of step k, for a timeout.
  std::string holder(std::int64_t k, std::size_t c) const;
  // Across hosts: makes this host's steps that nobody here made (trainers that left early), then
  // waits for the courier to finish, so that the other hosts get every step. Not while an
  // exception unwinds.
  void drain() noexcept;

  std::unique_ptr<one_to_many<B>> by_producers_;  // where the feed does not balance
  std::unique_ptr<all_shared<B>> by_turns_;
  bool balancing_ = false;
  bool by_message_ = false;  // one_to_many with claims by message

  // This host's; shared with the courier, whose sends and receives may outlive the feed.
  std::shared_ptr<detail::claim_board<B>> board_;
  // The pieces this host makes: those read on this host; with couriers, every piece.
  std::vector<std::size_t> here_;
  // Across hosts (no producer): which host makes each step, the couriers (one rank per host) and
  // this host's, which holds reader line courier_line_ of the board (0: no couriers).
  detail::home_hosts homes_;
  int host_ = 0;
  std::size_t courier_line_ = 0;
  std::int64_t owed_ = 0;  // every piece of the home steps before it is claimed
  std::vector<std::string> host_ranks_;  // [host]: "world ranks a, b", named in timeouts
  std::vector<int> courier_ranks_;       // [host]: its courier's world rank
  communicator couriers_;
  std::unique_ptr<detail::board_courier<B>> courier_;  // on the courier rank; before couriers_ goes
  detail::batch_assembly assembly_;
  std::vector<span<const std::byte>> taken_;
  std::vector<int> reading_;  // the board's pieces this trainer reads: assembly_'s, or split_'s
  std::optional<changed_split> split_;
  std::function<void(std::int64_t)> between_;
  bool away_ = false;  // step_aside(): the reader line is let go of
  std::vector<std::byte> failure_;  // producer: the first failed piece it made
  std::int64_t next_step_ = 0, lent_ = -1, made_ = 0;
  int producers_here_ = 0;                            // producers on this host's board
  int trainers_here_ = 0;                             // and trainers
  detail::training_clock training_;
  bool produced_ = false;
};

template <class B>
adaptive<B>::adaptive(const communicator& world, const ensemble_layout& layout, loader load, feed_options options)
    : detail::agreed_feed(world, layout, load, options, false, "adaptive") {
  // The options are agreed: every rank refuses alike.
  check(options_.flow.kind == flow_control::policy::lockstep, "adaptive",
        "flow_control::skip_ahead is one_to_many's: the adaptive feed delivers every step to every member");
  balancing_ = set_up_board(world);
  if (!balancing_) {
    if (layout_.producers() > 0 && options_.hand_over) {
      // Claims by message have no hand-over: as one_to_many, producers alone make the steps.
      by_producers_ = std::make_unique<one_to_many<B>>(world, layout, std::move(load), options);
    } else if (layout_.producers() > 0 && !layout_.per_host()) {
      by_producers_ = std::make_unique<one_to_many<B>>(world, layout, std::move(load), options,
                                                       detail::claims_by_message{});
      by_message_ = true;
    } else if (layout_.producers() > 0) {
      by_producers_ = std::make_unique<one_to_many<B>>(world, layout, std::move(load), options);
    } else
      by_turns_ = std::make_unique<all_shared<B>>(world, layout, std::move(load), options);
    return;
  }
  if (role_.kind != role::trainer) return;
  assembly_ = detail::batch_assembly(pieces_, layout_, role_, options_.shard_capacity);
  taken_.resize(assembly_.pieces().size());
  reading_ = assembly_.pieces();
}

// Collective over `world`: a board per host where the readers of every step share one, and the
// same answer on every rank.
template <class B>
bool adaptive<B>::set_up_board(const communicator& world) {
  if constexpr (has_host_window<B>) {
    const host_map hosts = B::hosts(world);
    const bool across = hosts.hosts() > 1 && layout_.producers() == 0;  // couriers carry the steps
    const bool possible = options_.shared_memory != shared_memory_use::off && (hosts.hosts() == 1 || layout_.per_host() || across);
    const int host = hosts.host_of(world.rank());
    const communicator group = world.split(possible ? host : communicator::undefined, world.rank(),
                                           cat("adaptive host ", host));
    // The host map may pretend several hosts (FLEXCOMM_HOSTS); MPI has the last word.
    int works = possible && B::host_window::on_one_host(group) ? 1 : 0;
    B::template iallreduce<int>(world, span<int>(&works, 1), op::min).wait();
    if (!works) {
      check(options_.shared_memory != shared_memory_use::on, "adaptive",
            "feed_options.shared_memory (FLEXCOMM_SHM) is on, but the trainers of a step do not all share a host "
            "with each other and its producer (a producer per host would)");
      return false;
    }
    // A host makes the pieces it reads, or with couriers every piece of its home steps; the
    // others have no room on its board.
    // Under hand-over a rank may join a member whose pieces no trainer of its host read before.
    std::vector<std::vector<std::size_t>> reads = pieces_read_on(hosts);
    std::vector<std::size_t> wire(pieces_.size());
    for (std::size_t c = 0; c < pieces_.size(); ++c) wire[c] = detail::piece_bytes(pieces_[c].shards, options_.shard_capacity);
    if (options_.hand_over)
      for (auto& on : reads) {
        on.resize(pieces_.size());
        for (std::size_t c = 0; c < pieces_.size(); ++c) on[c] = c;
      }
    if (across)
      for (std::size_t c = 0; c < pieces_.size(); ++c) here_.push_back(c);
    else
      here_ = reads[static_cast<std::size_t>(host)];
    std::vector<std::size_t> bytes(pieces_.size(), 0);
    for (std::size_t c : here_) bytes[c] = wire[c];
    // The layout counts ranks of `world`, which need not be MPI's world: group ranks are world
    // ranks only in the names a timeout gives.
    std::vector<int> ranks(static_cast<std::size_t>(group.size()));
    for (int r = 0; r < group.size(); ++r) ranks[static_cast<std::size_t>(r)] = group.world_rank_of(r);
    const std::vector<int> trainers_on = count_trainers(world, hosts, host);
    // Group rank 0 is the host's courier; its sends hold a reader line of the board.
    if (across) {
      courier_line_ = ranks.size();
      ranks.push_back(ranks.front());
      homes_ = detail::home_hosts(trainers_on);
      host_ = host;
      name_couriers(world, hosts);
    }
    const auto slots = static_cast<std::size_t>(4 * options_.depth);
    board_ = std::make_shared<detail::claim_board<B>>(group, role_.kind == role::trainer, slots, bytes,
                                                      std::move(ranks), cat("adaptive host ", host));
    if (across) {
      couriers_ = world.split(group.rank() == 0 ? 0 : communicator::undefined, host, "adaptive couriers");
      if (group.rank() == 0)
        courier_ = std::make_unique<detail::board_courier<B>>(couriers_, board_, courier_line_, homes_, std::move(reads),
                                                              std::move(wire), options_.steps, cat("adaptive host ", host));
    }
    return true;
  } else {
    check(options_.shared_memory != shared_memory_use::on, "adaptive",
          "feed_options.shared_memory (FLEXCOMM_SHM) is on, but this backend has no shared memory");
    (void)world;
    return false;
  }
}

template <class B>
std::vector<std::vector<std::size_t>> adaptive<B>::pieces_read_on(const host_map& hosts) const {
  std::vector<std::vector<std::size_t>> reads(static_cast<std::size_t>(hosts.hosts()));
  for (std::size_t c = 0; c < pieces_.size(); ++c)
    for (int m = 0; m < layout_.members(); ++m) {
      auto& on = reads[static_cast<std::size_t>(
          hosts.host_of(layout_.trainer_rank(m, pieces_[c].owner[static_cast<std::size_t>(m)])))];
      if (on.empty() || on.back() != c) on.push_back(c);
    }
  return reads;
}

template <class B>
std::vector<int> adaptive<B>::count_trainers(const communicator& world, const host_map& hosts, int host) {
  std::vector<int> trainers_on(static_cast<std::size_t>(hosts.hosts()), 0);
  for (int r = 0; r < world.size(); ++r) {
    const role kind = layout_.role_of(r).kind;
    trainers_on[static_cast<std::size_t>(hosts.host_of(r))] += kind == role::trainer ? 1 : 0;
    if (hosts.host_of(r) == host) producers_here_ += kind == role::producer ? 1 : 0;
  }
  trainers_here_ = trainers_on[static_cast<std::size_t>(host)];
  return trainers_on;
}

template <class B>
void adaptive<B>::name_couriers(const communicator& world, const host_map& hosts) {
  for (int h = 0; h < hosts.hosts(); ++h) {
    std::vector<int> ranks;
    for (int r : hosts.ranks_on(h)) ranks.push_back(world.world_rank_of(r));
    host_ranks_.push_back(world_ranks_named(ranks));
    courier_ranks_.push_back(world.world_rank_of(hosts.leader_of(h)));
    stall_registry::instance().add_role(courier_ranks_.back(), cat("courier of host ", h));  // for reports
  }
}

template <class B>
adaptive<B>::~adaptive() {
  // Nobody waits for this trainer's reading again; what it claimed, it made.
  if (board_ && lent_ >= 0) board_->training_ends();
  if (board_) board_->leave();
  // Destroyed by an exception (a timeout, the trainer's own failure), the job is ending: the
  // others learn of it by their own timeouts, naming this host, rather than wait on a drain.
  if (courier_line_ > 0 && std::uncaught_exceptions() == 0) drain();
}

template <class B>
void adaptive<B>::drain() noexcept {
  try {
    for (std::int64_t k = 0; k < options_.steps; ++k) {
      if (!made_here(k)) continue;
      for (std::size_t c : here_) {
        if (board_->claimed(k, c)) continue;
        detail::wait_in_shared_memory([&] { return board_->claimed(k, c) || board_->slot_free(k); },
                                      detail::answer_watchdog,
                                      cat("adaptive: slot of step ", k), [&] { return board_->holder(k, c); });
        if (board_->try_claim(k, c)) make(k, c);
      }
    }
    if (courier_) courier_->finish();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n(adaptive: while finishing this host's steps for the other hosts, in the destructor)\n",
                 e.what());
  }
}

template <class B>
std::string adaptive<B>::holder(std::int64_t k, std::size_t c) const {
  if (made_here(k) || !board_->slot_free(k)) return board_->holder(k, c);
  const int home = homes_.of(k);
  const std::string failed = courier_ ? courier_->failure() : std::string();
  return cat(host_ranks_[static_cast<std::size_t>(home)], "\n  (across hosts: host ", home, " makes step ", k,
             ", and its courier, world rank ", courier_ranks_[static_cast<std::size_t>(home)],
             ", sends it to this host's, world rank ", courier_ranks_[static_cast<std::size_t>(host_)],
             failed.empty() ? std::string() : cat("; the courier here failed: ", failed), ")");
}

template <class B>
void adaptive<B>::make(std::int64_t k, std::size_t c) {
  const detail::piece& piece = pieces_[c];
  const span<std::byte> slot(board_->piece(k, c), detail::piece_bytes(piece.shards, options_.shard_capacity) + detail::guard_bytes);
  const auto start = std::chrono::steady_clock::now();
  detail::fill_piece(load_, k, piece.first_shard, piece.shards, options_.shard_capacity, slot);
  board_->note_make_time(static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count()));
  if (role_.kind == role::producer && failure_.empty() &&
      reinterpret_cast<const detail::piece_header*>(slot.data())->status != detail::piece_ok)
    failure_.assign(slot.begin(), slot.end());
  board_->mark_made(k, c);
  ++made_;
}

template <class B>
void adaptive<B>::produce() {
  check(role_.kind == role::producer, "adaptive", "produce() is for producer ranks; this rank is a trainer");
  check(!produced_, "adaptive", "produce() runs once per feed");
  produced_ = true;
  if (by_producers_) return by_producers_->produce();
  if (!board_) return;  // all_shared, or a host without trainers
  // A producer that waits for a slot is ahead of the trainers by the whole board: it sleeps until
  // a trainer's release frees a slot (the board's doorbell) rather than wake on a timer to look.
  // Backing off instead, up to a quarter of its last wait, it still woke about seven times per
  // training step, and where training dominates (50 ms against 1 ms of preprocessing) two such
  // producers cost 1.2-1.4x all_shared's CPU.
  // Producers take turns as in one_to_many, but only in waiting: each waits for the slots of its
  // own steps and makes any other step whose slot is free and nobody took, so that while they are
  // ahead they do not all wake for the same slot.
  const std::int64_t turns = layout_.per_host() ? 1 : layout_.producers();
  for (std::int64_t k = 0; k < options_.steps; ++k)
    for (std::size_t c : here_) {
      if (board_->claimed(k, c)) continue;  // an idle trainer or producer took it
      if (k % turns != role_.producer % turns) {
        if (board_->try_claim(k, c)) make(k, c);
        continue;
      }
      detail::wait_on_doorbell(board_->freed(), board_->freed_channel(k),
                               [&] { return board_->claimed(k, c) || board_->slot_free(k); },
                               detail::answer_watchdog,
                               cat("adaptive: slot of step ", k), [&] { return board_->holder(k, c); });
      if (board_->try_claim(k, c)) make(k, c);
    }
  if (!failure_.empty())
    detail::piece_failure("adaptive", span<const std::byte>(failure_.data(), failure_.size()), options_.shard_capacity);
}

template <class B>
bool adaptive<B>::ready(std::int64_t k) const {
  for (int c : reading_)
    if (!board_->is_made(k, static_cast<std::size_t>(c))) return false;
  return true;
}

// The steps a trainer at step k may make: those whose slots it does not itself still hold.
template <class B>
bool adaptive<B>::can_make(std::int64_t k) const {
  if (courier_line_ > 0 && owes(k)) return true;
  const std::int64_t end = std::min<std::int64_t>(options_.steps, k + reach());
  for (std::int64_t j = k; j < end; ++j)
    for (std::size_t c : here_)
      if (made_here(j) && !board_->claimed(j, c) && board_->slot_free(j)) return true;
  return false;
}

template <class B>
bool adaptive<B>::make_owed(std::int64_t k) {
  for (; owed_ <= k && owed_ < options_.steps; ++owed_) {
    if (!made_here(owed_)) continue;
    for (std::size_t c : here_)
      if (!board_->claimed(owed_, c)) {
        if (!board_->try_claim(owed_, c)) return false;  // its slot is not free yet
        make(owed_, c);
        return true;
      }
  }
  return false;
}

template <class B>
bool adaptive<B>::owes(std::int64_t k) const {
  for (std::int64_t j = owed_; j <= k && j < options_.steps; ++j)
    if (made_here(j))
      for (std::size_t c : here_)
        if (!board_->claimed(j, c)) return board_->slot_free(j);
  return false;
}

template <class B>
bool adaptive<B>::make_one(std::int64_t k) {
  if (courier_line_ > 0 && make_owed(k)) return true;
  const std::int64_t end = std::min<std::int64_t>(options_.steps, k + reach());
  for (std::int64_t j = k; j < end; ++j)
    for (std::size_t c : here_)
      if (made_here(j) && board_->try_claim(j, c)) {
        make(j, c);
        return true;
      }
  return false;
}

template <class B>
std::int64_t adaptive<B>::reach() const {
  const std::int64_t window = 2 * options_.depth;
  if (producers_here_ == 0) return window;
  // A step's making, spread over the producers, against the trainer's time per step; unknown
  // (the first steps): the producers' work.
  const double step_ns = static_cast<double>(board_->make_time().count()) * static_cast<double>(here_.size());
  if (step_ns == 0 || training_.ns() == 0) return 1;
  return step_ns / producers_here_ > training_.ns() ? window : 1;
}

template <class B>
void adaptive<B>::make_until_ready(std::int64_t k) {
  while (!ready(k)) {
    if (make_one(k)) continue;
    std::size_t waiting_for = 0;  // the first of this trainer's pieces not made, named in a timeout
    for (int c : reading_)
      if (!board_->is_made(k, static_cast<std::size_t>(c))) {
        waiting_for = static_cast<std::size_t>(c);
        break;
      }
    // Its pieces are being made (or their slots held): they take about a piece's time, so the
    // trainer need not poll at the policy's pace, which on a crowded host takes the cores from
    // the makers (at 10 ranks on 2 cores, 1.15x all_shared's CPU); it wakes at most 1/16 of a
    // piece's time late.
    wait_policy patient = default_wait();
    const auto per_piece = std::chrono::duration_cast<std::chrono::microseconds>(board_->make_time());
    if (patient.kind == wait_kind::backoff && per_piece / 16 > patient.max_sleep) {
      patient.max_sleep = per_piece / 16;
      patient.first_sleep = patient.max_sleep / 8;
    }
    detail::wait_in_shared_memory([&] { return ready(k) || can_make(k); }, detail::answer_watchdog,
                                  cat("adaptive: step ", k),
                                  [&] { return holder(k, waiting_for); }, patient);
  }
}

template <class B>
std::optional<batch> adaptive<B>::next() {
  check(role_.kind == role::trainer, "adaptive", "next() is for trainer ranks; this rank is a producer");
  if (by_producers_) return by_producers_->next();
  if (by_turns_) return by_turns_->next();
  if (lent_ >= 0) {
    board_->training_ends();
    board_->release(lent_);
    training_.back();
  }
  lent_ = -1;
  if (between_ && next_step_ < options_.steps) between_(next_step_);
  check(!away_, "adaptive", cat("next() after step_aside(), before reshard() (step ", next_step_, ")"));
  if (next_step_ >= options_.steps) return std::nullopt;
  const std::int64_t k = next_step_;
  {
    trace::span traced(trace::names::feed_wait, k, "step", "feed");
    make_until_ready(k);
    // The pieces of this host's steps up to k that no trainer here reads: other hosts wait for
    // them, and a trainer whose own step is ready would otherwise leave them until it waits.
    if (courier_line_ > 0)
      while (make_owed(k)) {
      }
  }
  // Where the producers fall behind, a trainer that would start training while every other
  // trainer here trains first makes a piece of a later step: the trainers read the same steps, so
  // they get them at the same moment and train together, and the cores idled while only the
  // producers ran (one producer, 2 members, 2 ms of training and 10 ms of preprocessing: a core
  // idle for the whole of the training, 1.13-1.16x two producers' wall; 1.01-1.03 with this). Only
  // where its training is an eighth of a piece's making or more: the piece holds its step up for
  // a whole making, which a short training does not repay (0.1 ms against 1 ms, 4 members:
  // 1.12-1.14x where it was 0.91-1.04x).
  if (producers_here_ > 0 && trainers_here_ > 1 && reach() > 1 &&
      8 * training_.ns() >= static_cast<double>(board_->make_time().count()) &&
      board_->trainers_training() + 1 >= static_cast<std::uint64_t>(trainers_here_))
    make_one(k + 1);
  const batch out = split_ ? changed_step(k) : [&] {
    const std::vector<int>& mine = assembly_.pieces();
    for (std::size_t i = 0; i < mine.size(); ++i)
      taken_[i] = {board_->piece(k, static_cast<std::size_t>(mine[i])), assembly_.bytes(i)};
    return assembly_.assemble("adaptive", k, taken_);
  }();
  lent_ = k;
  board_->training_starts();
  training_.handed_out();
  ++next_step_;
  return out;
}

template <class B>
void adaptive<B>::between_steps(std::function<void(std::int64_t step)> each) {
  if (by_turns_) return by_turns_->between_steps(std::move(each));
  if (by_producers_) return by_producers_->between_steps(std::move(each));
  between_ = std::move(each);
}

template <class B>
void adaptive<B>::step_aside() {
  check(role_.kind == role::trainer, "adaptive", "step_aside() is for trainer ranks; this rank is a producer");
  if (by_turns_) return by_turns_->step_aside();
  if (by_producers_) return by_producers_->release();  // one_to_many: its stream is left
  check(balancing_ && options_.hand_over, "adaptive", "step_aside() is for a hand-over on a board (feed_options.hand_over)");
  // Its member's steps stay on the board for the member's other readers; the slots it held go
  // as soon as they let go of them too. While it waits for a member to join, nobody waits for it.
  leave_board();
  split_.reset();
  away_ = true;
}

// The joiner's line comes back at `from`, the step the member's own ranks are at and hold: they
// agreed on it at their next() of it, and go on only through the new member's first collective
// (the pipeline calls this before it), so its slot cannot have come free in between.
template <class B>
void adaptive<B>::hold(std::int64_t from) {
  if (by_turns_ || !away_) return;
  board_->hold(from);
}

template <class B>
void adaptive<B>::reshard(shard_range shards, std::int64_t from, int member, const std::vector<int>& ranks) {
  check(role_.kind == role::trainer, "adaptive", "reshard() is for trainer ranks; this rank is a producer");
  if (by_turns_) return by_turns_->reshard(shards, from, member, ranks);
  if (by_producers_) return by_producers_->reshard(shards, from, member);
  check(balancing_ && options_.hand_over && shards.count > 0 && shards.first >= 0 &&
            shards.first + shards.count <= layout_.shards_per_step() && from >= 0,
        "adaptive", cat("reshard() to ", shards.count, " shard(s) from step ", from,
                        ": needs a board under feed_options.hand_over, a shard of the step's and a step"));
  check(away_ || from == next_step_, "adaptive",
        cat("reshard() from step ", from, " on a trainer at step ", next_step_, " (the member's own ranks change at theirs)"));
  changed_split x;
  x.from = from;
  x.shards = shards;
  for (std::size_t c = 0; c < pieces_.size(); ++c) {
    const int lo = std::max(pieces_[c].first_shard, shards.first);
    const int hi = std::min(pieces_[c].first_shard + pieces_[c].shards, shards.first + shards.count);
    if (lo < hi) x.pieces.push_back(static_cast<int>(c));
  }
  x.bytes.assign(detail::piece_bytes(shards.count, options_.shard_capacity), std::byte{0});
  x.assembly = detail::batch_assembly({detail::piece{shards.first, shards.count, {}}}, {0}, shards, options_.shard_capacity);
  reading_ = x.pieces;
  split_ = std::move(x);
  next_step_ = from;
  away_ = false;
}

// A step of a changed split: its shards copied out of the board's pieces (which stay there for
// their other readers) into one piece of this trainer's own.
template <class B>
batch adaptive<B>::changed_step(std::int64_t k) {
  auto& x = *split_;
  for (int c : x.pieces) {
    const auto& h = *reinterpret_cast<const detail::piece_header*>(board_->piece(k, static_cast<std::size_t>(c)));
    check(h.step == k, "adaptive: hand-over",
          cat("piece ", c, " of step ", k, " holds step ", h.step, " (its slot was reused before this trainer read it)"));
  }
  detail::repack(
      pieces_,
      [&](int c) {
        return span<const std::byte>(board_->piece(k, static_cast<std::size_t>(c)),
                                     detail::piece_bytes(pieces_[static_cast<std::size_t>(c)].shards, options_.shard_capacity));
      },
      k, x.shards.first, x.shards.count, options_.shard_capacity, span<std::byte>(x.bytes));
  return x.assembly.assemble("adaptive", k, {span<const std::byte>(x.bytes.data(), x.bytes.size())});
}

// The step it holds goes back (its training ends), and nobody waits for its reading again.
template <class B>
void adaptive<B>::leave_board() {
  if (lent_ >= 0) {
    board_->training_ends();
    training_.back();
  }
  lent_ = -1;
  board_->leave();
}

template <class B>
void adaptive<B>::release() {
  if (role_.kind != role::trainer) return;
  if (by_turns_) return by_turns_->release();
  if (by_producers_ && !by_message_) return by_producers_->release();
  if (!board_) return;  // claims by message: the destructor closes the claims
  leave_board();
  next_step_ = options_.steps;
}

}  // namespace flexcomm
