// batch_plan: how a dataset of `size` samples becomes the steps of a feed. Each epoch is cut
// into batches of `batch` samples (the last one short, or dropped), and each batch is split over
// the layout's shards as evenly as PyTorch's DistributedSampler splits: the first b % k shards
// get one sample more, and a shard may be empty. Plain arithmetic, the same on every rank.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "error.hpp"

namespace flexcomm {

// A run of samples inside one step's batch: positions [first, first + count).
struct sample_range {
  std::int64_t first = 0;
  std::int64_t count = 0;
};

class batch_plan {
 public:
  batch_plan() = default;
  // `shards`: the layout's shards per step (ensemble_layout::shards_per_step()).
  batch_plan(std::int64_t size, std::int64_t batch, std::int64_t epochs, int shards, bool drop_last = false)
      : size_(size), batch_(batch), epochs_(epochs), shards_(shards), drop_last_(drop_last) {
    check(size_ >= 0, "batch_plan", cat("dataset size must be >= 0, got ", size_));
    check(batch_ > 0, "batch_plan", cat("batch size must be > 0, got ", batch_));
    check(epochs_ >= 0, "batch_plan", cat("epochs must be >= 0, got ", epochs_));
    check(shards_ > 0, "batch_plan", cat("shards per step must be > 0, got ", shards_));
    check(steps_per_epoch() == 0 || epochs_ <= INT64_MAX / steps_per_epoch(), "batch_plan",
          cat(epochs_, " epochs of ", steps_per_epoch(), " steps overflow the step count"));
  }

  std::int64_t size() const noexcept { return size_; }
  std::int64_t batch() const noexcept { return batch_; }
  std::int64_t epochs() const noexcept { return epochs_; }
  int shards() const noexcept { return shards_; }
  bool drop_last() const noexcept { return drop_last_; }

  // ceil(size / batch), or floor with drop_last.
  std::int64_t steps_per_epoch() const noexcept {
    return size_ / batch_ + (!drop_last_ && size_ % batch_ != 0 ? 1 : 0);
  }
  // The stream's length: epochs x steps per epoch.
  std::int64_t steps() const noexcept { return epochs_ * steps_per_epoch(); }

  // Of a step of the stream (0 <= step < steps()).
  std::int64_t epoch_of(std::int64_t step) const noexcept { return step / std::max<std::int64_t>(steps_per_epoch(), 1); }
  std::int64_t step_in_epoch(std::int64_t step) const noexcept { return step % std::max<std::int64_t>(steps_per_epoch(), 1); }
  bool last_in_epoch(std::int64_t step) const noexcept { return step_in_epoch(step) == steps_per_epoch() - 1; }

  // Samples in step `step`'s batch: `batch`, but what is left of the epoch for its last step.
  std::int64_t batch_samples(std::int64_t step) const noexcept {
    return std::min(batch_, size_ - step_in_epoch(step) * batch_);
  }
  // Where step `step`'s batch starts in its epoch's order of samples.
  std::int64_t first_in_epoch(std::int64_t step) const noexcept { return step_in_epoch(step) * batch_; }

  // The samples of shard `shard` of step `step`, as positions in its batch.
  sample_range shard_samples(std::int64_t step, int shard) const noexcept {
    return split(batch_samples(step), shard);
  }
  // The samples of shards [first, first + count) together (a trainer's part of the batch).
  sample_range shards_samples(std::int64_t step, int first, int count) const noexcept {
    const std::int64_t b = batch_samples(step);
    const sample_range a = split(b, first), z = split(b, first + count - 1);
    return count <= 0 ? sample_range{a.first, 0} : sample_range{a.first, z.first + z.count - a.first};
  }
  // The most samples any shard of any step holds: ceil(batch / shards).
  std::int64_t max_shard_samples() const noexcept { return batch_ / shards_ + (batch_ % shards_ != 0 ? 1 : 0); }

 private:
  sample_range split(std::int64_t b, int shard) const noexcept {
    const std::int64_t k = shards_, base = b / k, extra = b % k, s = shard;
    return {s * base + std::min<std::int64_t>(s, extra), base + (s < extra ? 1 : 0)};
  }

  std::int64_t size_ = 0, batch_ = 1, epochs_ = 0;
  int shards_ = 1;
  bool drop_last_ = false;
};

// The order in which an epoch visits the dataset: 0, 1, ... or, with a seed, a permutation drawn
// from (seed, epoch) alone (Fisher-Yates over splitmix64, no library distribution), so every
// rank that loads draws the same one.
class epoch_order {
 public:
  epoch_order() = default;
  epoch_order(std::int64_t size, bool shuffle, std::uint64_t seed) : size_(size), shuffle_(shuffle), seed_(seed) {}

  // The dataset index of the `position`-th sample of epoch `epoch`.
  std::int64_t index(std::int64_t epoch, std::int64_t position) {
    if (!shuffle_) return position;
    if (epoch != cached_) draw(epoch);
    return order_[static_cast<std::size_t>(position)];
  }

  static std::uint64_t mix(std::uint64_t x) noexcept {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
  }

 private:
  void draw(std::int64_t epoch) {
    order_.resize(static_cast<std::size_t>(size_));
    std::iota(order_.begin(), order_.end(), std::int64_t{0});
    std::uint64_t state = mix(seed_ ^ mix(static_cast<std::uint64_t>(epoch)));
    for (std::int64_t i = size_ - 1; i > 0; --i) {
      state = mix(state);
      // A 64-bit draw modulo i + 1: its bias (below (i + 1) / 2^64) is far under any use's notice.
      const auto j = static_cast<std::int64_t>(state % static_cast<std::uint64_t>(i + 1));
      std::swap(order_[static_cast<std::size_t>(i)], order_[static_cast<std::size_t>(j)]);
    }
    cached_ = epoch;
  }

  std::int64_t size_ = 0;
  bool shuffle_ = false;
  std::uint64_t seed_ = 0;
  std::int64_t cached_ = -1;
  std::vector<std::int64_t> order_;
};

}  // namespace flexcomm
