// The one rule every flexcomm reduction follows, element by element: core/reduce.hpp's host loops
// (the MPI backend's operators, shared memory, collect, the ring) and the device kernels
// (backend/cuda/reduce_kernels.cuh, where nvcc compiles these same functions) call it.
// - IEEE 754 arithmetic rounded to nearest even, subnormals kept (never flushed to zero);
// - a NaN result is the type's canonical NaN, every bit but the sign set, which is what CUDA
//   produces (x86 would keep a payload or give 0xffc00000): results do not depend on the hardware;
// - min and max are NaN when either operand is, and take -0 below +0 (IEEE 754-2019 minimum and
//   maximum): neither depends on the operand order, so neither does any rank's result;
// - integers wrap (two's complement) and an average truncates toward zero.
// half and bfloat16 compute in float under this rule and round once (datatype.hpp: NaN -> 0x7fff).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__CUDACC__)
#define FLEXCOMM_HOST_DEVICE __host__ __device__
#else
#define FLEXCOMM_HOST_DEVICE
#endif

namespace flexcomm {

enum class op { sum, prod, min, max, avg };

namespace rule {
template <class F> struct float_bits;
template <> struct float_bits<float> {
  using type = std::uint32_t;
  static constexpr type canonical_nan = 0x7fffffffu;
};
template <> struct float_bits<double> {
  using type = std::uint64_t;
  static constexpr type canonical_nan = 0x7fffffffffffffffull;
};

template <class F>
FLEXCOMM_HOST_DEVICE inline typename float_bits<F>::type bits_of(F x) {
  typename float_bits<F>::type b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}
template <class F>
FLEXCOMM_HOST_DEVICE inline F from_bits(typename float_bits<F>::type b) {
  F x;
  std::memcpy(&x, &b, sizeof x);
  return x;
}

template <class F>
FLEXCOMM_HOST_DEVICE inline F canonical(F x) {
  return x != x ? from_bits<F>(float_bits<F>::canonical_nan) : x;
}

// Equal operands are the same number but for zeros' signs: OR keeps a -0, AND a +0. Selects, no
// branches: the host loops vectorize them (a branch per element mispredicts on real data).
template <op O, class F>
FLEXCOMM_HOST_DEVICE inline F floating(F a, F b) {
  if constexpr (O == op::sum || O == op::avg) {
    return canonical(a + b);
  } else if constexpr (O == op::prod) {
    return canonical(a * b);
  } else {
    const F apart = O == op::min ? (b < a ? b : a) : (a < b ? b : a);
    const F tie = from_bits<F>(O == op::min ? (bits_of(a) | bits_of(b)) : (bits_of(a) & bits_of(b)));
    const F r = a == b ? tie : apart;
    return ((a != a) | (b != b)) ? from_bits<F>(float_bits<F>::canonical_nan) : r;
  }
}

// Sums and products in the unsigned type: wrapping, never undefined.
template <op O, class I>
FLEXCOMM_HOST_DEVICE inline I integral(I a, I b) {
  using U = std::make_unsigned_t<I>;
  if constexpr (O == op::sum || O == op::avg) return static_cast<I>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
  else if constexpr (O == op::prod) return static_cast<I>(static_cast<U>(static_cast<U>(a) * static_cast<U>(b)));
  else if constexpr (O == op::min) return b < a ? b : a;
  else return a < b ? b : a;
}

// a (op) b for float, double and the integer element types.
template <op O, class T>
FLEXCOMM_HOST_DEVICE inline T combined(T a, T b) {
  if constexpr (std::is_floating_point_v<T>) return floating<O>(a, b);
  else return integral<O>(a, b);
}

// The average's integer division, x / d truncated toward zero for a divisor d >= 2 fixed per call
// (the rank count), by a multiply-high and two shifts (Granlund and Montgomery 1994, figure 4.1):
// how the device kernels divide, a hardware division being tens of instructions there. The host
// loops divide directly; tests/unit/reduce.cpp holds the two equal.
FLEXCOMM_HOST_DEVICE inline std::uint32_t mul_high(std::uint32_t a, std::uint32_t b) {
  return static_cast<std::uint32_t>((static_cast<std::uint64_t>(a) * b) >> 32);
}
FLEXCOMM_HOST_DEVICE inline std::uint64_t mul_high(std::uint64_t a, std::uint64_t b) {
#if defined(__CUDA_ARCH__)
  return __umul64hi(a, b);
#else
  const std::uint64_t a_lo = a & 0xffffffffu, a_hi = a >> 32, b_lo = b & 0xffffffffu, b_hi = b >> 32;
  const std::uint64_t lo_lo = a_lo * b_lo, hi_lo = a_hi * b_lo, lo_hi = a_lo * b_hi;
  const std::uint64_t cross = (lo_lo >> 32) + (hi_lo & 0xffffffffu) + lo_hi;
  return a_hi * b_hi + (hi_lo >> 32) + (cross >> 32);
#endif
}

template <class U>
struct divisor {
  U magic = 0;
  unsigned shift = 0;

  // 2 <= d < 2^31 (a rank count): magic = floor(2^bits * (2^l - d) / d) + 1, l = ceil(log2 d),
  // by long division (r < d < 2^31 throughout).
  static divisor of(std::uint32_t d) {
    unsigned l = 1;
    while ((std::uint64_t{1} << l) < d) ++l;
    std::uint64_t r = (std::uint64_t{1} << l) - d;
    U q = 0;
    for (unsigned i = 0; i < sizeof(U) * 8; ++i) {
      r <<= 1;
      q = static_cast<U>((q << 1) | (r >= d ? 1u : 0u));
      if (r >= d) r -= d;
    }
    return {static_cast<U>(q + 1), l - 1};
  }
  FLEXCOMM_HOST_DEVICE U quotient(U n) const {
    const U t = mul_high(magic, n);
    return static_cast<U>((t + ((n - t) >> 1)) >> shift);
  }
};

template <class I>
using divisor_for = divisor<std::conditional_t<(sizeof(I) > 4), std::uint64_t, std::uint32_t>>;

template <class I>
FLEXCOMM_HOST_DEVICE inline I divided(I x, const divisor_for<I>& d) {
  using U = std::conditional_t<(sizeof(I) > 4), std::uint64_t, std::uint32_t>;
  if constexpr (std::is_unsigned_v<I>) {
    return static_cast<I>(d.quotient(static_cast<U>(x)));
  } else {
    const U magnitude = x < 0 ? static_cast<U>(U(0) - static_cast<U>(x)) : static_cast<U>(x);
    const U q = d.quotient(magnitude);
    return static_cast<I>(x < 0 ? static_cast<U>(U(0) - q) : q);
  }
}
}  // namespace rule

}  // namespace flexcomm
