// Claims by message: how the adaptive feed balances where a step's readers do not share a host
// (a member spread over hosts and fed by one producer) or shared memory is off. There is no
// board to compare-and-swap on, so the step's producer is the arbiter: a trainer whose next step
// has not come asks it for work, and it grants a piece nobody has started, answering between two
// pieces it makes and in its waits. The trainer makes the piece and sends it back, and the
// producer ships it with the rest of the step as if it had made it: the readers' side of
// one_to_many does not change (the claimer gets its copy back like every other reader).
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "../../core/error.hpp"
#include "../../core/hosts.hpp"
#include "../../core/watchdog.hpp"
#include "../../core/wait.hpp"
#include "steps_in_flight.hpp"

namespace flexcomm::detail {

// An average of recent samples, each weighing 1/8, from the first sample on (0: none yet).
inline void smooth(double& average, double sample) noexcept {
  average = average == 0 ? sample : 0.875 * average + 0.125 * sample;
}

// A trainer's training time per step, which decides how far ahead it claims: from handing a
// batch out to asking for the next, smoothed.
class training_clock {
 public:
  void handed_out() noexcept { at_ = std::chrono::steady_clock::now(); }
  void back() noexcept {
    smooth(ns_, static_cast<double>(
                    std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - at_).count()));
  }
  double ns() const noexcept { return ns_; }

 private:
  std::chrono::steady_clock::time_point at_;
  double ns_ = 0;
};

// Asked for by adaptive; one_to_many then runs with a claim desk on each producer.
struct claims_by_message {};

// A desk or claimant destroyed with its exchange still open is on an error path (its own waits
// close it otherwise), and the peers that wait on it are stuck with it: the job must end, and its
// pending requests are abandoned rather than each waited for up to the timeout.
inline void left_open(bool open) noexcept {
  if (open && std::uncaught_exceptions() > 0) watchdog::instance().must_end();
}

// On the producer's credit communicator (the producer is rank 0, its trainers the others).
constexpr int claim_tag = 19, answer_tag = 20, made_tag = 21;
// A trainer's claim: the step it waits for (negative: it will claim no more) and the first step
// it would not make for it.
using claim_message = std::array<std::int64_t, 2>;
// The answer: the step and piece granted (piece -1: none), and the producer's time to make one
// of its steps, which tells the trainer how far ahead a claim is worth it.
using answer_message = std::array<std::int64_t, 3>;

// The producer's side: which of its next steps' pieces are granted to whom, and the grants' pieces.
template <class B>
class claim_desk {
 public:
  using communicator = typename B::communicator;
  using request = typename B::request;

  // Makes piece i of mine for a step into a span of its bytes and the guard's.
  using maker = std::function<void(std::int64_t step, std::size_t i, span<std::byte> into)>;

  claim_desk() = default;
  // `mine`: the feed's pieces this producer makes, `bytes` their sizes; its steps are first,
  // first + every, ... below `steps`, and it grants pieces of the next `window` of them. `make`
  // makes a piece ahead while the producer waits. `who` names the feed in errors. Posts a claim
  // receive from every trainer of `comm`.
  claim_desk(const communicator& comm, std::vector<int> mine, std::vector<std::size_t> bytes, std::int64_t first,
             std::int64_t every, std::int64_t steps, std::int64_t window, maker make, std::string who)
      : comm_(&comm), mine_(std::move(mine)), bytes_(std::move(bytes)), first_(first), every_(every), steps_(steps),
        window_(window), step_(first), make_(std::move(make)), who_(std::move(who)),
        trainers_(static_cast<std::size_t>(comm.size())),
        store_(static_cast<std::size_t>(window_) * mine_.size()) {
    for (int t = 1; t < comm.size(); ++t) {
      trainers_[static_cast<std::size_t>(t)].world_rank = comm.world_rank_of(t);
      listen(t);
    }
  }
  claim_desk(claim_desk&&) noexcept = default;
  claim_desk& operator=(claim_desk&&) noexcept = default;
  ~claim_desk() { left_open(comm_ && !closed_); }
  explicit operator bool() const noexcept { return comm_ != nullptr; }

