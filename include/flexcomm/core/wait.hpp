// Wait policies: how a flexcomm thread waits for a nonblocking operation to finish.
// Busy polling is ruinous when ranks outnumber cores, so every wait in flexcomm goes through one.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <sys/prctl.h>
#endif

#include "doorbell.hpp"
#include "error.hpp"
#include "settings.hpp"
#include "stall.hpp"

namespace flexcomm {

namespace detail {
// Linux rounds every sleep up by the thread's timer slack (50 us by default), which would make
// a 1 us backoff step cost 50 us of latency; waiting threads ask for 1 us slack instead.
inline void tighten_timer_slack() {
#if defined(__linux__)
  thread_local bool done = false;
  if (!done) {
    prctl(PR_SET_TIMERSLACK, 1000UL, 0UL, 0UL, 0UL);
    done = true;
  }
#endif
}
}  // namespace detail

enum class wait_kind { spin, yield, backoff };

namespace detail {
// Work a waiting thread does instead of pausing (run_in_gaps, gaps.hpp): runs one short chunk
// and returns true, or returns false when there is none. Null while nothing is queued.
using gap_work_fn = bool (*)();
inline std::atomic<gap_work_fn>& gap_work() {
  static std::atomic<gap_work_fn> work{nullptr};
  return work;
}

// Threads of this process that poll MPI in the background right now (the progress engine while
// it has work, from the moment a task is handed to it); wait_policy::pause backs off while there
// are any.
inline std::atomic<int>& background_pollers() {
  static std::atomic<int> pollers{0};
  return pollers;
}
}  // namespace detail

struct wait_policy {
  wait_kind kind = wait_kind::backoff;
  // backoff: sleeps start at 1 us and double up to this bound.
  std::chrono::microseconds max_sleep{100};
  // The waiting thread does the work it waits for itself (it drives a shared-memory segment that
  // the engine's thread may drive too): beside the engine it yields instead of backing off,
  // since sleeping would only delay the work.
  bool drives = false;
  // backoff: the first sleep, for a waiter that knows it has long to wait (a feed's producer a
  // whole board ahead): it skips the yields and the microsecond sleeps, each a wake-up for nothing.
  std::chrono::microseconds first_sleep{1};

  static wait_policy spin() { return of(wait_kind::spin, {}); }
  static wait_policy yield() { return of(wait_kind::yield, {}); }
  static wait_policy backoff(std::chrono::microseconds max = std::chrono::microseconds{100}) {
    return of(wait_kind::backoff, max);
  }
  static wait_policy of(wait_kind kind, std::chrono::microseconds max_sleep) {
    wait_policy p;
    p.kind = kind;
    p.max_sleep = max_sleep;
    return p;
  }
  // This policy for a thread that drives what it waits for.
  wait_policy driving() const {
    wait_policy p = *this;
    p.drives = true;
    return p;
  }

  // "spin", "yield", "backoff" or "backoff:<max microseconds>" (the FLEXCOMM_WAIT syntax).
  static wait_policy parse(std::string_view text);

  // Backoff when the ranks on this node outnumber its cores, spinning otherwise;
  // FLEXCOMM_WAIT overrides.
  static wait_policy automatic(int ranks_on_node, unsigned cores = std::thread::hardware_concurrency());

  // Gives the CPU away (or not) between two polls; `round` counts the polls of one wait.
  // backoff first yields (a peer rank waiting for this core runs at once), then sleeps with
  // doubling length: a sleeping rank neither steals the core nor inflates CPU-time figures.
  // While the progress engine has work, every wait backs off: spinning or yielding beside it
  // keeps the core and MPICH's lock from the thread that does the work (docs/architecture.md,
  // "Waiting and progress"). A waiter that drives its own work (`drives`) yields instead of
  // sleeping where it would otherwise spin.
  void pause(unsigned round) const {
    const bool beside_engine = detail::background_pollers().load(std::memory_order_relaxed) > 0;
    wait_kind now = kind;
    if (beside_engine) now = drives && kind == wait_kind::spin ? wait_kind::yield : wait_kind::backoff;
    pause_as(now, round);
  }
  // The progress engine's own pause between two rounds over its tasks: the rule above is for the
  // threads beside it. Where this policy would spin it yields instead (the trainer shares its
  // core): backing off, it would sleep between the chunks of a large shared-memory bucket.
  void pause_engine(unsigned round) const { pause_as(kind == wait_kind::spin ? wait_kind::yield : kind, round); }

