#define BOOST_TEST_MODULE bucket_plan
#include <boost/test/unit_test.hpp>

#include <flexcomm/patterns/sync/bucket_plan.hpp>

#include <cstddef>
#include <vector>

namespace fc = flexcomm;

namespace {
// The plan of float gradients of these element counts, handed over in this order, sealed.
fc::bucket_plan plan_of(std::size_t capacity, const std::vector<std::size_t>& counts, std::size_t last_bytes) {
  fc::bucket_plan p(capacity);
  for (std::size_t i = 0; i < counts.size(); ++i) p.add(static_cast<int>(i), fc::dtype::f32, counts[i]);
  p.seal(last_bytes);
  return p;
}

// Every gradient lies inside its bucket, the buckets tile the gradients in order, and each
// bucket's count is the sum of its gradients'.
bool consistent(const fc::bucket_plan& p) {
  std::size_t next = 0;
  for (std::size_t b = 0; b < p.buckets().size(); ++b) {
    const auto& k = p.buckets()[b];
    if (k.first != next || k.last <= k.first) return false;
    std::size_t offset = 0;
    for (std::size_t i = k.first; i < k.last; ++i) {
      const auto& g = p.gradients()[i];
      if (g.bucket != static_cast<int>(b) || g.offset != offset) return false;
      offset += g.count;
    }
    if (offset != k.count) return false;
    next = k.last;
  }
  return next == p.gradients().size();
}
}  // namespace

// Six 400-byte gradients in one 4 KiB bucket: a 1000-byte limit moves the last two (800 bytes)
// into a bucket of their own.
BOOST_AUTO_TEST_CASE(the_gradients_handed_over_last_get_a_small_bucket_of_their_own) {
  const auto p = plan_of(4096, {100, 100, 100, 100, 100, 100}, 1000);
  BOOST_TEST(consistent(p));
  BOOST_REQUIRE(p.buckets().size() == 2u);
  BOOST_TEST(p.buckets()[0].count == 400u);
  BOOST_TEST(p.buckets()[1].count == 200u);
  BOOST_TEST(p.buckets()[1].first == 4u);
  BOOST_TEST(p.find(5)->bucket == 1);
  BOOST_TEST(p.find(5)->offset == 100u);
}

BOOST_AUTO_TEST_CASE(a_last_gradient_larger_than_the_limit_goes_alone) {
  const auto p = plan_of(1 << 20, {10, 20, 5000}, 64);
  BOOST_TEST(consistent(p));
  BOOST_REQUIRE(p.buckets().size() == 2u);
  BOOST_TEST(p.buckets()[1].count == 5000u);
  BOOST_TEST(p.buckets()[0].count == 30u);
}

BOOST_AUTO_TEST_CASE(a_small_last_bucket_a_single_gradient_or_zero_leave_the_plan_alone) {
  const std::vector<std::size_t> counts{300, 300, 300, 10};
  const auto small = plan_of(1200, counts, 1 << 10);  // a bucket per gradient: 40 bytes last
  BOOST_TEST(small.buckets().size() == 4u);
  const auto split = plan_of(1 << 20, counts, 1 << 10);  // one bucket of 3640 bytes: the 40 go alone
  BOOST_REQUIRE(split.buckets().size() == 2u);
  BOOST_TEST(split.buckets()[1].count == 10u);
  BOOST_TEST(consistent(split));
  const auto off = plan_of(1 << 20, counts, 0);
  BOOST_TEST(off.buckets().size() == 1u);
  const auto one = plan_of(1 << 20, {5000}, 4);
  BOOST_TEST(one.buckets().size() == 1u);
  BOOST_TEST(consistent(small));
  BOOST_TEST(consistent(off));
}

// The split keeps at least one gradient in the bucket before the tail, and plans sealed alike
// have equal signatures (every rank seals the same plan the same way).
BOOST_AUTO_TEST_CASE(the_split_never_empties_the_bucket_before_it_and_signs_alike) {
  const auto p = plan_of(1 << 20, {1, 1, 1, 1}, 1 << 20 /* the whole bucket fits: no split */);
  BOOST_TEST(p.buckets().size() == 1u);
  const auto q = plan_of(1 << 20, {1000, 1, 1, 1}, 8);
  BOOST_TEST(consistent(q));
  BOOST_REQUIRE(q.buckets().size() == 2u);
  BOOST_TEST(q.buckets()[0].last == 2u);  // 1000 and one 1-float gradient; the last two (8 bytes) split off
  BOOST_TEST(q.signature() == plan_of(1 << 20, {1000, 1, 1, 1}, 8).signature());
  BOOST_TEST(q.signature() != plan_of(1 << 20, {1000, 1, 1, 1}, 0).signature());
}