  // The producer moves to step s (every piece of earlier steps is made or collected).
  void begin(std::int64_t s) {
    step_ = s;
    next_ = 0;
  }
  // Whether the producer makes piece i (of mine) of its current step: false where a trainer was
  // granted it. Claims that came are answered first.
  bool take(std::size_t i) {
    serve();
    if (holder(step_, i) >= 0) return false;
    next_ = i + 1;
    return true;
  }
  // Every piece of the current step is made or granted: grants go to the steps after it.
  void all_taken() { next_ = mine_.size(); }
  // Step s is on its way to every trainer.
  void shipped(std::int64_t s) { shipped_ = s; }
  void note_make_time(std::chrono::nanoseconds piece) {
    smooth(piece_ns_, static_cast<double>(piece.count()));
  }
  std::int64_t granted() const noexcept { return granted_; }

  // Answers every claim that came: grants the first piece nobody started, of the current step or
  // one of the `window` after it (before the claimer's limit), to a trainer that holds no grant.
  void serve() {
    for (int t = 1; t < static_cast<int>(trainers_.size()); ++t) {
      trainer& d = trainers_[static_cast<std::size_t>(t)];
      if (d.finished || !d.claim.test()) continue;
      if (d.in[0] < 0) {  // it will claim no more
        d.finished = true;
        continue;
      }
      d.answer.wait();  // the trainer received the last answer before it asked again
      d.out = {-1, -1, static_cast<std::int64_t>(piece_ns_ * static_cast<double>(mine_.size()))};
      grant(t, d);
      d.answer = B::isend(*comm_, span<const std::int64_t>(d.out.data(), d.out.size()), t, answer_tag);
      listen(t);
    }
  }

  // Waits, answering claims, until every piece granted of step s has come, and copies each to
  // memory(i) for its index i in mine. Past FLEXCOMM_TIMEOUT it names the claimer.
  template <class Memory>
  void collect(std::int64_t s, Memory&& memory) {
    for (std::size_t g = 0; g < grants_.size();) {
      if (grants_[g].step != s) {
        ++g;
        continue;
      }
      const std::size_t i = grants_[g].index;
      const int claimer = trainers_[static_cast<std::size_t>(grants_[g].trainer)].world_rank;
      const std::string what = cat(who_, ": piece ", mine_[i], " of step ", s, ", claimed by world rank ", claimer);
      serve_until([&] { return grants_[g].made.test(); },
                  [&] {
                    timed_out_waiting(what, default_timeout(), cat("world rank ", claimer, on_host(claimer)));
                  });
      std::memcpy(memory(i).data(), stored(s, i).data(), bytes_[i]);
      grants_.erase(grants_.begin() + static_cast<std::ptrdiff_t>(g));
    }
  }

  // Waits until ready(), answering claims and making pieces ahead (the producer is the one rank
  // with nothing else to do: a trainer's piece far ahead, or slow trainers, need not leave it
  // idle); past FLEXCOMM_TIMEOUT calls timed_out(), which throws the wait's error; the grants
  // still out are added to it, since a trainer that holds one (stalled or gone while making it)
  // is as likely the cause as the one the wait names.
  template <class Ready, class TimedOut>
  void serve_until(Ready&& ready, TimedOut&& timed_out) {
    if (wait_answering(patient(), default_timeout(), [&] {
          serve();
          if (ready()) return true;
          make_ahead();
          return ready();
        },
                       [] { watchdog::instance().answer_queries(); }))
      return;
    watchdog::instance().must_end();
    try {
      timed_out();
    } catch (const error& e) {
      std::string held;
      for (grant_record& g : grants_) {
        const int claimer = trainers_[static_cast<std::size_t>(g.trainer)].world_rank;
        if (!g.made.test() && e.operation().find(cat("piece ", mine_[g.index], " of step ", g.step)) == std::string::npos)
          held += cat("\n  (world rank ", claimer, on_host(claimer), " was granted piece ", mine_[g.index], " of step ",
                      g.step, " and has not sent it)");
      }
      if (held.empty()) throw;
      fail(e.operation(), e.cause() + held);
    }
  }

  // The end of this producer's stream: answers claims (with nothing left to grant) until every
  // trainer said it will claim no more.
  void close() {
    begin(steps_);
    serve_until(
        [&] {
          for (std::size_t t = 1; t < trainers_.size(); ++t)
            if (!trainers_[t].finished) return false;
          return true;
        },
        [&] {
          std::vector<int> late;
          for (std::size_t t = 1; t < trainers_.size(); ++t)
            if (!trainers_[t].finished) late.push_back(trainers_[t].world_rank);
          timed_out_waiting(cat(who_, ": end of the stream (claims)"), default_timeout(),
                            world_ranks_named(late, on_host));
        });
    for (std::size_t t = 1; t < trainers_.size(); ++t) trainers_[t].answer.wait();
    closed_ = true;
  }

