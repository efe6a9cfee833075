// The buffers and streams of tests/backend_cases.hpp, chosen by the backend's memory space: here
// the host ones (a std::vector, and the backend's no_stream); the device ones, cudaMalloc'd and
// on a CUDA stream, are in tests/gpu/device_buffer.hpp, so a host test never sees CUDA headers.
#pragma once

#include <flexcomm/flexcomm.hpp>

#include <cstddef>
#include <cstring>
#include <type_traits>
#include <vector>

namespace flexcomm::testing {

// Memory of space M holding n elements of T, made from a host vector or filled with a value no
// result can plausibly be (all bits set: NaN, -1, 255); host() copies it back after the work
// queued on it is done; span() and cspan() are what a backend operation takes.
template <memory_space M, class T>
class test_buffer;

// A stream besides the communicator's own (the backend's `stream`, in `s`), to check that an
// operation's stream parameter is honoured; `stream{}` is the communicator's own.
template <memory_space M>
struct side_stream;

template <class T>
class test_buffer<memory_space::host, T> {
  static_assert(std::is_trivially_copyable_v<T>);

 public:
  explicit test_buffer(std::size_t n) : v_(n) {
    if (n) std::memset(static_cast<void*>(v_.data()), 0xff, n * sizeof(T));  // not a plausible result
  }
  explicit test_buffer(const std::vector<T>& host) : v_(host) {}
  test_buffer(const test_buffer&) = delete;
  test_buffer& operator=(const test_buffer&) = delete;

  std::vector<T> host() const { return v_; }
  flexcomm::span<T> span() { return {v_.data(), v_.size()}; }
  flexcomm::span<const T> cspan() const { return {v_.data(), v_.size()}; }

 private:
  std::vector<T> v_;
};

template <>
struct side_stream<memory_space::host> {
  no_stream s{};
};

}  // namespace flexcomm::testing
