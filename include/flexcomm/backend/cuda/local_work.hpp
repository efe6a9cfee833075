// The local work of the device backends (combine, divide, copy): kernels and copies on a stream,
// through the device layer, so they run on a GPU and on the host stand-in alike.
#pragma once

#include <cstddef>

#include "../../core/datatype.hpp"
#include "../../core/error.hpp"
#include "runtime.hpp"
#include "error.hpp"

namespace flexcomm::cuda {

// inout[i] = inout[i] (op) in[i] on `stream`; avg combines as sum (finish with divide()).
template <class T>
void combine(op o, T* inout, const T* in, std::size_t n, device::stream_t stream) {
  static_assert(is_element_v<T>, "combine: not a flexcomm element type");
  check_cuda(device::combine(o, inout, in, n, stream), "cuda combine (", n, " x ", name_of(dtype_of<T>), ", ", name_of(o), ")");
}

// Turns a sum over `ranks` contributions into their average, as divide_by() does on the host.
template <class T>
void divide(T* buf, std::size_t n, int ranks, device::stream_t stream) {
  static_assert(is_element_v<T>, "divide: not a flexcomm element type");
  check_cuda(device::divide(buf, n, ranks, stream), "cuda divide (", n, " x ", name_of(dtype_of<T>), " by ", ranks, ")");
}

// Stream-ordered copy between any two buffers (device or host; the runtime knows which).
inline void copy(void* dst, const void* src, std::size_t bytes, device::stream_t stream) {
  if (bytes) check_cuda(device::copy_async(dst, src, bytes, stream), "cuda copy");
}

// The Backend contract's local work (combine, divide, copy) for backends whose buffers live in
// device memory: kernels and copies on the operation's stream (the legacy default one if none).
struct device_work {
  template <class T>
  static void combine(op o, T* inout, const T* in, std::size_t n, device::stream_t s = nullptr) {
    cuda::combine(o, inout, in, n, s);
  }
  template <class T>
  static void divide(T* buf, std::size_t n, int ranks, device::stream_t s = nullptr) {
    cuda::divide(buf, n, ranks, s);
  }
  static void copy(void* dst, const void* src, std::size_t bytes, device::stream_t s = nullptr) {
    cuda::copy(dst, src, bytes, s);
  }
};

}  // namespace flexcomm::cuda
