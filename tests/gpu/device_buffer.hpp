// The device buffers and streams of tests/backend_cases.hpp (the host ones are in
// tests/test_buffer.hpp): device memory, and a stream of its own that is not ordered with the
// legacy default stream (cudaStreamNonBlocking), through the device layer, so that the same
// cases run on a GPU and on the host stand-in.
#pragma once

#include <flexcomm/backend/cuda/error.hpp>
#include <flexcomm/backend/cuda/runtime.hpp>

#include "../test_buffer.hpp"

#include <cstddef>
#include <vector>

namespace flexcomm::testing {

template <class T>
class test_buffer<memory_space::device, T> {
 public:
  explicit test_buffer(std::size_t n) : n_(n) {
    void* raw = nullptr;
    if (n_) check_cuda(device::malloc_device(&raw, n_ * sizeof(T)), "test: cudaMalloc");
    p_ = static_cast<T*>(raw);
    if (n_) check_cuda(device::fill(p_, 0xff, n_ * sizeof(T)), "test: cudaMemset");  // not a plausible result
    ready();
  }
  explicit test_buffer(const std::vector<T>& host) : test_buffer(host.size()) {
    if (n_) check_cuda(device::copy_sync(p_, host.data(), n_ * sizeof(T)), "test: upload");
    ready();
  }
  test_buffer(const test_buffer&) = delete;
  test_buffer& operator=(const test_buffer&) = delete;
  ~test_buffer() {
    if (p_) device::free_device(p_);
  }
  std::vector<T> host() const {
    check_cuda(device::device_synchronize(), "test: cudaDeviceSynchronize");
    std::vector<T> out(n_);
    if (n_) check_cuda(device::copy_sync(out.data(), p_, n_ * sizeof(T)), "test: download");
    return out;
  }
  flexcomm::span<T> span() const { return {p_, n_}; }
  flexcomm::span<const T> cspan() const { return {p_, n_}; }

 private:
  // cudaMemset and cudaMemcpy from pageable memory are queued on the legacy default stream and may
  // land after they return; an operation on a non-blocking stream (side_stream) is not ordered
  // after them. A trainer handing such a buffer to a non-blocking stream must order it first
  // (an event, or a synchronize): so must the test. Before this, the staged backend's cases on
  // side_stream read and wrote these buffers while the fill was still in flight (on the GPU at
  // 2-4 ranks; on the stand-in at every rank count).
  void ready() const { check_cuda(device::device_synchronize(), "test: cudaDeviceSynchronize"); }

  T* p_ = nullptr;
  std::size_t n_;
};

template <>
struct side_stream<memory_space::device> {
  device::stream_t s = nullptr;
  side_stream() { check_cuda(device::stream_create(&s, true), "test: cudaStreamCreate"); }
  side_stream(const side_stream&) = delete;
  side_stream& operator=(const side_stream&) = delete;
  ~side_stream() { device::stream_destroy(s); }
};

}  // namespace flexcomm::testing
