// flexcomm's device layer on the host, for tests (see flexcomm/backend/cuda/runtime.hpp for the
// interface): the device backends' logic runs unchanged on a machine without a GPU, in CI and under
// the sanitizers. A test double, so it lives under tests/ and is never installed: programs built
// with FLEXCOMM_DEVICE_STANDIN put tests/standin on their include path.
//
// Asynchronous the way a GPU is. Each stream is an ordered queue run by a worker thread of its
// own; a queued copy or kernel runs only after a random delay (up to FLEXCOMM_STANDIN_LATENCY
// microseconds, default 200), so a result read before its stream got there is stale, and two
// streams not ordered against each other run in any order. Streams made without non_blocking
// follow CUDA's legacy default stream rules (each waits for the default stream's earlier work,
// and the default stream for theirs). cudaMemcpy's rules are kept: from pageable memory to the
// device it returns before the copy lands; the other way it waits. Events complete when their
// stream reaches them. Kernels (combine, divide) are core/reduce.hpp's host loops. NCCL's calls
// go over MPI, each communicator a private MPI communicator whose operations are handed to MPI
// in the order they were issued, as NCCL runs them; a group runs as one task on its first
// stream, the group's other streams joined to it, as NCCL does.
//
// Several devices (FLEXCOMM_STANDIN_DEVICES, default 1), with CUDA's rules for them (the CUDA C++
// Programming Guide, "Multi-Device System"): each host thread has a current device, device 0 until
// it sets one; memory, streams and events belong to the device current when they were made, and
// each device has its own legacy default stream. A kernel launched into another device's stream
// fails (invalid resource handle), as does recording an event on another device's stream; copies,
// event queries and stream waits across devices succeed. A kernel that touches another device's
// memory (peer access is never enabled) faults when it runs: an illegal address, sticky, so every
// later call fails as a poisoned context does. NCCL refuses a buffer of another device than its
// communicator's. Every runtime call but the few that need no context (get/set device aside:
// cudaSetDevice opens one since CUDA 12) opens the primary context of the current device, and
// contexts() says which devices this process opened one on.
//
// NCCL's communicators are nonblocking, as flexcomm's config asks: init and split return
// ncclInProgress and stay in progress until every rank has joined (a missing rank leaves them
// there), ncclCommFinalize stays in progress while work issued on the communicator is outstanding,
// and ncclCommGetAsyncError reports an asynchronous error (ncclRemoteError, ncclSystemError) or a
// poisoned context (ncclUnhandledCudaError). A split may make its new communicator blocking
// (config.blocking = 1, as flexcomm's point-to-point child is): its calls complete their enqueue
// before they return, never ncclInProgress; the first send or receive between two ranks connects
// them inside the call that launches it (ncclGroupEnd), which blocks the host until the peer posts
// its side, or until the communicator is aborted from another thread (then an error); its
// ncclCommFinalize blocks until its work is done. Two test hooks at the end (inject_async_error,
// inject_kernel_fault) make the faults a GPU node shows; the library never calls them.
//
// CUDA graphs by stream capture, with the runtime's rules (cudaStreamBeginCapture,
// cudaStreamIsCapturing, cudaThreadExchangeStreamCaptureMode): work issued into a capturing stream
// (copies, kernels, NCCL groups) becomes a node of its graph instead of running; a stream that
// waits on an event recorded in the capture joins it; cudaGraphLaunch queues the nodes on a
// stream in capture order, an NCCL node taking its communicators' turns at each launch, so a
// replayed allreduce posts its MPI operation then, in issue order. A synchronize of a capturing
// stream, a query of an event recorded in a capture, and, in global and thread-local mode, a
// potentially unsafe call (allocations, frees, synchronizations, event queries: global mode from
// any thread) fail and invalidate the capture; so does work on the legacy default stream while a
// blocking stream captures (cudaErrorStreamCaptureImplicit). Per-thread capture modes
// (cudaThreadExchangeStreamCaptureMode) and child graphs are not modelled.
#pragma once

#include <mpi.h>
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <flexcomm/core/datatype.hpp>
#include <flexcomm/core/error.hpp>
#include <flexcomm/core/reduce.hpp>
#include <flexcomm/core/setting_values.hpp>
#include <flexcomm/core/settings.hpp>
#include <flexcomm/backend/mpi/types.hpp>

namespace flexcomm::device {

inline constexpr const char* implementation = "host stand-in (tests only)";

namespace standin {
struct stream_state;
struct event_state;
struct nccl_state;
struct graph_state;
}  // namespace standin

using stream_t = standin::stream_state*;
using event_t = standin::event_state*;
enum error_t : int {};
inline constexpr error_t success{0};
inline constexpr error_t invalid_value{1};
inline constexpr error_t invalid_device{101};
inline constexpr error_t invalid_handle{400};
inline constexpr error_t not_ready{600};
inline constexpr error_t illegal_address{700};
inline constexpr error_t capture_unsupported{900};
inline constexpr error_t capture_invalidated{901};
inline constexpr error_t capture_unmatched{903};
inline constexpr error_t capture_unjoined{904};
inline constexpr error_t capture_isolation{905};
inline constexpr error_t capture_implicit{906};
inline constexpr error_t captured_event{907};
inline constexpr error_t capture_wrong_thread{908};

// CUDA graphs: a captured stream records its work into a graph, which launches replay.
using graph_t = standin::graph_state*;
using graph_exec_t = standin::graph_state*;
enum capture_mode_t : int {};
inline constexpr capture_mode_t capture_global{0};
inline constexpr capture_mode_t capture_thread_local{1};
inline constexpr capture_mode_t capture_relaxed{2};
enum capture_status_t : int {};
inline constexpr capture_status_t capture_none{0};
inline constexpr capture_status_t capture_active{1};
inline constexpr capture_status_t capture_was_invalidated{2};

using nccl_comm_t = standin::nccl_state*;
struct nccl_id_t {
  char internal[128];
};
enum nccl_result_t : int {};
inline constexpr nccl_result_t nccl_success{0};
inline constexpr nccl_result_t nccl_unhandled_cuda_error{1};
inline constexpr nccl_result_t nccl_system_error{2};
inline constexpr nccl_result_t nccl_internal_error{3};
inline constexpr nccl_result_t nccl_invalid_argument{4};
inline constexpr nccl_result_t nccl_invalid_usage{5};
inline constexpr nccl_result_t nccl_remote_error{6};
inline constexpr nccl_result_t nccl_in_progress{7};

namespace standin {

using clock = std::chrono::steady_clock;

// A point in one stream's queue: reached once that stream has completed `seq` tasks.
struct mark {
  std::shared_ptr<stream_state> stream;
  std::uint64_t seq = 0;
};

struct task {
  std::function<void()> run;
  std::vector<mark> after;
  clock::time_point not_before;
};

struct engine;
struct capture_state;

struct stream_state {
  int device = 0;
  bool blocking = true;  // ordered with its device's legacy default stream
  std::deque<task> queue;
  std::uint64_t enqueued = 0, completed = 0;
  bool closing = false;
  std::shared_ptr<capture_state> capture;  // while capturing: its work goes into this graph
};

struct event_state {
  int device = 0;
  mark at;  // empty: never recorded, reads as reached
  // Recorded in a capture: a point in its graph (the nodes before it), not in a queue.
  std::shared_ptr<capture_state> captured;
  std::vector<std::size_t> tip;
};

// One node of a graph: queues its work on a stream when the graph is launched (under the
// engine's mutex); `after`: the nodes it depends on, all earlier in capture order.
struct graph_node {
  std::function<void(engine&, const std::shared_ptr<stream_state>&)> launch;
  std::vector<std::size_t> after;
};

// One capture sequence, cudaStreamBeginCapture to cudaStreamEndCapture: its streams (the origin,
// and those that joined by waiting on an event recorded in it), its nodes so far in issue order,
// and per stream the nodes that stream's next work follows.
struct capture_state {
  capture_mode_t mode = capture_global;
  std::thread::id thread;  // that began it
  int device = 0;
  std::shared_ptr<stream_state> origin;
  std::vector<std::shared_ptr<stream_state>> streams;
  std::map<const stream_state*, std::vector<std::size_t>> tips;
  std::vector<graph_node> nodes;
  bool invalidated = false, ended = false;
};

// A captured graph, or an instantiated one: its nodes, replayed in capture order on the stream
// it is launched into (one order that keeps every dependency of the graph).
struct graph_state {
  std::vector<graph_node> nodes;
  int device = 0;
};

struct allocation {
  std::size_t bytes;
  bool pinned;
  std::size_t capacity;  // of the block behind it
  int device;            // -1: pinned host memory, which every device reaches
};

// The calling thread's current device: 0 until it sets one, as in CUDA.
inline int& current_device() {
  thread_local int device = 0;
  return device;
}

// The process's device: every field under `mutex`, every change announced on `progress`.
struct engine {
  std::mutex mutex;
  std::condition_variable progress;
  std::vector<std::shared_ptr<stream_state>> legacy;               // each device's default stream
  std::map<stream_state*, std::shared_ptr<stream_state>> streams;  // live, legacy included
  std::vector<int> contexts;                                       // per device: 1 once opened
  std::atomic<int> sticky{0};  // a kernel faulted: the context is poisoned, every call fails
  std::map<const std::byte*, allocation> memory;
  // Released device blocks, by capacity, kept for later device allocations only: on a GPU a
  // device address never becomes a host one, and the nccl backend remembers device pointers by
  // address. Handed back to the heap, a block came back as a trainer's host vector, which that
  // memory then took for device memory: an allreduce issued on one rank only (CI's
  // standin_nccl_backend np4 timeout on Open MPI, 1 run in 26 here). Poisoned for ASan while they wait.
  std::multimap<std::size_t, std::byte*> released;
  // Set once an aborted communicator left operations in MPI: MPI may still read and write their
  // buffers (a real abort stops the kernels), so memory released after that is leaked, never
  // poisoned or handed out again.
  std::atomic<bool> mpi_holds_buffers{false};
  std::atomic<std::uint64_t> calls{0};
  std::chrono::microseconds latency{200};
  std::vector<std::shared_ptr<capture_state>> captures;  // active capture sequences

