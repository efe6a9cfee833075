// Following a stall to the rank that stopped (issue 53). A rank whose wait times out names the
// ranks it waited on; but a neighbour that waits itself on another rank is not the cause. So each
// long wait notes what it waits on (the operation and the world ranks), and a rank that times out
// asks those ranks, over a side channel, where they stand: one that answers names whom it waits on
// in turn, and the question follows until ranks do not answer. Those are the cause, named first.
// The side channel is the MPI backend's (backend/mpi/watchdog.hpp: stall_channel over a duplicate
// of the world); without one, a rank names its neighbours as before.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "error.hpp"

namespace flexcomm {

// Where a peer stands, as it answers the question (or does not).
struct stall_answer {
  bool answered = false;
  std::vector<int> waits_on;       // the world ranks it waits on, where it waits in flexcomm
  std::string waiting_in;          // the operations it waits in
  std::string last_started, last_completed;  // its flight recorders' newest operations
};

// The transport of the question: asks are posted, then polled until answered or given up.
class stall_channel {
 public:
  virtual ~stall_channel() = default;
  // Replies to the questions peers have sent this rank; cheap when there are none.
  virtual void answer() = 0;
  virtual void ask(int world_rank) = 0;
  // True once `world_rank` answered (`out` filled) or cannot (dead: `out.answered` false).
  virtual bool poll(int world_rank, stall_answer& out) = 0;
  // Stops waiting for the asks still open.
  virtual void give_up() = 0;
  // Stops the channel's own thread for good, if it has one: before MPI_Abort, as
  // progress_engine::halt. answer() on the calling thread still works.
  virtual void hush() noexcept {}
};

// How long a stall's report waits for the peers' answers: long enough for ranks whose waits
// started a little later to be waiting too, short against the timeout (watchdog::grace).
inline std::chrono::milliseconds stall_grace(std::chrono::milliseconds timeout) {
  using std::chrono::milliseconds;
  return std::clamp(timeout / 4, milliseconds{250}, milliseconds{5000});
}

// Process-wide: what this rank's waits wait on, the roles of the world's ranks, and the channel.
class stall_registry {
 public:
  static stall_registry& instance() {
    static stall_registry* r = new stall_registry;  // never destroyed: waits may note during exit
    return *r;
  }

  // Notes (again) what the wait `id` waits on; 0: a new wait. Returns its id.
  std::uint64_t note(std::uint64_t id, std::string what, std::vector<int> world_ranks);
  void clear(std::uint64_t id);
  // Everything this rank waits on now (and what it timed out on, kept till the end).
  stall_answer where() const;

  // "member 2's rank 0", "producer 0, courier of host 1": what each world rank does, where known.
  void set_role(int world_rank, std::string role);
  void add_role(int world_rank, const std::string& role);
  std::string role(int world_rank) const;
  // "world rank 5 (member 2's rank 0)"
  std::string named(int world_rank) const;

  // The process of each world rank on this host (the environment learns them at start). A rank
  // that gives no answer is looked up in /proc: a stopped or dead one is then named for sure, and
  // told from one that runs but cannot answer (its MPI stuck on a dead peer, on some MPIs).
  void set_local_processes(std::map<int, int> world_rank_to_pid);

  void set_channel(std::shared_ptr<stall_channel> c);
  // Replies to peers' questions; every long wait calls it (wait.hpp's wait_answering).
  void answer();
  // Stops the channel's own thread (stall_channel::hush): the job is being aborted.
  void hush() noexcept {
    if (const auto ch = channel()) ch->hush();
  }

