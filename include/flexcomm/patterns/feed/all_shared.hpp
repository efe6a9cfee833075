// all_shared: no producers. The trainers that receive a piece (one per member) take turns
// preprocessing it, one step each per round of M steps, and allgather the results (All-Shared).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <exception>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "../../core/error.hpp"
#include "../../core/layout.hpp"
#include "../../core/stall.hpp"
#include "../../core/wait.hpp"
#include "../../backend/contract.hpp"
#include "vocabulary.hpp"
#include "agreement.hpp"
#include "../../backend/shm/feed/host_slots.hpp"
#include "split_change.hpp"
#include "step_source.hpp"
#include "wire.hpp"

namespace flexcomm {

// Round g covers steps [g*M, g*M + M) for M members; in it, member i's owner of piece c fills
// piece c of step g*M + i, and one allgather per piece gives every owner all M steps. Each
// step is thus preprocessed once, and work is spread evenly (a shard cannot be cut smaller,
// so the ensemble shares steps, not parts of a step). `depth` rounds are in flight.
// Where a piece's owners share one host (feed_options.shared_memory, backends with
// has_host_window), there is no allgather: each owner's loader writes its step into a slot of
// shared memory and the others read it in place (host_slots.hpp). A trainer takes its steps from
// a step_source (step_source.hpp) whose publishers are the members, one step each per round.
template <class B>
class all_shared : private detail::agreed_feed {
  static_assert(holds_host_memory<B>,
                "all_shared<B>: the loader writes each batch into host memory and trainers read it there, but B's "
                "buffers live in device memory; feed with a host backend (all_shared<mpi>) and copy the batch to the "
                "device in the trainer (presets with a device Sync backend do: their feed is on its host backend)");

 public:
  static constexpr bool needs_producers = false;
  // Producer ranks of the layout have nothing to do here.
  void produce() { check(!is_trainer(), "all_shared", "produce() is for producer ranks; this rank is a trainer"); }

  using communicator = typename B::communicator;

  // Collective over `world`; builds one communicator per piece in a fixed order.
  all_shared(const communicator& world, const ensemble_layout& layout, loader load, feed_options options);
  ~all_shared();
  all_shared(const all_shared&) = delete;
  all_shared& operator=(const all_shared&) = delete;

  // The next step of this trainer's shards, or nothing at the end of the stream.
  std::optional<batch> next();

  // The members preprocess for one another, so they advance together and none is ever
  // behind a shared stream: nothing is skipped under either flow-control policy.
  std::int64_t skipped() const noexcept { return 0; }
  bool is_trainer() const noexcept { return role_.kind == role::trainer; }
  // Whether some piece of this trainer's goes round in shared memory.
  bool shared_memory() const noexcept { return detail::any_shared(host_); }

  // A member that finishes early hands its ranks on (pipeline/handover.hpp; options.hand_over,
  // which on_handover() sets). The pieces and their owners never change: a rank whose member
  // ended keeps its turn in every round (step_aside()), and a member that grew gets its steps
  // from its own first ranks by message (reshard()). docs/heterogeneous.md says why.
  // `each(step)` runs at the top of each next(), before the step is taken; it may reshard().
  void between_steps(std::function<void(std::int64_t step)> each) { between_ = std::move(each); }
  // The next step next() delivers (of the member this trainer trains now).
  std::int64_t position() const noexcept { return next_step_; }
  // This trainer reads its own member's stream no more, but keeps its turn in every round left
  // (its member's steps loaded, its part in the allgathers and the shared slots), whenever the
  // feed is called: next() of the member it joins, serve() in the pipeline's waits, release().
  void step_aside();
  // Takes part in the rounds without waiting: posts those whose slots are free and, after
  // step_aside(), lets go of those that arrived.
  void serve();
  // From step `from` on, this trainer trains `member`, whose world ranks (member order: the
  // layout's first, then those that joined) are `ranks`, on `shards` ([r*L/n, (r+1)*L/n) for
  // its index r): each step's shards come from the member's layout ranks, which hold them in
  // their pieces, as one message per holder (none from itself). Every rank in `ranks` calls it
  // with the same `from`.
  void reshard(shard_range shards, std::int64_t from, int member = -1, const std::vector<int>& ranks = {});
  // A trainer done for good takes its part in every round left, so that the others can finish
  // (a member that ended with nowhere to go); after it, next() is not called again.
  void release();

