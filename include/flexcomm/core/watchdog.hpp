// The watchdog: a flight recorder of recent operations per communicator, and the process-wide
// registry that turns a timed-out wait into a report naming the ranks that did not arrive.
//
// Policy when a wait times out (or ranks disagree on a collective):
//   1. the wait throws a flexcomm::error to its caller, carrying the whole report (operation,
//      communicator, sequence number, count, last enqueued vs completed, missing ranks, recorder);
//   2. the communicator is poisoned: later operations on it fail at once, pending requests on it
//      are abandoned instead of waited for again, so unwinding never hangs;
//   3. the job must end: MPI state is undefined once an operation is abandoned. flexcomm's
//      environment ends it with MPI_Abort(1) when it is destroyed, after a grace period that lets
//      the other surviving ranks print their own reports (see backend/mpi/environment.hpp). An error that
//      escapes main ends the job the same way (std::terminate).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "datatype.hpp"
#include "error.hpp"
#include "settings.hpp"
#include "stall.hpp"
#include "wait.hpp"

namespace flexcomm {

// FLEXCOMM_CHECK: "1"/"on"/"true" or "0"/"off"/"false"; unset means on.
bool parse_check(const char* text);

// Whether the cheap cross-rank consistency checks run (FLEXCOMM_CHECK, or set_checks()).
bool checks_enabled();
void set_checks(bool on);

// An extra value folded into the consistency signature of the collectives this thread posts
// while it lives, e.g. the bucket index, so that ranks reducing different buckets of the same
// size are told apart. Nests; the innermost label wins.
class check_label {
 public:
  explicit check_label(std::int64_t label);
  ~check_label();
  check_label(const check_label&) = delete;
  check_label& operator=(const check_label&) = delete;
  static std::int64_t current() noexcept;

 private:
  std::int64_t previous_;
};

enum class op_state : std::uint8_t { in_flight, completed, failed, timed_out, abandoned };
const char* name_of(op_state s);

// One operation as the flight recorder remembers it: no strings, so recording costs no allocation.
struct op_record {
  std::uint64_t seq = 0;
  const char* op = "";      // static text: "iallreduce"
  std::size_t count = 0;
  dtype type = dtype::u8;
  const char* redop = "";   // "" where there is none
  int peer = -1;            // root or peer, -1 where there is none
  int tag = -1;
  op_state state = op_state::in_flight;
  std::chrono::steady_clock::time_point posted{}, finished{};

  std::string str() const;  // "#5 iallreduce 1000 x float sum"

  // An operation about to be posted, as every backend records it.
  static op_record posting(const char* op, std::size_t count, dtype type, const char* redop, int peer, int tag) {
    op_record r;
    r.op = op;
    r.count = count;
    r.type = type;
    r.redop = redop;
    r.peer = peer;
    r.tag = tag;
    return r;
  }
};

// Ring buffer of the last operations posted on one communicator; thread-safe, since requests are
// tested by the progress engine while the trainer posts new ones. Lock-free: every operation of
// every backend passes through it, and a lock here was one of a post's several (docs/cuda.md,
// "Host work per operation"). Writers fill a slot and publish it with its sequence number and
// state in one word; readers, only in reports, take a slot when that word reads the same before
// and after (a slot rewritten meanwhile was evicted anyway).
class flight_recorder {
 public:
  explicit flight_recorder(std::size_t capacity = 32)
      : size_(capacity ? capacity : 1), ring_(new slot[capacity ? capacity : 1]) {}

  // Assigns the next sequence number to `r` and records it as in flight.
  std::uint64_t enqueue(op_record r);
  // Takes a sequence number without recording an operation.
  std::uint64_t reserve();
  void finish(std::uint64_t seq, op_state s);

  std::uint64_t last_enqueued() const;
  std::uint64_t last_completed() const;  // highest sequence number that completed
  std::size_t in_flight() const;
  // The oldest operation not finished (in flight or timed out); 0 when none (or evicted).
  std::uint64_t oldest_in_flight() const;
  op_record find(std::uint64_t seq) const;  // seq 0 in the result when not in the ring
  std::vector<op_record> recent() const;     // oldest first
  std::string dump(const std::string& title) const;