  static engine& instance() {
    static engine* e = [] {
      auto* made = new engine;  // never destroyed: detached workers wait on it until exit
      if (const char* text = setting("FLEXCOMM_STANDIN_LATENCY"))
        made->latency = std::chrono::microseconds(parse_standin_latency(text));
      const int devices = setting("FLEXCOMM_STANDIN_DEVICES") ? parse_standin_devices(setting("FLEXCOMM_STANDIN_DEVICES")) : 1;
      std::lock_guard<std::mutex> lock(made->mutex);
      made->contexts.assign(static_cast<std::size_t>(devices), 0);
      for (int d = 0; d < devices; ++d) made->legacy.push_back(made->start_locked(true, d));
      return made;
    }();
    return *e;
  }

  int devices() const { return static_cast<int>(legacy.size()); }

  // A call that needs a context: opens the current device's, and fails once the context is poisoned.
  error_t use_context_locked() {
    contexts[static_cast<std::size_t>(current_device())] = 1;
    return static_cast<error_t>(sticky.load());
  }

  std::shared_ptr<stream_state> start_locked(bool blocking, int device) {
    auto s = std::make_shared<stream_state>();
    s->device = device;
    s->blocking = blocking;
    streams.emplace(s.get(), s);
    std::thread([this, s] { work(s); }).detach();
    return s;
  }

  // nullptr: the current device's legacy default stream.
  std::shared_ptr<stream_state> resolve_locked(stream_t s) {
    if (!s) return legacy[static_cast<std::size_t>(current_device())];
    auto it = streams.find(s);
    return it == streams.end() ? nullptr : it->second;
  }

  static bool reached(const mark& m) { return !m.stream || m.stream->completed >= m.seq; }

  clock::time_point when() {
    thread_local std::minstd_rand random(static_cast<unsigned>(std::hash<std::thread::id>{}(std::this_thread::get_id())));
    const auto most = latency.count();
    return clock::now() + std::chrono::microseconds(most > 0 ? static_cast<long>(random() % static_cast<unsigned long>(most + 1)) : 0);
  }

  // Queues `run` on `s` after `after`, with the legacy default stream's ordering; returns the
  // mark of its completion. On a capturing stream `run` becomes a node of its graph instead (an
  // empty mark: nothing is queued).
  mark enqueue_locked(const std::shared_ptr<stream_state>& s, std::function<void()> run, std::vector<mark> after = {}) {
    if (s->capture) {
      if (run)
        capture_locked({s.get()}, [run](engine& e, const std::shared_ptr<stream_state>& on) { e.enqueue_locked(on, run); });
      return {};
    }
    task t{std::move(run), std::move(after), when()};
    const auto& own_legacy = legacy[static_cast<std::size_t>(s->device)];
    if (s == own_legacy) {
      for (auto& [raw, other] : streams)
        if (other != own_legacy && other->device == s->device && other->blocking && other->enqueued > other->completed)
          t.after.push_back({other, other->enqueued});
    } else if (s->blocking && own_legacy->enqueued > own_legacy->completed) {
      t.after.push_back({own_legacy, own_legacy->enqueued});
    }
    s->queue.push_back(std::move(t));
    ++s->enqueued;
    progress.notify_all();
    return {s, s->enqueued};
  }

  // A node of the capture `streams` are in (one capture): after their work so far, and before
  // their next.
  void capture_locked(const std::vector<stream_state*>& streams, std::function<void(engine&, const std::shared_ptr<stream_state>&)> launch) {
    auto& c = *streams.front()->capture;
    std::vector<std::size_t> after;
    for (const auto* s : streams)
      for (const std::size_t n : c.tips[s])
        if (std::find(after.begin(), after.end(), n) == after.end()) after.push_back(n);
    c.nodes.push_back({std::move(launch), std::move(after)});
    for (const auto* s : streams) c.tips[s] = {c.nodes.size() - 1};
  }

  // Work queued on `s` while streams capture, by CUDA's rules: on the legacy default stream
  // while a blocking stream of its device captures, it would depend on the capture implicitly
  // (cudaErrorStreamCaptureImplicit, and the capture is invalidated); on a stream whose capture
  // was invalidated, cudaErrorStreamCaptureInvalidated.
  error_t queue_rules_locked(const std::shared_ptr<stream_state>& s) {
    if (s->capture) return s->capture->invalidated ? capture_invalidated : success;
    if (captures.empty() || s != legacy[static_cast<std::size_t>(s->device)]) return success;
    bool implicit = false;
    for (auto& c : captures)
      for (const auto& member : c->streams)
        if (member->blocking && member->device == s->device) implicit = c->invalidated = true;
    return implicit ? capture_implicit : success;
  }

  // A potentially unsafe call (an allocation, a free, a synchronization, an event query) while
  // streams capture: prohibited on a thread that began a capture in global or thread-local mode,
  // and on every thread while a capture in global mode is under way (cudaStreamCaptureMode);
  // the call fails with cudaErrorStreamCaptureUnsupported and invalidates those captures.
  error_t unsafe_call_locked() {
    if (captures.empty()) return success;
    const auto me = std::this_thread::get_id();
    bool refused = false;
    for (auto& c : captures)
      if (c->mode == capture_global || (c->mode == capture_thread_local && c->thread == me)) refused = c->invalidated = true;
    return refused ? capture_unsupported : success;
  }

  // A call that conflicts with capture whatever the mode: refused, and the capture invalidated.
  error_t conflicts_locked(capture_state& c, error_t why) {
    if (!c.ended) c.invalidated = true;
    return why;
  }

  // Ends capture sequence `c`: its streams execute again.
  void end_capture_locked(const std::shared_ptr<capture_state>& c) {
    for (auto& s : c->streams) s->capture.reset();
    c->streams.clear();
    c->origin.reset();
    c->ended = true;
    captures.erase(std::find(captures.begin(), captures.end(), c));
  }

  void wait_locked(std::unique_lock<std::mutex>& lock, const mark& m) {
    progress.wait(lock, [&] { return reached(m); });
  }

  void work(std::shared_ptr<stream_state> s) {
    std::unique_lock<std::mutex> lock(mutex);
    for (;;) {
      if (s->queue.empty()) {
        if (s->closing) break;
        progress.wait(lock);
        continue;
      }
      task& next = s->queue.front();
      if (!std::all_of(next.after.begin(), next.after.end(), reached)) {
        progress.wait(lock);
        continue;
      }
      if (clock::now() < next.not_before) {
        progress.wait_until(lock, next.not_before);
        continue;
      }
      auto run = std::move(next.run);
      s->queue.pop_front();
      lock.unlock();
      if (run) run();
      lock.lock();
      ++s->completed;
      progress.notify_all();
    }
    streams.erase(s.get());
  }

  // The allocation `p` lies in, if any.
  const allocation* find_locked(const void* p) const {
    const auto* b = static_cast<const std::byte*>(p);
    auto it = memory.upper_bound(b);
    if (it == memory.begin()) return nullptr;
    --it;
    return b < it->first + std::max<std::size_t>(it->second.bytes, 1) ? &it->second : nullptr;
  }

  // Waits for every stream of `device` (all devices: -1).
  void synchronize_all_locked(std::unique_lock<std::mutex>& lock, int device = -1) {
    std::vector<mark> all;
    for (auto& [raw, s] : streams)
      if (device < 0 || s->device == device) all.push_back({s, s->enqueued});
    for (const auto& m : all) wait_locked(lock, m);
  }

  // The device whose memory `p` is, or -1 for host memory (pinned or not).
  int device_of_locked(const void* p) const {
    const auto* a = find_locked(p);
    return a ? a->device : -1;
  }

