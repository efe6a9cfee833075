// Device-side reductions for every flexcomm element type and op, the GPU twin of core/reduce.hpp:
// the same rule (core/reduce_rule.hpp, compiled here for the device), so a device result equals
// the host reference bit for bit, NaN, infinities and subnormals included.
// The CUDA half of the device layer's kernels (runtime_cuda.hpp); callers use cuda::combine and
// cuda::divide (cuda/local_work.hpp), which run on the host stand-in as well.
//
// Shape: memory-bound loops move 16 bytes per load and store. A call is a scalar head (elements
// until `inout` is 16-byte aligned), a body of 16-byte vectors, grid-stride, and a scalar tail. An
// `in` aligned differently from `inout` (a ring's segment at any element offset) is read as
// aligned vectors and funnel-shifted into place. half and bfloat16 add and multiply as half2 /
// bfloat162 pairs (one rounding, which equals the host's float-then-round: rounding twice is
// harmless when the wider format has 2p + 2 bits, 24 >= 2 x 11 + 2), take min, max and division
// through float, and every NaN lane becomes 0x7fff.
// The bodies are __host__ __device__, so a test can run them on the host thread by thread.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../../core/datatype.hpp"
#include "../../core/reduce.hpp"
#include "../../core/reduce_rule.hpp"

