// Which gradients share which bucket: the plan a member's ranks form at their first step and
// keep, so that every rank fills and launches the same buckets in the same order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <vector>

#include "../../core/agreement.hpp"
#include "../../core/datatype.hpp"
#include "options.hpp"

namespace flexcomm {

// Which gradients share which bucket. Formed at a member's first step from the order in which
// ready() hands gradients over (backprop order, so the first bucket fills first), then fixed:
// every later step fills the same buckets, and buckets launch in bucket-index order.
class bucket_plan {
 public:
  struct gradient {
    int index;
    dtype type;
    std::size_t count;
    int bucket;
    std::size_t offset;  // elements into its bucket
  };
  struct bucket {
    dtype type;
    std::size_t count;  // elements
    std::size_t first, last;  // its gradients: gradients()[first, last)
  };

  explicit bucket_plan(std::size_t capacity_bytes = default_bucket_bytes) : capacity_(capacity_bytes) {}

  // Appends a gradient; a new bucket starts when this one would overflow or change type.
  void add(int index, dtype type, std::size_t count);
  // Ends the plan: the gradients handed over last (the first layers', ready as backward ends) move
  // into a bucket of their own of at most `last_bytes` (the longest such run at the end, or the
  // last gradient alone), unless the last bucket is already that small; 0 leaves it. What only
  // starts when backward ends cannot be hidden behind it, so it should be short.
  void seal(std::size_t last_bytes);

  const gradient* find(int index) const {
    auto it = position_.find(index);
    return it == position_.end() ? nullptr : &gradients_[it->second];
  }
  std::size_t position(const gradient& g) const { return static_cast<std::size_t>(&g - gradients_.data()); }
  const std::vector<gradient>& gradients() const noexcept { return gradients_; }
  const std::vector<bucket>& buckets() const noexcept { return buckets_; }
  bool empty() const noexcept { return gradients_.empty(); }
  std::size_t capacity_bytes() const noexcept { return capacity_; }
  void clear() {
    gradients_.clear();
    buckets_.clear();
    position_.clear();
  }

  // Equal on two ranks exactly when their plans are (up to hash collisions).
  std::uint64_t signature() const;

 private:
  std::size_t capacity_;
  std::vector<gradient> gradients_;
  std::vector<bucket> buckets_;
  std::unordered_map<int, std::size_t> position_;
};

inline void bucket_plan::add(int index, dtype type, std::size_t count) {
  const std::size_t bytes = count * size_of(type);
  const bool fits = !buckets_.empty() && buckets_.back().type == type &&
                    (buckets_.back().count * size_of(type) + bytes <= capacity_);
  if (!fits) buckets_.push_back({type, 0, gradients_.size(), gradients_.size()});
  auto& b = buckets_.back();
  position_[index] = gradients_.size();
  gradients_.push_back({index, type, count, static_cast<int>(buckets_.size() - 1), b.count});
  b.count += count;
  b.last = gradients_.size();
}

inline void bucket_plan::seal(std::size_t last_bytes) {
  if (last_bytes == 0 || buckets_.empty()) return;
  bucket& last = buckets_.back();
  const std::size_t width = size_of(last.type);
  if (last.count * width <= last_bytes || last.last - last.first < 2) return;
  std::size_t split = last.last - 1, bytes = gradients_[split].count * width;
  while (split > last.first + 1 && bytes + gradients_[split - 1].count * width <= last_bytes)
    bytes += gradients_[--split].count * width;
  const std::size_t base = gradients_[split].offset;
  bucket tail{last.type, last.count - base, split, last.last};
  last.count = base;
  last.last = split;
  buckets_.push_back(tail);
  for (std::size_t i = split; i < gradients_.size(); ++i) {
    gradients_[i].bucket = static_cast<int>(buckets_.size() - 1);
    gradients_[i].offset -= base;
  }
}

inline std::uint64_t bucket_plan::signature() const {
  fingerprint f;
  f.add(capacity_);
  for (const auto& g : gradients_)
    f.add(static_cast<std::uint64_t>(g.index)).add(static_cast<std::uint64_t>(g.type)).add(g.count).add(
        static_cast<std::uint64_t>(g.bucket));
  return f.value();
}

}  // namespace flexcomm