  // A kernel on `s` reading or writing `p`: true when that is another device's memory, which the
  // kernel cannot reach without peer access.
  bool faults_locked(const stream_state& s, const void* p) const {
    const int d = device_of_locked(p);
    return d >= 0 && d != s.device;
  }
};

// The engine, counting one call of the device layer's interface.
inline engine& the() {
  auto& e = engine::instance();
  e.calls.fetch_add(1, std::memory_order_relaxed);
  return e;
}

// A released device block is poisoned until it is handed out again: a use meanwhile is an ASan
// report, as a use after cudaFree would be a fault.
inline void set_poisoned(const void* p, std::size_t bytes, bool poisoned) {
#if defined(__SANITIZE_ADDRESS__)
  if (poisoned)
    ASAN_POISON_MEMORY_REGION(p, bytes);
  else
    ASAN_UNPOISON_MEMORY_REGION(p, bytes);
#else
  static_cast<void>(p);
  static_cast<void>(bytes);
  static_cast<void>(poisoned);
#endif
}

inline error_t allocate(void** p, std::size_t bytes, bool pinned) {
  auto& e = the();
  {
    std::lock_guard<std::mutex> lock(e.mutex);
    if (const error_t rc = e.use_context_locked()) return rc;
    if (const error_t rc = e.unsafe_call_locked()) return rc;
  }
  const std::size_t wanted = std::max<std::size_t>(bytes, 1);
  std::byte* m = nullptr;
  std::size_t capacity = wanted;
  if (!pinned) {
    std::lock_guard<std::mutex> lock(e.mutex);
    auto it = e.released.lower_bound(wanted);
    if (it != e.released.end()) {
      m = it->second;
      capacity = it->first;
      e.released.erase(it);
    }
  }
  if (m)
    set_poisoned(m, capacity, false);
  else
    m = static_cast<std::byte*>(::operator new(wanted, std::align_val_t{256}));
  // Fresh device memory holds whatever was there: a pattern no result plausibly is.
  std::memset(m, 0xa5, wanted);
  std::lock_guard<std::mutex> lock(e.mutex);
  e.memory[m] = {bytes, pinned, capacity, pinned ? -1 : current_device()};
  *p = m;
  return success;
}

inline error_t release(void* p, bool pinned) {
  if (!p) return success;
  auto& e = the();
  std::unique_lock<std::mutex> lock(e.mutex);
  if (const error_t rc = e.use_context_locked()) return rc;
  if (const error_t rc = e.unsafe_call_locked()) return rc;
  auto it = e.memory.find(static_cast<const std::byte*>(p));
  if (it == e.memory.end() || it->second.pinned != pinned) return invalid_value;
  e.synchronize_all_locked(lock);  // cudaFree and cudaFreeHost wait for the device
  const allocation a = it->second;
  e.memory.erase(it);
  if (e.mpi_holds_buffers.load()) return success;
  if (pinned) {
    ::operator delete(p, std::align_val_t{256});
  } else {
    set_poisoned(p, a.capacity, true);
    e.released.emplace(a.capacity, static_cast<std::byte*>(p));
  }
  return success;
}

}  // namespace standin

// How many device-layer calls this process made (counted here; the CUDA build does not count).
inline constexpr bool counts_calls = true;
inline std::uint64_t calls() noexcept { return standin::engine::instance().calls.load(std::memory_order_relaxed); }

inline error_t get_device(int* device) {
  standin::the();
  *device = standin::current_device();
  return success;
}
// Opens the device's primary context, as cudaSetDevice does since CUDA 12.
inline error_t set_device(int device) {
  auto& e = standin::the();
  std::lock_guard<std::mutex> lock(e.mutex);
  if (device < 0 || device >= e.devices()) return invalid_device;
  standin::current_device() = device;
  return e.use_context_locked();
}
inline error_t device_count(int* devices) {
  *devices = standin::the().devices();
  return success;
}
// Whether this process has opened `device`'s primary context (cuDevicePrimaryCtxGetState).
inline error_t has_context(int device, bool* active) {
  auto& e = standin::the();
  std::lock_guard<std::mutex> lock(e.mutex);
  if (device < 0 || device >= e.devices()) return invalid_device;
  *active = e.contexts[static_cast<std::size_t>(device)] != 0;
  return success;
}
inline error_t last_error() { return static_cast<error_t>(standin::engine::instance().sticky.load()); }
namespace standin {
// The codes the stand-in returns, with CUDA's name and text for each.
struct error_text {
  int code;
  const char* name;
  const char* text;
};
inline const error_text& text_of(error_t e) {
  static constexpr error_text known[] = {{0, "cudaSuccess", "no error"},
                                         {1, "cudaErrorInvalidValue", "invalid argument"},
                                         {101, "cudaErrorInvalidDevice", "invalid device ordinal"},
                                         {400, "cudaErrorInvalidResourceHandle", "invalid resource handle"},
                                         {600, "cudaErrorNotReady", "device not ready"},
                                         {700, "cudaErrorIllegalAddress", "an illegal memory access was encountered"},
                                         {900, "cudaErrorStreamCaptureUnsupported", "operation not permitted when stream is capturing"},
                                         {901, "cudaErrorStreamCaptureInvalidated", "operation failed due to a previous error during capture"},
                                         {903, "cudaErrorStreamCaptureUnmatched", "capture was not initiated in this stream"},
                                         {904, "cudaErrorStreamCaptureUnjoined", "capturing stream has unjoined work"},
                                         {905, "cudaErrorStreamCaptureIsolation", "dependency created on uncaptured work in another stream"},
                                         {906, "cudaErrorStreamCaptureImplicit", "operation would make the legacy stream depend on a capturing blocking stream"},
                                         {907, "cudaErrorCapturedEvent", "operation not permitted on an event last recorded in a capturing stream"},
                                         {908, "cudaErrorStreamCaptureWrongThread", "attempt to terminate a thread-local capture sequence from another thread"}};
  static constexpr error_text unknown{-1, "cudaErrorUnknown", "unknown error"};
  for (const auto& k : known)
    if (k.code == static_cast<int>(e)) return k;
  return unknown;
}
}  // namespace standin
inline const char* error_name(error_t e) { return standin::text_of(e).name; }
inline const char* error_string(error_t e) { return standin::text_of(e).text; }
inline error_t pci_bus_id(char* out, int length, int) {
  standin::the();
  if (length > 0) std::snprintf(out, static_cast<std::size_t>(length), "standin:00:00.0");
  return success;
}
inline error_t device_synchronize() {
  auto& e = standin::the();
  std::unique_lock<std::mutex> lock(e.mutex);
  if (const error_t rc = e.use_context_locked()) return rc;
  if (const error_t rc = e.unsafe_call_locked()) return rc;
  e.synchronize_all_locked(lock, standin::current_device());
  return static_cast<error_t>(e.sticky.load());
}

inline error_t malloc_device(void** p, std::size_t bytes) { return standin::allocate(p, bytes, false); }
inline error_t free_device(void* p) { return standin::release(p, false); }
inline error_t malloc_pinned(void** p, std::size_t bytes) { return standin::allocate(p, bytes, true); }
inline error_t free_pinned(void* p) { return standin::release(p, true); }
inline error_t is_device_memory(const void* p, bool* on_device) {
  auto& e = standin::the();
  std::lock_guard<std::mutex> lock(e.mutex);
  *on_device = e.device_of_locked(p) >= 0;
  return e.use_context_locked();  // cudaPointerGetAttributes initializes the runtime
}

// cudaMemcpyAsync: pageable host memory is read at the call (CUDA stages it before returning) and
// written before returning (CUDA makes that copy synchronous); the rest runs on the stream.
inline error_t copy_async(void* dst, const void* src, std::size_t bytes, stream_t s) {
  auto& e = standin::the();
  std::unique_lock<std::mutex> lock(e.mutex);
  if (const error_t rc = e.use_context_locked()) return rc;
  auto stream = e.resolve_locked(s);  // another device's stream is allowed for a copy
  if (!stream) return invalid_handle;
  if (const error_t rc = e.queue_rules_locked(stream)) return rc;
  if (bytes == 0) return success;
  const bool pageable_src = !e.find_locked(src), pageable_dst = !e.find_locked(dst);
  // CUDA stages pageable memory at the call: a graph could not replay that (the stand-in refuses
  // it rather than replay a copy of what the host held at capture).
  if (stream->capture && (pageable_src || pageable_dst)) return e.conflicts_locked(*stream->capture, capture_unsupported);
  if (pageable_src) {
    auto staged = std::make_shared<std::vector<std::byte>>(static_cast<const std::byte*>(src),
                                                          static_cast<const std::byte*>(src) + bytes);
    e.enqueue_locked(stream, [dst, staged] { std::memcpy(dst, staged->data(), staged->size()); });
    return success;
  }
  const auto done = e.enqueue_locked(stream, [dst, src, bytes] { std::memmove(dst, src, bytes); });
  if (pageable_dst) e.wait_locked(lock, done);
  return success;
}

// cudaMemcpy: on the legacy default stream; from pageable memory to the device it returns once
// the source is staged, before the copy lands; otherwise it returns when the copy is done.
inline error_t copy_sync(void* dst, const void* src, std::size_t bytes) {
  auto& e = standin::the();
  std::unique_lock<std::mutex> lock(e.mutex);
  if (const error_t rc = e.use_context_locked()) return rc;
  const auto legacy = e.resolve_locked(nullptr);
  if (const error_t rc = e.queue_rules_locked(legacy)) return rc;
  if (const error_t rc = e.unsafe_call_locked()) return rc;
  if (bytes == 0) return success;
  const bool pageable_src = !e.find_locked(src), device_dst = e.find_locked(dst) != nullptr;
  if (pageable_src && device_dst) {
    e.wait_locked(lock, e.enqueue_locked(legacy, {}));  // "a stream sync is performed before"
    auto staged = std::make_shared<std::vector<std::byte>>(static_cast<const std::byte*>(src),
                                                          static_cast<const std::byte*>(src) + bytes);
    e.enqueue_locked(legacy, [dst, staged] { std::memcpy(dst, staged->data(), staged->size()); });
    return success;
  }
  e.wait_locked(lock, e.enqueue_locked(legacy, [dst, src, bytes] { std::memmove(dst, src, bytes); }));
  return static_cast<error_t>(e.sticky.load());
}

// cudaMemset on device memory: queued on the legacy default stream.
inline error_t fill(void* dst, int value, std::size_t bytes) {
  auto& e = standin::the();
  std::lock_guard<std::mutex> lock(e.mutex);
  if (const error_t rc = e.use_context_locked()) return rc;
  if (!e.find_locked(dst)) return invalid_value;
  if (const error_t rc = e.queue_rules_locked(e.resolve_locked(nullptr))) return rc;
  if (bytes) e.enqueue_locked(e.resolve_locked(nullptr), [dst, value, bytes] { std::memset(dst, value, bytes); });
  return success;
}

inline error_t stream_create(stream_t* s, bool non_blocking) {
  auto& e = standin::the();
  std::lock_guard<std::mutex> lock(e.mutex);
  if (const error_t rc = e.use_context_locked()) return rc;
  *s = e.start_locked(!non_blocking, standin::current_device()).get();
  return success;
}
// Returns at once, as cudaStreamDestroy does: the queued work still runs.
inline error_t stream_destroy(stream_t s) {
  auto& e = standin::the();
  std::lock_guard<std::mutex> lock(e.mutex);
  if (const error_t rc = e.use_context_locked()) return rc;
  auto stream = e.resolve_locked(s);
  if (!stream || stream->device < 0 || stream == e.legacy[static_cast<std::size_t>(stream->device)]) return invalid_handle;
  stream->closing = true;
  e.progress.notify_all();
  return success;
}
inline error_t stream_synchronize(stream_t s) {
  auto& e = standin::the();
  std::unique_lock<std::mutex> lock(e.mutex);
  if (const error_t rc = e.use_context_locked()) return rc;
  auto stream = e.resolve_locked(s);
  if (!stream) return invalid_handle;
  if (stream->capture) return e.conflicts_locked(*stream->capture, capture_unsupported);
  if (const error_t rc = e.queue_rules_locked(stream)) return rc;
  if (const error_t rc = e.unsafe_call_locked()) return rc;
  e.wait_locked(lock, e.enqueue_locked(stream, {}));
  return static_cast<error_t>(e.sticky.load());
}
namespace standin {
// A wait on an event recorded in a capture: the stream joins that capture (a fork), its next
// work after the event's point in the graph. A stream in another capture cannot depend on it.
inline error_t wait_in_capture_locked(engine& e, const std::shared_ptr<stream_state>& s, const event_state& ev) {
  const auto& c = ev.captured;
  if (c->ended) return captured_event;
  if (s->capture && s->capture != c) {
    e.conflicts_locked(*s->capture, capture_isolation);
    return e.conflicts_locked(*c, capture_isolation);
  }
  if (!s->capture) {
    s->capture = c;
    c->streams.push_back(s);
  }
  auto& tip = c->tips[s.get()];
  for (const std::size_t n : ev.tip)
    if (std::find(tip.begin(), tip.end(), n) == tip.end()) tip.push_back(n);
  return success;
}
}  // namespace standin

// Across devices too: the way devices wait for each other.
inline error_t stream_wait(stream_t s, event_t ev) {
  auto& e = standin::the();
  std::lock_guard<std::mutex> lock(e.mutex);
  if (const error_t rc = e.use_context_locked()) return rc;
  auto stream = e.resolve_locked(s);
  if (!stream || !ev) return invalid_handle;
  if (const error_t rc = e.queue_rules_locked(stream)) return rc;
  if (ev->captured) return standin::wait_in_capture_locked(e, stream, *ev);
  // A capture depends only on work captured in it (in-stream order aside).
  if (stream->capture) return e.conflicts_locked(*stream->capture, capture_isolation);
  if (ev->at.stream) e.enqueue_locked(stream, {}, {ev->at});
  return success;
}

inline error_t event_create(event_t* ev) {
  auto& e = standin::the();
  std::lock_guard<std::mutex> lock(e.mutex);
  if (const error_t rc = e.use_context_locked()) return rc;
  *ev = new standin::event_state;
  (*ev)->device = standin::current_device();
  return success;
}
inline error_t event_destroy(event_t ev) {
  auto& e = standin::the();
  std::lock_guard<std::mutex> lock(e.mutex);
  e.use_context_locked();  // cudaEventDestroy runs on the current device's context
  delete ev;
  return success;
}
// The event and the stream must belong to one device.
inline error_t event_record(event_t ev, stream_t s) {
  auto& e = standin::the();
  std::lock_guard<std::mutex> lock(e.mutex);
  if (const error_t rc = e.use_context_locked()) return rc;
  auto stream = e.resolve_locked(s);
  if (!stream || !ev || ev->device != stream->device) return invalid_handle;
  if (const error_t rc = e.queue_rules_locked(stream)) return rc;
  if (stream->capture) {  // a point in the graph, which a stream that waits for it joins
    ev->captured = stream->capture;
    ev->tip = stream->capture->tips[stream.get()];
    ev->at = {};
    return success;
  }
  ev->captured.reset();
  ev->tip.clear();
  ev->at = e.enqueue_locked(stream, {});  // a marker, so the legacy stream's ordering applies to it too
  return success;
}
// Query and synchronize succeed whichever device is current (and open its context).
inline error_t event_query(event_t ev) {
  auto& e = standin::the();
  std::lock_guard<std::mutex> lock(e.mutex);
  if (const error_t rc = e.use_context_locked()) return rc;
  if (!ev) return invalid_handle;
  if (ev->captured) return e.conflicts_locked(*ev->captured, captured_event);  // it marks a graph, not a queue
  if (const error_t rc = e.unsafe_call_locked()) return rc;
  if (!standin::engine::reached(ev->at)) return not_ready;
  return static_cast<error_t>(e.sticky.load());
}
inline error_t event_synchronize(event_t ev) {
  auto& e = standin::the();
  std::unique_lock<std::mutex> lock(e.mutex);
  if (const error_t rc = e.use_context_locked()) return rc;
  if (!ev) return invalid_handle;
  if (ev->captured) return e.conflicts_locked(*ev->captured, captured_event);
  if (const error_t rc = e.unsafe_call_locked()) return rc;
  e.wait_locked(lock, ev->at);
  return static_cast<error_t>(e.sticky.load());
}

// CUDA graphs by stream capture. Capture cannot begin on the legacy default stream, and must end
// on the stream where it began, from the same thread unless it is relaxed.
inline error_t stream_begin_capture(stream_t s, capture_mode_t mode) {
  auto& e = standin::the();
  std::lock_guard<std::mutex> lock(e.mutex);
  if (const error_t rc = e.use_context_locked()) return rc;
  auto stream = e.resolve_locked(s);
  if (!s || !stream || stream == e.legacy[static_cast<std::size_t>(stream->device)] || stream->capture) return invalid_value;
  auto c = std::make_shared<standin::capture_state>();
  c->mode = mode;
  c->thread = std::this_thread::get_id();
  c->device = stream->device;
  c->origin = stream;
  c->streams.push_back(stream);
  c->tips[stream.get()] = {};
  stream->capture = c;
  e.captures.push_back(std::move(c));
  return success;
}
// Every node must lead to the origin's last work: a stream that forked and never joined back is
// cudaErrorStreamCaptureUnjoined. An invalidated capture ends with no graph.
inline error_t stream_end_capture(stream_t s, graph_t* graph) {
  auto& e = standin::the();
  std::lock_guard<std::mutex> lock(e.mutex);
  *graph = nullptr;
  auto stream = e.resolve_locked(s);
  if (!stream || !stream->capture || stream->capture->origin != stream) return capture_unmatched;
  auto c = stream->capture;
  if (c->mode != capture_relaxed && c->thread != std::this_thread::get_id()) return capture_wrong_thread;
  e.end_capture_locked(c);
  if (c->invalidated) return capture_invalidated;
  std::vector<char> joined(c->nodes.size(), 0);
  std::vector<std::size_t> todo = c->tips[stream.get()];
  while (!todo.empty()) {
    const std::size_t n = todo.back();
    todo.pop_back();
    if (joined[n]) continue;
    joined[n] = 1;
    todo.insert(todo.end(), c->nodes[n].after.begin(), c->nodes[n].after.end());
  }
  if (std::find(joined.begin(), joined.end(), 0) != joined.end()) return capture_unjoined;
  *graph = new standin::graph_state{std::move(c->nodes), c->device};
  return success;
}
// On the legacy default stream while a blocking stream of the device captures: an implicit
// dependency (cudaErrorStreamCaptureImplicit), which does not invalidate the capture here.
inline error_t stream_is_capturing(stream_t s, capture_status_t* status) {
  auto& e = standin::the();
  std::lock_guard<std::mutex> lock(e.mutex);
  if (const error_t rc = e.use_context_locked()) return rc;
  auto stream = e.resolve_locked(s);
  if (!stream) return invalid_handle;
  *status = capture_none;
  if (stream == e.legacy[static_cast<std::size_t>(stream->device)]) {
    for (const auto& c : e.captures)
      for (const auto& member : c->streams)
        if (member->blocking && member->device == stream->device) return capture_implicit;
    return success;
  }
  if (stream->capture) *status = stream->capture->invalidated ? capture_was_invalidated : capture_active;
  return success;
}
inline error_t graph_instantiate(graph_exec_t* exec, graph_t graph) {
  standin::the();
  if (!graph) return invalid_value;
  *exec = new standin::graph_state(*graph);
  return success;
}
// Queues the graph's nodes on `s`, in capture order, as one launch.
inline error_t graph_launch(graph_exec_t exec, stream_t s) {
  auto& e = standin::the();
  std::lock_guard<std::mutex> lock(e.mutex);
  if (const error_t rc = e.use_context_locked()) return rc;
  auto stream = e.resolve_locked(s);
  if (!stream || !exec || stream->device != exec->device) return invalid_handle;
  if (const error_t rc = e.queue_rules_locked(stream)) return rc;
  if (stream->capture) return e.conflicts_locked(*stream->capture, capture_unsupported);  // child graphs: not modelled
  for (const auto& node : exec->nodes) node.launch(e, stream);
  return success;
}
inline error_t graph_destroy(graph_t graph) {
  standin::the();
  delete graph;
  return success;
}
inline error_t graph_exec_destroy(graph_exec_t exec) {
  standin::the();
  delete exec;
  return success;
}

// Kernels: the host reference loops, run when the stream gets there.
namespace standin {
// A kernel launch: into a stream of the current device only; a kernel that reaches another
// device's memory faults when it runs, and the fault is sticky.
template <class Kernel>
error_t launch_kernel(stream_t s, bool runs, std::initializer_list<const void*> touches, Kernel&& kernel) {
  auto& e = the();
  std::lock_guard<std::mutex> lock(e.mutex);
  if (const error_t rc = e.use_context_locked()) return rc;
  auto stream = e.resolve_locked(s);
  if (!stream || stream->device != current_device()) return invalid_handle;
  if (const error_t rc = e.queue_rules_locked(stream)) return rc;
  if (!runs) return success;
  bool faults = false;
  for (const void* p : touches) faults = faults || e.faults_locked(*stream, p);
  if (faults)
    e.enqueue_locked(stream, [&e] { e.sticky.store(static_cast<int>(illegal_address)); });
  else
    e.enqueue_locked(stream, std::forward<Kernel>(kernel));
  return success;
}
}  // namespace standin

template <class T>
error_t combine(op o, T* inout, const T* in, std::size_t n, stream_t s) {
  return standin::launch_kernel(s, n > 0, {inout, in}, [o, inout, in, n] { flexcomm::combine(o, inout, in, n); });
}
template <class T>
error_t divide(T* buf, std::size_t n, int ranks, stream_t s) {
  return standin::launch_kernel(s, n > 0 && ranks > 1, {buf}, [buf, n, ranks] { flexcomm::divide_by(buf, n, ranks); });
}

// NCCL over MPI.
namespace standin {

// A nonblocking init or split under way (config.blocking = 0, as flexcomm makes them): NCCL says
// ncclInProgress on the communicators concerned until every rank has joined, so a missing rank
// leaves them in progress instead of blocking the caller. Phase 1 is nonblocking MPI (MPI_Comm_idup
// for an init; an MPI_Iallgather of colors and keys for a split); phase 2, once every rank joined
// it, makes the split's communicators among ranks that are all there (as the MPI backend's
// split_of does). What MPI writes lives here, leaked rather than freed when the job is given up
// (an abort) before MPI is done with it.
struct setup_job {
  std::mutex mutex;
  std::vector<MPI_Request> requests;
  MPI_Comm* slots = new MPI_Comm[3]{MPI_COMM_NULL, MPI_COMM_NULL, MPI_COMM_NULL};
  std::vector<int>* keys = nullptr;  // a split's: this rank's (color, key), then every rank's
  std::function<nccl_result_t(setup_job&)> finish;  // phase 2
  nccl_result_t result = nccl_in_progress;