 private:
  struct trainer {
    int world_rank = -1;
    claim_message in{};
    answer_message out{};
    request claim, answer, made;
    bool finished = false;
  };
  // A piece granted and not yet shipped: its step, its index in mine, the trainer (its rank in
  // comm_) and the receive of what it makes, into stored(step, index).
  struct grant_record {
    std::int64_t step;
    std::size_t index;
    int trainer;
    request made;
  };

  void listen(int t) {
    trainer& d = trainers_[static_cast<std::size_t>(t)];
    d.claim = B::irecv(*comm_, span<std::int64_t>(d.in.data(), d.in.size()), t, claim_tag);
  }
  // The trainer granted piece i of step s, or -1.
  int holder(std::int64_t s, std::size_t i) const {
    for (const grant_record& g : grants_)
      if (g.step == s && g.index == i) return g.trainer;
    return -1;
  }
  // Where piece i of step s arrives: grants lie within the window, so no two share a place.
  std::vector<std::byte>& stored(std::int64_t s, std::size_t i) {
    auto& place = store_[static_cast<std::size_t>((s - first_) / every_ % window_) * mine_.size() + i];
    if (place.size() < bytes_[i] + guard_bytes) place.resize(bytes_[i] + guard_bytes);
    return place;
  }
  // How the producer waits while it serves: it cannot sleep until the engine fires, since claims
  // come as messages it must test, so it polls, backing off to 1 ms where the policy backs off.
  // At 100 us, a producer waiting on credits where training dominates (10 ms against 1 ms of
  // preprocessing, 4 members) cost 1.28x one_to_many's CPU; a claim or a credit seen up to 1 ms
  // late costs no step, the producer being ahead by the feed's depth when it waits.
  static wait_policy patient() {
    wait_policy p = engine_wait();
    if (p.kind == wait_kind::backoff) p.max_sleep = std::max(p.max_sleep, std::chrono::microseconds(1000));
    return p;
  }
  // Makes the nearest piece nobody started, of the window's steps, into its place (granted to the
  // producer itself, rank 0, and so collected like a trainer's); false if there is none.
  bool make_ahead() {
    const std::int64_t end = std::min(steps_, step_ + window_ * every_);
    for (std::int64_t s = step_; s < end; s += every_)
      for (std::size_t i = s == step_ ? next_ : 0; i < mine_.size(); ++i)
        if (holder(s, i) < 0) {
          std::vector<std::byte>& place = stored(s, i);
          grants_.push_back({s, i, 0, request{}});
          make_(s, i, span<std::byte>(place.data(), bytes_[i] + guard_bytes));
          return true;
        }
    return false;
  }
  // The last piece nobody started in the claimer's reach: the producer makes its steps in order,
  // so a piece far ahead is one it will not wait for when it gets there (granting the nearest,
  // with preprocessing ten times training at 2 ranks: the producer waited on every other step,
  // 1.4x one_to_many with two producers).
  // A trainer that waits for a step already shipped is the one behind (the others wait on its
  // credits, not on the producer): it gets nothing, so that it goes back to training. Without
  // this, at 2 members, one trainer made five times the other's pieces and held both back.
  void grant(int t, trainer& d) {
    if (d.in[0] <= shipped_) return;
    const std::int64_t end = std::min({steps_, d.in[1], step_ + window_ * every_});
    if (end <= step_) return;
    const std::int64_t last = step_ + (end - 1 - step_) / every_ * every_;
    for (std::int64_t s = last; s >= step_; s -= every_)
      for (std::size_t i = mine_.size(); i-- > (s == step_ ? next_ : 0);)
        if (holder(s, i) < 0) {
          d.out[0] = s;
          d.out[1] = mine_[i];
          // Posted before the answer goes, so that the piece is matched as soon as it is sent.
          std::vector<std::byte>& place = stored(s, i);
          grants_.push_back({s, i, t,
                             B::irecv(*comm_, span<std::uint8_t>(reinterpret_cast<std::uint8_t*>(place.data()), bytes_[i]),
                                      t, made_tag)});
          ++granted_;
          return;
        }
  }

