// Members that finish early hand their ranks on: the messages between members' roots that agree
// which member takes a finished member's ranks, and at which step, and the re-forming of the
// joined member (docs/heterogeneous.md says why it works this way; ensemble_pipeline uses it).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "../backend/contract.hpp"
#include "../core/error.hpp"
#include "../core/layout.hpp"
#include "../core/member_plan.hpp"
#include "../core/span.hpp"
#include "../core/stall.hpp"
#include "../core/wait.hpp"

namespace flexcomm {

// What the user tells the pipeline before run() to let members hand their ranks on
// (ensemble_pipeline::on_handover; every rank passes the same costs).
struct handover_options {
  // Where member `m`'s parameters and optimizer state lie on this rank: the same parts, sizes
  // and order on every rank that trains m. At a hand-over the member's rank 0 sends from them
  // and the joining ranks receive into them, so every rank of m holds the same state.
  std::function<std::vector<span<std::byte>>(int member)> state;
  // Each member's cost (one step on one rank, e.g. member_plan's costs). The default target is
  // the running member with the longest expected step, cost / ranks. Empty: all equal.
  std::vector<double> costs;
};

// One hand-over as this rank saw it: `member` ended at step `ended_at` and its ranks joined
// `joined` at that member's step `joined_at` (-1, -1 when no member took them).
struct handover_record {
  int member = -1;
  std::int64_t ended_at = -1;
  int joined = -1;
  std::int64_t joined_at = -1;
};

namespace detail {

// A target's answer to a finished member: take its ranks at `step` into `ranks` (world ranks
// in member order, the target's first), or none (`member` -1).
struct handover_accept {
  int member = -1;
  std::int64_t step = -1;
  std::vector<int> ranks;
};

// The protocol, one per rank. Only each member's first rank (its root, which never changes:
// joiners come after) talks to other members: a root probes for their messages once per step
// (B::probe, MPI_Iprobe), so no step pays a collective; the member's other ranks learn what
// their root decided in the sync's per-step check (sync_core::carry) and from its messages.
template <class B>
class member_handover {
 public:
  using communicator = typename B::communicator;
  enum kind : std::int64_t { request = 1, bye, accept, refuse, none, grown };
  static constexpr int inbox_tag = 7101, outcome_tag = 7102, here_tag = 7103, go_tag = 7104;
  static constexpr std::int64_t ended_token = -1;  // the handshake's answer from a target that ended

  // Collective over `world` (a duplicate for the protocol's messages).
  member_handover(const communicator& world, const ensemble_layout& layout, std::int64_t steps, handover_options o);

  bool is_root() const noexcept { return own_ >= 0; }
  int root_of(int member) const { return roots_[static_cast<std::size_t>(member)]; }
  int shards_per_step() const noexcept { return shards_; }
  std::int64_t steps() const noexcept { return steps_; }
  const handover_options& options() const noexcept { return options_; }
  std::vector<handover_record>& records() noexcept { return records_; }
  const std::vector<handover_record>& records() const noexcept { return records_; }
  // On the aggregator, after leave(): how each member ended, member by member, from the roots'
  // byes (ended_at -1: it ran to the end of the stream).
  const std::vector<handover_record>& member_ends() const noexcept { return ends_; }
  int known_size(int member) const { return sizes_[static_cast<std::size_t>(member)]; }
  void set_size(int member, int n) { sizes_[static_cast<std::size_t>(member)] = n; }

  // On a root, once per step (and inside every wait here): answers what arrived; a finished
  // member asking to join this running member becomes pending(). On every rank first: `each()`
  // of while_waiting (all_shared: the rank's turn in the rounds, which the others need).
  void poll();
  void while_waiting(std::function<void()> each) { waiting_ = std::move(each); }
  const std::optional<std::vector<std::int64_t>>& pending() const noexcept { return pending_; }
  // The running member's root takes the pending joiners at `step`: tells its member's other
  // ranks and the finished member's root, and returns the new member.
  handover_accept take(std::int64_t step, const std::vector<int>& ranks);
  // A running member's other ranks, told by the sync's check: their root's accept (or none).
  handover_accept told(int root) { return read_accept(wait_message(root, outcome_tag, "the member's root")); }
  // The target a finished member asks (explicit: `target` >= 0), or -1 when none can take `count`.
  int choose(int finished, int count, int target, const std::vector<char>& skip = {}) const;
  // The finished member's root: this member no longer takes joiners (its pending asker is refused).
  void stop_taking();
  // The finished member's root asks targets in turn and tells its member's other ranks the
  // outcome; they wait for it (a none outcome: member -1).
  handover_accept negotiate(int finished, const std::vector<int>& ranks, int target);
  handover_accept outcome(int root) {
    return read_accept(wait_message(root, outcome_tag, "the finished member's root"));
  }
  // Every rank of the new member: all alive (a handshake under FLEXCOMM_TIMEOUT), then its
  // communicator, made by its ranks alone; none on a joiner whose target's root turned it away
  // (turn_away(): the target ended first), which then asks again.
  std::optional<communicator> form(const handover_accept& a, int world_rank);
  // The running member's root, whose trainer function returned before the step it took `a`'s
  // joiners at (its first `kept` ranks are the member's own, which returned too): it answers the
  // joiners' handshake with "ended" and takes no more.
  void turn_away(const handover_accept& a, std::size_t kept);
  // After the trainer function's last return: a root says it asks no more (no wait), refusing
  // what it holds; before the collect's flush, which may wait on a root still training.
  void done();
  // The end of run(): a root answers the others until they have all said so too.
  void leave();
  // A rank leaving run() by an exception: done(), never throwing.
  void quit() noexcept;