  // In progress until every rank has joined phase 1; then what phase 2 gave.
  nccl_result_t poll() {
    std::lock_guard<std::mutex> lock(mutex);
    if (result != nccl_in_progress) return result;
    int done = 0;
    if (MPI_Testall(static_cast<int>(requests.size()), requests.data(), &done, MPI_STATUSES_IGNORE) != MPI_SUCCESS)
      return result = nccl_system_error;
    if (!done) return nccl_in_progress;
    return result = finish ? finish(*this) : nccl_success;
  }
  setup_job() = default;
  setup_job(const setup_job&) = delete;
  setup_job& operator=(const setup_job&) = delete;
  ~setup_job() {
    if (result == nccl_in_progress) return;  // MPI may still write into slots and keys
    delete[] slots;
    delete keys;
  }
};

// One NCCL communicator: `ops` carries its operations, `control` its splits (a collective of the
// calling thread, which must not interleave with operations a stream posts on `ops`).
struct nccl_state {
  MPI_Comm ops = MPI_COMM_NULL, control = MPI_COMM_NULL, connect = MPI_COMM_NULL;
  int rank = 0, size = 1;  // a split's: once its setup is done
  int device = 0;  // the device current when it was made, as NCCL's cudaDev
  std::uint64_t issued = 0, posted = 0;  // under the engine's mutex
  std::atomic<bool> aborted{false};
  std::atomic<int> active{0};  // operations handed to MPI and not yet complete
  std::atomic<int> async_error{0};  // what NCCL found (injected by a test: inject_async_error)
  std::atomic<bool> finalizing{false};
  bool blocking = false;  // config.blocking = 1: set when made, before any call on it
  // A blocking communicator's pairs connected so far, each way: peers sent to, received from.
  std::vector<int> sends_to, receives_from;  // the calling thread's (flexcomm's lock)