 private:
  using source = detail::step_source<B>;

  void setup_host_slots();
  void setup_source();
  void post_free_rounds(bool wait = true);
  void drain() noexcept;
  void finish_stream();
  batch changed_step(std::int64_t step);
  std::size_t rounds_in_flight() const {
    return static_cast<std::size_t>(std::max<std::int64_t>(1, std::min<std::int64_t>(options_.depth, rounds_)));
  }

  std::vector<communicator> comms_;  // per piece; empty where this rank takes no part
  int members_ = 1;
  std::int64_t rounds_ = 0;

  std::vector<detail::host_slots<B>> host_;  // per piece of this trainer: where its owners share a host
  detail::batch_assembly assembly_;          // this trainer's pieces, and its batches made of them
  source source_;
  std::int64_t next_round_ = 0, next_step_ = 0, lent_ = -1;

  // The hand-over. A changed split: which member, from which step, its ranks, this rank's
  // index, and this rank's shards as parts, one per holder (parts[i] from world rank from[i]).
  struct changed_split {
    int member = -1;
    std::int64_t from = 0;
    std::vector<int> ranks;
    int me = -1;
    std::vector<detail::piece> parts;
    std::vector<int> holders;
    std::vector<std::vector<std::byte>> in;  // per part
    detail::batch_assembly assembly;
  };
  std::function<void(std::int64_t)> between_;
  communicator joins_;                        // a duplicate of the world, under options.hand_over
  std::optional<changed_split> split_;
  bool away_ = false;                         // step_aside(): the own stream's rounds are not read
  std::int64_t away_round_ = 0;               // the oldest round of it still held
  std::vector<detail::piece> own_pieces_;     // this trainer's pieces, for repacking them
  struct part_sent {
    std::vector<std::byte> bytes;
    typename B::request request;
    int to = -1;  // world rank
  };
  std::deque<part_sent> sends_;  // parts on their way
};

template <class B>
all_shared<B>::all_shared(const communicator& world, const ensemble_layout& layout, loader load,
                          feed_options options)
    // per-host producers idle here, as any producers
    : detail::agreed_feed(world, layout, std::move(load), options, false, "all_shared") {
  for (std::size_t c = 0; c < pieces_.size(); ++c) {
    const bool mine = role_.kind == role::trainer &&
                      pieces_[c].owner[static_cast<std::size_t>(role_.member)] == role_.rank_in_member;
    comms_.push_back(world.split(mine ? 0 : communicator::undefined, role_.member, cat("all_shared piece ", c)));
  }
  if (options_.hand_over) joins_ = world.dup("all_shared hand-over");
  if (role_.kind != role::trainer) return;

  members_ = layout_.members();
  rounds_ = (options_.steps + members_ - 1) / members_;
  assembly_ = detail::batch_assembly(pieces_, layout_, role_, options_.shard_capacity);
  for (int c : assembly_.pieces()) own_pieces_.push_back(pieces_[static_cast<std::size_t>(c)]);
  setup_host_slots();
  setup_source();
}

// Step s of round g = s / M is member s % M's, its piece i in that member's slot of the piece's
// shared memory, or in the round's allgather at member s % M's place.
template <class B>
void all_shared<B>::setup_source() {
  const std::size_t mine = assembly_.pieces().size();
  std::vector<std::vector<typename source::shared_piece>> shared(static_cast<std::size_t>(members_));
  std::vector<std::size_t> bytes;
  for (std::size_t i = 0; i < mine; ++i) bytes.push_back(assembly_.bytes(i));
  for (int m = 0; m < members_; ++m)
    for (std::size_t i = 0; i < mine; ++i)  // the owners' group has the members in order
      shared[static_cast<std::size_t>(m)].push_back({host_[i] ? &host_[i] : nullptr, m, 0});
  source_.setup(members_, std::move(shared), bytes, members_, rounds_in_flight(), [&](typename source::received& r) {
    for (std::size_t i = 0; i < mine; ++i) {
      const bool shared_memory = static_cast<bool>(host_[i]);  // then its slots are in shared memory
      r.outgoing.emplace_back(shared_memory ? 0 : bytes[i] + detail::guard_bytes);
      r.buffers.emplace_back(shared_memory ? 0 : bytes[i] * static_cast<std::size_t>(members_));
    }
  }, "all_shared: allgather of round ");
}

// Collective over each of this trainer's piece communicators, in piece order (as every owner
// takes them): shared slots for the pieces whose owners share one host.
template <class B>
void all_shared<B>::setup_host_slots() {
  const std::vector<int>& mine = assembly_.pieces();
  host_.resize(mine.size());
  if constexpr (has_host_window<B>) {
    if (options_.shared_memory == shared_memory_use::off || members_ < 2) return;
    for (std::size_t i = 0; i < mine.size(); ++i) {
      const communicator& owners = comms_[static_cast<std::size_t>(mine[i])];
      // The host map may pretend several hosts (FLEXCOMM_HOSTS); MPI has the last word.
      if (B::hosts(owners).hosts() != 1 || !B::host_window::on_one_host(owners)) continue;
      std::vector<int> ranks(static_cast<std::size_t>(owners.size()));
      for (int r = 0; r < owners.size(); ++r) ranks[static_cast<std::size_t>(r)] = owners.world_rank_of(r);
      host_[i] = detail::host_slots<B>(owners, true, rounds_in_flight(), assembly_.bytes(i) + detail::guard_bytes,
                                       std::move(ranks), cat("all_shared piece ", mine[i]));
    }
  } else {
    check(options_.shared_memory != shared_memory_use::on, "all_shared",
          "feed_options.shared_memory (FLEXCOMM_SHM) is on, but this backend has no shared memory");
  }
}

// Under hand-overs a rank that leaves by an exception does not wait in the rounds a second time
// (each wait is a FLEXCOMM_TIMEOUT): it only stops holding the shared slots, and the job ends
// with the error it carries.
template <class B>
all_shared<B>::~all_shared() {
  if (role_.kind != role::trainer) return;
  if (options_.hand_over && std::uncaught_exceptions() > 0) {
    source_.leave();
    return;
  }
  drain();
}

// Preprocesses this trainer's step of every round whose slot is free, and starts its allgathers.
// Without `wait`, only rounds whose shared slots are free already (serve()).
template <class B>
void all_shared<B>::post_free_rounds(bool wait) {
  const std::vector<int>& mine = assembly_.pieces();
  for (; next_round_ < rounds_; ++next_round_) {
    const std::int64_t g = next_round_;
    if (!wait)
      for (const auto& shared : host_)
        if (shared && !shared.is_free(g)) return;
    auto* claimed = source_.claim(g);
    if (!claimed) return;  // still holds an earlier round
    auto& r = *claimed;
    const std::int64_t step = g * members_ + role_.member;
    for (std::size_t i = 0; i < mine.size(); ++i) {
      const auto& piece = pieces_[static_cast<std::size_t>(mine[i])];
      const auto& shared = host_[i];
      // The piece communicator's ranks are the members in order: this trainer is rank member.
      if (shared) shared.wait_free(g, cat("all_shared: allgather of round ", g));
      const span<std::byte> send =
          shared ? span<std::byte>(shared.slot(role_.member, g), assembly_.bytes(i) + detail::guard_bytes)
                 : span<std::byte>(r.outgoing[i]);
      if (step < options_.steps)
        detail::fill_piece(load_, step, piece.first_shard, piece.shards, options_.shard_capacity, send);
      else
        detail::empty_piece(step, piece.shards, send);  // past the end: nobody reads it
      if (shared) {
        shared.publish(g);
        continue;
      }
      const std::size_t bytes = send.size() - detail::guard_bytes;
      r.requests.push_back(B::template iallgather<std::uint8_t>(
          comms_[static_cast<std::size_t>(mine[i])],
          span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(send.data()), bytes),
          span<std::uint8_t>(reinterpret_cast<std::uint8_t*>(r.buffers[i].data()), r.buffers[i].size())));
    }
    source_.start(g, r);
  }
}