 private:
  void pause_as(wait_kind now, unsigned round) const {
    switch (now) {
      case wait_kind::spin: return;
      case wait_kind::yield: std::this_thread::yield(); return;
      case wait_kind::backoff: {
        const bool patient = kind == wait_kind::backoff && first_sleep.count() > 1;
        const unsigned yield_rounds = patient ? 0 : 16;
        if (round < yield_rounds) {
          std::this_thread::yield();
          return;
        }
        detail::tighten_timer_slack();
        const unsigned shift = round - yield_rounds < 16 ? round - yield_rounds : 16;
        const auto bound = kind == wait_kind::backoff ? max_sleep : std::chrono::microseconds{100};
        const auto sleep = (patient ? first_sleep : std::chrono::microseconds{1}) * (1u << shift);
        std::this_thread::sleep_for(sleep < bound ? sleep : bound);
        return;
      }
    }
  }

 public:
  // Polls done() until it returns true or `timeout` (zero: none) passes; false on timeout.
  template <class Done>
  bool until(Done&& done, std::chrono::milliseconds timeout = std::chrono::milliseconds{0}) const {
    if (done()) return true;
    std::chrono::steady_clock::time_point start;
    if (timeout.count() > 0) start = std::chrono::steady_clock::now();  // no clock read where none is kept
    for (unsigned round = 0;; ++round) {
      if (done()) return true;
      if (timeout.count() > 0 && (round & 15u) == 15u &&
          std::chrono::steady_clock::now() - start > timeout)
        return done();
      // The rank would only wait here: background work queued by run_in_gaps goes first.
      const auto work = detail::gap_work().load(std::memory_order_acquire);
      if (work && work()) continue;
      pause(round);
    }
  }
};

inline const char* name_of(wait_kind k) {
  switch (k) {
    case wait_kind::spin: return "spin";
    case wait_kind::yield: return "yield";
    case wait_kind::backoff: return "backoff";
  }
  return "?";
}

inline wait_policy wait_policy::parse(std::string_view text) {
  if (text == "spin") return spin();
  if (text == "yield") return yield();
  if (text == "backoff") return backoff();
  if (text.substr(0, 8) == "backoff:") {
    const std::string number(text.substr(8));
    char* end = nullptr;
    const long us = std::strtol(number.c_str(), &end, 10);
    if (!number.empty() && end && *end == '\0' && us > 0 && us <= 1000000)
      return backoff(std::chrono::microseconds{us});
  }
  fail("wait policy", cat("cannot parse '", text,
                          "': expected spin, yield, backoff or backoff:<max microseconds 1..1000000>"));
}

inline wait_policy wait_policy::automatic(int ranks_on_node, unsigned cores) {
  if (const char* forced = setting("FLEXCOMM_WAIT")) return parse(forced);
  if (cores == 0) cores = 1;
  return ranks_on_node > static_cast<int>(cores) ? backoff() : spin();
}

namespace detail {
struct wait_defaults {
  std::atomic<int> kind{static_cast<int>(wait_kind::backoff)};
  std::atomic<long> max_sleep_us{100};
  std::atomic<long> timeout_ms{-1};  // -1: not read from FLEXCOMM_TIMEOUT yet
};
inline wait_defaults& defaults() {
  static wait_defaults d;
  return d;
}
}  // namespace detail

// The policy every flexcomm wait uses unless told otherwise; flexcomm::environment sets it.
inline wait_policy default_wait() {
  auto& d = detail::defaults();
  return {static_cast<wait_kind>(d.kind.load(std::memory_order_relaxed)),
          std::chrono::microseconds{d.max_sleep_us.load(std::memory_order_relaxed)}};
}

inline void set_default_wait(const wait_policy& p) {
  auto& d = detail::defaults();
  d.kind.store(static_cast<int>(p.kind), std::memory_order_relaxed);
  d.max_sleep_us.store(static_cast<long>(p.max_sleep.count()), std::memory_order_relaxed);
}

// Seconds (may be fractional) from the variable `name`; zero or unset means no limit.
inline std::chrono::milliseconds parse_seconds(const char* name, const char* text) {
  if (!text || !*text) return std::chrono::milliseconds{0};
  char* end = nullptr;
  const double seconds = std::strtod(text, &end);
  if (!end || *end != '\0' || !(seconds >= 0) || seconds > 1e7)
    fail(name, cat("cannot parse '", text, "': expected seconds, e.g. 300 or 0.5"));
  return std::chrono::milliseconds{static_cast<long long>(seconds * 1000.0 + 0.5)};
}

inline std::chrono::milliseconds parse_timeout(const char* text) { return parse_seconds("FLEXCOMM_TIMEOUT", text); }

// How long a single flexcomm wait may take before it becomes a flexcomm::error.
inline std::chrono::milliseconds default_timeout() {
  auto& d = detail::defaults();
  long ms = d.timeout_ms.load(std::memory_order_relaxed);
  if (ms < 0) {
    ms = static_cast<long>(parse_timeout(setting("FLEXCOMM_TIMEOUT")).count());
    d.timeout_ms.store(ms, std::memory_order_relaxed);
  }
  return std::chrono::milliseconds{ms};
}

inline void set_default_timeout(std::chrono::milliseconds t) {
  detail::defaults().timeout_ms.store(static_cast<long>(t.count()), std::memory_order_relaxed);
}

// wait()'s default `timeout` argument: the limit of the operation's communicator.
inline constexpr std::chrono::milliseconds inherit_timeout{-1};

// A communicator's own limit on waits for its operations (set_timeout), the same for every
// backend: unset, or set negative, it follows FLEXCOMM_TIMEOUT's default_timeout().
class timeout_limit {
 public:
  void set(std::chrono::milliseconds t) noexcept {
    ms_.store(t.count() < 0 ? -1 : static_cast<long long>(t.count()), std::memory_order_relaxed);
  }
  std::chrono::milliseconds get() const {
    const long long t = ms_.load(std::memory_order_relaxed);
    return t >= 0 ? std::chrono::milliseconds{t} : default_timeout();
  }
  // What one wait allows: its own `timeout` argument where given, else this limit.
  std::chrono::milliseconds for_wait(std::chrono::milliseconds asked) const { return asked.count() >= 0 ? asked : get(); }

