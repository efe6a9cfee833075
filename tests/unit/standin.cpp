// The device layer's host stand-in (tests/standin/flexcomm_standin/device.hpp) is asynchronous
// the way a GPU is, so that the device backends' ordering bugs show on a CPU: work runs when its
// stream gets there, events complete when reached, streams not ordered against each other run in
// any order, the legacy default stream orders blocking streams only, and cudaMemcpy from pageable
// memory returns before the copy lands. Races shown on purpose here are left out under
// ThreadSanitizer, which reports them itself (as it would a backend's).
#define BOOST_TEST_MODULE unit_standin
#define FLEXCOMM_DEVICE_STANDIN 1
#include <boost/test/unit_test.hpp>

#include <flexcomm/backend/cuda/error.hpp>
#include <flexcomm/backend/cuda/runtime.hpp>

#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace fc = flexcomm;
namespace device = flexcomm::device;

namespace {

// Up to 2 ms before a queued task runs: long against the host's next step. Three devices.
struct slow_device {
  slow_device() {
    setenv("FLEXCOMM_STANDIN_LATENCY", "2000", 1);
    setenv("FLEXCOMM_STANDIN_DEVICES", "3", 1);
  }
};

void* device_bytes(std::size_t n) {
  void* p = nullptr;
  fc::check_cuda(device::malloc_device(&p, n), "test: malloc");
  return p;
}

int read_int(const void* p) {
  int x = 0;
  fc::check_cuda(device::copy_sync(&x, p, sizeof x), "test: download");
  return x;
}

#if !defined(__SANITIZE_THREAD__)
constexpr int tries = 40;
#endif

}  // namespace

BOOST_TEST_GLOBAL_FIXTURE(slow_device);

BOOST_AUTO_TEST_CASE(work_runs_when_its_stream_gets_there_and_an_event_says_when) {
  device::stream_t s = nullptr;
  fc::check_cuda(device::stream_create(&s, true), "test: stream");
  void* buf = device_bytes(sizeof(int));
  const int seven = 7;
  fc::check_cuda(device::copy_async(buf, &seven, sizeof seven, s), "test: copy");
  device::event_t done = nullptr;
  fc::check_cuda(device::event_create(&done), "test: event");
  BOOST_TEST(device::event_query(done) == device::success);  // never recorded: reached
  fc::check_cuda(device::event_record(done, s), "test: record");
  BOOST_TEST(device::event_query(done) == device::not_ready);  // the copy is still queued
  fc::check_cuda(device::event_synchronize(done), "test: event sync");
  BOOST_TEST(device::event_query(done) == device::success);
  BOOST_TEST(read_int(buf) == 7);
  device::event_destroy(done);
  device::free_device(buf);
  device::stream_destroy(s);
}

BOOST_AUTO_TEST_CASE(kernels_are_the_host_reference_on_the_stream) {
  device::stream_t s = nullptr;
  fc::check_cuda(device::stream_create(&s, false), "test: stream");
  const std::vector<float> a{1, 2, 3, 4}, b{4, 3, 2, 1};
  auto* x = static_cast<float*>(device_bytes(16));
  auto* y = static_cast<float*>(device_bytes(16));
  fc::check_cuda(device::copy_async(x, a.data(), 16, s), "test: up");
  fc::check_cuda(device::copy_async(y, b.data(), 16, s), "test: up");
  fc::check_cuda(device::combine(fc::op::max, x, y, 4, s), "test: combine");
  fc::check_cuda(device::divide(x, 4, 2, s), "test: divide");
  std::vector<float> got(4);
  fc::check_cuda(device::copy_async(got.data(), x, 16, s), "test: down");  // pageable: waits
  BOOST_TEST(got == (std::vector<float>{2, 1.5f, 1.5f, 2}), boost::test_tools::per_element());
  device::free_device(x);
  device::free_device(y);
  device::stream_destroy(s);
}