  // A wait on `world_ranks` in `what` timed out: follows them to the ranks that stopped answering,
  // for up to stall_grace(timeout), and returns the text that names those first, e.g.
  // "world rank 5 (member 2's rank 0; no answer within 1000 ms: stopped, busy outside flexcomm or
  // dead), which world rank 0 (producer 0) waits on in one_to_many: credits of step 7". Ranks in
  // `silent` are known not to answer already (asked on another channel). Keeps `what` as this
  // rank's state for later questions: the job is ending.
  std::string follow(const std::string& what, const std::vector<int>& world_ranks, std::chrono::milliseconds timeout,
                     const std::vector<int>& silent = {});
  // Whether every rank of `world_ranks` answers within `grace`, whatever it does (a rank busy
  // outside flexcomm answers from the channel's thread): a long wait on ranks that all answer is
  // slow work, not a stall. Nothing is kept, the job goes on. False without a channel.
  bool all_answer(const std::vector<int>& world_ranks, std::chrono::milliseconds grace);
  // follow() as the lead of a timeout's cause, "stalled at <its text>; ", or "" where there is no
  // channel to ask (nor anyone to follow).
  std::string lead(const std::string& what, const std::vector<int>& world_ranks, std::chrono::milliseconds timeout,
                   const std::vector<int>& silent = {}) {
    if (world_ranks.empty() || !channel()) return {};
    return cat("stalled at ", follow(what, world_ranks, timeout, silent), "; ");
  }

 private:
  std::shared_ptr<stall_channel> channel() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return channel_;
  }
  void ask_all(stall_channel& ch, const std::vector<int>& ranks, std::chrono::milliseconds grace);
  // Polls the asks in `open` until each is answered (`heard(rank, answer)`, which may ask more and
  // returns false to stop), or `grace` passes; then gives up the rest, which stay in `open`.
  template <class Heard>
  static void await_answers(stall_channel& ch, std::set<int>& open, std::chrono::milliseconds grace, Heard&& heard);
  std::string chain_text(const std::vector<int>& start, std::chrono::milliseconds grace) const;
  std::string end_text(int r, std::chrono::milliseconds grace, bool asked) const;
  // Ranks on this host whose process is stopped or gone, with how ("stopped", "gone: dead").
  std::vector<std::pair<int, std::string>> down_here() const;

  mutable std::mutex mutex_;
  std::map<std::uint64_t, std::pair<std::string, std::vector<int>>> notes_;
  std::uint64_t next_id_ = 0;
  std::map<int, std::string> roles_;
  std::shared_ptr<stall_channel> channel_;
  std::map<int, int> local_pids_;
  std::mutex follow_mutex_;          // one follow at a time; later ones reuse its answers
  std::map<int, stall_answer> known_;  // answers (or silences) learnt: the job is ending
};

// What one wait waits on, noted only once the wait is long (nothing on a short wait's path).
class waiting_note {
 public:
  waiting_note() = default;
  ~waiting_note() { clear(); }
  waiting_note(const waiting_note&) = delete;
  waiting_note& operator=(const waiting_note&) = delete;
  void set(std::string what, std::vector<int> world_ranks) {
    id_ = stall_registry::instance().note(id_, std::move(what), std::move(world_ranks));
  }
  void clear() {
    if (id_) stall_registry::instance().clear(std::exchange(id_, 0));
  }
  bool set_already() const noexcept { return id_ != 0; }

 private:
  std::uint64_t id_ = 0;
};

// ---------------------------------------------------------------------------------------------

inline std::uint64_t stall_registry::note(std::uint64_t id, std::string what, std::vector<int> world_ranks) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (id == 0) id = ++next_id_;
  notes_[id] = {std::move(what), std::move(world_ranks)};
  return id;
}

inline void stall_registry::clear(std::uint64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  notes_.erase(id);
}

inline stall_answer stall_registry::where() const {
  std::lock_guard<std::mutex> lock(mutex_);
  stall_answer a;
  a.answered = true;
  for (const auto& [id, n] : notes_) {
    static_cast<void>(id);
    if (!a.waiting_in.empty()) a.waiting_in += "; ";
    a.waiting_in += n.first;
    for (int r : n.second)
      if (std::find(a.waits_on.begin(), a.waits_on.end(), r) == a.waits_on.end()) a.waits_on.push_back(r);
  }
  return a;
}

inline void stall_registry::set_role(int world_rank, std::string role) {
  std::lock_guard<std::mutex> lock(mutex_);
  roles_[world_rank] = std::move(role);
}

inline void stall_registry::add_role(int world_rank, const std::string& role) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto& r = roles_[world_rank];
  if (r.find(role) == std::string::npos) r += cat(r.empty() ? "" : ", ", role);
}

