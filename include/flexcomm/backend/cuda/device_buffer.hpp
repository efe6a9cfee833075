// cuda::device_buffer<T>: an owning array in device memory, the device backends' B::buffer<T>,
// so that an adapter's scratch space lives where the backend's buffers must live.
#pragma once

#include <cstddef>
#include <utility>

#include "../../core/error.hpp"
#include "error.hpp"

namespace flexcomm::cuda {

// Like the parts of std::vector an adapter's scratch space uses (size, data, resize), except
// that resize() does not keep the contents: scratch is always written before it is read.
// It belongs to the device current where it was made, and allocates and frees there whichever
// thread grows or drops it (an adapter's ring grows its scratch on the progress engine's thread).
template <class T>
class device_buffer {
 public:
  device_buffer() : device_(current_device("device_buffer")) {}
  explicit device_buffer(std::size_t n) : device_buffer() { resize(n); }
  device_buffer(device_buffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)),
        size_(std::exchange(o.size_, 0)),
        capacity_(std::exchange(o.capacity_, 0)),
        device_(o.device_) {}
  device_buffer& operator=(device_buffer&& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(size_, o.size_);
    std::swap(capacity_, o.capacity_);
    std::swap(device_, o.device_);
    return *this;
  }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  ~device_buffer() {
    if (!data_) return;
    try {
      device_guard guard(device_, "device_buffer: cudaFree");
      device::free_device(data_);
    } catch (...) {  // the device is gone: nothing left to free
    }
  }

  void resize(std::size_t n) {
    if (n > capacity_) {
      device_guard guard(device_, "device_buffer");
      void* raw = nullptr;
      check_cuda(device::malloc_device(&raw, n * sizeof(T)), "device_buffer: cudaMalloc(", n * sizeof(T),
                 " bytes) on device ", device_);
      if (data_) device::free_device(data_);
      data_ = static_cast<T*>(raw);
      capacity_ = n;
    }
    size_ = n;
  }
  int device() const noexcept { return device_; }
  T* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }
  bool empty() const noexcept { return size_ == 0; }

 private:
  T* data_ = nullptr;
  std::size_t size_ = 0, capacity_ = 0;
  int device_ = 0;
};

}  // namespace flexcomm::cuda