BOOST_AUTO_TEST_CASE(host_memory_is_told_from_device_memory) {
  void* d = device_bytes(8);
  void* pinned = nullptr;
  fc::check_cuda(device::malloc_pinned(&pinned, 8), "test: pinned");
  std::vector<char> pageable(8);
  bool on = false;
  device::is_device_memory(d, &on);
  BOOST_TEST(on);
  device::is_device_memory(static_cast<char*>(d) + 7, &on);
  BOOST_TEST(on);
  device::is_device_memory(pinned, &on);
  BOOST_TEST(!on);
  device::is_device_memory(pageable.data(), &on);
  BOOST_TEST(!on);
  BOOST_TEST(device::free_device(pinned) == device::invalid_value);  // the wrong kind of free
  BOOST_TEST(device::free_pinned(pinned) == device::success);
  BOOST_TEST(device::free_device(d) == device::success);
}

// As on a GPU, a device address never becomes a host address: a released device block goes to
// later device allocations, not back to the heap, where it came back as host vectors that the
// nccl backend's cache of device pointers took for device memory (an allreduce posted on one rank
// only). The same sizes, and smaller and larger, from the heap after the free: never that block,
// which the next device allocation that fits gets back (with the pattern of fresh memory).
BOOST_AUTO_TEST_CASE(a_released_device_block_never_becomes_host_memory) {
  const std::size_t sizes[] = {32, 4096, 1 << 20};
  for (std::size_t n : sizes) {
    void* d = device_bytes(n);
    std::memset(d, 1, n);
    BOOST_TEST(device::free_device(d) == device::success);
    std::vector<std::vector<char>> host;
    bool reused = false;
    for (int i = 0; i < 64; ++i)
      for (std::size_t m : {n / 2, n, n + 16}) {
        host.emplace_back(m);
        reused = reused || static_cast<void*>(host.back().data()) == d;
      }
    BOOST_TEST(!reused, n << " bytes: a host vector got the released device block");
    void* again = device_bytes(n);
    bool on = false;
    device::is_device_memory(again, &on);
    BOOST_TEST(on);
    BOOST_TEST(static_cast<unsigned char*>(again)[n - 1] == 0xa5);
    BOOST_TEST(device::free_device(again) == device::success);
  }
}

BOOST_AUTO_TEST_CASE(every_call_is_counted) {
  const auto before = device::calls();
  int d = -1;
  device::get_device(&d);
  device::set_device(0);
  BOOST_TEST(device::calls() - before == 2u);
  BOOST_TEST(device::set_device(3) == device::invalid_device);
  BOOST_TEST(device::set_device(-1) == device::invalid_device);
}

bool context_open(int d) {
  bool open = false;
  fc::check_cuda(device::has_context(d, &open), "test: context");
  return open;
}

// CUDA's rules for several devices (Programming Guide, "Multi-Device System"): a thread's device
// is 0 until it sets one, and is its own; asking which device opens nothing, setting one or
// allocating on it opens its primary context.
BOOST_AUTO_TEST_CASE(each_thread_has_its_own_device_and_a_new_one_starts_on_device_0) {
  int count = 0;
  device::device_count(&count);
  BOOST_TEST(count == 3);
  BOOST_TEST(!context_open(2));
  fc::check_cuda(device::set_device(1), "test: set");
  int seen = -1;
  std::thread([&] {
    device::get_device(&seen);
    fc::check_cuda(device::set_device(2), "test: set on a thread");
  }).join();
  BOOST_TEST(seen == 0);
  int here = -1;
  device::get_device(&here);
  BOOST_TEST(here == 1);
  BOOST_TEST(context_open(1));
  BOOST_TEST(context_open(2));
  fc::check_cuda(device::set_device(0), "test: set");
}