inline std::string stall_registry::role(int world_rank) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto it = roles_.find(world_rank);
  return it == roles_.end() ? std::string() : it->second;
}

inline std::string stall_registry::named(int world_rank) const {
  const std::string r = role(world_rank);
  return cat("world rank ", world_rank, r.empty() ? "" : cat(" (", r, ")"));
}

inline void stall_registry::set_local_processes(std::map<int, int> world_rank_to_pid) {
  std::lock_guard<std::mutex> lock(mutex_);
  local_pids_ = std::move(world_rank_to_pid);
}

namespace detail {
// A process's state letter in /proc/<pid>/stat ('R', 'S', 'D'; 'T' stopped; 'Z' zombie), or 0
// where it is gone.
inline char process_state(int pid) {
  std::ifstream f(cat("/proc/", pid, "/stat"));
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const auto close = text.rfind(')');
  return close == std::string::npos || close + 2 >= text.size() ? 0 : text[close + 2];
}
// How a process is down, "stopped (process 5512, state T)" or "dead (process 5512 gone)", or
// nothing while it runs.
inline std::string process_down(int pid) {
  const char state = process_state(pid);
  if (state == 'T' || state == 't') return cat("stopped (process ", pid, ", state ", state, ")");
  if (state == 0 || state == 'Z' || state == 'X') return cat("dead (process ", pid, " gone)");
  return {};
}
}  // namespace detail

inline std::vector<std::pair<int, std::string>> stall_registry::down_here() const {
  std::map<int, int> pids;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    pids = local_pids_;
  }
  std::vector<std::pair<int, std::string>> down;
  for (const auto& [r, pid] : pids) {
    if (r == process_rank()) continue;
    if (auto how = detail::process_down(pid); !how.empty()) down.emplace_back(r, std::move(how));
  }
  return down;
}

inline void stall_registry::set_channel(std::shared_ptr<stall_channel> c) {
  std::lock_guard<std::mutex> lock(mutex_);
  channel_ = std::move(c);
}

inline void stall_registry::answer() {
  if (const auto ch = channel()) ch->answer();
}

// Asks `ranks` and, as answers come, whom they wait on, until every rank asked has answered or
// `grace` has passed; answers (and silences) go to known_. This rank answers its peers meanwhile.
inline void stall_registry::ask_all(stall_channel& ch, const std::vector<int>& ranks, std::chrono::milliseconds grace) {
  const int me = process_rank();
  std::set<int> open;
  auto ask = [&](int r) {
    if (r == me || r < 0 || known_.count(r) || open.count(r)) return;
    ch.ask(r);
    open.insert(r);
  };
  for (int r : ranks) ask(r);
  await_answers(ch, open, grace, [&](int r, const stall_answer& a) {
    known_[r] = a;
    for (int next : a.waits_on) ask(next);
    return true;
  });
  for (int r : open) known_[r] = stall_answer{};  // silent
}

template <class Heard>
void stall_registry::await_answers(stall_channel& ch, std::set<int>& open, std::chrono::milliseconds grace,
                                   Heard&& heard) {
  const auto deadline = std::chrono::steady_clock::now() + grace;
  bool going = true;
  while (going && !open.empty() && std::chrono::steady_clock::now() < deadline) {
    ch.answer();
    // Erased before `heard` runs: it may insert the ranks the answer names.
    for (auto it = open.begin(); going && it != open.end();) {
      stall_answer a;
      if (!ch.poll(*it, a)) {
        ++it;
        continue;
      }
      const int r = *it;
      it = open.erase(it);
      going = heard(r, a);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds{1});
  }
  ch.give_up();
}

inline bool stall_registry::all_answer(const std::vector<int>& world_ranks, std::chrono::milliseconds grace) {
  const auto ch = channel();
  if (!ch) return false;
  std::lock_guard<std::mutex> lock(follow_mutex_);
  std::set<int> open;
  for (int r : world_ranks)
    if (r != process_rank() && open.insert(r).second) ch->ask(r);
  bool dead = false;
  await_answers(*ch, open, grace, [&](int, const stall_answer& a) {
    dead = !a.answered;
    return a.answered;
  });
  return open.empty() && !dead;
}