template <class B>
std::optional<batch> all_shared<B>::next() {
  check(role_.kind == role::trainer, "all_shared", "next() is for trainer ranks; this rank is a producer");
  if (lent_ >= 0) source_.release(lent_);  // a round is let go of with its last step
  lent_ = -1;
  if (between_) between_(std::min(next_step_, options_.steps));
  if (next_step_ >= options_.steps) return std::nullopt;
  if (split_ && next_step_ >= split_->from) return changed_step(next_step_++);
  check(!away_, "all_shared", cat("next() after step_aside(), before reshard() (step ", next_step_, ")"));
  post_free_rounds();
  const batch out = source_.take(next_step_, assembly_, "all_shared");
  lent_ = next_step_++;
  return out;
}

template <class B>
void all_shared<B>::step_aside() {
  check(role_.kind == role::trainer, "all_shared", "step_aside() is for trainer ranks; this rank is a producer");
  if (lent_ >= 0) source_.release(lent_);
  lent_ = -1;
  if (!away_) away_round_ = next_step_ / members_;  // the earlier rounds are let go of already
  away_ = true;
  split_.reset();
  serve();
}

template <class B>
void all_shared<B>::serve() {
  if (role_.kind != role::trainer) return;
  while (!sends_.empty() && sends_.front().request.test()) sends_.pop_front();
  for (; away_ && away_round_ < next_round_; ++away_round_) {
    const std::int64_t first = away_round_ * members_;
    for (std::int64_t s = first; s < first + members_; ++s)
      if (!source_.here(s)) return post_free_rounds(false);
    source_.release(first + members_ - 1);
  }
  post_free_rounds(false);
}

