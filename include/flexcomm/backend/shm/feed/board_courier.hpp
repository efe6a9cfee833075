// The adaptive feed across hosts with no producer: each step has a home host, whose trainers make
// it on their claim board (claim_board.hpp) whoever of them is idle, and one rank per host, its
// courier, ships the home steps' pieces to the other hosts' couriers and lays theirs on its own
// board. The courier works on the progress engine's thread, so no trainer leaves its training to
// answer a message: a step's makers are trainers, and a trainer does not look at the network
// while it trains.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "../../../core/error.hpp"
#include "../../../core/progress.hpp"
#include "claim_board.hpp"

namespace flexcomm::detail {

// Which host makes step k. The hosts take turns, each as many per cycle as it has trainers (a
// host of four trainers makes twice the steps of a host of two: all_shared's split, by host),
// spread over the cycle by a smooth weighted round robin so that no host makes a run of steps
// while another waits for them. The same on every rank.
class home_hosts {
 public:
  home_hosts() = default;
  explicit home_hosts(const std::vector<int>& trainers_on) {
    int total = 0;
    for (int t : trainers_on) total += t;
    std::vector<long> credit(trainers_on.size(), 0);
    for (int turn = 0; turn < total; ++turn) {
      std::size_t pick = 0;
      for (std::size_t h = 0; h < trainers_on.size(); ++h) {
        credit[h] += trainers_on[h];
        if (credit[h] > credit[pick]) pick = h;
      }
      credit[pick] -= total;
      turns_.push_back(static_cast<int>(pick));
    }
  }
  int of(std::int64_t k) const { return turns_[static_cast<std::size_t>(k) % turns_.size()]; }

 private:
  std::vector<int> turns_;  // [k mod cycle]
};

// One host's courier: over `couriers` (one rank per host, rank h on host h), it sends each home
// step's pieces, once made, to every other host that reads them, and receives the other hosts'
// steps into their slots on this board once free, marking them made. The board keeps a reader
// line for it (`line`), released as the sends finish, so that a slot is not refilled under a send.
// Pieces go in step order between each pair of couriers, and MPI keeps the order of messages on
// one communicator between two ranks: no step needs naming in a tag.
template <class B>
class board_courier {
 public:
  using communicator = typename B::communicator;

  // `reads[h]`: the pieces host h reads, ascending; `bytes[c]`: piece c on the wire. The courier
  // starts at once, on the progress engine.
  board_courier(const communicator& couriers, std::shared_ptr<const claim_board<B>> board, std::size_t line,
                home_hosts homes, std::vector<std::vector<std::size_t>> reads, std::vector<std::size_t> bytes,
                std::int64_t steps, const std::string& who)
      : state_(std::make_shared<state>()) {
    state& s = *state_;
    s.comm = &couriers;
    s.board = std::move(board);
    s.line = line;
    s.homes = std::move(homes);
    s.host = couriers.rank();
    s.reads = std::move(reads);
    s.bytes = std::move(bytes);
    s.steps = steps;
    for (std::size_t h = 0; h < s.reads.size(); ++h)
      for (std::size_t c : s.reads[h])
        if (static_cast<int>(h) != s.host) s.shipped.push_back(c);
    task_ = progress_engine::instance().submit([p = state_] { return p->poll(); }, cat(who, ": courier"));
  }
  board_courier(const board_courier&) = delete;
  board_courier& operator=(const board_courier&) = delete;
  // Posts nothing more (the communicator goes with the feed); what is in flight finishes on the
  // engine, with the board kept alive until then.
  ~board_courier() { close(); }

  // Waits until every home step is shipped and every other host's step received (the feed's end,
  // after the trainers here made their home steps); fails, naming who did not answer, past the
  // timeout.
  void finish() const { task_->wait(engine_wait()); }

  // What made the courier fail (an MPI error), for a timeout that waits on it; empty while it
  // has not.
  std::string failure() const {
    std::lock_guard<std::mutex> lock(state_->mutex);
    return state_->failure;
  }

