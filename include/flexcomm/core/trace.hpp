// flexcomm::trace: a per-rank timeline of what each thread did when (loader, feed wait, bucket
// reduce, trainer spans, collectives), written as Chrome trace JSON that Perfetto opens.
// Off by default and then one predictable branch per probe, no allocation; MPI-free (clock
// alignment lives in backend/mpi/trace.hpp).
#pragma once

#include <algorithm>
#include <cerrno>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "error.hpp"

namespace flexcomm::trace {

// Well-known span names: the report tool finds the weight-update gaps by these.
namespace names {
inline constexpr const char* loader = "loader";
inline constexpr const char* feed_wait = "feed wait";
inline constexpr const char* forward = "forward";
inline constexpr const char* backward = "backward";
inline constexpr const char* update = "update";  // the optimizer step
inline constexpr const char* bucket_ready = "bucket ready";
inline constexpr const char* bucket_reduce = "bucket reduce";
inline constexpr const char* bucket_landing = "bucket landing";  // a fused bucket's copy back
inline constexpr const char* segment = "segment";
inline constexpr const char* finish = "finish";
inline constexpr const char* collect = "collect";
}  // namespace names

struct options {
  // Events each thread can hold; beyond that they are counted as dropped, never reallocated.
  // A thread's buffer is made at its first event, with the capacity of the session then.
  std::size_t events_per_thread = 1u << 16;
};

// True while this process records. The one branch every probe pays when tracing is off.
inline bool enabled() noexcept;

// Starts recording for this process (world rank `rank`); files go to `dir` (created if missing).
// flexcomm::environment calls it when FLEXCOMM_TRACE=<dir> is set, after aligning clocks.
inline void start(const std::string& dir, int rank, options opts = {});
// Writes this rank's file now (all events recorded so far); tracing goes on.
inline void flush();
// Flushes and stops recording. Harmless when tracing is off.
inline void stop();
// The file this rank writes: <dir>/flexcomm-trace-<rank>.json.
inline std::string file_of(const std::string& dir, int rank);
// Events this process could not keep because a thread's buffer was full.
inline std::uint64_t dropped() noexcept;

// Clock alignment, set by backend/mpi/trace.hpp: this rank's steady clock minus rank 0's (ns), the
// round trip it was measured with, and rank 0's trace origin in rank 0's clock.
inline void set_clock(std::int64_t offset_ns, std::int64_t rtt_ns, std::int64_t origin_ns, int ranks);

// Names the calling thread's lane ("trainer", "progress engine").
inline void name_thread(const char* name);

// Nanoseconds of the clock every event is stamped with.
inline std::int64_t now() noexcept {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// A phase of this thread, from construction to destruction: trace::span s("forward").
// `name` and `category` must have static storage (string literals); `arg` (>= 0) is shown as
// `arg_name` (the step, the bucket, the segment).
class span {
 public:
  explicit span(const char* name, std::int64_t arg = -1, const char* arg_name = "step",
                const char* category = "trainer") noexcept
      : name_(name), category_(category), arg_name_(arg_name), arg_(arg), begin_(enabled() ? now() : 0) {}
  span(const span&) = delete;
  span& operator=(const span&) = delete;
  ~span();

 private:
  const char* name_;
  const char* category_;
  const char* arg_name_;
  std::int64_t arg_;
  std::int64_t begin_;
};
using scope = span;

// A finished phase whose begin was stamped earlier with now().
inline void complete(const char* name, const char* category, std::int64_t begin, std::int64_t end,
                     std::int64_t arg = -1, const char* arg_name = "step") noexcept;
// A point in time on this thread's lane.
inline void instant(const char* name, const char* category = "trainer", std::int64_t arg = -1,
                    const char* arg_name = "step") noexcept;

// A collective as this rank saw it: begin() when the rank arrives (posts it), end() when it has
// finished here, possibly on another thread. (comm, sequence) names the same collective on
// every rank of the communicator, which is how the report measures arrival skew.
// begin() returns 0 when tracing is off; end(0) does nothing. Another `category` (a ring's
// segments) draws the same way but stays out of the report's arrival matching.
inline std::uint64_t collective_begin(const char* kind, const std::string& comm, std::uint64_t sequence,
                                      const char* category = "collective") noexcept;
inline void collective_end(const char* kind, std::uint64_t id, const char* category = "collective") noexcept;

// A request's collective span: begun where it is posted, ended where it is seen complete.
// Every backend's requests carry one, so their collectives read alike in a trace.
class collective_mark {
 public:
  void begin(const char* kind, const std::string& comm, std::uint64_t sequence) noexcept {
    if (!enabled()) return;
    kind_ = kind;
    id_ = collective_begin(kind, comm, sequence);
  }
  void end() noexcept { collective_end(kind_, std::exchange(id_, 0)); }
  void swap(collective_mark& o) noexcept {
    std::swap(kind_, o.kind_);
    std::swap(id_, o.id_);
  }

 private:
  const char* kind_ = nullptr;
  std::uint64_t id_ = 0;  // 0: not traced
};

namespace detail {

struct event {
  std::int64_t ts = 0;   // ns, this process's steady clock
  std::int64_t dur = 0;  // ns, complete events
  const char* name = nullptr;
  const char* category = nullptr;
  const char* arg_name = nullptr;
  std::int64_t arg = -1;
  std::uint64_t id = 0;  // async id (collectives)
  char phase = 'X';      // X complete, i instant, b/e async begin/end
  char comm[39] = {};    // communicator name, truncated
};

struct thread_buffer {
  thread_buffer(std::size_t capacity, int tid_) : events(capacity), tid(tid_) {}
  std::vector<event> events;          // preallocated; written by its thread only
  std::atomic<std::size_t> size{0};   // published with release, read by flush()
  std::atomic<std::uint64_t> dropped{0};
  std::atomic<const char*> name{nullptr};
  int tid;
};

struct state {
  std::atomic<bool> on{false};
  std::atomic<std::uint64_t> next_id{1};
  std::atomic<int> rank{0};  // read by probes without the lock
  std::mutex mutex;  // guards the fields below
  std::vector<std::unique_ptr<thread_buffer>> buffers;
  std::string dir;
  int ranks = 1;
  std::size_t capacity = options{}.events_per_thread;
  std::int64_t session_begin = 0;  // local clock; events before it belong to an earlier session
  std::int64_t offset = 0, rtt = -1, origin = 0;
  bool aligned = false;
};

// Never destroyed: threads may still record while static destructors run at exit.
inline state& global() {
  static state* s = new state;
  return *s;
}

inline thread_buffer*& local_slot() {
  thread_local thread_buffer* mine = nullptr;
  return mine;
}

// The calling thread's buffer; allocated once per thread, on its first event while tracing.
inline thread_buffer* local_buffer() {
  auto*& mine = local_slot();
  if (!mine) {
    auto& s = global();
    std::lock_guard<std::mutex> lock(s.mutex);
    s.buffers.push_back(std::make_unique<thread_buffer>(s.capacity, static_cast<int>(s.buffers.size())));
    mine = s.buffers.back().get();
  }
  return mine;
}

inline void record(const event& e) noexcept {
  thread_buffer* b = nullptr;
  try {
    b = local_buffer();
  } catch (...) {
    return;  // out of memory for a first buffer: lose the event, not the run
  }
  const std::size_t n = b->size.load(std::memory_order_relaxed);
  if (n == b->events.size()) {
    b->dropped.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  b->events[n] = e;
  b->size.store(n + 1, std::memory_order_release);
}

inline void copy_name(char (&out)[sizeof(event::comm)], const std::string& in) noexcept {
  const std::size_t n = std::min(in.size(), sizeof(out) - 1);
  std::memcpy(out, in.data(), n);
  out[n] = '\0';
}

inline void write_string(std::FILE* f, const char* s) {
  std::fputc('"', f);
  for (; s && *s; ++s) {
    const auto c = static_cast<unsigned char>(*s);
    if (c == '"' || c == '\\') std::fprintf(f, "\\%c", c);
    else if (c < 0x20) std::fprintf(f, "\\u%04x", c);
    else std::fputc(c, f);
  }
  std::fputc('"', f);
}

// Writes the events of every thread since the session began, timestamps in microseconds on
// rank 0's clock (when aligned), as one Chrome trace JSON object.
inline void write(std::FILE* f, state& s) {
  const std::int64_t base = s.offset + s.origin;  // rank 0's origin in this clock
  const int rank = s.rank.load(std::memory_order_relaxed);
  auto us = [&](std::int64_t ns) { return static_cast<double>(ns - base) / 1000.0; };
  std::fprintf(f, "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n");
  std::fprintf(f, "{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":%d,\"tid\":0,\"args\":{\"name\":\"rank %d\"}},\n",
               rank, rank);
  std::fprintf(f, "{\"ph\":\"M\",\"name\":\"process_sort_index\",\"pid\":%d,\"tid\":0,\"args\":{\"sort_index\":%d}}",
               rank, rank);
  std::uint64_t dropped = 0;
  for (auto& b : s.buffers) {
    dropped += b->dropped.load(std::memory_order_relaxed);
    const char* lane = b->name.load(std::memory_order_acquire);
    std::fprintf(f, ",\n{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":%d,\"tid\":%d,\"args\":{\"name\":", rank,
                 b->tid);
    if (lane) {
      write_string(f, lane);
    } else {
      std::fprintf(f, "\"thread %d\"", b->tid);
    }
    std::fprintf(f, "}}");
    const std::size_t n = b->size.load(std::memory_order_acquire);
    for (std::size_t i = 0; i < n; ++i) {
      const event& e = b->events[i];
      if (e.ts < s.session_begin) continue;
      std::fprintf(f, ",\n{\"ph\":\"%c\",\"name\":", e.phase);
      write_string(f, e.name);
      std::fprintf(f, ",\"cat\":");
      write_string(f, e.category);
      std::fprintf(f, ",\"pid\":%d,\"tid\":%d,\"ts\":%.3f", rank, b->tid, us(e.ts));
      if (e.phase == 'X') std::fprintf(f, ",\"dur\":%.3f", static_cast<double>(e.dur) / 1000.0);
      if (e.phase == 'i') std::fprintf(f, ",\"s\":\"t\"");
      if (e.phase == 'b' || e.phase == 'e') std::fprintf(f, ",\"id\":\"0x%llx\"", static_cast<unsigned long long>(e.id));
      if (e.phase == 'b') {
        std::fprintf(f, ",\"args\":{\"comm\":");
        write_string(f, e.comm);
        std::fprintf(f, ",\"seq\":%lld}", static_cast<long long>(e.arg));
      } else if (e.arg >= 0 && e.arg_name) {
        std::fprintf(f, ",\"args\":{");
        write_string(f, e.arg_name);
        std::fprintf(f, ":%lld}", static_cast<long long>(e.arg));
      }
      std::fputc('}', f);
    }
  }
  std::fprintf(f,
               "\n],\"otherData\":{\"producer\":\"flexcomm\",\"rank\":%d,\"ranks\":%d,\"aligned\":%s,"
               "\"clock_offset_us\":%.3f,\"clock_rtt_us\":%.3f,\"dropped\":%llu}}\n",
               rank, s.ranks, s.aligned ? "true" : "false", static_cast<double>(s.offset) / 1000.0,
               static_cast<double>(s.rtt) / 1000.0, static_cast<unsigned long long>(dropped));
}

}  // namespace detail

inline bool enabled() noexcept { return detail::global().on.load(std::memory_order_relaxed); }

inline std::string file_of(const std::string& dir, int rank) {
  return dir + "/flexcomm-trace-" + std::to_string(rank) + ".json";
}

inline void start(const std::string& dir, int rank, options opts) {
  check(!dir.empty(), "trace", "no directory given for the trace files");
  check(opts.events_per_thread > 0, "trace", "events_per_thread must be positive");
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  check(!ec, "trace", cat("cannot create '", dir, "': ", ec.message()));
  auto& s = detail::global();
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    s.dir = dir;
    s.rank.store(rank, std::memory_order_relaxed);
    s.capacity = opts.events_per_thread;  // for threads that record for the first time from now
    s.session_begin = now();
    s.origin = s.session_begin;
    s.offset = 0;
    s.rtt = -1;
    s.aligned = false;
  }
  s.on.store(true, std::memory_order_relaxed);
}

inline void set_clock(std::int64_t offset_ns, std::int64_t rtt_ns, std::int64_t origin_ns, int ranks) {
  auto& s = detail::global();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.offset = offset_ns;
  s.rtt = rtt_ns;
  s.origin = origin_ns;
  s.ranks = ranks;
  s.aligned = true;
}

inline void flush() {
  auto& s = detail::global();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (s.dir.empty()) return;
  const std::string path = file_of(s.dir, s.rank.load(std::memory_order_relaxed));
  const std::string partial = path + ".partial";
  std::FILE* f = std::fopen(partial.c_str(), "w");
  check(f != nullptr, "trace", cat("cannot write '", partial, "': ", std::strerror(errno)));
  detail::write(f, s);
  const bool ok = std::fflush(f) == 0 && !std::ferror(f);
  std::fclose(f);
  check(ok && std::rename(partial.c_str(), path.c_str()) == 0, "trace", cat("cannot write '", path, "'"));
}

inline void stop() {
  auto& s = detail::global();
  if (!s.on.exchange(false, std::memory_order_relaxed)) return;
  flush();
}

inline std::uint64_t dropped() noexcept {
  auto& s = detail::global();
  std::lock_guard<std::mutex> lock(s.mutex);
  std::uint64_t n = 0;
  for (auto& b : s.buffers) n += b->dropped.load(std::memory_order_relaxed);
  return n;
}

inline void name_thread(const char* name) {
  if (!enabled()) return;
  if (auto* b = detail::local_buffer()) b->name.store(name, std::memory_order_release);
}

inline span::~span() {
  if (begin_) complete(name_, category_, begin_, now(), arg_, arg_name_);
}

inline void complete(const char* name, const char* category, std::int64_t begin, std::int64_t end, std::int64_t arg,
                     const char* arg_name) noexcept {
  if (!enabled()) return;
  detail::event e;
  e.ts = begin;
  e.dur = end - begin;
  e.name = name;
  e.category = category;
  e.arg = arg;
  e.arg_name = arg_name;
  detail::record(e);
}

inline void instant(const char* name, const char* category, std::int64_t arg, const char* arg_name) noexcept {
  if (!enabled()) return;
  detail::event e;
  e.ts = now();
  e.phase = 'i';
  e.name = name;
  e.category = category;
  e.arg = arg;
  e.arg_name = arg_name;
  detail::record(e);
}

inline std::uint64_t collective_begin(const char* kind, const std::string& comm, std::uint64_t sequence,
                                      const char* category) noexcept {
  if (!enabled()) return 0;
  detail::event e;
  e.ts = now();
  e.phase = 'b';
  e.name = kind;
  e.category = category;
  e.arg = static_cast<std::int64_t>(sequence);
  // Unique across ranks, so merged files keep every rank's operations apart.
  e.id = (static_cast<std::uint64_t>(detail::global().rank.load(std::memory_order_relaxed)) << 40) |
         detail::global().next_id.fetch_add(1, std::memory_order_relaxed);
  detail::copy_name(e.comm, comm);
  detail::record(e);
  return e.id;
}

inline void collective_end(const char* kind, std::uint64_t id, const char* category) noexcept {
  if (id == 0 || !enabled()) return;
  detail::event e;
  e.ts = now();
  e.phase = 'e';
  e.name = kind;
  e.category = category;
  e.id = id;
  detail::record(e);
}

}  // namespace flexcomm::trace
