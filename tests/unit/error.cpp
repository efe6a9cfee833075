#define BOOST_TEST_MODULE error
#include <boost/test/unit_test.hpp>

#include <flexcomm/core/error.hpp>
#include <flexcomm/core/span.hpp>

namespace fc = flexcomm;

BOOST_AUTO_TEST_CASE(error_names_rank_operation_and_cause) {
  const fc::error e(3, "one_to_many", "step 17 shard 1: loader wrote 5000 bytes, slot holds 4096");
  BOOST_TEST(std::string(e.what()) ==
             "flexcomm: rank 3: one_to_many: step 17 shard 1: loader wrote 5000 bytes, slot holds 4096");
  BOOST_TEST(e.rank() == 3);
  BOOST_TEST(e.operation() == "one_to_many");
  try {
    fc::check(1 + 1 == 3, "arith", fc::cat("got ", 2));
    BOOST_FAIL("check did not throw");
  } catch (const fc::error& thrown) {
    BOOST_TEST(thrown.cause() == "got 2");
    BOOST_TEST(thrown.rank() == fc::process_rank());
  }
}

BOOST_AUTO_TEST_CASE(span_views_containers) {
  std::vector<int> v{1, 2, 3, 4};
  fc::span<int> s(v);
  fc::span<const int> c = s;
  BOOST_TEST(c.size() == 4u);
  BOOST_TEST(s.subspan(1, 2)[1] == 3);
  BOOST_TEST(fc::as_bytes(c).size() == 16u);
  int raw[3] = {7, 8, 9};
  BOOST_TEST(fc::span<int>(raw).size() == 3u);
}
