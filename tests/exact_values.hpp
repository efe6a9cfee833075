// Values whose reductions are exact, and the reference every backend and adapter test compares
// against: the same generator on every rank, reduced locally with flexcomm's host operators. Small
// values keep sums and products exact in every element type at up to 6 ranks, so integer and
// float results alike must equal the reference bit for bit, in any reduction order.
#pragma once

#include <boost/mpl/list.hpp>

#include <flexcomm/flexcomm.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <type_traits>
#include <vector>

namespace flexcomm::testing {

using element_types = boost::mpl::list<float, double, std::int32_t, std::int64_t, std::uint8_t, half, bfloat16>;
inline const op all_ops[] = {op::sum, op::prod, op::min, op::max, op::avg};
// Counts that are zero, below the rank count and not divisible by it.
inline const std::size_t counts[] = {0, 1, 3, 1001};

template <class T>
T value(int rank, int step, int index, std::size_t i) {
  const int v = static_cast<int>((static_cast<std::size_t>(rank) * 7 + i * 3 + static_cast<std::size_t>(step) * 5 +
                                  static_cast<std::size_t>(index) * 11) % 5);
  return T(static_cast<float>(std::is_unsigned_v<T> ? v : v - 2));
}

// Gradient `index` of step `step` as rank `rank` hands it over.
template <class T>
std::vector<T> gradient(int rank, int step, int index, std::size_t n) {
  std::vector<T> g(n);
  for (std::size_t i = 0; i < n; ++i) g[i] = value<T>(rank, step, index, i);
  return g;
}

// What rank `rank` sends in a backend test.
template <class T>
std::vector<T> data(int rank, std::size_t n) {
  return gradient<T>(rank, 0, 0, n);
}

// The reduction over `ranks` (world ranks) of their gradient `index` of step `step`.
template <class T>
std::vector<T> reference(op o, const std::vector<int>& ranks, int step, int index, std::size_t n) {
  auto acc = gradient<T>(ranks.front(), step, index, n);
  for (std::size_t r = 1; r < ranks.size(); ++r) {
    const auto other = gradient<T>(ranks[r], step, index, n);
    combine(o, acc.data(), other.data(), n);
  }
  if (o == op::avg) divide_by(acc.data(), n, static_cast<int>(ranks.size()));
  return acc;
}

// The reduction of what ranks 0 .. ranks-1 send in a backend test.
template <class T>
std::vector<T> expected(op o, int ranks, std::size_t n) {
  std::vector<int> all(static_cast<std::size_t>(ranks));
  std::iota(all.begin(), all.end(), 0);
  return reference<T>(o, all, 0, 0, n);
}

// The first n elements equal, exactly; but floating averages under `o == avg` within a relative
// tolerance, because ncclAvg scales each contribution by 1/n before summing.
template <class T>
bool same(const std::vector<T>& a, const std::vector<T>& b, std::size_t n, op o = op::sum) {
  if (a.size() < n || b.size() < n) return false;
  const bool loose = o == op::avg && !std::is_integral_v<T>;
  const double tolerance = std::is_same_v<T, double> ? 1e-12 : std::is_same_v<T, float> ? 1e-6 : 1e-2;
  for (std::size_t i = 0; i < n; ++i) {
    const double x = static_cast<double>(a[i]), y = static_cast<double>(b[i]);
    if (loose ? std::fabs(x - y) > tolerance * std::fmax(1.0, std::fabs(y)) : x != y) return false;
  }
  return true;
}

// Equal sizes and every element exactly equal.
template <class T>
bool same(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && same(a, b, a.size());
}

}  // namespace flexcomm::testing
