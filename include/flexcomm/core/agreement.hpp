// Cross-rank agreement, the one way flexcomm asks "did every rank pass the same thing?": each
// value travels with its negation in one max-reduction, after which every rank holds the largest
// and the smallest of each value, and the ranks agree on it exactly when the two are equal. A
// rank never waits on a verdict the others do not reach too. Things that are not numbers (a
// layout, a sequence of gradients) are compared by fingerprint.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string_view>
#include <utility>
#include <vector>

#include "span.hpp"

namespace flexcomm {

// An order-sensitive hash of a sequence of values: splitmix64's finaliser, chained.
class fingerprint {
 public:
  fingerprint() = default;
  explicit fingerprint(std::uint64_t seed) : h_(seed) {}

  fingerprint& add(std::uint64_t v) {
    std::uint64_t z = h_ ^ (v + 0x9e3779b97f4a7c15ull + (h_ << 6) + (h_ >> 2));
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    h_ = z ^ (z >> 31);
    return *this;
  }
  fingerprint& add(std::string_view text) {
    for (unsigned char c : text) add(c);
    return add(text.size());
  }

  std::uint64_t value() const noexcept { return h_; }
  // 62 bits, never negative: a value whose negation cannot overflow, for an agreement.
  std::int64_t folded() const noexcept { return static_cast<std::int64_t>(h_ >> 2); }

 private:
  std::uint64_t h_ = 0x666c6578636f6d6dull;  // "flexcomm"
};

// The values every rank must share and, after the caller reduces buffer() with op::max on every
// rank, what each rank learns of them. A few values (a step's check: two) live inside it: the
// allocations cost a tenth of a small shared-memory step.
class agreement {
 public:
  explicit agreement(std::initializer_list<std::int64_t> values) : n_(values.size()) { take(values.begin()); }
  explicit agreement(const std::vector<std::int64_t>& values) : n_(values.size()) { take(values.data()); }

  span<std::int64_t> buffer() noexcept { return {data(), 2 * n_}; }

  bool agreed(std::size_t i) const { return v(i) == -v(n_ + i); }
  bool all_agreed() const {
    for (std::size_t i = 0; i < n_; ++i)
      if (!agreed(i)) return false;
    return true;
  }
  std::int64_t highest(std::size_t i) const { return v(i); }
  std::int64_t lowest(std::size_t i) const { return -v(n_ + i); }

 private:
  static constexpr std::size_t inline_values = 4;
  std::int64_t* data() noexcept { return n_ > inline_values ? big_.data() : small_; }
  std::int64_t v(std::size_t i) const { return n_ > inline_values ? big_[i] : small_[i]; }
  // Each value, then its negation.
  void take(const std::int64_t* values) {
    if (n_ > inline_values) big_.resize(2 * n_);
    std::int64_t* d = data();
    for (std::size_t i = 0; i < n_; ++i) {
      d[i] = values[i];
      d[n_ + i] = -values[i];
    }
  }

  std::size_t n_;
  std::int64_t small_[2 * inline_values] = {};
  std::vector<std::int64_t> big_;
};

}  // namespace flexcomm