 private:
  // One operation; `word` is seq << 3 | state, 0 while empty or being written.
  struct slot {
    std::atomic<std::uint64_t> word{0};
    std::atomic<const char*> op{""}, redop{""};
    std::atomic<std::size_t> count{0};
    std::atomic<int> peer{-1}, tag{-1};
    std::atomic<std::uint8_t> type{0};
    std::atomic<std::int64_t> posted{0}, finished{0};  // steady_clock ticks; finished 0: not yet
  };
  static std::uint64_t word_of(std::uint64_t seq, op_state s) { return seq << 3 | static_cast<std::uint64_t>(s); }
  slot& at(std::uint64_t seq) const { return ring_[seq % size_]; }
  bool read(const slot& s, op_record& out) const;  // false: empty, or rewritten while read
  void lower_in_flight();

  std::size_t size_;
  std::unique_ptr<slot[]> ring_;
  std::atomic<std::uint64_t> enqueued_{0}, completed_{0};
  std::atomic<std::size_t> in_flight_{0};
};

// What a backend gives the watchdog for each of its communicators.
class watched {
 public:
  virtual ~watched() = default;
  virtual const std::string& name() const = 0;
  virtual const flight_recorder& recorder() const = 0;
  // Tells the peers where this rank stands on this communicator; once, cheap, never blocks.
  virtual void announce() = 0;
  // Announces, if a peer has already announced (it timed out first and waits for our state).
  // Cheap: called from long waits only, a few times per millisecond at most.
  virtual void answer_queries() = 0;
  // Who did not arrive at `seq`: gathers the peers' announcements for up to `grace`.
  virtual std::string diagnose(std::uint64_t seq, std::chrono::milliseconds grace) = 0;
  virtual void poison(const std::string& why) = 0;
  // After diagnose(): the world ranks that did not arrive, those that gave no answer (`silent`)
  // and those that answered behind.
  virtual void late(std::vector<int>& silent, std::vector<int>& behind) const {
    static_cast<void>(silent);
    static_cast<void>(behind);
  }
};

class watchdog {
 public:
  static watchdog& instance() {
    static watchdog* w = new watchdog;  // never destroyed: requests may report during exit
    return *w;
  }

  void add(const std::shared_ptr<watched>& w);

  // A wait timed out: every communicator of this process announces itself (so the peers' reports
  // can name this rank's state), then the ones with operations in flight are diagnosed.
  // `focus` (may be null) is diagnosed first for `seq`. Marks the job as one that must end.
  // `lead`, when given, gets what leads the error: "stalled at <the ranks that stopped>" (the
  // ranks that did not arrive followed to the end of their chains, stall.hpp), or "".
  std::string timed_out(watched* focus, std::uint64_t seq, std::chrono::milliseconds timeout,
                        std::string* lead = nullptr);

  // The job cannot end cleanly any more (a timeout, an abandoned operation, ranks disagreeing).
  void must_end() noexcept { must_end_.store(true, std::memory_order_release); }
  bool job_must_end() const noexcept { return must_end_.load(std::memory_order_acquire); }

  // A pending request given up at destruction after its communicator was poisoned.
  void abandon() noexcept {
    abandoned_.fetch_add(1, std::memory_order_acq_rel);
    must_end();
  }
  std::size_t abandoned() const noexcept { return abandoned_.load(std::memory_order_acquire); }

  // Called by long waits that cannot tell which communicator they wait on (the progress engine's
  // completions): every communicator with operations in flight answers peers that timed out.
  void answer_queries();

  // How long a wait runs before it starts answering peers' queries (wait.hpp).
  static constexpr std::chrono::milliseconds answer_after = answer_queries_after;

  // Operations in flight over every live communicator (the soak test watches it).
  std::size_t in_flight() const;
  // The flight recorders of the communicators with operations in flight; "" when none.
  std::string in_flight_report() const;
  // This rank's newest operation posted and newest completed over every live communicator,
  // "#812 isend 100 x u8 to 3 on 'feed' (in flight)"; "none" where there is none. What a rank
  // answers a peer that follows a stall (stall.hpp).
  std::pair<std::string, std::string> last_operations() const;