inline std::string stall_registry::follow(const std::string& what, const std::vector<int>& world_ranks,
                                          std::chrono::milliseconds timeout, const std::vector<int>& silent) {
  // Kept: a rank that timed out still waits on these until the job ends.
  note(0, cat(what, " (timed out)"), world_ranks);
  const auto grace = stall_grace(timeout);
  std::lock_guard<std::mutex> lock(follow_mutex_);
  for (int r : silent) known_.emplace(r, stall_answer{});
  if (const auto ch = channel()) ask_all(*ch, world_ranks, grace);
  return chain_text(world_ranks, grace);
}

// The ends of the chains from `start` (silent ranks first; else answering ranks that wait on no
// one named), each with the rank before it that waits on it.
inline std::string stall_registry::chain_text(const std::vector<int>& start, std::chrono::milliseconds grace) const {
  std::map<int, int> before;  // rank -> the answering rank that waits on it (-1: in start)
  std::vector<int> order;
  for (int r : start)
    if (before.emplace(r, -1).second) order.push_back(r);
  for (std::size_t i = 0; i < order.size(); ++i) {
    const auto it = known_.find(order[i]);
    if (it == known_.end() || !it->second.answered) continue;
    for (int next : it->second.waits_on)
      if (next != process_rank() && before.emplace(next, order[i]).second) order.push_back(next);
  }
  std::vector<int> silent, idle;
  for (int r : order) {
    const auto it = known_.find(r);
    if (it == known_.end() || !it->second.answered) silent.push_back(r);
    else if (it->second.waits_on.empty()) idle.push_back(r);
  }
  const bool asked = !known_.empty();
  const auto& ends = !silent.empty() ? silent : !idle.empty() ? idle : order;
  // A rank seen stopped or dead on this host is the cause for sure: it comes first.
  std::string out;
  std::set<int> down;
  for (const auto& [r, how] : down_here()) {
    down.insert(r);
    const std::string role = this->role(r);
    out += cat(out.empty() ? "" : "; and ", "world rank ", r, " (", role, role.empty() ? "" : "; ", "seen on this host: ",
               how, ")");
  }
  std::string chain;
  for (int r : ends) {
    if (down.count(r)) continue;
    std::string item = end_text(r, grace, asked);
    for (int via = before[r]; via >= 0; via = before[via]) {
      const auto& a = known_.at(via);
      item += cat(", which ", named(via), " waits on in ", a.waiting_in, " (last completed ", a.last_completed, ")");
    }
    chain += cat(chain.empty() ? "" : "; and ", item);
  }
  if (out.empty() || chain.empty()) return out.empty() ? chain : out;
  return cat(out, "; waited on: ", chain);
}

// "world rank 5 (member 2's rank 0; no answer within 500 ms: stopped or dead)"
inline std::string stall_registry::end_text(int r, std::chrono::milliseconds grace, bool asked) const {
  const auto it = known_.find(r);
  std::string state;
  if (it == known_.end() || !it->second.answered) {
    bool here = false;  // on this host, and not down: chain_text names the down ones first
    {
      std::lock_guard<std::mutex> lock(mutex_);
      here = local_pids_.count(r) != 0;
    }
    if (asked && here)
      state = cat("no answer within ", grace.count(), " ms, though its process runs on this host: its MPI may ",
                  "wait on a stopped or dead rank");
    else if (asked)
      state = cat("no answer within ", grace.count(), " ms: stopped or dead");
  } else {
    state = cat("answered: ", it->second.waiting_in.empty() ? "busy, waiting on no rank" : cat("waits in ", it->second.waiting_in),
                "; last completed ", it->second.last_completed);
  }
  const std::string role = this->role(r);
  std::string item = cat("world rank ", r);
  if (!role.empty() || !state.empty()) item += cat(" (", role, !role.empty() && !state.empty() ? "; " : "", state, ")");
  return item;
}

}  // namespace flexcomm
