#define BOOST_TEST_MODULE reduce
#include <boost/test/unit_test.hpp>
#include <boost/mpl/list.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
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

// The NaN rule (core/reduce_rule.hpp), element type by element type: special values in both
// operand orders, against what the rule says each result is, bit for bit.
namespace {
using floating_types = boost::mpl::list<float, double, fc::half, fc::bfloat16>;
const fc::op combining_ops[] = {fc::op::sum, fc::op::prod, fc::op::min, fc::op::max};

template <class T>
auto bits(T x) {
  using U = std::conditional_t<sizeof(T) == 8, std::uint64_t, std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint16_t>>;
  U b;
  if constexpr (sizeof(T) == 2) b = x.bits;
  else std::memcpy(&b, &x, sizeof b);
  return b;
}
template <class T>
T from_bits(std::uint64_t b) {
  T x;
  if constexpr (sizeof(T) == 2) {
    x.bits = static_cast<std::uint16_t>(b);
  } else {
    const auto narrow = static_cast<decltype(bits(T{}))>(b);
    std::memcpy(&x, &narrow, sizeof x);
  }
  return x;
}
template <class T> std::uint64_t canonical_nan_bits() {
  return sizeof(T) == 8 ? 0x7fffffffffffffffull : sizeof(T) == 4 ? 0x7fffffffull : 0x7fffull;
}
template <class T> bool is_nan(T x) { return std::isnan(static_cast<double>(x)); }

// NaNs of both signs with payloads, infinities, zeros of both signs, subnormals, the largest
// finite value and plain numbers.
template <class T>
std::vector<T> specials() {
  std::vector<T> v;
  if constexpr (sizeof(T) == 2) {
    const bool h = std::is_same_v<T, fc::half>;
    for (std::uint64_t b : {h ? 0x7e00ull : 0x7fc0ull, h ? 0xfd01ull : 0xff81ull, 0x7fffull, h ? 0x7c00ull : 0x7f80ull,
                            h ? 0xfc00ull : 0xff80ull, 0x0000ull, 0x8000ull, 0x0001ull, 0x8003ull,
                            h ? 0x7bffull : 0x7f7full, h ? 0x3c00ull : 0x3f80ull, h ? 0xc000ull : 0xc000ull})
      v.push_back(from_bits<T>(b));
  } else {
    using L = std::numeric_limits<T>;
    v = {L::quiet_NaN(), -L::quiet_NaN(), from_bits<T>(bits(L::quiet_NaN()) | 5u), L::infinity(), -L::infinity(),
         T(0), -T(0), L::denorm_min(), -L::denorm_min() * 3, L::max(), T(1), T(-2)};
  }
  return v;
}

// What the rule says a (op) b is, computed without the library: 16-bit floats and float in double
// (exact for sums and products of two of them), rounded to float as float arithmetic is, then to T.
template <class T>
std::uint64_t by_the_rule(fc::op o, T a, T b) {
  if (is_nan(a) || is_nan(b)) return canonical_nan_bits<T>();
  const double x = static_cast<double>(a), y = static_cast<double>(b);
  if (o == fc::op::min || o == fc::op::max) {
    if (x == y) return o == fc::op::min ? (bits(a) | bits(b)) : (bits(a) & bits(b));  // -0 below +0
    return bits((x < y) == (o == fc::op::min) ? a : b);
  }
  T r;
  if constexpr (std::is_same_v<T, double>) r = o == fc::op::prod ? a * b : a + b;
  else r = T(static_cast<float>(o == fc::op::prod ? x * y : x + y));
  return is_nan(r) ? canonical_nan_bits<T>() : bits(r);
}
}  // namespace

BOOST_AUTO_TEST_CASE_TEMPLATE(specials_follow_the_rule_in_both_orders, T, floating_types) {
  const auto v = specials<T>();
  for (fc::op o : combining_ops)
    for (T a : v)
      for (T b : v) {
        T ab = a, ba = b;
        fc::combine(o, &ab, &b, 1);
        fc::combine(o, &ba, &a, 1);
        BOOST_TEST_REQUIRE(std::uint64_t{bits(ab)} == by_the_rule(o, a, b),
                           fc::name_of(o) << "(" << std::hex << std::uint64_t{bits(a)} << ", " << std::uint64_t{bits(b)} << ")");
        BOOST_TEST_REQUIRE(std::uint64_t{bits(ba)} == std::uint64_t{bits(ab)},
                           fc::name_of(o) << " depends on the operand order: " << std::hex << std::uint64_t{bits(a)}
                                          << ", " << std::uint64_t{bits(b)});
      }
}

BOOST_AUTO_TEST_CASE(the_rule_in_the_words_of_the_issue) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  auto apply = [](fc::op o, float a, float b) { fc::combine(o, &a, &b, 1); return bits(a); };
  BOOST_TEST(apply(fc::op::max, nan, 1.f) == 0x7fffffffu);
  BOOST_TEST(apply(fc::op::max, 1.f, nan) == 0x7fffffffu);
  BOOST_TEST(apply(fc::op::min, 1.f, -nan) == 0x7fffffffu);
  BOOST_TEST(apply(fc::op::sum, inf, -inf) == 0x7fffffffu);  // x86 makes 0xffc00000
  BOOST_TEST(apply(fc::op::prod, 0.f, inf) == 0x7fffffffu);
  BOOST_TEST(apply(fc::op::min, 0.f, -0.f) == 0x80000000u);
  BOOST_TEST(apply(fc::op::min, -0.f, 0.f) == 0x80000000u);
  BOOST_TEST(apply(fc::op::max, -0.f, 0.f) == 0u);
  BOOST_TEST(apply(fc::op::sum, 1e-45f, 1e-45f) == 2u);  // subnormals kept
  // Narrowing: any NaN is 0x7fff, as CUDA's __float2bfloat16_rn and __float2half_rn make it.
  for (float x : {nan, -nan, from_bits<float>(0x7f800001u), from_bits<float>(0xffa00000u)}) {
    BOOST_TEST(fc::bfloat16(x).bits == 0x7fffu);
    BOOST_TEST(fc::half(x).bits == 0x7fffu);
  }
  BOOST_TEST(fc::half(-inf).bits == 0xfc00u);
  BOOST_TEST(fc::bfloat16(-inf).bits == 0xff80u);
  BOOST_TEST(fc::bfloat16(from_bits<float>(0x00018000u)).bits == 0x0002u);  // a subnormal's tie: to even
}