  // Phase 2 of a setup: the communicator's own MPI communicators.
  void connect_ranks(MPI_Comm o, MPI_Comm c, MPI_Comm k) {
    ops = o;
    control = c;
    connect = k;
    MPI_Comm_rank(ops, &rank);
    MPI_Comm_size(ops, &size);
  }
  void set_job(std::shared_ptr<setup_job> j) {
    std::lock_guard<std::mutex> lock(job_mutex);
    job = std::move(j);
  }
  std::shared_ptr<setup_job> current_job() {
    std::lock_guard<std::mutex> lock(job_mutex);
    return job;
  }

  // ncclCommEnsureReady: an asynchronous error stays the answer of every call; a setup not
  // done refuses ("Attempt to use communicator before the previous operation returned ncclSuccess").
  nccl_result_t ready() {
    if (const int e = async_error.load()) return static_cast<nccl_result_t>(e);
    if (auto j = current_job()) {
      const nccl_result_t r = j->poll();
      if (r != nccl_success) return r == nccl_in_progress ? nccl_invalid_argument : r;
    }
    return nccl_success;
  }

  // ncclCommGetAsyncError: an error found; a poisoned context (its kernels fail); a setup, a
  // finalize or the first collective's handshake still under way.
  nccl_result_t status() {
    if (const int e = async_error.load()) return static_cast<nccl_result_t>(e);
    if (engine::instance().sticky.load()) return nccl_unhandled_cuda_error;
    if (auto j = current_job()) {
      const nccl_result_t r = j->poll();
      if (r != nccl_success) return r;
    }
    if (finalizing.load() && !quiet()) return nccl_in_progress;
    return connecting() ? nccl_in_progress : nccl_success;
  }

  // Every operation issued has been handed to MPI and completed there.
  bool quiet() {
    auto& e = engine::instance();
    std::lock_guard<std::mutex> lock(e.mutex);
    return issued == posted && active.load() == 0;
  }

  // NCCL connects a communicator's ranks lazily, at its first collective (NCCL_RUNTIME_CONNECT):
  // on a nonblocking communicator that call returns ncclInProgress and the communicator stays in
  // progress until every rank has issued its first collective too, so a rank missing there
  // stalls the enqueue itself, not only the wait (the first GPU run's nccl np2-np4 failure).
  // A barrier on `connect` is that handshake.
  bool connecting() {
    std::lock_guard<std::mutex> lock(handshake_mutex);
    if (!handshake_started || handshake == MPI_REQUEST_NULL) return false;
    int done = 0;
    MPI_Test(&handshake, &done, MPI_STATUS_IGNORE);
    return !done;
  }
  // At a collective: starts the handshake the first time; true while it is not complete.
  bool connect_for_collective() {
    {
      std::lock_guard<std::mutex> lock(handshake_mutex);
      if (!handshake_started) {
        handshake_started = true;
        MPI_Ibarrier(connect, &handshake);
      }
    }
    return connecting();
  }

  ~nccl_state() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    // An aborted operation's MPI request can never be freed: its communicator is left to the end.
    if (finalized || active.load() > 0) return;
    if (ops != MPI_COMM_NULL) MPI_Comm_free(&ops);
    if (control != MPI_COMM_NULL) MPI_Comm_free(&control);
    if (connect != MPI_COMM_NULL && handshake == MPI_REQUEST_NULL) MPI_Comm_free(&connect);
  }