  // How long a report waits for the peers' answers: long enough for ranks whose waits started a
  // little later to time out as well, short against the timeout.
  static std::chrono::milliseconds grace(std::chrono::milliseconds timeout) { return stall_grace(timeout); }

 private:
  std::vector<std::shared_ptr<watched>> live() const;

  mutable std::mutex mutex_;
  std::vector<std::weak_ptr<watched>> comms_;
  std::atomic<bool> must_end_{false};
  std::atomic<std::size_t> abandoned_{0};
};

// ---------------------------------------------------------------------------------------------

namespace detail {
struct check_defaults {
  std::atomic<int> on{-1};  // -1: not read from FLEXCOMM_CHECK yet
};
inline check_defaults& check_state() {
  static check_defaults d;
  return d;
}
inline std::int64_t& thread_check_label() {
  thread_local std::int64_t label = -1;
  return label;
}
}  // namespace detail

inline bool parse_check(const char* text) {
  if (!text || !*text) return true;
  const std::string_view t(text);
  if (t == "1" || t == "on" || t == "true") return true;
  if (t == "0" || t == "off" || t == "false") return false;
  fail("FLEXCOMM_CHECK", cat("cannot parse '", t, "': expected 1 (on) or 0 (off)"));
}

inline bool checks_enabled() {
  auto& s = detail::check_state();
  int on = s.on.load(std::memory_order_relaxed);
  if (on < 0) {
    on = parse_check(setting("FLEXCOMM_CHECK")) ? 1 : 0;
    s.on.store(on, std::memory_order_relaxed);
  }
  return on == 1;
}

inline void set_checks(bool on) { detail::check_state().on.store(on ? 1 : 0, std::memory_order_relaxed); }

inline check_label::check_label(std::int64_t label) : previous_(detail::thread_check_label()) {
  detail::thread_check_label() = label;
}
inline check_label::~check_label() { detail::thread_check_label() = previous_; }
inline std::int64_t check_label::current() noexcept { return detail::thread_check_label(); }

inline const char* name_of(op_state s) {
  static const char* const names[] = {"in flight", "completed", "failed", "timed out", "abandoned"};  // in op_state's order
  const auto i = static_cast<unsigned>(s);
  return i < sizeof names / sizeof *names ? names[i] : "?";
}

inline std::string op_record::str() const {
  std::string s = cat("#", seq, " ", op, " ", count, " x ", name_of(type));
  if (*redop) s += cat(" ", redop);
  if (peer >= 0) s += cat(std::string_view(op).find("send") != std::string_view::npos ? " to " :
                          std::string_view(op).find("recv") != std::string_view::npos ? " from " : " root ", peer);
  if (tag >= 0) s += cat(" tag ", tag);
  return s;
}

inline std::uint64_t flight_recorder::enqueue(op_record r) {
  const std::uint64_t seq = enqueued_.fetch_add(1, std::memory_order_relaxed) + 1;
  slot& s = at(seq);
  // Each field is stored with release, after the word is cleared: a reader that sees a new field
  // sees the cleared word after it too, and drops the slot (no fences: ThreadSanitizer has none).
  constexpr auto order = std::memory_order_release;
  s.word.store(0, std::memory_order_relaxed);
  s.op.store(r.op, order);
  s.redop.store(r.redop, order);
  s.count.store(r.count, order);
  s.peer.store(r.peer, order);
  s.tag.store(r.tag, order);
  s.type.store(static_cast<std::uint8_t>(r.type), order);
  s.posted.store(std::chrono::steady_clock::now().time_since_epoch().count(), order);
  s.finished.store(0, order);
  in_flight_.fetch_add(1, std::memory_order_relaxed);
  s.word.store(word_of(seq, op_state::in_flight), std::memory_order_release);
  return seq;
}

inline std::uint64_t flight_recorder::reserve() { return enqueued_.fetch_add(1, std::memory_order_relaxed) + 1; }

inline void flight_recorder::lower_in_flight() {
  std::size_t n = in_flight_.load(std::memory_order_relaxed);
  while (n > 0 && !in_flight_.compare_exchange_weak(n, n - 1, std::memory_order_relaxed)) {
  }
}

inline void flight_recorder::finish(std::uint64_t seq, op_state s) {
  slot& r = at(seq);
  std::uint64_t word = word_of(seq, op_state::in_flight);
  if (!r.word.compare_exchange_strong(word, word_of(seq, s), std::memory_order_acq_rel)) {
    if (word >> 3 == seq) {
      // Failed or timed out earlier; now given up for good.
      if (s == op_state::abandoned) r.word.compare_exchange_strong(word, word_of(seq, s), std::memory_order_acq_rel);
      return;
    }
    // Evicted (or never recorded): only the counts remember it.
  } else {
    r.finished.store(std::chrono::steady_clock::now().time_since_epoch().count(), std::memory_order_relaxed);
  }
  if (s == op_state::completed) {
    std::uint64_t done = completed_.load(std::memory_order_relaxed);
    while (seq > done && !completed_.compare_exchange_weak(done, seq, std::memory_order_relaxed)) {
    }
  }
  lower_in_flight();
}

inline std::uint64_t flight_recorder::last_enqueued() const { return enqueued_.load(std::memory_order_relaxed); }
inline std::uint64_t flight_recorder::last_completed() const { return completed_.load(std::memory_order_relaxed); }
inline std::size_t flight_recorder::in_flight() const { return in_flight_.load(std::memory_order_relaxed); }

inline bool flight_recorder::read(const slot& s, op_record& out) const {
  constexpr auto order = std::memory_order_acquire;
  for (int attempt = 0; attempt < 4; ++attempt) {
    const std::uint64_t before = s.word.load(order);
    if (before == 0) return false;
    out.seq = before >> 3;
    out.state = static_cast<op_state>(before & 7);
    out.op = s.op.load(order);
    out.redop = s.redop.load(order);
    out.count = s.count.load(order);
    out.peer = s.peer.load(order);
    out.tag = s.tag.load(order);
    out.type = static_cast<dtype>(s.type.load(order));
    using tp = std::chrono::steady_clock::time_point;
    out.posted = tp(tp::duration(s.posted.load(order)));
    const auto finished = s.finished.load(order);
    out.finished = finished ? tp(tp::duration(finished)) : tp{};
    if (s.word.load(std::memory_order_relaxed) == before) return true;
  }
  return false;
}

inline std::uint64_t flight_recorder::oldest_in_flight() const {
  std::uint64_t oldest = 0;
  for (std::size_t i = 0; i < size_; ++i) {
    const std::uint64_t word = ring_[i].word.load(std::memory_order_acquire);
    const auto state = static_cast<op_state>(word & 7);
    const std::uint64_t seq = word >> 3;
    if (seq != 0 && (state == op_state::in_flight || state == op_state::timed_out) && (oldest == 0 || seq < oldest))
      oldest = seq;
  }
  return oldest;
}

inline op_record flight_recorder::find(std::uint64_t seq) const {
  op_record r;
  if (seq == 0 || !read(at(seq), r) || r.seq != seq) return op_record{};
  return r;
}

inline std::vector<op_record> flight_recorder::recent() const {
  std::vector<op_record> out;
  for (std::size_t i = 0; i < size_; ++i) {
    op_record r;
    if (read(ring_[i], r)) out.push_back(r);
  }
  std::sort(out.begin(), out.end(), [](const op_record& a, const op_record& b) { return a.seq < b.seq; });
  return out;
}

inline std::string flight_recorder::dump(const std::string& title) const {
  const auto ops = recent();
  const auto now = std::chrono::steady_clock::now();
  auto ms = [](auto d) { return std::chrono::duration<double, std::milli>(d).count(); };
  std::string s = cat("  flight recorder of ", title, " (last ", ops.size(), " of ", last_enqueued(), "):");
  for (const auto& r : ops) {
    s += cat("\n    ", r.str(), ": ", name_of(r.state));
    if (r.state == op_state::in_flight || r.finished == std::chrono::steady_clock::time_point{})
      s += cat(" for ", static_cast<long long>(ms(now - r.posted)), " ms");
    else
      s += cat(" after ", static_cast<long long>(ms(r.finished - r.posted) * 1000.0) / 1000.0, " ms");
  }
  return s;
}

inline void watchdog::add(const std::shared_ptr<watched>& w) {
  std::lock_guard<std::mutex> lock(mutex_);
  comms_.erase(std::remove_if(comms_.begin(), comms_.end(), [](const auto& c) { return c.expired(); }),
               comms_.end());
  comms_.push_back(w);
}

inline std::vector<std::shared_ptr<watched>> watchdog::live() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::shared_ptr<watched>> out;
  for (const auto& c : comms_)
    if (auto p = c.lock()) out.push_back(std::move(p));
  return out;
}