 private:
  std::size_t words() const noexcept { return 5 + static_cast<std::size_t>(control_.size()); }
  std::vector<std::int64_t> message(kind k, int member, std::int64_t a, const std::vector<int>& ranks) const;
  void send(std::vector<std::int64_t> m, int dest, int tag);
  void serve(int m);  // handles inbox m's message
  std::vector<std::int64_t> wait_message(int source, int tag, const std::string& who);
  std::optional<std::vector<std::int64_t>> answer_from(int target);
  void wait_until(const std::function<bool()>& done, const std::string& what, const std::string& cause);
  static handover_accept read_accept(const std::vector<std::int64_t>& m);

  communicator control_;
  std::vector<int> roots_;
  std::vector<int> sizes_;
  std::vector<char> ended_;
  int own_ = -1;          // the member this rank is the root of, or -1
  bool listens_ = false;  // the aggregator, not a root: it hears the roots' byes too
  bool taking_ = false;   // this root's member runs and takes joiners
  bool said_bye_ = false;
  int aggregator_ = -1;
  int shards_ = 1;
  std::int64_t steps_ = 0;
  handover_options options_;
  std::vector<std::int64_t> inbox_;  // the message being handled
  std::vector<char> bye_from_;
  std::vector<std::optional<std::vector<std::int64_t>>> answers_;  // per member: its root's answer
  std::optional<std::vector<std::int64_t>> pending_;  // a request this root takes
  std::deque<std::pair<std::vector<std::int64_t>, typename B::request>> sent_;
  std::vector<handover_record> records_;
  std::vector<handover_record> ends_;  // per member, as its root's bye said
  std::function<void()> waiting_;
};

// ---------------------------------------------------------------------------------------------

template <class B>
member_handover<B>::member_handover(const communicator& world, const ensemble_layout& layout, std::int64_t steps,
                                    handover_options o)
    : control_(world.dup("ensemble_pipeline hand-over")), steps_(steps), options_(std::move(o)) {
  const int members = layout.members();
  check(options_.costs.empty() || static_cast<int>(options_.costs.size()) == members, "ensemble_pipeline: on_handover",
        cat(options_.costs.size(), " costs for ", members, " members"));
  detail::check_member_costs(options_.costs, "ensemble_pipeline: on_handover");
  shards_ = layout.shards_per_step();
  ended_.assign(static_cast<std::size_t>(members), 0);
  bye_from_.assign(static_cast<std::size_t>(members), 0);
  answers_.resize(static_cast<std::size_t>(members));
  for (int m = 0; m < members; ++m) {
    roots_.push_back(layout.trainer_rank(m, 0));
    sizes_.push_back(layout.member_size(m));
    if (roots_.back() == control_.rank()) own_ = m;
  }
  taking_ = own_ >= 0;
  listens_ = own_ < 0 && layout.aggregator() == control_.rank();
  aggregator_ = layout.aggregator();
  for (int m = 0; m < members; ++m) ends_.push_back({m, -1, -1, -1});
}

template <class B>
std::vector<std::int64_t> member_handover<B>::message(kind k, int member, std::int64_t a,
                                                      const std::vector<int>& ranks) const {
  std::vector<std::int64_t> m(words(), 0);
  m[0] = k;
  m[1] = member;
  m[2] = a;
  m[3] = static_cast<std::int64_t>(ranks.size());
  for (std::size_t i = 0; i < ranks.size(); ++i) m[5 + i] = ranks[i];
  for (std::size_t i = 0; i < ended_.size() && i < 64; ++i)
    if (ended_[i]) m[4] |= std::int64_t{1} << i;  // what the sender knows has ended
  return m;
}

template <class B>
void member_handover<B>::send(std::vector<std::int64_t> m, int dest, int tag) {
  while (!sent_.empty() && sent_.front().second.test()) sent_.pop_front();
  sent_.emplace_back(std::move(m), typename B::request{});
  auto& s = sent_.back();
  s.second = B::isend(control_, span<const std::int64_t>(s.first.data(), s.first.size()), dest, tag);
}

template <class B>
void member_handover<B>::serve(int m) {
  const auto& box = inbox_;
  for (std::size_t i = 0; i < ended_.size() && i < 64; ++i)
    if (box[4] & (std::int64_t{1} << i)) ended_[i] = 1;
  if (box[0] == bye) {
    bye_from_[static_cast<std::size_t>(m)] = 1;
    ended_[static_cast<std::size_t>(m)] = 1;
    const bool joined = box[3] == 2;  // the member's ranks joined another: its index and step
    ends_[static_cast<std::size_t>(m)] = {m, box[2], joined ? static_cast<int>(box[5]) : -1, joined ? box[6] : -1};
    return;
  }
  if (box[0] == grown) {
    sizes_[static_cast<std::size_t>(m)] = static_cast<int>(box[2]);
    return;
  }
  if (box[0] == request && own_ < 0) return;  // the aggregator hears byes only
  if (box[0] == request) {
    const int n = known_size(own_) + static_cast<int>(box[3]);
    if (taking_ && !pending_ && n <= shards_) {
      pending_ = box;
    } else {
      // Ended, busy with another member's ranks, or too small a step to split further.
      send(message(refuse, own_, taking_ ? 0 : 1, {}), root_of(m), inbox_tag);
    }
  } else {
    answers_[static_cast<std::size_t>(m)] = box;  // accept or refuse, for negotiate()
  }
}

template <class B>
void member_handover<B>::poll() {
  if (waiting_) waiting_();
  if (own_ < 0 && !listens_) return;
  while (const auto source = B::probe(control_, inbox_tag)) {
    const auto root = std::find(roots_.begin(), roots_.end(), *source);
    check(root != roots_.end(), "ensemble_pipeline: hand-over",
          cat("world rank ", *source, ", no member's first rank, sent a hand-over message"));
    inbox_.assign(words(), 0);
    B::irecv(control_, span<std::int64_t>(inbox_.data(), inbox_.size()), *source, inbox_tag).wait();
    serve(static_cast<int>(root - roots_.begin()));
  }
}

template <class B>
handover_accept member_handover<B>::take(std::int64_t step, const std::vector<int>& ranks) {
  const auto asked = *std::exchange(pending_, std::nullopt);
  const int finished = static_cast<int>(asked[1]);
  if (step >= steps_) {  // the stream is over: nothing to join
    send(message(refuse, own_, 1, {}), root_of(finished), inbox_tag);
    return {};
  }
  handover_accept a{own_, step, ranks};
  for (std::int64_t i = 0; i < asked[3]; ++i)
    a.ranks.push_back(static_cast<int>(asked[5 + static_cast<std::size_t>(i)]));
  if (static_cast<int>(a.ranks.size()) > shards_) {  // asked while the member grew: no room now
    send(message(refuse, own_, 0, {}), root_of(finished), inbox_tag);
    for (std::size_t i = 1; i < ranks.size(); ++i) send(message(none, own_, step, {}), ranks[i], outcome_tag);
    return {};
  }
  set_size(own_, static_cast<int>(a.ranks.size()));  // a request arriving meanwhile sees the room left
  const auto m = message(accept, own_, step, a.ranks);
  send(m, root_of(finished), inbox_tag);
  for (std::size_t i = 1; i < ranks.size(); ++i) send(m, ranks[i], outcome_tag);
  // The other running roots learn the new size, so that the next member to finish does not pick
  // this one for a step it no longer has (the default target is the longest expected step).
  const auto size = message(grown, own_, static_cast<std::int64_t>(a.ranks.size()), {});
  for (std::size_t j = 0; j < roots_.size(); ++j)
    if (static_cast<int>(j) != own_ && static_cast<int>(j) != finished && !ended_[j]) send(size, roots_[j], inbox_tag);
  return a;
}

template <class B>
int member_handover<B>::choose(int finished, int count, int target, const std::vector<char>& skip) const {
  const auto open = [&](int m) {
    const auto i = static_cast<std::size_t>(m);
    return m != finished && !ended_[i] && (skip.empty() || !skip[i]) && known_size(m) + count <= shards_;
  };
  if (target >= 0) return open(target) ? target : -1;
  int best = -1;
  double longest = 0;
  for (int m = 0; m < static_cast<int>(sizes_.size()); ++m) {
    if (!open(m)) continue;
    const double cost = options_.costs.empty() ? 1.0 : options_.costs[static_cast<std::size_t>(m)];
    const double expected = cost / known_size(m);
    if (best < 0 || expected > longest) best = m, longest = expected;
  }
  return best;
}

template <class B>
void member_handover<B>::stop_taking() {
  taking_ = false;
  ended_[static_cast<std::size_t>(own_)] = 1;
  if (!pending_) return;
  const int asker = static_cast<int>((*pending_)[1]);
  pending_.reset();
  send(message(refuse, own_, 1, {}), root_of(asker), inbox_tag);
}

template <class B>
std::optional<std::vector<std::int64_t>> member_handover<B>::answer_from(int target) {
  auto& a = answers_[static_cast<std::size_t>(target)];
  wait_until(
      [&] {
        poll();
        return a.has_value() || bye_from_[static_cast<std::size_t>(target)] != 0;
      },
      "ensemble_pipeline: hand-over",
      cat("member ", target, "'s rank 0 (world rank ", root_of(target), ") did not answer member ", own_,
          "'s request to join it"));
  return std::exchange(a, std::nullopt);
}

template <class B>
handover_accept member_handover<B>::negotiate(int finished, const std::vector<int>& ranks, int target) {
  handover_accept got;
  std::vector<char> tried(sizes_.size(), 0);
  const int count = static_cast<int>(ranks.size());
  for (;;) {
    const int t = choose(finished, count, target, tried);
    if (t < 0) break;
    tried[static_cast<std::size_t>(t)] = 1;
    send(message(request, finished, 0, ranks), root_of(t), inbox_tag);
    const auto answer = answer_from(t);
    if (answer && (*answer)[0] == accept) {
      got = read_accept(*answer);
      break;
    }
    if (!answer || (*answer)[2] == 1) ended_[static_cast<std::size_t>(t)] = 1;
    if (target >= 0) break;
  }
  const auto m = got.member < 0 ? message(none, -1, 0, {}) : message(accept, got.member, got.step, got.ranks);
  for (std::size_t i = 1; i < ranks.size(); ++i) send(m, ranks[i], outcome_tag);
  return got;
}

template <class B>
std::vector<std::int64_t> member_handover<B>::wait_message(int source, int tag, const std::string& who) {
  std::vector<std::int64_t> m(words(), 0);
  auto r = B::irecv(control_, span<std::int64_t>(m.data(), m.size()), source, tag);
  wait_until([&] { return poll(), r.test(); }, "ensemble_pipeline: hand-over",
             cat(who, " (world rank ", source, ") did not say how the hand-over goes"));
  return m;
}

template <class B>
handover_accept member_handover<B>::read_accept(const std::vector<std::int64_t>& m) {
  if (m[0] != accept) return {};
  handover_accept a{static_cast<int>(m[1]), m[2], {}};
  for (std::int64_t i = 0; i < m[3]; ++i) a.ranks.push_back(static_cast<int>(m[5 + static_cast<std::size_t>(i)]));
  return a;
}

template <class B>
void member_handover<B>::wait_until(const std::function<bool()>& done, const std::string& what,
                                    const std::string& cause) {
  const auto limit = control_.timeout();
  const bool ok = default_wait().until(done, limit);
  check(ok, what, cat("timed out after ", limit.count(), " ms (FLEXCOMM_TIMEOUT): ", cause));
}

template <class B>
std::optional<typename B::communicator> member_handover<B>::form(const handover_accept& a, int world_rank) {
  const std::string what = cat("ensemble_pipeline: hand-over to member ", a.member, " at step ", a.step);
  std::int64_t token = a.step;
  if (a.ranks.front() == world_rank) {
    std::vector<std::int64_t> here(a.ranks.size(), -1);
    std::vector<typename B::request> r;
    for (std::size_t i = 1; i < a.ranks.size(); ++i)
      r.push_back(B::irecv(control_, span<std::int64_t>(&here[i], 1), a.ranks[i], here_tag));
    const bool all = default_wait().until(
        [&] {
          poll();
          bool done = true;
          for (auto& q : r) done = q.test() && done;
          return done;
        },
        control_.timeout());
    std::vector<int> missing;
    for (std::size_t i = 1; i < a.ranks.size(); ++i)
      if (here[i] != a.step) missing.push_back(a.ranks[i]);
    check(all, what,
          cat("timed out after ", control_.timeout().count(), " ms (FLEXCOMM_TIMEOUT): ", world_ranks_named(missing),
              " did not come to it"));
    check(missing.empty(), what, cat(world_ranks_named(missing), " came for another step"));
    for (std::size_t i = 1; i < a.ranks.size(); ++i)
      B::isend(control_, span<const std::int64_t>(&token, 1), a.ranks[i], go_tag).wait();
  } else {
    auto sent = B::isend(control_, span<const std::int64_t>(&token, 1), a.ranks.front(), here_tag);
    std::int64_t go = -1;
    auto r = B::irecv(control_, span<std::int64_t>(&go, 1), a.ranks.front(), go_tag);
    wait_until([&] { return poll(), r.test(); }, what,
               cat("member ", a.member, "'s rank 0 (world rank ", a.ranks.front(), ") did not confirm it"));
    sent.wait();
    check(go == a.step || go == ended_token, what,
          cat("member ", a.member, "'s rank 0 (world rank ", a.ranks.front(), ") confirmed step ", go));
    if (go == ended_token) {  // the target ended before the step: this rank is not taken
      ended_[static_cast<std::size_t>(a.member)] = 1;
      return std::nullopt;
    }
  }
  return control_.group(a.ranks, a.member, cat("member ", a.member, " from step ", a.step));
}

template <class B>
void member_handover<B>::turn_away(const handover_accept& a, std::size_t kept) {
  stop_taking();
  const std::string what = cat("ensemble_pipeline: hand-over to member ", a.member, " at step ", a.step);
  // The joiners' "here" is received, so that no message of theirs is left unmatched; they come
  // at once (they were told at the agreement), each wait under FLEXCOMM_TIMEOUT.
  std::vector<std::int64_t> here(a.ranks.size(), -1);
  const std::int64_t token = ended_token;
  for (std::size_t i = kept; i < a.ranks.size(); ++i) {
    auto r = B::irecv(control_, span<std::int64_t>(&here[i], 1), a.ranks[i], here_tag);
    wait_until([&] { return poll(), r.test(); }, what,
               cat("world rank ", a.ranks[i], " did not come to it (member ", a.member, " ended before it)"));
    B::isend(control_, span<const std::int64_t>(&token, 1), a.ranks[i], go_tag).wait();
  }
}

template <class B>
void member_handover<B>::done() {
  if (own_ < 0 || said_bye_) return;
  if (taking_) stop_taking();
  // The bye says how this root's member ended, for the aggregator's report.
  auto& end = ends_[static_cast<std::size_t>(own_)];
  for (const auto& r : records_)
    if (r.member == own_) end = r;
  const std::vector<int> joined{end.joined, static_cast<int>(end.joined_at)};
  const auto m = message(bye, own_, end.ended_at, end.joined >= 0 ? joined : std::vector<int>{});
  for (int other = 0; other < static_cast<int>(roots_.size()); ++other)
    if (other != own_) send(m, root_of(other), inbox_tag);
  if (std::find(roots_.begin(), roots_.end(), aggregator_) == roots_.end()) send(m, aggregator_, inbox_tag);
  said_bye_ = true;
}

template <class B>
void member_handover<B>::quit() noexcept {
  try {
    done();
  } catch (...) {  // the job is failing already; the first error is the one reported
  }
}

template <class B>
void member_handover<B>::leave() {
  done();
  if (own_ >= 0 || listens_) {
    const auto waits_for = [&](std::size_t m) { return static_cast<int>(m) != own_ && !bye_from_[m]; };
    const auto all_left = [&] {
      poll();
      for (std::size_t m = 0; m < bye_from_.size(); ++m)
        if (waits_for(m)) return false;
      return true;
    };
    // A member that trains on longer than the timeout is no stall: its root still answers, and
    // the wait goes on. Only roots that stopped answering end it.
    const auto limit = control_.timeout();
    while (!default_wait().until(all_left, limit)) {
      std::vector<int> waited;
      for (std::size_t m = 0; m < bye_from_.size(); ++m)
        if (waits_for(m)) waited.push_back(control_.world_rank_of(roots_[m]));
      if (stall_registry::instance().all_answer(waited, stall_grace(limit))) continue;
      const std::string what = "ensemble_pipeline: hand-over";
      fail(what, cat("timed out after ", limit.count(), " ms (FLEXCOMM_TIMEOUT) at the end: ",
                     stall_registry::instance().lead(what, waited, limit), "member roots (", world_ranks_named(waited),
                     ") did not say they were done"));
    }
  }
  for (auto& s : sent_) s.second.wait();
  sent_.clear();
}

}  // namespace detail
}  // namespace flexcomm
