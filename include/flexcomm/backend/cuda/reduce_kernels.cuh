// Device-side reductions for every flexcomm element type and op, the GPU twin of core/reduce.hpp:
// same arithmetic in the same order, so a device result equals the host reference bit for bit.
// The CUDA half of the device layer's kernels (runtime_cuda.hpp); callers use cuda::combine and
// cuda::divide (cuda/local_work.hpp), which run on the host stand-in as well.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "../../core/datatype.hpp"
#include "../../core/reduce.hpp"

namespace flexcomm::cuda::kernels {

namespace detail {
// flexcomm::half and bfloat16 are storage types; on the device they are CUDA's own.
template <class T> struct device_type { using type = T; };
template <> struct device_type<half> { using type = __half; };
template <> struct device_type<bfloat16> { using type = __nv_bfloat16; };
static_assert(sizeof(half) == sizeof(__half) && sizeof(bfloat16) == sizeof(__nv_bfloat16),
              "flexcomm's 16-bit floats must be bit-compatible with CUDA's");

template <class D> inline constexpr bool is_f16_device = std::is_same_v<D, __half> || std::is_same_v<D, __nv_bfloat16>;

__device__ inline float widen(__half x) { return __half2float(x); }
__device__ inline float widen(__nv_bfloat16 x) { return __bfloat162float(x); }
template <class D> __device__ inline D narrow(float x);
template <> __device__ inline __half narrow<__half>(float x) { return __float2half_rn(x); }
template <> __device__ inline __nv_bfloat16 narrow<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// The host's std::min / std::max expressions, so ties and signed zeros resolve the same way.
template <class V> __device__ inline V apply(op o, V a, V b) {
  switch (o) {
    case op::prod: return static_cast<V>(a * b);
    case op::min: return (b < a) ? b : a;
    case op::max: return (a < b) ? b : a;
    default: return static_cast<V>(a + b);  // sum, avg
  }
}

template <op O, class D>
__global__ void combine_kernel(D* __restrict__ inout, const D* __restrict__ in, std::size_t n) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    if constexpr (is_f16_device<D>) inout[i] = narrow<D>(apply(O, widen(inout[i]), widen(in[i])));
    else inout[i] = apply(O, inout[i], in[i]);
  }
}

// Floating types multiply by the host-computed reciprocal (as divide_by does); 16-bit floats
// divide in float; integers divide and truncate toward zero.
template <class D, class S>
__global__ void divide_kernel(D* buf, std::size_t n, S by) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    if constexpr (is_f16_device<D>) buf[i] = narrow<D>(widen(buf[i]) / by);
    else if constexpr (std::is_floating_point_v<D>) buf[i] = buf[i] * by;
    else buf[i] = static_cast<D>(buf[i] / by);
  }
}

constexpr unsigned block_threads = 256;

inline unsigned grid_for(std::size_t n) {
  const std::size_t blocks = (n + block_threads - 1) / block_threads;
  return static_cast<unsigned>(blocks < 4096 ? blocks : 4096);  // grid-stride beyond that
}

template <op O, class T>
void launch_combine(T* inout, const T* in, std::size_t n, cudaStream_t stream) {
  using D = typename device_type<T>::type;
  combine_kernel<O, D><<<grid_for(n), block_threads, 0, stream>>>(reinterpret_cast<D*>(inout),
                                                                   reinterpret_cast<const D*>(in), n);
}
}  // namespace detail

// inout[i] = inout[i] (op) in[i] on `stream`; avg combines as sum (finish with divide()).
template <class T>
cudaError_t combine(op o, T* inout, const T* in, std::size_t n, cudaStream_t stream) {
  static_assert(is_element_v<T>, "combine: not a flexcomm element type");
  if (n == 0) return cudaSuccess;
  switch (o) {
    case op::sum: case op::avg: detail::launch_combine<op::sum>(inout, in, n, stream); break;
    case op::prod: detail::launch_combine<op::prod>(inout, in, n, stream); break;
    case op::min: detail::launch_combine<op::min>(inout, in, n, stream); break;
    case op::max: detail::launch_combine<op::max>(inout, in, n, stream); break;
  }
  return cudaGetLastError();
}

// Turns a sum over `ranks` contributions into their average, as divide_by() does on the host.
template <class T>
cudaError_t divide(T* buf, std::size_t n, int ranks, cudaStream_t stream) {
  static_assert(is_element_v<T>, "divide: not a flexcomm element type");
  if (n == 0 || ranks <= 1) return cudaSuccess;
  using D = typename detail::device_type<T>::type;
  D* d = reinterpret_cast<D*>(buf);
  if constexpr (detail::is_f16_device<D>) {
    detail::divide_kernel<<<detail::grid_for(n), detail::block_threads, 0, stream>>>(d, n, static_cast<float>(ranks));
  } else if constexpr (std::is_floating_point_v<D>) {
    const D inv = D(1) / static_cast<D>(ranks);
    detail::divide_kernel<<<detail::grid_for(n), detail::block_threads, 0, stream>>>(d, n, inv);
  } else {
    detail::divide_kernel<<<detail::grid_for(n), detail::block_threads, 0, stream>>>(d, n, static_cast<D>(ranks));
  }
  return cudaGetLastError();
}

}  // namespace flexcomm::cuda::kernels
