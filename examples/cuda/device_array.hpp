// An array in device memory, allocated and freed through flexcomm's device layer, so the same
// code runs on a GPU and on the device stand-in (where device memory is host RAM).
#pragma once

#include <flexcomm/flexcomm.hpp>

#include <cstddef>
#include <utility>

namespace cuda_mlp {

template <class T>
class device_array {
 public:
  device_array() = default;
  explicit device_array(std::size_t n, const char* what) : size_(n) {
    void* raw = nullptr;
    flexcomm::check_cuda(flexcomm::device::malloc_device(&raw, n * sizeof(T)), what, ": cudaMalloc(", n * sizeof(T), " bytes)");
    data_ = static_cast<T*>(raw);
  }
  device_array(device_array&& o) noexcept : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  device_array& operator=(device_array&& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(size_, o.size_);
    return *this;
  }
  device_array(const device_array&) = delete;
  device_array& operator=(const device_array&) = delete;
  ~device_array() {
    if (data_) flexcomm::device::free_device(data_);  // waits for the device's work, as cudaFree does
  }

  T* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }

 private:
  T* data_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace cuda_mlp