// Memory, streams and events belong to the device current when they were made. A kernel goes only
// into a stream of the current device, an event is recorded only on a stream of its own device;
// copies, queries and waits cross devices.
BOOST_AUTO_TEST_CASE(memory_streams_and_events_belong_to_the_device_current_when_made) {
  fc::check_cuda(device::set_device(1), "test: set");
  device::stream_t s1 = nullptr;
  device::event_t e1 = nullptr;
  fc::check_cuda(device::stream_create(&s1, true), "test: stream");
  fc::check_cuda(device::event_create(&e1), "test: event");
  auto* x1 = static_cast<float*>(device_bytes(16));
  fc::check_cuda(device::set_device(2), "test: set");
  device::stream_t s2 = nullptr;
  fc::check_cuda(device::stream_create(&s2, true), "test: stream");
  auto* x2 = static_cast<float*>(device_bytes(16));
  BOOST_TEST(device::combine(fc::op::sum, x1, x1, 4, s1) == device::invalid_handle);
  BOOST_TEST(device::event_record(e1, s2) == device::invalid_handle);
  const std::vector<float> a{1, 2, 3, 4};
  BOOST_TEST(device::copy_async(x1, a.data(), 16, s1) == device::success);
  BOOST_TEST(device::event_record(e1, s1) == device::success);  // both device 1's, whichever is current
  BOOST_TEST(device::stream_wait(s2, e1) == device::success);
  BOOST_TEST(device::copy_async(x2, x1, 16, s2) == device::success);  // a copy between devices
  BOOST_TEST(device::event_synchronize(e1) == device::success);
  fc::check_cuda(device::stream_synchronize(s2), "test: sync");
  std::vector<float> got(4);
  fc::check_cuda(device::copy_sync(got.data(), x2, 16), "test: down");
  BOOST_TEST(got == a, boost::test_tools::per_element());
  device::free_device(x1);
  device::free_device(x2);
  device::event_destroy(e1);
  device::stream_destroy(s1);
  device::stream_destroy(s2);
  fc::check_cuda(device::set_device(0), "test: set");
}

#if !defined(__SANITIZE_THREAD__)
// Without an event, a stream reading what another stream writes sees the old bytes in some runs;
// with the writer's event waited for, never.
BOOST_AUTO_TEST_CASE(streams_not_ordered_against_each_other_run_in_any_order) {
  device::stream_t writer = nullptr, reader = nullptr;
  fc::check_cuda(device::stream_create(&writer, true), "test: stream");
  fc::check_cuda(device::stream_create(&reader, true), "test: stream");
  device::event_t written = nullptr;
  fc::check_cuda(device::event_create(&written), "test: event");
  void* pinned = nullptr;
  fc::check_cuda(device::malloc_pinned(&pinned, sizeof(int)), "test: pinned");
  int stale_without = 0, stale_with = 0;
  for (int i = 0; i < tries; ++i)
    for (bool ordered : {false, true}) {
      void* buf = device_bytes(sizeof(int));
      void* out = device_bytes(sizeof(int));
      std::memcpy(pinned, &i, sizeof i);
      fc::check_cuda(device::copy_async(buf, pinned, sizeof i, writer), "test: write");
      fc::check_cuda(device::event_record(written, writer), "test: record");
      if (ordered) fc::check_cuda(device::stream_wait(reader, written), "test: wait");
      fc::check_cuda(device::copy_async(out, buf, sizeof i, reader), "test: read");
      fc::check_cuda(device::device_synchronize(), "test: sync");
      if (read_int(out) != i) ++(ordered ? stale_with : stale_without);
      device::free_device(buf);
      device::free_device(out);
    }
  BOOST_TEST(stale_without > 0);
  BOOST_TEST(stale_with == 0);
  device::free_pinned(pinned);
  device::event_destroy(written);
  device::stream_destroy(writer);
  device::stream_destroy(reader);
}