// Long runs mixing specials, as the vectorized host loops and the device kernels see them.
BOOST_AUTO_TEST_CASE_TEMPLATE(runs_equal_their_elements, T, floating_types) {
  const auto v = specials<T>();
  std::mt19937 gen(7);
  std::vector<T> a(1003), b(1003);
  for (std::size_t i = 0; i < a.size(); ++i) {
    a[i] = v[gen() % v.size()];
    b[i] = v[gen() % v.size()];
  }
  for (fc::op o : combining_ops) {
    auto r = a;
    fc::combine(o, r.data(), b.data(), r.size());
    bool ok = true;
    for (std::size_t i = 0; i < r.size(); ++i) ok = ok && std::uint64_t{bits(r[i])} == by_the_rule(o, a[i], b[i]);
    BOOST_TEST(ok, fc::name_of(o));
  }
  auto d = a;
  fc::divide_by(d.data(), d.size(), 3);
  bool nan_canonical = true;
  for (std::size_t i = 0; i < d.size(); ++i)
    nan_canonical = nan_canonical && (!is_nan(d[i]) || std::uint64_t{bits(d[i])} == canonical_nan_bits<T>());
  BOOST_TEST(nan_canonical);
}

BOOST_AUTO_TEST_CASE(integers_wrap) {
  std::int32_t i = std::numeric_limits<std::int32_t>::max(), one = 1;
  fc::combine(fc::op::sum, &i, &one, 1);
  BOOST_TEST(i == std::numeric_limits<std::int32_t>::min());
  std::int64_t l = std::int64_t{1} << 62, four = 4;
  fc::combine(fc::op::prod, &l, &four, 1);
  BOOST_TEST(l == 0);
  std::uint8_t u = 200, hundred = 100;
  fc::combine(fc::op::sum, &u, &hundred, 1);
  BOOST_TEST(u == 44);
  std::uint8_t avg = 255;
  fc::divide_by(&avg, 1, 256);  // by the rank count, not by uint8(256) == 0
  BOOST_TEST(avg == 0);
}

// The device's integer division (multiply-high and shifts) against the host's, truncating.
template <class I>
void check_divisor(std::uint32_t d, const std::vector<I>& xs) {
  const auto by = fc::rule::divisor_for<I>::of(d);
  for (I x : xs) {
    const I want = static_cast<I>(x / static_cast<std::int64_t>(d));
    BOOST_TEST_REQUIRE(fc::rule::divided(x, by) == want, +x << " / " << d);
  }
}

BOOST_AUTO_TEST_CASE(magic_division_equals_division) {
  std::mt19937_64 gen(11);
  std::vector<std::uint32_t> divisors{2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 64, 100, 255, 256, 257, 1000, 65535, 65536,
                                      65537, 1u << 30, (1u << 31) - 1};
  for (int k = 0; k < 40; ++k) divisors.push_back(2 + static_cast<std::uint32_t>(gen() % 100000));
  for (std::uint32_t d : divisors) {
    std::vector<std::int32_t> i32{0, 1, -1, static_cast<std::int32_t>(d), -static_cast<std::int32_t>(d),
                                  std::numeric_limits<std::int32_t>::max(), std::numeric_limits<std::int32_t>::min()};
    std::vector<std::int64_t> i64{0, 1, -1, std::numeric_limits<std::int64_t>::max(), std::numeric_limits<std::int64_t>::min()};
    std::vector<std::uint8_t> u8;
    for (int x = 0; x < 256; ++x) u8.push_back(static_cast<std::uint8_t>(x));
    for (std::uint64_t m : {std::uint64_t{1}, std::uint64_t{7}, std::uint64_t{1} << 20, std::uint64_t{1} << 40})
      for (std::uint64_t e : {~std::uint64_t{0}, std::uint64_t{0}, std::uint64_t{1}}) {  // multiples of d, -1, +1 (wrapping)
        const std::uint64_t x = d * m + e;
        i32.push_back(static_cast<std::int32_t>(x));
        i64.push_back(static_cast<std::int64_t>(x));
        i64.push_back(static_cast<std::int64_t>(std::uint64_t{0} - x));
      }
    for (int k = 0; k < 200; ++k) {
      i32.push_back(static_cast<std::int32_t>(gen()));
      i64.push_back(static_cast<std::int64_t>(gen()));
    }
    check_divisor(d, i32);
    check_divisor(d, i64);
    check_divisor(d, u8);
  }
}

BOOST_AUTO_TEST_CASE(dtype_table) {
  BOOST_TEST(fc::size_of(fc::dtype_of<fc::half>) == 2u);
  BOOST_TEST(fc::size_of(fc::dtype_of<std::int64_t>) == 8u);
  BOOST_TEST(std::string(fc::name_of(fc::dtype::bf16)) == "bfloat16");
  BOOST_TEST(fc::visit_dtype(fc::dtype::f64, [](auto x) { return sizeof(x); }) == 8u);
  static_assert(fc::is_element_v<const float>);
  static_assert(!fc::is_element_v<char>);
}