template <class B>
void all_shared<B>::reshard(shard_range shards, std::int64_t from, int member, const std::vector<int>& ranks) {
  check(role_.kind == role::trainer, "all_shared", "reshard() is for trainer ranks; this rank is a producer");
  const int me = joins_ ? joins_.rank() : -1;
  const auto at = std::find(ranks.begin(), ranks.end(), me);
  check(static_cast<bool>(joins_) && member >= 0 && member < members_ && at != ranks.end() && shards.count > 0 &&
            from >= 0,
        "all_shared",
        cat("reshard() to member ", member, " from step ", from, " over ", ranks.size(),
            " rank(s): needs feed_options.hand_over, a member, this rank among its ranks and a shard"));
  check(away_ || member == role_.member, "all_shared",
        cat("reshard() to member ", member, ": this rank reads member ", role_.member, "'s stream (step_aside() first)"));
  changed_split x;
  x.member = member;
  x.from = from;
  x.ranks = ranks;
  x.me = static_cast<int>(at - ranks.begin());
  // Every shard of a step lies in the pieces of each of the member's layout ranks: take each
  // of this rank's shards from the one whose layout split holds it.
  std::vector<int> all;
  for (int t = 0; t < layout_.member_size(member); ++t) {
    const shard_range held = layout_.shards_of(member, t);
    const int lo = std::max(held.first, shards.first), hi = std::min(held.first + held.count, shards.first + shards.count);
    if (lo >= hi) continue;
    all.push_back(static_cast<int>(x.parts.size()));
    x.parts.push_back({lo, hi - lo, {}});
    x.holders.push_back(layout_.trainer_rank(member, t));
    x.in.emplace_back(detail::piece_bytes(hi - lo, options_.shard_capacity));
  }
  x.assembly = detail::batch_assembly(x.parts, std::move(all), shards, options_.shard_capacity);
  split_ = std::move(x);
  next_step_ = from;
}

