#define BOOST_TEST_MODULE slot_writer
#include <boost/test/unit_test.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include <flexcomm/backend/shm/slot_writer.hpp>

namespace fcd = flexcomm::detail;

// Streaming stores write exactly what memcpy would, at every alignment of both sides and every
// length around the 16-byte head and the 64-byte body, and touch nothing beyond.
BOOST_AUTO_TEST_CASE(stream_copy_equals_memcpy_at_every_alignment) {
  std::vector<std::uint8_t> from(1024 + 64), into(1024 + 128), want(into.size());
  for (std::size_t i = 0; i < from.size(); ++i) from[i] = static_cast<std::uint8_t>(i * 7 + 3);
  for (std::size_t src = 0; src < 16; ++src)
    for (std::size_t dst = 0; dst < 16; ++dst)
      for (std::size_t bytes : {0, 1, 15, 16, 17, 63, 64, 65, 127, 128, 200, 1000, 1024}) {
        std::fill(into.begin(), into.end(), 0xAB);
        want = into;
        std::memcpy(want.data() + 32 + dst, from.data() + src, bytes);
        fcd::stream_copy(into.data() + 32 + dst, from.data() + src, bytes);
        BOOST_TEST_REQUIRE((into == want), "src offset " << src << ", dst offset " << dst << ", " << bytes << " bytes");
      }
}

// Sizes fall in classes a factor of 4 apart, from 256 KiB to 64 MiB and beyond.
BOOST_AUTO_TEST_CASE(size_classes) {
  using k = fcd::slot_writer;
  BOOST_TEST(k::size_class(0) == 0);
  BOOST_TEST(k::size_class((256u << 10) - 1) == 0);
  BOOST_TEST(k::size_class(256u << 10) == 1);
  BOOST_TEST(k::size_class((1u << 20) - 1) == 1);
  BOOST_TEST(k::size_class(1u << 20) == 2);
  BOOST_TEST(k::size_class(4u << 20) == 3);
  BOOST_TEST(k::size_class(16u << 20) == 4);
  BOOST_TEST(k::size_class((64u << 20) - 1) == 4);
  BOOST_TEST(k::size_class(64u << 20) == k::classes - 1);
  BOOST_TEST(k::size_class(std::size_t{1} << 40) == k::classes - 1);
}

// Both kinds are tried twice first, the cheaper one is kept, the other is tried one task in
// explore_every, and a change of costs changes the choice.
BOOST_AUTO_TEST_CASE(keeps_the_cheaper_kind_and_explores) {
  fcd::slot_writer w;
  using k = fcd::slot_writer;
  const int cls = 3;
  BOOST_TEST(w.choose(cls, 0) == k::cached);
  BOOST_TEST(w.choose(cls, 1) == k::streaming);
  BOOST_TEST(w.choose(cls, 2) == k::cached);
  BOOST_TEST(w.choose(cls, 3) == k::streaming);
  w.learn(cls, k::cached, 0.5);
  w.learn(cls, k::streaming, 0.2);
  BOOST_TEST(w.preferred(cls) == k::streaming);
  int explored = 0;
  for (std::uint64_t n = 4; n < 4 + 4 * k::explore_every; ++n) explored += w.choose(cls, n) == k::cached;
  BOOST_TEST(explored == 4);
  // The cached kind turns cheap (the process moved): the first such sample is the estimate.
  w.learn(cls, k::cached, 0.05);
  BOOST_TEST(w.preferred(cls) == k::cached);
  // One interrupted task (100x) does not undo it.
  w.learn(cls, k::cached, 5.0);
  BOOST_TEST(w.preferred(cls) == k::cached);
  // A lasting slowdown does, within a few tasks.
  int tasks = 0;
  while (w.preferred(cls) == k::cached && tasks < 50) {
    w.learn(cls, k::cached, 1.0);
    ++tasks;
  }
  BOOST_TEST(w.preferred(cls) == k::streaming);
  BOOST_TEST(tasks <= 12);
}

// A task preempted while the kinds are first tried (3x its cost) does not make the slower kind
// the choice: its kind's second, undisturbed sample is the estimate.
BOOST_AUTO_TEST_CASE(a_slow_first_sample_does_not_choose_the_slower_kind) {
  fcd::slot_writer w;
  using k = fcd::slot_writer;
  const int cls = 1;
  w.learn(cls, k::cached, 3.0);  // preempted
  w.learn(cls, k::streaming, 1.5);
  w.learn(cls, k::cached, 1.0);
  w.learn(cls, k::streaming, 1.5);
  BOOST_TEST(w.preferred(cls) == k::cached);
}

// Each size class learns apart: a first cost in one says nothing of another.
BOOST_AUTO_TEST_CASE(classes_learn_apart) {
  fcd::slot_writer w;
  using k = fcd::slot_writer;
  w.learn(1, k::cached, 0.1);
  w.learn(1, k::streaming, 0.3);
  w.learn(5, k::cached, 2.0);
  w.learn(5, k::streaming, 0.4);
  BOOST_TEST(w.preferred(1) == k::cached);
  BOOST_TEST(w.preferred(5) == k::streaming);
  BOOST_TEST(w.preferred(3) == k::cached);  // nothing measured: ordinary stores
}