 private:
  std::mutex handshake_mutex, job_mutex;
  MPI_Request handshake = MPI_REQUEST_NULL;
  bool handshake_started = false;
  std::shared_ptr<setup_job> job;  // the last init or split this communicator took part in
};

inline std::mutex& nccl_registry_mutex() {
  static auto* m = new std::mutex;
  return *m;
}
inline std::map<nccl_state*, std::shared_ptr<nccl_state>>& nccl_registry() {
  static auto* r = new std::map<nccl_state*, std::shared_ptr<nccl_state>>;
  return *r;
}
inline std::shared_ptr<nccl_state> find(nccl_comm_t c) {
  std::lock_guard<std::mutex> lock(nccl_registry_mutex());
  auto it = nccl_registry().find(c);
  return it == nccl_registry().end() ? nullptr : it->second;
}
inline nccl_comm_t adopt(std::shared_ptr<nccl_state> state) {
  std::lock_guard<std::mutex> lock(nccl_registry_mutex());
  nccl_comm_t handle = state.get();
  nccl_registry().emplace(handle, std::move(state));
  return handle;
}

inline std::string& last_nccl_error() {
  thread_local std::string text;
  return text;
}
inline nccl_result_t nccl_fail(nccl_result_t r, std::string why) {
  last_nccl_error() = std::move(why);
  return r;
}

// A query of communicator `c`: `read` on its state, or an error when there is no such one.
template <class Read>
nccl_result_t with_comm(nccl_comm_t c, Read&& read) {
  the();
  auto state = find(c);
  if (!state) return nccl_fail(nccl_invalid_argument, "invalid communicator");
  read(*state);
  return nccl_success;
}

template <class F>
void with_element(dtype t, F&& f) {
  switch (t) {
    case dtype::f32: f(float{}); break;
    case dtype::f64: f(double{}); break;
    case dtype::i32: f(std::int32_t{}); break;
    case dtype::i64: f(std::int64_t{}); break;
    case dtype::u8: f(std::uint8_t{}); break;
    case dtype::f16: f(half{}); break;
    case dtype::bf16: f(bfloat16{}); break;
  }
}

inline std::size_t bytes_of(dtype t, std::size_t count) {
  std::size_t size = 0;
  with_element(t, [&](auto x) { size = sizeof(x); });
  return size * count;
}

// One NCCL call: its MPI operations (posted in order) and the host work after they complete.
struct call {
  std::shared_ptr<nccl_state> comm;
  std::shared_ptr<stream_state> stream;
  std::function<void(MPI_Comm, std::vector<MPI_Request>&)> post;
  std::function<void()> after;
  int peer = -1;  // a send's or receive's
  bool sends = false;
};

struct group_state {
  int depth = 0;
  std::vector<call> calls;
  bool connecting = false;  // a call of the group waits for its communicator's first handshake
};
inline group_state& this_threads_group() {
  thread_local group_state g;
  return g;
}

// Runs on the group's first stream: waits for each communicator's turn, posts, then polls.
inline void run_group(const std::vector<call>& calls,
                      const std::vector<std::pair<std::shared_ptr<nccl_state>, std::uint64_t>>& turns) {
  auto& e = engine::instance();
  {
    std::unique_lock<std::mutex> lock(e.mutex);
    e.progress.wait(lock, [&] {
      for (const auto& [comm, seq] : turns)
        if (comm->posted != seq && !comm->aborted.load()) return false;
      return true;
    });
  }
  std::vector<MPI_Request> requests;
  bool aborted = false, failed = false;
  for (const auto& [comm, seq] : turns) {
    aborted = aborted || comm->aborted.load();
    failed = failed || comm->async_error.load() != 0;
  }
  if (!aborted && !failed)
    for (const auto& c : calls) c.post(c.comm->ops, requests);
  {
    std::lock_guard<std::mutex> lock(e.mutex);
    for (const auto& [comm, seq] : turns) {
      comm->posted = seq + 1;
      if (!aborted) comm->active.fetch_add(1);
    }
    e.progress.notify_all();
  }
  if (aborted) return;
  // A communicator with an asynchronous error holds its kernels (stuck on a peer that is gone)
  // until it is aborted: the group never completes.
  const auto stuck = [&] {
    return std::any_of(turns.begin(), turns.end(), [](const auto& t) { return t.first->async_error.load() != 0; });
  };
  for (;;) {
    int done = 0;
    if (!requests.empty()) MPI_Testall(static_cast<int>(requests.size()), requests.data(), &done, MPI_STATUSES_IGNORE);
    else done = 1;
    if (done && !stuck()) break;
    for (const auto& [comm, seq] : turns)
      if (comm->aborted.load()) {  // what MPI still holds is left to it, as a killed kernel's is
        if (!done) e.mpi_holds_buffers.store(true);
        return;
      }
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
  for (const auto& [comm, seq] : turns) comm->active.fetch_sub(1);
  for (const auto& c : calls)
    if (c.after) c.after();
}

using turn_list = std::vector<std::pair<std::shared_ptr<nccl_state>, std::uint64_t>>;

// On a blocking communicator NCCL connects a pair at their first send or receive, in the call that
// launches it: the sender and the receiver exchange a hello on `connect` (tag 1 from the sender,
// 2 from the receiver), and the host waits until the peer's arrives. Aborted meanwhile (from
// another thread), the call gives up: an error. Once per pair and direction.
inline nccl_result_t connect_pairs(const std::vector<call>& calls) {
  static const int hello = 1;
  std::vector<std::pair<std::shared_ptr<nccl_state>, std::pair<int, bool>>> links;
  for (const auto& c : calls) {
    if (c.peer < 0 || !c.comm->blocking) continue;
    const auto& done = c.sends ? c.comm->sends_to : c.comm->receives_from;
    const auto link = std::make_pair(c.comm, std::make_pair(c.peer, c.sends));
    if (std::find(done.begin(), done.end(), c.peer) == done.end() &&
        std::find(links.begin(), links.end(), link) == links.end())
      links.push_back(link);
  }
  if (links.empty()) return nccl_success;
  std::vector<MPI_Request> sends(links.size(), MPI_REQUEST_NULL), receives(links.size(), MPI_REQUEST_NULL);
  std::vector<int> got(links.size(), 0);
  for (std::size_t i = 0; i < links.size(); ++i) {
    const auto& [comm, link] = links[i];
    MPI_Isend(&hello, 1, MPI_INT, link.first, link.second ? 1 : 2, comm->connect, &sends[i]);
    MPI_Irecv(&got[i], 1, MPI_INT, link.first, link.second ? 2 : 1, comm->connect, &receives[i]);
  }
  for (;;) {
    int done = 0;
    MPI_Testall(static_cast<int>(receives.size()), receives.data(), &done, MPI_STATUSES_IGNORE);
    if (done) break;
    if (std::any_of(links.begin(), links.end(), [](const auto& l) { return l.first->aborted.load(); })) {
      for (auto& r : receives)
        if (r != MPI_REQUEST_NULL) MPI_Cancel(&r);
      MPI_Waitall(static_cast<int>(receives.size()), receives.data(), MPI_STATUSES_IGNORE);
      for (auto& r : sends) MPI_Request_free(&r);  // from a static buffer: left to MPI
      return nccl_fail(nccl_invalid_usage, "communicator aborted while connecting to a peer that did not take part");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
  MPI_Waitall(static_cast<int>(sends.size()), sends.data(), MPI_STATUSES_IGNORE);
  for (const auto& [comm, link] : links) (link.second ? comm->sends_to : comm->receives_from).push_back(link.first);
  return nccl_success;
}

// A blocking communicator's first collective connects its ranks inside the call: the host waits.
inline nccl_result_t connect_collective(nccl_state& comm) {
  while (comm.connecting()) {
    if (comm.aborted.load()) return nccl_fail(nccl_invalid_usage, "communicator aborted while connecting");
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
  return nccl_success;
}

// Each communicator of a group takes its next turn: groups run in the order they were issued
// (or, captured in a graph, launched). Under the engine's mutex.
inline turn_list take_turns_locked(const std::vector<call>& calls) {
  turn_list turns;
  for (const auto& c : calls) {
    const bool seen = std::any_of(turns.begin(), turns.end(), [&](const auto& t) { return t.first == c.comm; });
    if (!seen) turns.emplace_back(c.comm, c.comm->issued++);
  }
  return turns;
}

// A group issued into a capturing stream is one node of its graph: at each launch of the graph
// it takes its communicators' turns and runs as one task on the launch stream, as NCCL's
// captured kernels replay (NCCL supports capture since 2.9). Its streams must be in that capture.
inline nccl_result_t capture_group_locked(engine& e, std::vector<call> calls) {
  std::vector<stream_state*> streams;
  for (const auto& c : calls) {
    if (c.stream->capture != calls.front().stream->capture)
      return nccl_fail(nccl_invalid_usage, "a group over a capturing stream and a stream outside its capture");
    if (std::find(streams.begin(), streams.end(), c.stream.get()) == streams.end()) streams.push_back(c.stream.get());
  }
  e.capture_locked(streams, [calls = std::move(calls)](engine& en, const std::shared_ptr<stream_state>& on) {
    en.enqueue_locked(on, [calls, turns = take_turns_locked(calls)] { run_group(calls, turns); });
  });
  return nccl_success;
}

inline nccl_result_t launch(std::vector<call> calls) {
  if (calls.empty()) return nccl_success;
  auto& e = engine::instance();
  std::lock_guard<std::mutex> lock(e.mutex);
  if (std::any_of(calls.begin(), calls.end(), [](const call& c) { return c.stream->capture != nullptr; }))
    return capture_group_locked(e, std::move(calls));
  const turn_list turns = take_turns_locked(calls);
  // The group's other streams: their work so far comes first, and their later work waits for it.
  const auto first = calls.front().stream;
  std::vector<mark> joined;
  std::vector<std::shared_ptr<stream_state>> others;
  for (const auto& c : calls)
    if (c.stream != first && std::find(others.begin(), others.end(), c.stream) == others.end()) {
      others.push_back(c.stream);
      joined.push_back(e.enqueue_locked(c.stream, {}));
    }
  const auto done = e.enqueue_locked(
      first, [calls = std::move(calls), turns] { run_group(calls, turns); }, std::move(joined));
  for (const auto& s : others) e.enqueue_locked(s, {}, {done});
  return nccl_success;
}

enum class kind { collective, point_to_point };

inline nccl_result_t submit(nccl_comm_t c, stream_t s, std::initializer_list<const void*> buffers,
                            std::function<void(MPI_Comm, std::vector<MPI_Request>&)> post,
                            std::function<void()> after = {}, kind what = kind::collective, int peer = -1,
                            bool sends = false) {
  auto comm = find(c);
  if (!comm) return nccl_fail(nccl_invalid_argument, "invalid communicator");
  if (comm->aborted.load()) return nccl_fail(nccl_invalid_usage, "communicator was aborted");
  if (const nccl_result_t ready = comm->ready(); ready != nccl_success)
    return nccl_fail(ready, ready == nccl_invalid_argument
                                ? "Attempt to use communicator before the previous operation returned ncclSuccess"
                                : "an asynchronous error was found on the communicator");
  std::shared_ptr<stream_state> stream;
  {
    auto& e = engine::instance();
    std::lock_guard<std::mutex> lock(e.mutex);
    if (e.sticky.load()) return nccl_fail(nccl_unhandled_cuda_error, "Cuda failure 700 'an illegal memory access was encountered'");
    e.contexts[static_cast<std::size_t>(comm->device)] = 1;  // NCCL works on its communicator's device
    stream = e.resolve_locked(s);
    // NCCL checks each buffer's device against the communicator's (argcheck), and its kernels
    // cannot run in another device's stream.
    for (const void* b : buffers) {
      const int d = e.device_of_locked(b);
      if (d >= 0 && d != comm->device)
        return nccl_fail(nccl_invalid_argument, cat("buffer allocated on device ", d, " mismatches with NCCL device ",
                                                    comm->device));
    }
    if (stream && stream->device != comm->device)
      return nccl_fail(nccl_unhandled_cuda_error, cat("Cuda failure 'invalid resource handle': a stream of device ",
                                                      stream->device, " for NCCL device ", comm->device));
    if (stream)
      if (const error_t rc = e.queue_rules_locked(stream))
        return nccl_fail(nccl_unhandled_cuda_error, cat("Cuda failure '", text_of(rc).text, "'"));
  }
  if (!stream) return nccl_fail(nccl_invalid_argument, "invalid stream");
  bool connecting = what == kind::collective && comm->connect_for_collective();
  if (connecting && comm->blocking) {
    if (const nccl_result_t rc = connect_collective(*comm); rc != nccl_success) return rc;
    connecting = false;
  }
  call one{std::move(comm), std::move(stream), std::move(post), std::move(after), peer, sends};
  auto& group = this_threads_group();
  if (group.depth > 0) {
    group.calls.push_back(std::move(one));
    group.connecting = group.connecting || connecting;
    return nccl_success;
  }
  std::vector<call> alone;
  alone.push_back(std::move(one));
  if (const nccl_result_t rc = connect_pairs(alone); rc != nccl_success) return rc;
  const nccl_result_t rc = launch(std::move(alone));
  return rc == nccl_success && connecting ? nccl_in_progress : rc;
}

// `r` by reference: read after the call that sets it (argument order is unspecified).
inline void post_checked(int rc, std::vector<MPI_Request>& requests, const MPI_Request& r) {
  if (rc == MPI_SUCCESS) requests.push_back(r);
}

// Host work after a reduction: avg is the sum divided by the rank count.
inline std::function<void()> averaged(op o, void* buf, std::size_t count, dtype t, int ranks) {
  if (o != op::avg || count == 0) return {};
  return [buf, count, t, ranks] {
    with_element(t, [&](auto x) { divide_by(static_cast<decltype(x)*>(buf), count, ranks); });
  };
}
inline MPI_Op reduction(op o, dtype t) { return flexcomm::detail::mpi_op(o == op::avg ? op::sum : o, t); }

}  // namespace standin

inline nccl_result_t nccl_get_unique_id(nccl_id_t* id) {
  standin::the();
  std::memset(id->internal, 0, sizeof id->internal);
  std::snprintf(id->internal, sizeof id->internal, "standin");
  return nccl_success;
}
// Collective over `over`, whose ranks are the communicator's (the CUDA build's NCCL finds them by
// the unique id instead). Nonblocking, as flexcomm's config asks: ncclInProgress, and the
// communicator in progress until every rank has joined (a missing rank leaves it there).
inline nccl_result_t nccl_comm_init(nccl_comm_t* comm, int ranks, const nccl_id_t&, int rank, MPI_Comm over) {
  {
    auto& e = standin::the();
    std::lock_guard<std::mutex> lock(e.mutex);
    if (e.use_context_locked()) return standin::nccl_fail(nccl_unhandled_cuda_error, "the CUDA context is poisoned");
  }
  int size = 0, me = -1;
  MPI_Comm_size(over, &size);
  MPI_Comm_rank(over, &me);
  if (size != ranks || me != rank)
    return standin::nccl_fail(nccl_invalid_argument, "ranks differ from the MPI communicator's");
  auto job = std::make_shared<standin::setup_job>();
  job->requests.assign(3, MPI_REQUEST_NULL);
  for (std::size_t i = 0; i < 3; ++i)
    if (MPI_Comm_idup(over, &job->slots[i], &job->requests[i]) != MPI_SUCCESS)
      return standin::nccl_fail(nccl_system_error, "MPI_Comm_idup failed");
  auto state = std::make_shared<standin::nccl_state>();
  state->device = standin::current_device();
  state->rank = rank;
  state->size = ranks;
  job->finish = [weak = std::weak_ptr<standin::nccl_state>(state)](standin::setup_job& j) {
    if (auto s = weak.lock()) s->connect_ranks(j.slots[0], j.slots[1], j.slots[2]);
    return nccl_success;
  };
  state->set_job(std::move(job));
  *comm = standin::adopt(std::move(state));
  return nccl_in_progress;
}
namespace standin {
// Phase 2 of a split, once every rank's color and key are known: the new communicator among the
// ranks of this color, ordered by key (MPI_Comm_split's order), made by those ranks alone.
inline nccl_result_t split_among(MPI_Comm parent, const std::vector<int>& keys, int n, nccl_state& child) {
  std::vector<int> ranks;
  for (int r = 0; r < n; ++r)
    if (keys[2 + 2 * static_cast<std::size_t>(r)] == keys[0]) ranks.push_back(r);
  std::stable_sort(ranks.begin(), ranks.end(), [&](int a, int b) {
    return keys[3 + 2 * static_cast<std::size_t>(a)] < keys[3 + 2 * static_cast<std::size_t>(b)];
  });
  MPI_Group all = MPI_GROUP_NULL, group = MPI_GROUP_NULL;
  MPI_Comm_group(parent, &all);
  MPI_Group_incl(all, static_cast<int>(ranks.size()), ranks.data(), &group);
  MPI_Comm control = MPI_COMM_NULL, ops = MPI_COMM_NULL, connect = MPI_COMM_NULL;
  const int rc = MPI_Comm_create_group(parent, group, 0, &control);
  MPI_Group_free(&group);
  MPI_Group_free(&all);
  if (rc != MPI_SUCCESS || MPI_Comm_dup(control, &ops) != MPI_SUCCESS || MPI_Comm_dup(control, &connect) != MPI_SUCCESS)
    return nccl_fail(nccl_system_error, "MPI could not make the split's communicator");
  child.connect_ranks(ops, control, connect);
  return nccl_success;
}
}  // namespace standin
// Nonblocking, as the init: the parent (and the new communicator) stay in progress until every
// rank of the parent has joined. A negative color takes part and gets no communicator. `blocking`:
// the new communicator's (config.blocking = 1); the split itself follows its nonblocking parent,
// as NCCL's does (the handle written when it settles).
inline nccl_result_t nccl_comm_split(nccl_comm_t comm, int color, int key, nccl_comm_t* out, bool blocking = false) {
  standin::the();
  auto parent = standin::find(comm);
  if (!parent) return standin::nccl_fail(nccl_invalid_argument, "invalid communicator");
  if (const nccl_result_t ready = parent->ready(); ready != nccl_success)
    return standin::nccl_fail(ready, "the parent communicator is not ready");
  const int n = parent->size;
  auto job = std::make_shared<standin::setup_job>();
  job->keys = new std::vector<int>(2 + 2 * static_cast<std::size_t>(n));
  (*job->keys)[0] = color < 0 ? MPI_UNDEFINED : color;
  (*job->keys)[1] = key;
  job->requests.assign(1, MPI_REQUEST_NULL);
  if (MPI_Iallgather(job->keys->data(), 2, MPI_INT, job->keys->data() + 2, 2, MPI_INT, parent->control,
                     &job->requests[0]) != MPI_SUCCESS)
    return standin::nccl_fail(nccl_system_error, "MPI_Iallgather failed");
  std::shared_ptr<standin::nccl_state> child;
  if (color >= 0) {
    child = std::make_shared<standin::nccl_state>();
    child->device = parent->device;
    child->blocking = blocking;
    child->set_job(job);
  }
  job->finish = [control = parent->control, n, weak = std::weak_ptr<standin::nccl_state>(child)](standin::setup_job& j) {
    auto c = weak.lock();
    return c ? standin::split_among(control, *j.keys, n, *c) : nccl_success;
  };
  parent->set_job(std::move(job));
  *out = child ? standin::adopt(std::move(child)) : nullptr;
  return nccl_in_progress;
}
inline nccl_result_t nccl_comm_count(nccl_comm_t comm, int* size) {
  return standin::with_comm(comm, [&](standin::nccl_state& c) { *size = c.size; });
}
inline nccl_result_t nccl_comm_user_rank(nccl_comm_t comm, int* rank) {
  return standin::with_comm(comm, [&](standin::nccl_state& c) { *rank = c.rank; });
}
inline nccl_result_t nccl_comm_get_async_error(nccl_comm_t comm, nccl_result_t* state) {
  return standin::with_comm(comm, [&](standin::nccl_state& c) { *state = c.status(); });
}
// Nonblocking: in progress until every operation issued on the communicator has completed (one
// that waits for a peer that is gone never does); an asynchronous error is the answer instead.
// Blocking: the call waits for that, or for an abort from another thread (an error then).
inline nccl_result_t nccl_comm_finalize(nccl_comm_t comm) {
  standin::the();
  auto c = standin::find(comm);
  if (!c) return standin::nccl_fail(nccl_invalid_argument, "invalid communicator");
  if (const nccl_result_t ready = c->ready(); ready != nccl_success)
    return standin::nccl_fail(ready, "ncclCommFinalize on a communicator that is not ready");
  if (c->finalizing.exchange(true)) return standin::nccl_fail(nccl_invalid_argument, "finalized twice");
  if (!c->blocking) return nccl_in_progress;
  for (;;) {
    if (c->aborted.load()) return standin::nccl_fail(nccl_invalid_usage, "communicator aborted while finalizing");
    const nccl_result_t r = c->status();
    if (r != nccl_in_progress) return r;
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}
inline nccl_result_t nccl_comm_destroy(nccl_comm_t comm) {
  standin::the();
  std::lock_guard<std::mutex> lock(standin::nccl_registry_mutex());
  return standin::nccl_registry().erase(comm) ? nccl_success
                                              : standin::nccl_fail(nccl_invalid_argument, "invalid communicator");
}
// Operations not yet handed to MPI never will be; those in MPI are left there.
inline nccl_result_t nccl_comm_abort(nccl_comm_t comm) {
  standin::the();
  auto c = standin::find(comm);
  if (!c) return standin::nccl_fail(nccl_invalid_argument, "invalid communicator");
  c->aborted.store(true);
  {
    auto& e = standin::engine::instance();
    std::lock_guard<std::mutex> lock(e.mutex);
    e.progress.notify_all();
  }
  return nccl_comm_destroy(comm);
}
inline nccl_result_t nccl_group_start() {
  standin::the();
  ++standin::this_threads_group().depth;
  return nccl_success;
}
inline nccl_result_t nccl_group_end() {
  standin::the();
  auto& group = standin::this_threads_group();
  if (group.depth == 0) return standin::nccl_fail(nccl_invalid_usage, "ncclGroupEnd without ncclGroupStart");
  if (--group.depth > 0) return nccl_success;
  std::vector<standin::call> calls;
  calls.swap(group.calls);
  const bool connecting = std::exchange(group.connecting, false);
  if (const nccl_result_t rc = standin::connect_pairs(calls); rc != nccl_success) return rc;
  const nccl_result_t rc = standin::launch(std::move(calls));
  return rc == nccl_success && connecting ? nccl_in_progress : rc;
}

inline nccl_result_t nccl_allreduce(const void* send, void* recv, std::size_t count, dtype t, op o, nccl_comm_t comm,
                                    stream_t s) {
  standin::the();
  auto c = standin::find(comm);
  const int ranks = c ? c->size : 1;
  return standin::submit(
      comm, s, {send, recv},
      [=](MPI_Comm m, std::vector<MPI_Request>& r) {
        MPI_Request q = MPI_REQUEST_NULL;
        standin::post_checked(MPI_Iallreduce(send == recv ? MPI_IN_PLACE : send, recv, static_cast<int>(count),
                                             flexcomm::detail::mpi_type(t), standin::reduction(o, t), m, &q),
                              r, q);
      },
      standin::averaged(o, recv, count, t, ranks));
}
inline nccl_result_t nccl_broadcast(const void* send, void* recv, std::size_t count, dtype t, int root,
                                    nccl_comm_t comm, stream_t s) {
  standin::the();
  return standin::submit(comm, s, {send, recv}, [=](MPI_Comm m, std::vector<MPI_Request>& r) {
    int me = 0;
    MPI_Comm_rank(m, &me);
    if (me == root && send != recv) std::memmove(recv, send, standin::bytes_of(t, count));
    MPI_Request q = MPI_REQUEST_NULL;
    standin::post_checked(MPI_Ibcast(recv, static_cast<int>(count), flexcomm::detail::mpi_type(t), root, m, &q), r, q);
  });
}
inline nccl_result_t nccl_reduce(const void* send, void* recv, std::size_t count, dtype t, op o, int root,
                                 nccl_comm_t comm, stream_t s) {
  standin::the();
  auto c = standin::find(comm);
  const int ranks = c ? c->size : 1;
  const bool at_root = c && c->rank == root;
  return standin::submit(
      comm, s, {send, at_root ? recv : nullptr},
      [=](MPI_Comm m, std::vector<MPI_Request>& r) {
        MPI_Request q = MPI_REQUEST_NULL;
        standin::post_checked(MPI_Ireduce(at_root && send == recv ? MPI_IN_PLACE : send, at_root ? recv : nullptr,
                                          static_cast<int>(count), flexcomm::detail::mpi_type(t),
                                          standin::reduction(o, t), root, m, &q),
                              r, q);
      },
      at_root ? standin::averaged(o, recv, count, t, ranks) : std::function<void()>{});
}
inline nccl_result_t nccl_allgather(const void* send, void* recv, std::size_t count, dtype t, nccl_comm_t comm,
                                    stream_t s) {
  standin::the();
  auto c = standin::find(comm);
  const int me = c ? c->rank : 0;
  return standin::submit(comm, s, {send, recv}, [=](MPI_Comm m, std::vector<MPI_Request>& r) {
    const auto type = flexcomm::detail::mpi_type(t);
    const bool in_place = static_cast<const std::byte*>(send) ==
                          static_cast<const std::byte*>(recv) + standin::bytes_of(t, count) * static_cast<std::size_t>(me);
    MPI_Request q = MPI_REQUEST_NULL;
    standin::post_checked(MPI_Iallgather(in_place ? MPI_IN_PLACE : send, static_cast<int>(count), type, recv,
                                         static_cast<int>(count), type, m, &q),
                          r, q);
  });
}
inline nccl_result_t nccl_reduce_scatter(const void* send, void* recv, std::size_t count, dtype t, op o,
                                         nccl_comm_t comm, stream_t s) {
  standin::the();
  auto c = standin::find(comm);
  const int ranks = c ? c->size : 1;
  return standin::submit(
      comm, s, {send, recv},
      [=](MPI_Comm m, std::vector<MPI_Request>& r) {
        MPI_Request q = MPI_REQUEST_NULL;
        standin::post_checked(MPI_Ireduce_scatter_block(send, recv, static_cast<int>(count),
                                                        flexcomm::detail::mpi_type(t), standin::reduction(o, t), m, &q),
                              r, q);
      },
      standin::averaged(o, recv, count, t, ranks));
}
// NCCL has no tags: one tag keeps MPI's order between a pair of ranks, as NCCL's issue order.
inline nccl_result_t nccl_send(const void* buf, std::size_t count, dtype t, int peer, nccl_comm_t comm, stream_t s) {
  standin::the();
  return standin::submit(comm, s, {buf}, [=](MPI_Comm m, std::vector<MPI_Request>& r) {
    MPI_Request q = MPI_REQUEST_NULL;
    standin::post_checked(MPI_Isend(buf, static_cast<int>(count), flexcomm::detail::mpi_type(t), peer, 0, m, &q), r, q);
  }, {}, standin::kind::point_to_point, peer, true);
}
inline nccl_result_t nccl_recv(void* buf, std::size_t count, dtype t, int peer, nccl_comm_t comm, stream_t s) {
  standin::the();
  return standin::submit(comm, s, {buf}, [=](MPI_Comm m, std::vector<MPI_Request>& r) {
    MPI_Request q = MPI_REQUEST_NULL;
    standin::post_checked(MPI_Irecv(buf, static_cast<int>(count), flexcomm::detail::mpi_type(t), peer, 0, m, &q), r, q);
  }, {}, standin::kind::point_to_point, peer, false);
}
// NCCL's texts (ncclGetErrorString) and the names of its codes.
inline const char* nccl_error_string(nccl_result_t r) {
  switch (static_cast<int>(r)) {
    case 0: return "no error";
    case 1: return "unhandled cuda error";
    case 2: return "unhandled system error";
    case 3: return "internal error";
    case 4: return "invalid argument";
    case 5: return "invalid usage";
    case 6: return "remote process exited or there was a network error";
    case 7: return "NCCL operation in progress";
  }
  return "unknown result code";
}
inline const char* nccl_error_name(nccl_result_t r) {
  static const char* const names[] = {"ncclSuccess",         "ncclUnhandledCudaError", "ncclSystemError",
                                      "ncclInternalError",   "ncclInvalidArgument",    "ncclInvalidUsage",
                                      "ncclRemoteError",     "ncclInProgress"};
  const int i = static_cast<int>(r);
  return i >= 0 && i < 8 ? names[i] : "ncclResult?";
}
inline const char* nccl_last_error() { return standin::last_nccl_error().c_str(); }

// Test hooks: faults a GPU node shows that the stand-in does not make by itself
// (tests/fault/device_fault.cpp injects them). The library under include/ never calls these.
namespace standin {
// NCCL found `code` on `comm`: its proxy saw a peer's connection drop (ncclRemoteError), or a
// socket or memory call failed (ncclSystemError). From now on ncclCommGetAsyncError reports it,
// every call on the communicator returns it (ncclCommEnsureReady), and its operations not yet
// complete never finish, as kernels stuck on a peer that is gone, until the communicator is
// aborted.
inline nccl_result_t inject_async_error(nccl_comm_t comm, nccl_result_t code) {
  auto c = find(comm);
  if (!c) return nccl_fail(nccl_invalid_argument, "invalid communicator");
  c->async_error.store(static_cast<int>(code));
  auto& e = engine::instance();
  std::lock_guard<std::mutex> lock(e.mutex);
  e.progress.notify_all();
  return nccl_success;
}
// A kernel on stream `s` reads an address it may not (cudaErrorIllegalAddress): the calling
// thread waits for it, as cudaStreamSynchronize would, and gets the error. Sticky: the context is
// poisoned and every later call fails with it, NCCL's kernels too (ncclUnhandledCudaError).
inline error_t inject_kernel_fault(stream_t s) {
  auto& e = the();
  std::unique_lock<std::mutex> lock(e.mutex);
  if (const error_t rc = e.use_context_locked()) return rc;
  auto stream = e.resolve_locked(s);
  if (!stream) return invalid_handle;
  e.wait_locked(lock, e.enqueue_locked(stream, [&e] { e.sticky.store(static_cast<int>(illegal_address)); }));
  return static_cast<error_t>(e.sticky.load());
}
}  // namespace standin

}  // namespace flexcomm::device
