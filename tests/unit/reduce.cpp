#define BOOST_TEST_MODULE reduce
#include <boost/test/unit_test.hpp>
#include <boost/mpl/list.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include <flexcomm/core/reduce.hpp>

namespace fc = flexcomm;

using element_types = boost::mpl::list<float, double, std::int32_t, std::int64_t, std::uint8_t, fc::half, fc::bfloat16>;

BOOST_AUTO_TEST_CASE_TEMPLATE(every_op_matches_its_definition, T, element_types) {
  const std::vector<float> a{1, 5, -2, 3, 0, 7, 2}, b{4, 2, 6, -1, 0, 7, 3};
  for (fc::op o : {fc::op::sum, fc::op::prod, fc::op::min, fc::op::max, fc::op::avg}) {
    std::vector<T> x, y;
    for (std::size_t i = 0; i < a.size(); ++i) {
      const bool is_unsigned = std::is_same_v<T, std::uint8_t>;
      x.push_back(T(is_unsigned ? std::fabs(a[i]) : a[i]));
      y.push_back(T(is_unsigned ? std::fabs(b[i]) : b[i]));
    }
    std::vector<T> expected = x;
    for (std::size_t i = 0; i < x.size(); ++i) {
      const float p = static_cast<float>(x[i]), q = static_cast<float>(y[i]);
      float r = o == fc::op::prod ? p * q : o == fc::op::min ? std::min(p, q) : o == fc::op::max ? std::max(p, q) : p + q;
      expected[i] = T(r);
    }
    fc::combine(o, x.data(), y.data(), x.size());
    for (std::size_t i = 0; i < x.size(); ++i)
      BOOST_TEST(static_cast<double>(x[i]) == static_cast<double>(expected[i]), "op " << fc::name_of(o) << " at " << i);
  }
}

BOOST_AUTO_TEST_CASE(average_divides_the_sum) {
  std::vector<float> f{3, 6, 9};
  fc::divide_by(f.data(), f.size(), 3);
  BOOST_TEST(f == (std::vector<float>{1, 2, 3}), boost::test_tools::per_element());
  std::vector<std::int32_t> i{7, -7, 8};
  fc::divide_by(i.data(), i.size(), 2);
  BOOST_TEST(i == (std::vector<std::int32_t>{3, -3, 4}), boost::test_tools::per_element());
  std::vector<fc::half> h{fc::half(5.f)};
  fc::divide_by(h.data(), h.size(), 2);
  BOOST_TEST(static_cast<float>(h[0]) == 2.5f);
}

BOOST_AUTO_TEST_CASE(half_round_trips_and_rounds_to_nearest_even) {
  for (float f : {0.f, -0.f, 1.f, -2.5f, 65504.f, 6.103515625e-05f, 5.960464477539063e-08f, 0.333251953125f})
    BOOST_TEST(static_cast<float>(fc::half(f)) == f);
  BOOST_TEST(std::isinf(static_cast<float>(fc::half(70000.f))));
  BOOST_TEST(std::isnan(static_cast<float>(fc::half(std::numeric_limits<float>::quiet_NaN()))));
  BOOST_TEST(fc::half(1.f + 1.f / 2048).bits == fc::half(1.f).bits);          // tie to even: down
  BOOST_TEST(fc::half(1.f + 3.f / 2048).bits == fc::half(1.f).bits + 2);      // tie to even: up
  // Every half value converts to float and back unchanged.
  for (unsigned b = 0; b < 0x10000u; ++b) {
    fc::half h;
    h.bits = static_cast<std::uint16_t>(b);
    const float f = h;
    if (std::isnan(f)) continue;
    BOOST_TEST_REQUIRE(fc::half(f).bits == h.bits, "bits " << b);
  }
}

BOOST_AUTO_TEST_CASE(bfloat16_keeps_the_float_exponent) {
  BOOST_TEST(static_cast<float>(fc::bfloat16(1e30f)) == 1e30f, boost::test_tools::tolerance(0.01f));
  BOOST_TEST(static_cast<float>(fc::bfloat16(-3.f)) == -3.f);
  BOOST_TEST(fc::bfloat16(1.f + 1.f / 256).bits == fc::bfloat16(1.f).bits);  // tie to even
  BOOST_TEST(std::isnan(static_cast<float>(fc::bfloat16(std::numeric_limits<float>::quiet_NaN()))));
}

BOOST_AUTO_TEST_CASE(dtype_table) {
  BOOST_TEST(fc::size_of(fc::dtype_of<fc::half>) == 2u);
  BOOST_TEST(fc::size_of(fc::dtype_of<std::int64_t>) == 8u);
  BOOST_TEST(std::string(fc::name_of(fc::dtype::bf16)) == "bfloat16");
  BOOST_TEST(fc::visit_dtype(fc::dtype::f64, [](auto x) { return sizeof(x); }) == 8u);
  static_assert(fc::is_element_v<const float>);
  static_assert(!fc::is_element_v<char>);
}