// cudaMemset and cudaMemcpy from pageable memory are queued on the legacy default stream: a
// blocking stream's later work sees them, a non-blocking stream's need not (the staged backend's
// failures on a GPU at 2-4 ranks, 2026-11-26, were a test doing exactly that).
BOOST_AUTO_TEST_CASE(the_legacy_stream_orders_blocking_streams_only) {
  device::stream_t blocking = nullptr, non_blocking = nullptr;
  fc::check_cuda(device::stream_create(&blocking, false), "test: stream");
  fc::check_cuda(device::stream_create(&non_blocking, true), "test: stream");
  int stale_blocking = 0, stale_non_blocking = 0;
  for (int i = 0; i < tries; ++i)
    for (device::stream_t s : {blocking, non_blocking}) {
      void* buf = device_bytes(sizeof(int));
      void* out = device_bytes(sizeof(int));
      fc::check_cuda(device::copy_sync(buf, &i, sizeof i), "test: upload");  // may land after it returns
      fc::check_cuda(device::copy_async(out, buf, sizeof i, s), "test: read");
      fc::check_cuda(device::device_synchronize(), "test: sync");
      if (read_int(out) != i) ++(s == blocking ? stale_blocking : stale_non_blocking);
      device::free_device(buf);
      device::free_device(out);
    }
  BOOST_TEST(stale_blocking == 0);
  BOOST_TEST(stale_non_blocking > 0);
  device::stream_destroy(blocking);
  device::stream_destroy(non_blocking);
}
#endif

// CUDA graphs by stream capture: work issued into a capturing stream runs only when the graph is
// launched, once per launch, in order.
BOOST_AUTO_TEST_CASE(a_captured_stream_records_its_work_and_each_launch_replays_it) {
  device::stream_t s = nullptr;
  fc::check_cuda(device::stream_create(&s, true), "test: stream");
  auto* x = static_cast<float*>(device_bytes(sizeof(float)));
  auto* one = static_cast<float*>(device_bytes(sizeof(float)));
  const float zero = 0, unit = 1;
  fc::check_cuda(device::copy_async(x, &zero, sizeof zero, s), "test: up");
  fc::check_cuda(device::copy_async(one, &unit, sizeof unit, s), "test: up");
  fc::check_cuda(device::stream_synchronize(s), "test: sync");
  fc::check_cuda(device::stream_begin_capture(s, device::capture_global), "test: begin");
  device::capture_status_t status = device::capture_none;
  fc::check_cuda(device::stream_is_capturing(s, &status), "test: is capturing");
  BOOST_TEST(status == device::capture_active);
  fc::check_cuda(device::combine(fc::op::sum, x, one, 1, s), "test: x += 1");
  fc::check_cuda(device::combine(fc::op::prod, x, x, 1, s), "test: x *= x");
  device::graph_t graph = nullptr;
  fc::check_cuda(device::stream_end_capture(s, &graph), "test: end");
  fc::check_cuda(device::stream_synchronize(s), "test: sync");
  float got = -1;
  fc::check_cuda(device::copy_sync(&got, x, sizeof got), "test: down");
  BOOST_TEST(got == 0.0f);  // captured, not run
  device::graph_exec_t exec = nullptr;
  fc::check_cuda(device::graph_instantiate(&exec, graph), "test: instantiate");
  for (int i = 0; i < 3; ++i) fc::check_cuda(device::graph_launch(exec, s), "test: launch");
  fc::check_cuda(device::stream_synchronize(s), "test: sync");
  fc::check_cuda(device::copy_sync(&got, x, sizeof got), "test: down");
  BOOST_TEST(got == 25.0f);  // ((0+1)^2 + 1)^2 = 4, (4+1)^2 = 25
  device::graph_exec_destroy(exec);
  device::graph_destroy(graph);
  device::free_device(x);
  device::free_device(one);
  device::stream_destroy(s);
}