 private:
  struct outgoing {
    std::int64_t step;
    std::vector<typename B::request> sends;
  };
  struct incoming {  // the pieces this host reads, in reads[host] order
    std::int64_t step;
    std::vector<typename B::request> receives;
    std::vector<bool> made;
  };

  struct state {
    std::mutex mutex;  // the feed's thread closes; the engine's polls
    const communicator* comm = nullptr;
    std::shared_ptr<const claim_board<B>> board;
    std::size_t line = 0;
    home_hosts homes;
    int host = 0;
    std::vector<std::vector<std::size_t>> reads;
    std::vector<std::size_t> bytes, shipped;  // shipped: pieces some other host reads
    std::int64_t steps = 0, ship_next = 0, receive_next = 0;
    std::deque<outgoing> sends;
    std::deque<incoming> receives;
    std::string failure;
    bool closed = false;

    bool poll() {
      std::lock_guard<std::mutex> lock(mutex);
      try {
        if (!closed) {
          ship();
          receive();
        }
        settle();
      } catch (const std::exception& e) {
        failure = e.what();
        throw;
      }
      if (closed) return sends.empty() && receives.empty();
      return ship_next == steps && sends.empty() && receive_next == steps && receives.empty();
    }

    // Posts the sends of each home step once all its pieces others read are made, in step order.
    void ship() {
      for (; ship_next < steps; ++ship_next) {
        const std::int64_t k = ship_next;
        if (homes.of(k) != host || shipped.empty()) continue;
        for (std::size_t c : shipped)
          if (!board->is_made(k, c)) return;
        outgoing o{k, {}};
        for (std::size_t h = 0; h < reads.size(); ++h)
          if (static_cast<int>(h) != host)
            for (std::size_t c : reads[h])
              o.sends.push_back(B::isend(*comm, span<const std::uint8_t>(piece(k, c), bytes[c]), static_cast<int>(h), 0));
        sends.push_back(std::move(o));
      }
    }

    // Posts the receives of each other host's step into its slot here once the slot is free, in
    // step order; the sender's order is the same.
    void receive() {
      const auto& mine = reads[static_cast<std::size_t>(host)];
      for (; receive_next < steps; ++receive_next) {
        const std::int64_t k = receive_next;
        if (homes.of(k) == host || mine.empty()) continue;
        if (!board->slot_free(k)) return;
        incoming in{k, {}, std::vector<bool>(mine.size(), false)};
        for (std::size_t c : mine)
          in.receives.push_back(B::irecv(*comm, span<std::uint8_t>(piece(k, c), bytes[c]), homes.of(k), 0));
        receives.push_back(std::move(in));
      }
    }

    // Marks what arrived made, and gives back the slots of steps whose sends finished.
    void settle() {
      const auto& mine = reads[static_cast<std::size_t>(host)];
      for (auto& in : receives)
        for (std::size_t i = 0; i < mine.size(); ++i)
          if (!in.made[i] && in.receives[i].test()) {
            if (!closed) board->mark_made(in.step, mine[i]);
            in.made[i] = true;
          }
      while (!receives.empty() && std::all_of(receives.front().made.begin(), receives.front().made.end(),
                                              [](bool made) { return made; }))
        receives.pop_front();
      while (!sends.empty() && all_done(sends.front().sends)) sends.pop_front();
      // Shipped: every step before the oldest whose sends are out, or before the next to ship.
      board->release_line(line, static_cast<std::uint64_t>(sends.empty() ? ship_next : sends.front().step));
    }

    std::uint8_t* piece(std::int64_t k, std::size_t c) const {
      return reinterpret_cast<std::uint8_t*>(board->piece(k, c));
    }
    static bool all_done(std::vector<typename B::request>& requests) {
      bool done = true;
      for (auto& r : requests) done = r.test() && done;  // test each: it moves MPI on
      return done;
    }
  };

  void close() noexcept {
    if (!state_) return;
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->closed = true;
  }

  std::shared_ptr<state> state_;
  std::shared_ptr<completion> task_;
};

}  // namespace flexcomm::detail
