// Element types flexcomm moves and reduces: f32 f64 i32 i64 u8 f16 bf16.
// The 16-bit float types are storage types here; arithmetic on them goes through float.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace flexcomm {

enum class dtype { f32, f64, i32, i64, u8, f16, bf16 };

namespace detail {
// IEEE 754 binary16's bits, as CUDA's __half holds them, rounded to nearest even.
struct binary16_format {
  static std::uint16_t from_float(float f) {
    std::uint32_t x;
    std::memcpy(&x, &f, 4);
    const std::uint32_t sign = (x >> 16) & 0x8000u;
    const std::uint32_t absx = x & 0x7fffffffu;
    if (absx > 0x7f800000u) return 0x7fffu;  // any NaN: the canonical one, as __float2half_rn gives
    if (absx == 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7c00u);
    if (absx >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // overflow
    if (absx < 0x38800000u) {  // subnormal or zero in half: round to nearest even
      if (absx < 0x33000000u) return static_cast<std::uint16_t>(sign);
      const std::uint32_t mant = (absx & 0x7fffffu) | 0x800000u;
      const int shift = 126 - static_cast<int>(absx >> 23);  // 14..24: value / 2^-24 = mant >> shift
      std::uint32_t h = mant >> shift;
      const std::uint32_t rem = mant & ((1u << shift) - 1u);
      const std::uint32_t halfway = 1u << (shift - 1);
      if (rem > halfway || (rem == halfway && (h & 1u))) ++h;
      return static_cast<std::uint16_t>(sign | h);
    }
    std::uint32_t h = ((absx >> 13) - (112u << 10));
    const std::uint32_t rem = absx & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
    return static_cast<std::uint16_t>(sign | h);
  }

  static float to_float(std::uint16_t h) {
    const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
    std::uint32_t exp = (h >> 10) & 0x1fu;
    std::uint32_t mant = h & 0x3ffu;
    std::uint32_t x;
    if (exp == 0) {
      if (mant == 0) {
        x = sign;
      } else {  // subnormal: normalize
        exp = 113;
        while (!(mant & 0x400u)) { mant <<= 1; --exp; }
        x = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
      }
    } else if (exp == 31) {
      x = sign | 0x7f800000u | (mant << 13);
    } else {
      x = sign | ((exp + 112u) << 23) | (mant << 13);
    }
    float f;
    std::memcpy(&f, &x, 4);
    return f;
  }
};

// bfloat16's bits: the top half of a float, rounded to nearest even, as __nv_bfloat16 holds them;
// any NaN becomes the canonical 0x7fff, as __float2bfloat16_rn makes it.
struct bfloat16_format {
  static std::uint16_t from_float(float f) {
    std::uint32_t x;
    std::memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;
    x += 0x7fffu + ((x >> 16) & 1u);
    return static_cast<std::uint16_t>(x >> 16);
  }
  static float to_float(std::uint16_t b) {
    const std::uint32_t x = static_cast<std::uint32_t>(b) << 16;
    float f;
    std::memcpy(&f, &x, 4);
    return f;
  }
};
}  // namespace detail

// A 16-bit float as storage: converts from and to float (implicitly, like CUDA's types), compared
// by its bits.
template <class Format>
struct float16 {
  std::uint16_t bits = 0;
  float16() = default;
  float16(float f) : bits(Format::from_float(f)) {}  // NOLINT: implicit like __half
  operator float() const { return Format::to_float(bits); }
  friend bool operator==(float16 a, float16 b) { return a.bits == b.bits; }
};

using half = float16<detail::binary16_format>;        // bit-compatible with CUDA's __half
using bfloat16 = float16<detail::bfloat16_format>;    // bit-compatible with __nv_bfloat16

namespace detail {
template <class T> struct dtype_of_impl;  // no flexcomm dtype for this element type
template <> struct dtype_of_impl<float> { static constexpr dtype value = dtype::f32; };
template <> struct dtype_of_impl<double> { static constexpr dtype value = dtype::f64; };
template <> struct dtype_of_impl<std::int32_t> { static constexpr dtype value = dtype::i32; };
template <> struct dtype_of_impl<std::int64_t> { static constexpr dtype value = dtype::i64; };
template <> struct dtype_of_impl<std::uint8_t> { static constexpr dtype value = dtype::u8; };
template <> struct dtype_of_impl<half> { static constexpr dtype value = dtype::f16; };
template <> struct dtype_of_impl<bfloat16> { static constexpr dtype value = dtype::bf16; };
template <class T, class = void> struct has_dtype : std::false_type {};
template <class T> struct has_dtype<T, std::void_t<decltype(dtype_of_impl<T>::value)>> : std::true_type {};
}  // namespace detail

template <class T>
inline constexpr bool is_element_v = detail::has_dtype<std::remove_cv_t<T>>::value;

template <class T>
inline constexpr dtype dtype_of = detail::dtype_of_impl<std::remove_cv_t<T>>::value;

constexpr std::size_t size_of(dtype t) {
  switch (t) {
    case dtype::f64: case dtype::i64: return 8;
    case dtype::f32: case dtype::i32: return 4;
    case dtype::f16: case dtype::bf16: return 2;
    case dtype::u8: return 1;
  }
  return 0;
}

constexpr const char* name_of(dtype t) {
  switch (t) {
    case dtype::f32: return "float";
    case dtype::f64: return "double";
    case dtype::i32: return "int32";
    case dtype::i64: return "int64";
    case dtype::u8: return "uint8";
    case dtype::f16: return "half";
    case dtype::bf16: return "bfloat16";
  }
  return "?";
}

// Calls f(T{}) with the C++ element type of a runtime dtype.
template <class F>
decltype(auto) visit_dtype(dtype t, F&& f) {
  switch (t) {
    case dtype::f32: return f(float{});
    case dtype::f64: return f(double{});
    case dtype::i32: return f(std::int32_t{});
    case dtype::i64: return f(std::int64_t{});
    case dtype::u8: return f(std::uint8_t{});
    case dtype::f16: return f(half{});
    case dtype::bf16: return f(bfloat16{});
  }
  return f(float{});
}

}  // namespace flexcomm