// A step of a changed split: a layout rank of the member sends each other rank its shards
// of the step out of its own pieces, then every rank takes its parts (pumping the rounds while
// it waits: a rank that stepped aside is needed in them).
template <class B>
batch all_shared<B>::changed_step(std::int64_t step) {
  auto& x = *split_;
  const int me = joins_.rank(), shards = layout_.shards_per_step(), n = static_cast<int>(x.ranks.size());
  const char* what = "all_shared: hand-over";
  std::vector<span<const std::byte>> mine;  // this rank's pieces of the step, if it holds the member's
  if (!away_) {
    post_free_rounds();
    mine = source_.pieces(step);
    lent_ = step;
    const shard_range held = layout_.shards_of(role_.member, role_.rank_in_member);
    const auto piece = [&](int i) { return mine[static_cast<std::size_t>(i)]; };
    for (int r = 0; r < n; ++r) {
      const int lo = std::max(held.first, r * shards / n), hi = std::min(held.first + held.count, (r + 1) * shards / n);
      if (lo >= hi || r == x.me) continue;
      const int to = x.ranks[static_cast<std::size_t>(r)];
      sends_.push_back({std::vector<std::byte>(detail::piece_bytes(hi - lo, options_.shard_capacity)), {}, to});
      auto& out = sends_.back();
      detail::repack(own_pieces_, piece, step, lo, hi - lo, options_.shard_capacity, span<std::byte>(out.bytes));
      out.request = B::isend(joins_, span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(out.bytes.data()),
                                                             out.bytes.size()),
                             to, detail::split_piece_tag(x.member));
    }
  }
  std::vector<typename B::request> receives;
  std::vector<int> peers;
  std::vector<span<const std::byte>> parts;
  for (std::size_t i = 0; i < x.parts.size(); ++i) {
    auto& buffer = x.in[i];
    parts.emplace_back(buffer.data(), buffer.size());
    if (x.holders[i] == me) {
      const auto piece = [&](int c) { return mine[static_cast<std::size_t>(c)]; };
      detail::repack(own_pieces_, piece, step, x.parts[i].first_shard, x.parts[i].shards, options_.shard_capacity,
                     span<std::byte>(buffer));
      continue;
    }
    receives.push_back(B::irecv(joins_, span<std::uint8_t>(reinterpret_cast<std::uint8_t*>(buffer.data()), buffer.size()),
                                x.holders[i], detail::split_piece_tag(x.member)));
    peers.push_back(x.holders[i]);
  }
  std::vector<char> done(receives.size(), 0);
  const auto limit = default_timeout();
  waiting_note note;  // peers following a stall through this rank learn whom it waits on
  const auto owed = [&] {
    std::vector<int> out;
    for (std::size_t i = 0; i < receives.size(); ++i)
      if (!done[i]) out.push_back(joins_.world_rank_of(peers[i]));
    return out;
  };
  const bool all = wait_answering(
      default_wait(), limit,
      [&] {
        serve();
        bool out = true;
        for (std::size_t i = 0; i < receives.size(); ++i) out = (done[i] = done[i] || receives[i].test()) && out;
        return out;
      },
      [&] {
        note.set(cat(what, ": step ", step, " of member ", x.member, "'s changed split"), owed());
        detail::answer_watchdog();
      });
  if (!all)
    fail(what, cat("timed out after ", limit.count(), " ms (FLEXCOMM_TIMEOUT) waiting for step ", step, " of member ",
                   x.member, "'s changed split from ", world_ranks_named(owed())));
  return x.assembly.assemble("all_shared", step, parts);
}

template <class B>
void all_shared<B>::release() {
  check(role_.kind == role::trainer, "all_shared", "release() is for trainer ranks; this rank is a producer");
  finish_stream();
}

// Every round left, its part taken, and every part sent on its way.
template <class B>
void all_shared<B>::finish_stream() {
  lent_ = -1;
  split_.reset();
  source_.drain([&] { post_free_rounds(); });
  away_round_ = next_round_;  // nothing held: serve() has nothing left to let go of
  std::vector<typename B::request> rs;
  std::vector<int> peers;
  for (auto& s : sends_) rs.push_back(std::move(s.request)), peers.push_back(joins_.world_rank_of(s.to));
  detail::await_named(rs, peers, "all_shared: hand-over (the last changed split's steps sent)");
  sends_.clear();
}

// Takes part in every round left (preprocessing its share), so the other members can finish.
template <class B>
void all_shared<B>::drain() noexcept {
  try {
    finish_stream();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n(all_shared: while draining the stream in the destructor)\n", e.what());
  }
}

}  // namespace flexcomm
