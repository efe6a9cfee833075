#define BOOST_TEST_MODULE doorbell
#include <boost/test/unit_test.hpp>

#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <new>
#include <thread>

#include <flexcomm/core/doorbell.hpp>

namespace fcd = flexcomm::detail;
using namespace std::chrono_literals;
using clock_type = std::chrono::steady_clock;

// Two sides take turns through one doorbell, each asleep on its own channel until the other
// rings that channel: a ring lost between a sleeper's look and its sleep, or sent to the wrong
// sleeper, would leave it asleep for the whole limit, which no sleep here comes near (the longest
// is reported).
BOOST_AUTO_TEST_CASE(turns_taken_through_one_doorbell_lose_no_ring) {
  fcd::doorbell bell;
  std::atomic<int> turn{0};
  constexpr int rounds = 3000;
  const auto limit = 2s;
  std::atomic<bool> lost{false};  // a sleep ran to its limit: both sides stop
  clock_type::duration longest_a{}, longest_b{};
  auto side = [&](int me, clock_type::duration& longest) {
    for (int r = me; r < 2 * rounds; r += 2) {
      while (turn.load() != r) {
        if (lost.load()) return;
        const auto start = clock_type::now();
        bell.sleep_unless([&] { return turn.load() == r || lost.load(); }, limit,
                          fcd::doorbell::channel(static_cast<unsigned>(me)));
        longest = std::max(longest, clock_type::now() - start);
        if (longest >= limit) {
          lost.store(true);
          bell.ring();
        }
      }
      turn.store(r + 1);
      bell.ring(fcd::doorbell::channel(static_cast<unsigned>(1 - me)));
    }
  };
  std::thread b([&] { side(1, longest_b); });
  side(0, longest_a);
  b.join();
  BOOST_TEST(turn.load() == 2 * rounds);
  const auto ms = [](clock_type::duration d) { return std::chrono::duration_cast<std::chrono::milliseconds>(d).count(); };
  BOOST_TEST((std::max(longest_a, longest_b) < limit), "longest sleep " << ms(std::max(longest_a, longest_b)) << " ms");
}

// Nobody rings: the sleep ends at its limit and done() stays false; done() already true: no sleep.
BOOST_AUTO_TEST_CASE(a_sleep_ends_at_its_limit_or_not_at_all) {
  fcd::doorbell bell;
  int looks = 0;
  bell.sleep_unless([&] { return ++looks > 100; }, 20ms);
  BOOST_TEST(looks == 2);  // before the sleep and once more after announcing itself
  looks = 0;
  bell.sleep_unless([&] { return ++looks > 0; }, 10s);
  BOOST_TEST(looks == 1);
  BOOST_TEST(bell.sleepers.load() == 0u);
}

// As the feeds use it: a zeroed shared page between two processes; the child sleeps until the
// parent's ring, and the parent's store is what the child sees after it.
BOOST_AUTO_TEST_CASE(a_ring_wakes_another_process_on_a_shared_page) {
  void* page = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  BOOST_TEST_REQUIRE(page != MAP_FAILED);
  auto* bell = std::launder(reinterpret_cast<fcd::doorbell*>(page));  // zeroed: never rung
  auto* flag = std::launder(reinterpret_cast<std::atomic<std::uint32_t>*>(static_cast<char*>(page) + 64));
  const pid_t child = fork();
  BOOST_TEST_REQUIRE(child >= 0);
  if (child == 0) {
    for (int i = 0; i < 200 && flag->load() == 0; ++i) bell->sleep_unless([&] { return flag->load() != 0; }, 50ms);
    _exit(flag->load() == 42 ? 0 : 1);
  }
  std::this_thread::sleep_for(30ms);  // most likely asleep by now; either way it must see the ring
  flag->store(42);
  bell->ring();
  int status = 0;
  BOOST_TEST_REQUIRE(waitpid(child, &status, 0) == child);
  BOOST_TEST((WIFEXITED(status) && WEXITSTATUS(status) == 0));
  munmap(page, 4096);
}
