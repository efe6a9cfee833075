// Reduction operators and the host loops that apply them under reduce_rule.hpp's rule (NaN,
// signed zeros, wrapping), the reference the device kernels equal bit for bit. The loops are plain
// element-wise code over restrict pointers so the compiler vectorizes them; 16-bit floats go
// through float and round once.
#pragma once

#include <cstddef>
#include <type_traits>

#include "datatype.hpp"
#include "reduce_rule.hpp"

namespace flexcomm {

constexpr const char* name_of(op o) {
  constexpr const char* names[] = {"sum", "prod", "min", "max", "avg"};  // in op's order
  const auto i = static_cast<unsigned>(o);
  return i < sizeof names / sizeof *names ? names[i] : "?";
}

namespace detail {
template <class T>
inline constexpr bool is_f16_like = std::is_same_v<T, half> || std::is_same_v<T, bfloat16>;

// Blocks of 8 with a fixed count: -O2's cheap vectorizer takes those (not a loop of unknown
// count), and the NaN selects then cost nothing measurable on a sum.
template <op O, class T>
inline void combine_loop(T* __restrict inout, const T* __restrict in, std::size_t n) {
  const std::size_t blocks = n - n % 8;
  for (std::size_t i = 0; i < blocks; i += 8)
    for (std::size_t k = 0; k < 8; ++k) inout[i + k] = rule::combined<O>(inout[i + k], in[i + k]);
  for (std::size_t i = blocks; i < n; ++i) inout[i] = rule::combined<O>(inout[i], in[i]);
}

template <op O, class T>
inline void combine_f16(T* inout, const T* in, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) inout[i] = T(rule::floating<O>(static_cast<float>(inout[i]), static_cast<float>(in[i])));
}

template <op O, class T>
inline void combine_as(T* inout, const T* in, std::size_t n) {
  if constexpr (is_f16_like<T>) combine_f16<O>(inout, in, n);
  else combine_loop<O>(inout, in, n);
}
}  // namespace detail

// inout[i] = inout[i] (op) in[i]. For avg this is the sum; finish with divide_by().
template <class T>
void combine(op o, T* inout, const T* in, std::size_t n) {
  switch (o) {
    case op::sum: case op::avg: detail::combine_as<op::sum>(inout, in, n); break;
    case op::prod: detail::combine_as<op::prod>(inout, in, n); break;
    case op::min: detail::combine_as<op::min>(inout, in, n); break;
    case op::max: detail::combine_as<op::max>(inout, in, n); break;
  }
}

// Turns a sum over `ranks` contributions into the average. Integer averages truncate toward
// zero, as integer division does (and as ncclAvg does for integer types).
template <class T>
void divide_by(T* buf, std::size_t n, int ranks) {
  if (ranks <= 1) return;
  if constexpr (detail::is_f16_like<T>) {
    for (std::size_t i = 0; i < n; ++i) buf[i] = T(static_cast<float>(buf[i]) / static_cast<float>(ranks));
  } else if constexpr (std::is_floating_point_v<T>) {
    const T inv = T(1) / static_cast<T>(ranks);
    for (std::size_t i = 0; i < n; ++i) buf[i] = rule::canonical(buf[i] * inv);
  } else {
    // By the rank count itself (an int): T(ranks) would wrap for uint8 at 256 ranks.
    for (std::size_t i = 0; i < n; ++i) buf[i] = static_cast<T>(buf[i] / ranks);
  }
}

}  // namespace flexcomm
