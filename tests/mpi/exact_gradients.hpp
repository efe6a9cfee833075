// Gradients whose reductions are exact: the Sync tests compare adapters with a reference bit for
// bit, in every element type and op.
#pragma once

#include <boost/mpl/list.hpp>

#include <flexcomm/flexcomm.hpp>

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace flexcomm::testing {

using element_types = boost::mpl::list<float, double, std::int32_t, std::int64_t, std::uint8_t, half, bfloat16>;
inline const op all_ops[] = {op::sum, op::prod, op::min, op::max, op::avg};

// Small values whose sums and products are exact in every element type at up to 6 ranks, so
// integer and float results alike must equal the reference bit for bit, in any reduction order.
template <class T>
T value(int rank, int step, int index, std::size_t i) {
  const int v = static_cast<int>((static_cast<std::size_t>(rank) * 7 + i * 3 + static_cast<std::size_t>(step) * 5 +
                                  static_cast<std::size_t>(index) * 11) % 5);
  return T(static_cast<float>(std::is_unsigned_v<T> ? v : v - 2));
}

template <class T>
std::vector<T> gradient(int rank, int step, int index, std::size_t n) {
  std::vector<T> g(n);
  for (std::size_t i = 0; i < n; ++i) g[i] = value<T>(rank, step, index, i);
  return g;
}

}  // namespace flexcomm::testing