namespace {
// Begins a capture on `s`, runs `call`, ends it: the call's result, and the end's.
template <class Call>
std::pair<device::error_t, device::error_t> in_capture(device::stream_t s, device::capture_mode_t mode, Call&& call) {
  fc::check_cuda(device::stream_begin_capture(s, mode), "test: begin");
  const device::error_t during = call();
  device::graph_t graph = nullptr;
  const device::error_t end = device::stream_end_capture(s, &graph);
  if (graph) device::graph_destroy(graph);
  return {during, end};
}
}  // namespace

// What CUDA refuses while a stream captures, each refusal invalidating the capture.
BOOST_AUTO_TEST_CASE(a_capture_refuses_synchronizations_event_queries_and_unsafe_calls) {
  using pair = std::pair<device::error_t, device::error_t>;
  device::stream_t s = nullptr;
  fc::check_cuda(device::stream_create(&s, true), "test: stream");
  BOOST_TEST(device::stream_begin_capture(nullptr, device::capture_global) == device::invalid_value);
  // Synchronizing the capturing stream, even in relaxed mode.
  BOOST_TEST((in_capture(s, device::capture_relaxed, [&] { return device::stream_synchronize(s); }) ==
              pair{device::capture_unsupported, device::capture_invalidated}));
  // Querying an event recorded in the capture: it marks a graph, not a queue.
  device::event_t e = nullptr;
  fc::check_cuda(device::event_create(&e), "test: event");
  BOOST_TEST((in_capture(s, device::capture_relaxed, [&] {
                fc::check_cuda(device::event_record(e, s), "test: record");
                return device::event_query(e);
              }) == pair{device::captured_event, device::capture_invalidated}));
  fc::check_cuda(device::event_record(e, s), "test: record outside");  // an ordinary event again
  // Potentially unsafe calls: prohibited in global and thread-local mode on the capturing thread.
  void* p = nullptr;
  BOOST_TEST((in_capture(s, device::capture_global, [&] { return device::malloc_device(&p, 16); }) ==
              pair{device::capture_unsupported, device::capture_invalidated}));
  BOOST_TEST((in_capture(s, device::capture_thread_local, [&] { return device::event_query(e); }) ==
              pair{device::capture_unsupported, device::capture_invalidated}));
  BOOST_TEST((in_capture(s, device::capture_relaxed, [&] { return device::malloc_device(&p, 16); }) ==
              pair{device::success, device::success}));
  device::free_device(p);
  // On another thread (a progress engine polling an event): prohibited in global mode only.
  const auto elsewhere = [&] {
    device::error_t rc = device::success;
    std::thread([&] { rc = device::event_query(e); }).join();
    return rc;
  };
  BOOST_TEST((in_capture(s, device::capture_global, elsewhere) == pair{device::capture_unsupported, device::capture_invalidated}));
  BOOST_TEST((in_capture(s, device::capture_thread_local, elsewhere) == pair{device::success, device::success}));
  device::event_destroy(e);
  device::stream_destroy(s);
}

// The legacy default stream cannot take work while a blocking stream of its device captures
// (an implicit dependency on the capture); a non-blocking one's capture leaves it usable.
BOOST_AUTO_TEST_CASE(the_legacy_stream_is_unusable_while_a_blocking_stream_captures) {
  using pair = std::pair<device::error_t, device::error_t>;
  device::stream_t blocking = nullptr, non_blocking = nullptr;
  fc::check_cuda(device::stream_create(&blocking, false), "test: stream");
  fc::check_cuda(device::stream_create(&non_blocking, true), "test: stream");
  auto* x = static_cast<float*>(device_bytes(16));
  device::capture_status_t status = device::capture_none;
  BOOST_TEST((in_capture(blocking, device::capture_relaxed, [&] { return device::stream_is_capturing(nullptr, &status); }) ==
              pair{device::capture_implicit, device::success}));  // asking does not invalidate it
  BOOST_TEST((in_capture(blocking, device::capture_relaxed, [&] { return device::fill(x, 0, 16); }) ==
              pair{device::capture_implicit, device::capture_invalidated}));
  BOOST_TEST((in_capture(blocking, device::capture_relaxed, [&] { return device::combine(fc::op::sum, x, x, 4, nullptr); }) ==
              pair{device::capture_implicit, device::capture_invalidated}));
  BOOST_TEST((in_capture(non_blocking, device::capture_relaxed, [&] { return device::combine(fc::op::sum, x, x, 4, nullptr); }) ==
              pair{device::success, device::success}));
  fc::check_cuda(device::device_synchronize(), "test: sync");
  device::free_device(x);
  device::stream_destroy(blocking);
  device::stream_destroy(non_blocking);
}

