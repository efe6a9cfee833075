// A feed's batches on the device: each batch's bytes (a pinned host slot) are copied on a stream
// of their own while the feed's transfer of the next batch is in flight; the trainer's stream
// waits for the copy on the GPU only, so the host never blocks on it.
#pragma once

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
  device_feed(Feed& feed, std::size_t capacity, device::stream_t compute = nullptr)
      : feed_(feed), capacity_(capacity), compute_(compute) {
    copy_ = stream_handle::create("device_feed", true);
    for (auto& s : slots_) {
      void* raw = nullptr;
      check_cuda(device::malloc_device(&raw, capacity_ ? capacity_ : 1), "device_feed: cudaMalloc(", capacity_, " bytes)");
      s.device = static_cast<std::byte*>(raw);
      s.copied = event::create("device_feed");
      s.consumed = event::create("device_feed");
    }
  }
  device_feed(const device_feed&) = delete;
  device_feed& operator=(const device_feed&) = delete;
  ~device_feed() {
    device::stream_synchronize(copy_.get());
    device::stream_synchronize(compute_);
    for (auto& s : slots_)
      if (s.device) device::free_device(s.device);
  }

  std::optional<device_batch> next() {
    if (current_ >= 0) {
      auto& previous = slots_[current_];
      // The trainer's work on the previous batch so far is what must finish before its slot is
      // overwritten (two batches from now) ...
      previous.consumed.record(compute_, "device_feed: mark batch consumed");
      // ... and the feed may reuse the previous batch's host slot once its copy is done.
      check_cuda(device::event_synchronize(previous.copied.get()), "device_feed: wait for the previous copy");
    }
    auto batch = feed_.next();
    if (!batch) return std::nullopt;
    const int k = current_ < 0 ? 0 : 1 - current_;
    auto& slot = slots_[k];
    const auto host = batch->bytes();
    const auto what = cat("device_feed: step ", batch->step());
    check(host.size() <= capacity_, what,
          "batch holds ", host.size(), " bytes, the device slot ", capacity_);
    if (slot.used) check_cuda(device::stream_wait(copy_.get(), slot.consumed.get()), what, ": wait for slot");
    if (!host.empty())
      check_cuda(device::copy_async(slot.device, host.data(), host.size(), copy_.get()),
                 what, ": cudaMemcpyAsync");
    slot.copied.record(copy_.get(), what);
    check_cuda(device::stream_wait(compute_, slot.copied.get()), what, ": order the trainer's stream");
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
  device::stream_t compute_;
  stream_handle copy_;
  slot_state slots_[2];
  int current_ = -1;
};

}  // namespace flexcomm::cuda
