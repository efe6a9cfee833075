// dataset: what a trainer tells a feed about its data instead of bytes: how many samples, the
// batch size and epochs, the shape and element type of a sample (and of its label), and a loader
// of one sample or of a run of samples. typed_feed (typed_feed.hpp) derives the steps, shard
// capacities and the slicing of every batch from it, on every feed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "../../core/datatype.hpp"
#include "../../core/error.hpp"
#include "../../core/span.hpp"

namespace flexcomm {

// One typed field of a sample: its element type and shape ({} is a scalar).
struct field {
  dtype type = dtype::f32;
  std::vector<std::int64_t> shape;

  template <class T>
  static field of(std::vector<std::int64_t> shape = {}) {
    static_assert(is_element_v<T>, "field::of<T>: T has no flexcomm dtype (float, double, int32, int64, uint8, "
                                   "half, bfloat16)");
    return {dtype_of<T>, std::move(shape)};
  }
  std::int64_t elements() const noexcept {
    std::int64_t n = 1;
    for (auto d : shape) n *= d;
    return n;
  }
  std::size_t bytes() const noexcept { return static_cast<std::size_t>(elements()) * size_of(type); }
  std::string str() const {
    std::string s = cat(name_of(type), "{");
    for (std::size_t i = 0; i < shape.size(); ++i) s += cat(i ? "," : "", shape[i]);
    return s + "}";
  }
};

namespace detail {
// `bytes` viewed as T, after checking T against the field's element type.
template <class T>
span<T> typed_view(span<std::byte> bytes, dtype type, const char* what) {
  static_assert(is_element_v<T>, "a typed view needs an element type with a flexcomm dtype");
  check(dtype_of<T> == type, what, cat("the field holds ", name_of(type), ", asked for ", name_of(dtype_of<T>)));
  return {reinterpret_cast<T*>(bytes.data()), bytes.size() / sizeof(T)};
}
}  // namespace detail

namespace detail {
// The bytes a loader writes, sample and label, and their typed views: what sample_slot and
// batch_slot both hand out (one sample, or a run of them).
class loader_fields {
 public:
  span<std::byte> sample_bytes() const noexcept { return sample_bytes_; }
  span<std::byte> label_bytes() const noexcept { return label_bytes_; }

 protected:
  loader_fields(const field& sample, span<std::byte> sample_bytes, const field* label, span<std::byte> label_bytes)
      : sample_(sample), sample_bytes_(sample_bytes), label_(label), label_bytes_(label_bytes) {}
  template <class T>
  span<T> typed_sample(const char* what) const { return typed_view<T>(sample_bytes_, sample_.type, what); }
  template <class T>
  span<T> typed_label(const char* what) const {
    check(label_ != nullptr, what, "the dataset has no label field");
    return typed_view<T>(label_bytes_, label_->type, what);
  }

 private:
  const field& sample_;
  span<std::byte> sample_bytes_;
  const field* label_;
  span<std::byte> label_bytes_;
};
}  // namespace detail

// Where a sample loader writes one sample (and its label). Element pointers are aligned to at
// least 8 bytes; the bytes are zeroed before the call.
class sample_slot : public detail::loader_fields {
 public:
  sample_slot(std::int64_t index, std::int64_t epoch, std::int64_t step, std::int64_t position, const field& sample,
              span<std::byte> sample_bytes, const field* label, span<std::byte> label_bytes)
      : loader_fields(sample, sample_bytes, label, label_bytes),
        index_(index), epoch_(epoch), step_(step), position_(position) {}

  std::int64_t index() const noexcept { return index_; }        // in the dataset, 0..size-1
  std::int64_t epoch() const noexcept { return epoch_; }
  std::int64_t step() const noexcept { return step_; }          // in the whole stream
  std::int64_t position() const noexcept { return position_; }  // in its step's batch

  template <class T>
  span<T> sample() const { return typed_sample<T>("sample_slot::sample"); }
  template <class T>
  span<T> label() const { return typed_label<T>("sample_slot::label"); }

 private:
  std::int64_t index_, epoch_, step_, position_;
};

// Where a batch loader writes a run of samples: one shard of a step, `count()` samples at
// positions [position(), position() + count()) of the batch, dataset indices `indices()`.
// Samples are contiguous (count x sample shape), labels too; aligned to at least 8 bytes, zeroed.
class batch_slot : public detail::loader_fields {
 public:
  batch_slot(std::int64_t epoch, std::int64_t step, std::int64_t step_in_epoch, std::int64_t position,
             span<const std::int64_t> indices, const field& sample, span<std::byte> samples, const field* label,
             span<std::byte> labels)
      : loader_fields(sample, samples, label, labels),
        epoch_(epoch), step_(step), step_in_epoch_(step_in_epoch), position_(position), indices_(indices) {}

  std::int64_t epoch() const noexcept { return epoch_; }
  std::int64_t step() const noexcept { return step_; }
  std::int64_t step_in_epoch() const noexcept { return step_in_epoch_; }
  std::int64_t position() const noexcept { return position_; }
  std::int64_t count() const noexcept { return static_cast<std::int64_t>(indices_.size()); }
  span<const std::int64_t> indices() const noexcept { return indices_; }

  template <class T>
  span<T> samples() const { return typed_sample<T>("batch_slot::samples"); }
  template <class T>
  span<T> labels() const { return typed_label<T>("batch_slot::labels"); }

 private:
  std::int64_t epoch_, step_, step_in_epoch_, position_;
  span<const std::int64_t> indices_;
};

// Writes sample `index` (and its label) into `out`. Called once per sample, on the ranks that load.
using sample_loader = std::function<void(std::int64_t index, const sample_slot& out)>;
// Writes the run of samples `out` describes; called once per non-empty shard of each step.
using batch_loader = std::function<void(const batch_slot& out)>;

struct dataset {
  std::int64_t size = 0;     // samples in one epoch; every rank gives it, only loading ranks hold the data
  std::int64_t batch = 0;    // samples per step; every member trains on the whole batch, split over its ranks
  std::int64_t epochs = 1;
  field sample;              // e.g. field::of<float>({1, 28, 28})
  std::optional<field> label;  // e.g. field::of<std::int64_t>()
  bool drop_last = false;    // drop the short last batch of each epoch instead of delivering it
  bool shuffle = false;      // visit each epoch in a permutation drawn from (seed, epoch)
  std::uint64_t seed = 0;
  // One of the two, on the ranks that load (producers under one_to_many, trainers otherwise);
  // with both, load_batch is used.
  sample_loader load_sample;
  batch_loader load_batch;
};

namespace detail {
// How one shard of n samples travels inside the byte feed: the dataset indices (n x int64),
// the samples, the labels; each block padded to 8 bytes, so every block of every shard stays
// aligned however shards are concatenated.
struct shard_record {
  std::size_t sample_bytes = 0, label_bytes = 0;

  static std::size_t pad8(std::size_t n) noexcept { return (n + 7) / 8 * 8; }
  std::size_t samples_offset(std::size_t n) const noexcept { return n * sizeof(std::int64_t); }
  std::size_t labels_offset(std::size_t n) const noexcept { return samples_offset(n) + pad8(n * sample_bytes); }
  std::size_t bytes(std::size_t n) const noexcept { return labels_offset(n) + pad8(n * label_bytes); }
};
}  // namespace detail

}  // namespace flexcomm