 private:
  std::atomic<long long> ms_{-1};
};

// ---------------------------------------------------------------------------------------------
// Waits that answer the watchdog. A peer that timed out first asks where this rank stands; a
// long wait replies now and then through `answer()` (a communicator's answer_queries(), or
// watchdog::instance().answer_queries() for all of them; watchdog.hpp, which includes this file).

// How long a wait runs before it starts answering peers' queries (watchdog::answer_after).
inline constexpr std::chrono::milliseconds answer_queries_after{100};

// Waits until `done()` under `policy` for up to `limit`; true when done. Past
// answer_queries_after, `answer()` is called now and then to reply to peers.
template <class Done, class Answer>
bool wait_answering(const wait_policy& policy, std::chrono::milliseconds limit, Done&& done, Answer&& answer) {
  if (done()) return true;
  // The clock starts at round 64, not at once: a small allreduce's whole wait is shorter, and the
  // read cost a tenth of it. Before that a backing-off wait has slept about 4 ms, a spinning one
  // a few microseconds: the answers begin that much later than answer_queries_after.
  std::chrono::steady_clock::time_point start;
  unsigned round = 0;
  return policy.until(
      [&] {
        if (done()) return true;
        if (++round == 64 && start == std::chrono::steady_clock::time_point{}) start = std::chrono::steady_clock::now();
        if ((round & 255u) == 0 && std::chrono::steady_clock::now() - start > answer_queries_after) {
          answer();
          stall_registry::instance().answer();  // peers following a stall through this rank
        }
        return false;
      },
      limit);
}

namespace detail {

// The world ranks a wait's words name: every "world rank N" or "world ranks N, M" of the first line
// of `text` (hosts, where a report gives them, are skipped: "world ranks 3, host a, 4, host b").
inline std::vector<int> ranks_named_in(const std::string& text) {
  const std::string line = text.substr(0, text.find('\n'));
  std::vector<int> out;
  for (std::size_t at = line.find("world rank"); at != std::string::npos; at = line.find("world rank", at + 1)) {
    std::size_t i = at + 10;
    if (i < line.size() && line[i] == 's') ++i;
    for (bool first = true;; first = false) {
      if (!first) {
        if (line.compare(i, 2, ", ") != 0) break;
        i += 2;
        if (line.compare(i, 5, "host ") == 0) {
          i = line.find(", ", i);
          if (i == std::string::npos) break;
          continue;
        }
      } else if (i < line.size() && line[i] == ' ') {
        ++i;
      }
      if (i >= line.size() || line[i] < '0' || line[i] > '9') break;
      int r = 0;
      while (i < line.size() && line[i] >= '0' && line[i] <= '9') r = r * 10 + (line[i++] - '0');
      if (std::find(out.begin(), out.end(), r) == out.end()) out.push_back(r);
    }
  }
  return out;
}

// Past FLEXCOMM_TIMEOUT, `what` fails naming who has not moved (`late`), in the words a wait on
// messages uses (patterns/feed/steps_in_flight.hpp): for waits in shared memory, and for claims
// by message. The ranks `late` names are followed first to the ranks that stopped (stall.hpp).
[[noreturn]] inline void timed_out_waiting(const std::string& what, std::chrono::milliseconds limit,
                                           const std::string& late) {
  const std::string stalled = stall_registry::instance().lead(what, ranks_named_in(late), limit);
  fail(what, cat("timed out after ", limit.count(), " ms (FLEXCOMM_TIMEOUT); ", stalled, "not answered by ", late));
}

// A wait on peers' counters in shared memory: through the wait policy, answering the watchdog's
// queries (and noting, once long, whom it waits on); past FLEXCOMM_TIMEOUT it fails naming `late()`.
template <class Done, class Answer, class Late>
void wait_in_shared_memory(Done&& done, Answer&& answer, const std::string& what, Late&& late,
                           const wait_policy& policy = default_wait()) {
  if (done()) return;
  const auto limit = default_timeout();
  waiting_note note;
  auto answer_noting = [&] {
    note.set(what, ranks_named_in(late()));
    answer();
  };
  if (!wait_answering(policy, limit, done, answer_noting)) timed_out_waiting(what, limit, late());
}

// The same wait for a change that whoever makes it announces on `bell` (on one of `channels`):
// where the policy backs off (the ranks outnumber the cores) the waiter sleeps until a ring
// rather than waking on a timer to look, and looks at least every answer_queries_after to
// answer the watchdog and keep the timeout. Where the policy spins or yields, or work waits for
// this rank's gaps, it is the wait above.
template <class Done, class Answer, class Late>
void wait_on_doorbell(doorbell& bell, std::uint32_t channels, Done&& done, Answer&& answer, const std::string& what,
                      Late&& late, const wait_policy& policy = default_wait()) {
  if (policy.kind != wait_kind::backoff || gap_work().load(std::memory_order_acquire))
    return wait_in_shared_memory(done, answer, what, late, policy);
  if (done()) return;
  const auto limit = default_timeout();
  const auto start = std::chrono::steady_clock::now();
  waiting_note note;
  for (;;) {
    const auto waited = std::chrono::steady_clock::now() - start;
    auto slice = std::chrono::duration_cast<std::chrono::nanoseconds>(answer_queries_after);
    if (limit.count() > 0) {
      if (waited >= limit) break;
      slice = std::min(slice, std::chrono::duration_cast<std::chrono::nanoseconds>(limit - waited));
    }
    if (waited >= answer_queries_after) {
      note.set(what, ranks_named_in(late()));
      answer();
      stall_registry::instance().answer();
    }
    bell.sleep_unless(done, slice, channels);
    if (done()) return;
  }
  if (!done()) timed_out_waiting(what, limit, late());
}

}  // namespace detail

}  // namespace flexcomm
