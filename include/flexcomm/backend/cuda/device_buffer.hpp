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
template <class T>
class device_buffer {
 public:
  device_buffer() = default;
  explicit device_buffer(std::size_t n) { resize(n); }
  device_buffer(device_buffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)), capacity_(std::exchange(o.capacity_, 0)) {}
  device_buffer& operator=(device_buffer&& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(size_, o.size_);
    std::swap(capacity_, o.capacity_);
    return *this;
  }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  ~device_buffer() {
    if (data_) device::free_device(data_);
  }

  void resize(std::size_t n) {
    if (n > capacity_) {
      T* fresh = nullptr;
      void* raw = nullptr;
      check_cuda(device::malloc_device(&raw, n * sizeof(T)), "device_buffer: cudaMalloc(", n * sizeof(T), " bytes)");
      fresh = static_cast<T*>(raw);
      if (data_) device::free_device(data_);
      data_ = fresh;
      capacity_ = n;
    }
    size_ = n;
  }
  T* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }
  bool empty() const noexcept { return size_ == 0; }

 private:
  T* data_ = nullptr;
  std::size_t size_ = 0, capacity_ = 0;
};

}  // namespace flexcomm::cuda