namespace flexcomm::cuda::kernels {

namespace detail {
// flexcomm::half and bfloat16 are storage types; on the device they are CUDA's own.
template <class T> struct device_type { using type = T; };
template <> struct device_type<half> { using type = __half; };
template <> struct device_type<bfloat16> { using type = __nv_bfloat16; };
static_assert(sizeof(half) == sizeof(__half) && sizeof(bfloat16) == sizeof(__nv_bfloat16),
              "flexcomm's 16-bit floats must be bit-compatible with CUDA's");

template <class D> inline constexpr bool is_f16_device = std::is_same_v<D, __half> || std::is_same_v<D, __nv_bfloat16>;
template <class D> using pair_of = std::conditional_t<std::is_same_v<D, __half>, __half2, __nv_bfloat162>;

constexpr std::size_t vector_bytes = 16;
template <class D> inline constexpr std::size_t lanes = vector_bytes / sizeof(D);

// Two 16-bit floats in one word: a NaN lane becomes the canonical 0x7fff whatever made it.
template <class D>
FLEXCOMM_HOST_DEVICE inline std::uint32_t canonical_pair(std::uint32_t w) {
  constexpr std::uint32_t inf = std::is_same_v<D, __half> ? 0x7c00u : 0x7f80u;
  const std::uint32_t lo = (w & 0x7fffu) > inf ? 0x7fffu : (w & 0xffffu);
  const std::uint32_t hi = ((w >> 16) & 0x7fffu) > inf ? 0x7fffu : (w >> 16);
  return lo | (hi << 16);
}

template <class To, class From>
FLEXCOMM_HOST_DEVICE inline To bit_cast(const From& x) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast: sizes differ");
  To y;
  std::memcpy(static_cast<void*>(&y), static_cast<const void*>(&x), sizeof y);  // CUDA's types have no trivial copy
  return y;
}

template <class D>
FLEXCOMM_HOST_DEVICE inline float2 widen(std::uint32_t w) {
  if constexpr (std::is_same_v<D, __half>) return __half22float2(bit_cast<__half2>(w));
  else return __bfloat1622float2(bit_cast<__nv_bfloat162>(w));
}
template <class D>
FLEXCOMM_HOST_DEVICE inline std::uint32_t narrow(float lo, float hi) {
  if constexpr (std::is_same_v<D, __half>) return canonical_pair<D>(bit_cast<std::uint32_t>(__floats2half2_rn(lo, hi)));
  else return canonical_pair<D>(bit_cast<std::uint32_t>(__floats2bfloat162_rn(lo, hi)));
}

// a (op) b on two pairs of 16-bit floats.
template <op O, class D>
FLEXCOMM_HOST_DEVICE inline std::uint32_t combine_pair(std::uint32_t a, std::uint32_t b) {
  using P = pair_of<D>;
  if constexpr (O == op::sum || O == op::avg) {
    return canonical_pair<D>(bit_cast<std::uint32_t>(__hadd2(bit_cast<P>(a), bit_cast<P>(b))));
  } else if constexpr (O == op::prod) {
    return canonical_pair<D>(bit_cast<std::uint32_t>(__hmul2(bit_cast<P>(a), bit_cast<P>(b))));
  } else {
    const float2 x = widen<D>(a), y = widen<D>(b);
    return narrow<D>(rule::floating<O>(x.x, y.x), rule::floating<O>(x.y, y.y));
  }
}

template <op O, class D>
FLEXCOMM_HOST_DEVICE inline D combine_one(D a, D b) {
  if constexpr (is_f16_device<D>) {
    const std::uint32_t r = combine_pair<O, D>(bit_cast<std::uint16_t>(a), bit_cast<std::uint16_t>(b));
    return bit_cast<D>(static_cast<std::uint16_t>(r & 0xffffu));
  } else {
    return rule::combined<O>(a, b);
  }
}

template <op O, class D>
FLEXCOMM_HOST_DEVICE inline uint4 combine_vector(uint4 a, uint4 b) {
  if constexpr (is_f16_device<D>) {
    return make_uint4(combine_pair<O, D>(a.x, b.x), combine_pair<O, D>(a.y, b.y), combine_pair<O, D>(a.z, b.z),
                      combine_pair<O, D>(a.w, b.w));
  } else {
    D x[lanes<D>], y[lanes<D>];
    std::memcpy(x, &a, sizeof x);
    std::memcpy(y, &b, sizeof y);
    for (std::size_t k = 0; k < lanes<D>; ++k) x[k] = rule::combined<O>(x[k], y[k]);
    std::memcpy(&a, x, sizeof x);
    return a;
  }
}

// The 16 bytes that start `shift` bytes into lo:hi (two aligned vectors), shift in 0..15.
FLEXCOMM_HOST_DEVICE inline uint4 shifted(uint4 lo, uint4 hi, unsigned shift) {
  const std::uint32_t w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
  const unsigned q = shift / 4, s = 8 * (shift % 4);
  std::uint32_t r[5];
  for (unsigned k = 0; k < 5; ++k) r[k] = q == 0 ? w[k] : q == 1 ? w[k + 1] : q == 2 ? w[k + 2] : w[k + 3];
  for (unsigned k = 0; k < 4; ++k) r[k] = s == 0 ? r[k] : (r[k] >> s) | (r[k + 1] << (32 - s));
  return make_uint4(r[0], r[1], r[2], r[3]);
}

// How a call cuts its n elements: `head` scalars until inout + head is 16-byte aligned, `vectors`
// vectors, then scalars to n. `shift`: how far in + head lies past a 16-byte boundary.
struct plan {
  std::size_t n = 0, head = 0, vectors = 0;
  unsigned shift = 0;
};

inline plan plan_for(const void* inout, const void* in, std::size_t n, std::size_t size) {
  plan p;
  p.n = n;
  const auto at = reinterpret_cast<std::uintptr_t>(inout);
  if (at % size != 0) {  // not even element-aligned: one element at a time
    p.head = n;
    return p;
  }
  const std::size_t to_boundary = (vector_bytes - at % vector_bytes) % vector_bytes / size;
  p.head = to_boundary < n ? to_boundary : n;
  const std::size_t rest = (n - p.head) * size;
  p.shift = static_cast<unsigned>((reinterpret_cast<std::uintptr_t>(in) + p.head * size) % vector_bytes);
  // Shifted, vector v reads in's aligned blocks v and v + 1: the last must end inside `in`.
  if (p.shift == 0) p.vectors = rest / vector_bytes;
  else p.vectors = rest + p.shift >= vector_bytes ? (rest + p.shift) / vector_bytes - 1 : 0;
  return p;
}

// One thread's share of a combine: vectors thread, thread + threads, ...; then the scalars.
template <op O, class D, bool Shifted>
FLEXCOMM_HOST_DEVICE inline void combine_part(D* __restrict__ inout, const D* __restrict__ in, const plan& p,
                                              std::size_t thread, std::size_t threads) {
  uint4* body = reinterpret_cast<uint4*>(inout + p.head);
  const uint4* from = reinterpret_cast<const uint4*>(reinterpret_cast<const char*>(in + p.head) - p.shift);
  for (std::size_t v = thread; v < p.vectors; v += threads) {
    const uint4 b = Shifted ? shifted(from[v], from[v + 1], p.shift) : from[v];
    body[v] = combine_vector<O, D>(body[v], b);
  }
  for (std::size_t i = thread; i < p.head; i += threads) inout[i] = combine_one<O>(inout[i], in[i]);
  for (std::size_t i = p.head + p.vectors * lanes<D> + thread; i < p.n; i += threads)
    inout[i] = combine_one<O>(inout[i], in[i]);
}

template <op O, class D, bool Shifted>
__global__ void combine_kernel(D* __restrict__ inout, const D* __restrict__ in, plan p) {
  combine_part<O, D, Shifted>(inout, in, p, static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x,
                              static_cast<std::size_t>(gridDim.x) * blockDim.x);
}

// What a divide multiplies or divides by: the reciprocal for float and double (as divide_by),
// the rank count in float for 16-bit floats, a magic divisor for integers.
template <class D>
using divide_arg = std::conditional_t<is_f16_device<D>, float,
                                      std::conditional_t<std::is_floating_point_v<D>, D, rule::divisor_for<D>>>;

template <class D>
FLEXCOMM_HOST_DEVICE inline std::uint32_t divide_pair(std::uint32_t w, float by) {
  const float2 x = widen<D>(w);
  return narrow<D>(x.x / by, x.y / by);
}

template <class D>
FLEXCOMM_HOST_DEVICE inline D divide_one(D x, const divide_arg<D>& by) {
  if constexpr (is_f16_device<D>) {
    return bit_cast<D>(static_cast<std::uint16_t>(divide_pair<D>(bit_cast<std::uint16_t>(x), by) & 0xffffu));
  } else if constexpr (std::is_floating_point_v<D>) {
    return rule::canonical(x * by);
  } else {
    return rule::divided(x, by);
  }
}

template <class D>
FLEXCOMM_HOST_DEVICE inline uint4 divide_vector(uint4 a, const divide_arg<D>& by) {
  if constexpr (is_f16_device<D>) {
    return make_uint4(divide_pair<D>(a.x, by), divide_pair<D>(a.y, by), divide_pair<D>(a.z, by), divide_pair<D>(a.w, by));
  } else {
    D x[lanes<D>];
    std::memcpy(x, &a, sizeof x);
    for (std::size_t k = 0; k < lanes<D>; ++k) x[k] = divide_one<D>(x[k], by);
    std::memcpy(&a, x, sizeof x);
    return a;
  }
}

template <class D>
FLEXCOMM_HOST_DEVICE inline void divide_part(D* __restrict__ buf, divide_arg<D> by, const plan& p, std::size_t thread,
                                             std::size_t threads) {
  uint4* body = reinterpret_cast<uint4*>(buf + p.head);
  for (std::size_t v = thread; v < p.vectors; v += threads) body[v] = divide_vector<D>(body[v], by);
  for (std::size_t i = thread; i < p.head; i += threads) buf[i] = divide_one<D>(buf[i], by);
  for (std::size_t i = p.head + p.vectors * lanes<D> + thread; i < p.n; i += threads) buf[i] = divide_one<D>(buf[i], by);
}

template <class D>
__global__ void divide_kernel(D* __restrict__ buf, divide_arg<D> by, plan p) {
  divide_part<D>(buf, by, p, static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x,
                 static_cast<std::size_t>(gridDim.x) * blockDim.x);
}

constexpr unsigned block_threads = 256;

// A thread per vector (or per scalar of the longer scalar run), up to 4096 blocks: grid-stride
// beyond that. Never more blocks than the scalar kernels had at the same size.
template <class D>
unsigned grid_for(const plan& p) {
  const std::size_t tail = p.n - p.head - p.vectors * lanes<D>;
  std::size_t work = p.vectors > p.head ? p.vectors : p.head;
  if (tail > work) work = tail;
  const std::size_t blocks = (work + block_threads - 1) / block_threads;
  return static_cast<unsigned>(blocks < 1 ? 1 : blocks < 4096 ? blocks : 4096);
}

template <op O, class T>
void launch_combine(T* inout, const T* in, std::size_t n, cudaStream_t stream) {
  using D = typename device_type<T>::type;
  const plan p = plan_for(inout, in, n, sizeof(T));
  D* out = reinterpret_cast<D*>(inout);
  const D* from = reinterpret_cast<const D*>(in);
  if (p.shift == 0) combine_kernel<O, D, false><<<grid_for<D>(p), block_threads, 0, stream>>>(out, from, p);
  else combine_kernel<O, D, true><<<grid_for<D>(p), block_threads, 0, stream>>>(out, from, p);
}

template <class D>
divide_arg<D> divide_by_arg(int ranks) {
  if constexpr (is_f16_device<D>) return static_cast<float>(ranks);
  else if constexpr (std::is_floating_point_v<D>) return D(1) / static_cast<D>(ranks);
  else return divide_arg<D>::of(static_cast<std::uint32_t>(ranks));
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
  const detail::plan p = detail::plan_for(buf, buf, n, sizeof(T));
  detail::divide_kernel<D><<<detail::grid_for<D>(p), detail::block_threads, 0, stream>>>(
      reinterpret_cast<D*>(buf), detail::divide_by_arg<D>(ranks), p);
  return cudaGetLastError();
}

}  // namespace flexcomm::cuda::kernels
