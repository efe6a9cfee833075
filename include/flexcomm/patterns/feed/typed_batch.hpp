// typed_batch: one step as a trainer of a typed_feed sees it: its samples (and labels) as
// tensors of shape {samples, ...field shape}, contiguous and 64-byte aligned, the dataset
// index of each, and where the step sits in its epoch. Valid until the feed's next next().
// The tensors are this trainer's own copy, so they may be changed in place: the byte batch
// underneath can be a shared-memory slot that other members read too.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "../../core/datatype.hpp"
#include "../../core/error.hpp"
#include "../../core/span.hpp"
#include "dataset.hpp"
#include "vocabulary.hpp"

namespace flexcomm {

// Every tensor a typed_batch hands out starts on a boundary of this many bytes (a cache line,
// and enough for AVX-512 loads and for torch::from_blob's and Eigen's alignment wishes).
constexpr std::size_t batch_alignment = 64;

// A dense, row-major tensor over memory someone else owns: a pointer and a shape. Mutable, so
// a framework can wrap it without a cast (torch::from_blob(v.data(), v.shape())).
template <class T>
class tensor_view {
 public:
  tensor_view() = default;
  tensor_view(T* data, std::vector<std::int64_t> shape) : data_(data), shape_(std::move(shape)) {}

  T* data() const noexcept { return data_; }
  const std::vector<std::int64_t>& shape() const noexcept { return shape_; }
  int dim() const noexcept { return static_cast<int>(shape_.size()); }
  std::int64_t size(int d) const {
    check(d >= 0 && d < dim(), "tensor_view", cat("dimension ", d, " of a ", dim(), "-dimensional tensor"));
    return shape_[static_cast<std::size_t>(d)];
  }
  std::size_t numel() const noexcept {
    std::size_t n = 1;
    for (auto d : shape_) n *= static_cast<std::size_t>(d);
    return n;
  }
  span<T> flat() const noexcept { return {data_, numel()}; }
  T& operator[](std::size_t i) const noexcept { return data_[i]; }

 private:
  T* data_ = nullptr;
  std::vector<std::int64_t> shape_;
};

class typed_batch {
 public:
  // Built by typed_feed; `storage` points into buffers the feed owns.
  struct storage {
    std::byte* samples = nullptr;      // batch_alignment-aligned
    std::byte* labels = nullptr;       // batch_alignment-aligned, or null without a label field
    const std::int64_t* indices = nullptr;
  };
  typed_batch(const batch& bytes, const field& sample, const field* label, storage at, std::int64_t samples,
              std::int64_t first_sample, std::int64_t batch_samples, std::int64_t epoch, std::int64_t step_in_epoch,
              std::int64_t steps_in_epoch)
      : bytes_(bytes), sample_(&sample), label_(label), at_(at), samples_(samples), first_sample_(first_sample),
        batch_samples_(batch_samples), epoch_(epoch), step_in_epoch_(step_in_epoch), steps_in_epoch_(steps_in_epoch) {}

  std::int64_t step() const noexcept { return bytes_.step(); }  // in the whole stream
  std::int64_t epoch() const noexcept { return epoch_; }
  std::int64_t step_in_epoch() const noexcept { return step_in_epoch_; }
  std::int64_t steps_in_epoch() const noexcept { return steps_in_epoch_; }
  bool last_in_epoch() const noexcept { return step_in_epoch_ == steps_in_epoch_ - 1; }

  // This trainer's samples (0 is possible: a short last batch over many shards); they are
  // positions [first_sample(), first_sample() + samples()) of the step's batch of
  // batch_samples() (the whole member's; every member gets the same batch).
  std::int64_t samples() const noexcept { return samples_; }
  std::int64_t first_sample() const noexcept { return first_sample_; }
  std::int64_t batch_samples() const noexcept { return batch_samples_; }
  // The dataset index of each of this trainer's samples.
  span<const std::int64_t> indices() const noexcept { return {at_.indices, static_cast<std::size_t>(samples_)}; }

  // The samples as {samples(), ...sample shape}; T must be the sample field's element type.
  template <class T>
  tensor_view<T> as() const {
    return view<T>(at_.samples, *sample_, "typed_batch::as");
  }
  // The labels as {samples(), ...label shape}.
  template <class T>
  tensor_view<T> labels() const {
    check(label_ != nullptr, "typed_batch::labels", "the dataset has no label field");
    return view<T>(at_.labels, *label_, "typed_batch::labels");
  }
  bool has_labels() const noexcept { return label_ != nullptr; }
  const field& sample_field() const noexcept { return *sample_; }

  // The byte batch underneath (one record per shard: indices, samples, labels; see dataset.hpp).
  const batch& bytes_batch() const noexcept { return bytes_; }

 private:
  template <class T>
  tensor_view<T> view(std::byte* data, const field& f, const char* what) const {
    static_assert(is_element_v<T>, "typed_batch: T has no flexcomm dtype (float, double, int32, int64, uint8, half, "
                                   "bfloat16)");
    check(dtype_of<T> == f.type, what,
          cat("the field is ", f.str(), ", asked for ", name_of(dtype_of<T>), " elements"));
    std::vector<std::int64_t> shape{samples_};
    shape.insert(shape.end(), f.shape.begin(), f.shape.end());
    return {reinterpret_cast<T*>(data), std::move(shape)};
  }

  batch bytes_;
  const field* sample_;
  const field* label_;
  storage at_;
  std::int64_t samples_, first_sample_, batch_samples_, epoch_, step_in_epoch_, steps_in_epoch_;
};

}  // namespace flexcomm