// Another stream joins a capture by waiting on an event recorded in it, and must be joined back
// to the stream the capture began on; waiting on work outside the capture crosses its boundary.
BOOST_AUTO_TEST_CASE(a_forked_stream_must_join_back_and_a_capture_depends_on_nothing_outside) {
  using pair = std::pair<device::error_t, device::error_t>;
  device::stream_t origin = nullptr, side = nullptr;
  fc::check_cuda(device::stream_create(&origin, true), "test: stream");
  fc::check_cuda(device::stream_create(&side, true), "test: stream");
  device::event_t fork = nullptr, join = nullptr;
  fc::check_cuda(device::event_create(&fork), "test: event");
  fc::check_cuda(device::event_create(&join), "test: event");
  auto* x = static_cast<float*>(device_bytes(16));
  const auto forked = [&](bool joined) {
    return [&, joined] {
      fc::check_cuda(device::event_record(fork, origin), "test: fork");
      fc::check_cuda(device::stream_wait(side, fork), "test: side joins");
      fc::check_cuda(device::combine(fc::op::sum, x, x, 4, side), "test: on the side");
      if (joined) {
        fc::check_cuda(device::event_record(join, side), "test: join");
        fc::check_cuda(device::stream_wait(origin, join), "test: origin waits");
      }
      return device::success;
    };
  };
  BOOST_TEST((in_capture(origin, device::capture_global, forked(false)) == pair{device::success, device::capture_unjoined}));
  BOOST_TEST((in_capture(origin, device::capture_global, forked(true)) == pair{device::success, device::success}));
  device::event_t outside = nullptr;
  fc::check_cuda(device::event_create(&outside), "test: event");
  fc::check_cuda(device::event_record(outside, side), "test: record");
  BOOST_TEST((in_capture(origin, device::capture_global, [&] { return device::stream_wait(origin, outside); }) ==
              pair{device::capture_isolation, device::capture_invalidated}));
  fc::check_cuda(device::device_synchronize(), "test: sync");
  for (device::event_t e : {fork, join, outside}) device::event_destroy(e);
  device::free_device(x);
  device::stream_destroy(origin);
  device::stream_destroy(side);
}

// Last: it poisons this process's context. A kernel that reaches another device's memory (no peer
// access) faults when it runs; from then on every call fails, as after a GPU's illegal address.
BOOST_AUTO_TEST_CASE(a_kernel_that_reaches_another_devices_memory_poisons_the_context) {
  fc::check_cuda(device::set_device(1), "test: set");
  auto* x1 = static_cast<float*>(device_bytes(16));
  fc::check_cuda(device::set_device(0), "test: set");
  auto* x0 = static_cast<float*>(device_bytes(16));
  BOOST_TEST(device::combine(fc::op::sum, x0, x1, 4, nullptr) == device::success);  // launched; faults later
  BOOST_TEST(device::device_synchronize() == device::illegal_address);
  BOOST_TEST(device::last_error() == device::illegal_address);
  void* more = nullptr;
  BOOST_TEST(device::malloc_device(&more, 16) == device::illegal_address);
  BOOST_TEST(std::string(device::error_name(device::illegal_address)) == "cudaErrorIllegalAddress");
}
