#define BOOST_TEST_MODULE slot_writer
#include <boost/test/unit_test.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include <flexcomm/backend/mpi/slot_writer.hpp>

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

// Both kinds are tried first, the cheaper one is kept, the other is tried one allreduce in
// explore_every, and a change of costs changes the choice.
BOOST_AUTO_TEST_CASE(keeps_the_cheaper_kind_and_explores) {
  fcd::slot_writer w;
  using k = fcd::slot_writer;
  BOOST_TEST(w.choose(0) == k::cached);
  BOOST_TEST(w.choose(1) == k::streaming);
  w.learn(k::cached, 0.5);
  w.learn(k::streaming, 0.2);
  BOOST_TEST(w.preferred() == k::streaming);
  int explored = 0;
  for (std::uint64_t n = 2; n < 2 + 4 * k::explore_every; ++n) explored += w.choose(n) == k::cached;
  BOOST_TEST(explored == 4);
  // The cached kind turns cheap (the process moved): a few samples move the choice back.
  for (int i = 0; i < 6; ++i) w.learn(k::cached, 0.05);
  BOOST_TEST(w.preferred() == k::cached);
  // One interrupted allreduce (100x) does not undo it.
  w.learn(k::cached, 5.0);
  BOOST_TEST(w.preferred() == k::cached);
}
