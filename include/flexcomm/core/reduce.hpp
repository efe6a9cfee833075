// Reduction operators and the host loops that apply them. The loops are plain element-wise
// code over restrict pointers so the compiler vectorizes them; 16-bit floats go through float.
#pragma once

#include <algorithm>
#include <cstddef>
#include <type_traits>

#include "datatype.hpp"

namespace flexcomm {

enum class op { sum, prod, min, max, avg };

constexpr const char* name_of(op o) {
  constexpr const char* names[] = {"sum", "prod", "min", "max", "avg"};  // in op's order
  const auto i = static_cast<unsigned>(o);
  return i < sizeof names / sizeof *names ? names[i] : "?";
}

namespace detail {
template <class T>
inline constexpr bool is_f16_like = std::is_same_v<T, half> || std::is_same_v<T, bfloat16>;

template <op O, class T>
inline void combine_loop(T* __restrict inout, const T* __restrict in, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    if constexpr (O == op::sum || O == op::avg) inout[i] = static_cast<T>(inout[i] + in[i]);
    else if constexpr (O == op::prod) inout[i] = static_cast<T>(inout[i] * in[i]);
    else if constexpr (O == op::min) inout[i] = std::min(inout[i], in[i]);
    else inout[i] = std::max(inout[i], in[i]);
  }
}

template <op O, class T>
inline void combine_f16(T* inout, const T* in, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    const float a = inout[i], b = in[i];
    float r;
    if constexpr (O == op::sum || O == op::avg) r = a + b;
    else if constexpr (O == op::prod) r = a * b;
    else if constexpr (O == op::min) r = std::min(a, b);
    else r = std::max(a, b);
    inout[i] = T(r);
  }
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
    for (std::size_t i = 0; i < n; ++i) buf[i] *= inv;
  } else {
    for (std::size_t i = 0; i < n; ++i) buf[i] = static_cast<T>(buf[i] / static_cast<T>(ranks));
  }
}

}  // namespace flexcomm