  const communicator* comm_ = nullptr;
  std::vector<int> mine_;
  std::vector<std::size_t> bytes_;
  std::int64_t first_ = 0, every_ = 1, steps_ = 0, window_ = 1;
  std::int64_t step_ = 0;  // the step the producer is making
  std::size_t next_ = 0;   // its first piece the producer has not started
  std::int64_t shipped_ = -1;  // the last step shipped
  maker make_;
  std::string who_;
  std::vector<trainer> trainers_;  // by rank in comm_; 0, the producer, unused
  std::vector<grant_record> grants_;
  std::vector<std::vector<std::byte>> store_;  // [window position][piece]: pieces granted, as they arrive
  double piece_ns_ = 0;            // the producer's time to make one piece, smoothed
  std::int64_t granted_ = 0;
  bool closed_ = false;
};

// A trainer's side, towards one producer: at most one claim out, and the piece it made for the
// last grant on its way back.
template <class B>
class claimant {
 public:
  using communicator = typename B::communicator;
  using request = typename B::request;

  claimant() = default;
  claimant(const communicator& comm, std::size_t largest_piece, std::string who)
      : comm_(&comm), producer_(comm.world_rank_of(0)), who_(std::move(who)),
        pieces_{std::vector<std::byte>(largest_piece), std::vector<std::byte>(largest_piece)} {}
  claimant(claimant&&) noexcept = default;
  claimant& operator=(claimant&&) noexcept = default;
  ~claimant() { left_open(comm_ && !finished_); }
  explicit operator bool() const noexcept { return comm_ != nullptr; }

  bool asking() const noexcept { return asking_; }
  // Asks for a piece of a step in [awaited, end).
  void ask(std::int64_t awaited, std::int64_t end) {
    out_ = {awaited, end};
    answer_ = B::irecv(*comm_, span<std::int64_t>(in_.data(), in_.size()), 0, answer_tag);
    claim_.wait();  // the last claim's send
    claim_ = B::isend(*comm_, span<const std::int64_t>(out_.data(), out_.size()), 0, claim_tag);
    asking_ = true;
  }
  bool answered() { return asking_ && answer_.test(); }
  // Waits for the answer to the claim out; past FLEXCOMM_TIMEOUT names the producer.
  void await_answer(std::int64_t awaited) {
    waiting_note note;  // once long: whom this wait is on (core/stall.hpp)
    if (!wait_answering(engine_wait(), default_timeout(), [&] { return answer_.test(); }, [&] {
          note.set(cat(who_, ": claim while waiting for step ", awaited), {producer_});
          watchdog::instance().answer_queries();
        })) {
      watchdog::instance().must_end();
      timed_out_waiting(cat(who_, ": claim while waiting for step ", awaited), default_timeout(),
                        cat("world rank ", producer_, on_host(producer_)));
    }
  }
  // The answer that came: {step, piece (-1: none), the producer's time per step in ns}.
  answer_message take_answer() {
    asking_ = false;
    return in_;
  }
  int producer() const noexcept { return producer_; }

  // Where the granted piece is made: the buffer of the piece before last, once it has gone. Two,
  // because a large piece's send finishes only once the producer tests it, between pieces of its
  // own: with one buffer the trainer waited for that before it could make the next.
  span<std::byte> piece(std::size_t bytes) {
    current_ ^= 1;
    made_[current_].wait();
    return span<std::byte>(pieces_[current_].data(), bytes + guard_bytes);
  }
  // Sends the granted piece, made in piece(bytes), to the producer.
  void send(std::size_t bytes) {
    made_[current_] = B::isend(
        *comm_, span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(pieces_[current_].data()), bytes), 0,
        made_tag);
  }
  // Will claim no more (called with no claim out).
  void finish() {
    if (finished_) return;
    finished_ = true;
    made_[0].wait();
    made_[1].wait();
    claim_.wait();
    out_ = {-1, 0};
    claim_ = B::isend(*comm_, span<const std::int64_t>(out_.data(), out_.size()), 0, claim_tag);
    claim_.wait();
  }
  bool finished() const noexcept { return finished_; }

 private:
  const communicator* comm_ = nullptr;
  int producer_ = -1;
  std::string who_;
  std::vector<std::byte> pieces_[2];  // pieces made, with room for the guard, sent from alternately
  int current_ = 0;
  claim_message out_{};
  answer_message in_{};
  request claim_, answer_, made_[2];
  bool asking_ = false, finished_ = false;
};

}  // namespace flexcomm::detail