inline void watchdog::answer_queries() {
  for (const auto& c : live())
    if (c->recorder().in_flight() > 0) c->answer_queries();
}

inline std::size_t watchdog::in_flight() const {
  std::size_t n = 0;
  for (const auto& c : live()) n += c->recorder().in_flight();
  return n;
}

inline std::string watchdog::in_flight_report() const {
  std::string report;
  for (const auto& c : live()) {
    if (c->recorder().in_flight() == 0) continue;
    if (!report.empty()) report += "\n";
    report += c->recorder().dump(cat("'", c->name(), "'"));
  }
  return report;
}

inline std::pair<std::string, std::string> watchdog::last_operations() const {
  std::string started = "none", completed = "none";
  std::chrono::steady_clock::time_point posted{}, finished{};
  for (const auto& c : live())
    for (const auto& r : c->recorder().recent()) {
      if (r.posted >= posted) {
        posted = r.posted;
        started = cat(r.str(), " on '", c->name(), "' (", name_of(r.state), ")");
      }
      if (r.state == op_state::completed && r.finished >= finished) {
        finished = r.finished;
        completed = cat(r.str(), " on '", c->name(), "'");
      }
    }
  return {started, completed};
}

inline std::string watchdog::timed_out(watched* focus, std::uint64_t seq, std::chrono::milliseconds timeout,
                                       std::string* lead) {
  must_end();
  const auto comms = live();
  if (focus) focus->announce();
  for (const auto& c : comms) c->announce();
  // One grace period for the whole report, however many communicators it covers.
  const auto deadline = std::chrono::steady_clock::now() + grace(timeout);
  auto left = [&] {
    const auto d = deadline - std::chrono::steady_clock::now();
    return std::max(std::chrono::milliseconds{0}, std::chrono::duration_cast<std::chrono::milliseconds>(d));
  };
  std::string report;
  std::vector<int> silent, late;
  if (focus) {
    report += focus->diagnose(seq, left());
    focus->late(silent, late);
  }
  std::vector<std::pair<watched*, std::uint64_t>> others;
  for (const auto& c : comms) {
    if (c.get() == focus || c->recorder().in_flight() == 0) continue;
    if (!report.empty()) report += "\n";
    const auto seq_here = c->recorder().oldest_in_flight();
    report += c->diagnose(seq_here, left());
    if (!focus) c->late(silent, late);
    others.emplace_back(c.get(), seq_here);
  }
  late.insert(late.end(), silent.begin(), silent.end());
  std::string stalled = stall_registry::instance().lead(focus ? focus->name() : "a wait", late, timeout, silent);
  if (stalled.size() >= 2) stalled.resize(stalled.size() - 2);  // its "; "
  for (const auto& [c, seq_here] : others)
    c->poison(cat("a wait timed out while #", seq_here, " was in flight", stalled.empty() ? "" : "; ", stalled));
  if (lead) *lead = stalled;
  if (report.empty()) report = "  no flexcomm operation is in flight on this rank";
  return report;
}

}  // namespace flexcomm
