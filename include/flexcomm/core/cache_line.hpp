// The cache line: what two writers on different cores must not share (each write would take the
// line from the other), and so the unit in which shared memory, slots and staged gradients are
// laid out.
#pragma once

#include <cstddef>

namespace flexcomm::detail {

// 64 bytes on x86-64 and on the ARM server cores flexcomm targets. Not
// std::hardware_destructive_interference_size: GCC warns that it may change between compiler
// versions, and this value is part of a layout every rank must agree on.
inline constexpr std::size_t cache_line = 64;

// `bytes` rounded up to a whole number of `to` (cache lines unless said).
constexpr std::size_t round_up(std::size_t bytes, std::size_t to = cache_line) noexcept {
  return (bytes + to - 1) / to * to;
}

}  // namespace flexcomm::detail
