// A feed's batches on the device: each batch's bytes (a pinned host slot) are copied on a stream
// of their own while the feed's transfer of the next batch is in flight; the trainer's stream
// waits for the copy on the GPU only, so the host never blocks on it.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "../../core/error.hpp"
#include "../../core/span.hpp"
#include "error.hpp"

namespace flexcomm::cuda {

// One batch in device memory: valid for work enqueued on the trainer's stream until the
// device_feed's next() after the one that returned it.
class device_batch {
 public:
  device_batch(std::int64_t step, span<const std::byte> bytes) : step_(step), bytes_(bytes) {}
  std::int64_t step() const noexcept { return step_; }
  span<const std::byte> bytes() const noexcept { return bytes_; }  // device memory
  template <class T>
  const T* as() const noexcept { return reinterpret_cast<const T*>(bytes_.data()); }

 private:
  std::int64_t step_;
  span<const std::byte> bytes_;
};

// Wraps any Feed of the feed contract (`next()` gives an optional-like batch with step() and
// bytes(), the bytes valid until the following next()). Two device slots alternate: batch s is
// copied into one while the trainer still computes on batch s-1 in the other.
template <class Feed>
class device_feed {
 public:
  // `capacity` bytes per batch; `compute` is the trainer's stream (nullptr: the legacy default).
  device_feed(Feed& feed, std::size_t capacity, cudaStream_t compute = nullptr)
      : feed_(feed), capacity_(capacity), compute_(compute) {
    copy_ = stream_handle::create("device_feed", cudaStreamNonBlocking);
    for (auto& s : slots_) {
      check_cuda(cudaMalloc(&s.device, capacity_ ? capacity_ : 1), cat("device_feed: cudaMalloc(", capacity_, " bytes)"));
      s.copied = event::create("device_feed");
      s.consumed = event::create("device_feed");
    }
  }
  device_feed(const device_feed&) = delete;
  device_feed& operator=(const device_feed&) = delete;
  ~device_feed() {
    cudaStreamSynchronize(copy_.get());
    cudaStreamSynchronize(compute_);
    for (auto& s : slots_)
      if (s.device) cudaFree(s.device);
  }

  std::optional<device_batch> next() {
    if (current_ >= 0) {
      auto& previous = slots_[current_];
      // The trainer's work on the previous batch so far is what must finish before its slot is
      // overwritten (two batches from now) ...
      previous.consumed.record(compute_, "device_feed: mark batch consumed");
      // ... and the feed may reuse the previous batch's host slot once its copy is done.
      check_cuda(cudaEventSynchronize(previous.copied.get()), "device_feed: wait for the previous copy");
    }
    auto batch = feed_.next();
    if (!batch) return std::nullopt;
    const int k = current_ < 0 ? 0 : 1 - current_;
    auto& slot = slots_[k];
    const auto host = batch->bytes();
    const auto what = cat("device_feed: step ", batch->step());
    check(host.size() <= capacity_, what,
          cat("batch holds ", host.size(), " bytes, the device slot ", capacity_));
    if (slot.used) check_cuda(cudaStreamWaitEvent(copy_.get(), slot.consumed.get(), 0), cat(what, ": wait for slot"));
    if (!host.empty())
      check_cuda(cudaMemcpyAsync(slot.device, host.data(), host.size(), cudaMemcpyHostToDevice, copy_.get()),
                 cat(what, ": cudaMemcpyAsync"));
    slot.copied.record(copy_.get(), what);
    check_cuda(cudaStreamWaitEvent(compute_, slot.copied.get(), 0), cat(what, ": order the trainer's stream"));
    slot.used = true;
    current_ = k;
    return device_batch(batch->step(), span<const std::byte>(slot.device, host.size()));
  }

 private:
  struct slot_state {
    std::byte* device = nullptr;
    event copied, consumed;
    bool used = false;
  };

  Feed& feed_;
  std::size_t capacity_;
  cudaStream_t compute_;
  stream_handle copy_;
  slot_state slots_[2];
  int current_ = -1;
};

}  // namespace flexcomm::cuda
