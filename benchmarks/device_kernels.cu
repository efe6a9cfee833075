// The device reduction kernels (backend/cuda/reduce_kernels.cuh) against a device-to-device copy of
// the same bytes, in one run, for every element type and op, nccl-tests-like columns and JSON:
//   build/benchmarks/device_kernels -b 4K -e 256M -f 4 -n 20 -w 5 -c 1 -J device_kernels.json
// Per row: the copy; flexcomm's kernel with both operands aligned alike (`vector`) and with `in`
// one element off (`shifted`, a ring segment's case; a divide's buffer one element off); and the kernels as they were before issue 52
// (`scalar`: one element per thread and pass, kept here as the reference for launch cost). busbw
// counts the bytes each moves through memory: a copy and a divide 2n, a combine 3n (two reads, a
// write); `/copy` is busbw over the copy's. `launch` is host time to enqueue one call. #wrong:
// elements of `vector` and `shifted` that differ from core/reduce.hpp's host loops (sizes <= 16 MiB).
// The last lines (`# verdict`) give the worst ratio at >= 16 MiB and the worst vector/scalar time
// at <= 1 MiB: the targets are >= 0.9 and <= 1.
#include <boost/program_options.hpp>
#include <cuda_runtime.h>

#include <flexcomm/backend/cuda/error.hpp>
#include <flexcomm/backend/cuda/reduce_kernels.cuh>
#include <flexcomm/core/setting_values.hpp>

#include "../examples/common/counts.hpp"
#include "flags.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

namespace fc = flexcomm;
namespace kn = flexcomm::cuda::kernels;
namespace po = boost::program_options;

namespace {
// ---- The kernels before issue 52, verbatim in shape: grid-stride, one element per pass ----
template <class D> inline constexpr bool scalar_f16 = kn::detail::is_f16_device<D>;
__device__ inline float widen(__half x) { return __half2float(x); }
__device__ inline float widen(__nv_bfloat16 x) { return __bfloat162float(x); }
template <class D> __device__ inline D narrow(float x) {
  if constexpr (std::is_same_v<D, __half>) return __float2half_rn(x);
  else return __float2bfloat16_rn(x);
}
template <class V> __device__ inline V apply(fc::op o, V a, V b) {
  switch (o) {
    case fc::op::prod: return static_cast<V>(a * b);
    case fc::op::min: return (b < a) ? b : a;
    case fc::op::max: return (a < b) ? b : a;
    default: return static_cast<V>(a + b);
  }
}
template <fc::op O, class D>
__global__ void scalar_combine(D* __restrict__ inout, const D* __restrict__ in, std::size_t n) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    if constexpr (scalar_f16<D>) inout[i] = narrow<D>(apply(O, widen(inout[i]), widen(in[i])));
    else inout[i] = apply(O, inout[i], in[i]);
  }
}
template <class D, class S>
__global__ void scalar_divide(D* buf, std::size_t n, S by) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    if constexpr (scalar_f16<D>) buf[i] = narrow<D>(widen(buf[i]) / by);
    else if constexpr (std::is_floating_point_v<D>) buf[i] = buf[i] * by;
    else buf[i] = static_cast<D>(buf[i] / by);
  }
}
unsigned scalar_grid(std::size_t n) { return static_cast<unsigned>(std::min<std::size_t>((n + 255) / 256, 4096)); }

template <class T>
void scalar_launch(fc::op o, T* inout, const T* in, std::size_t n, int ranks, cudaStream_t s) {
  using D = typename kn::detail::device_type<T>::type;
  D* x = reinterpret_cast<D*>(inout);
  const D* y = reinterpret_cast<const D*>(in);
  const unsigned g = scalar_grid(n);
  switch (o) {
    case fc::op::sum: scalar_combine<fc::op::sum><<<g, 256, 0, s>>>(x, y, n); break;
    case fc::op::prod: scalar_combine<fc::op::prod><<<g, 256, 0, s>>>(x, y, n); break;
    case fc::op::min: scalar_combine<fc::op::min><<<g, 256, 0, s>>>(x, y, n); break;
    case fc::op::max: scalar_combine<fc::op::max><<<g, 256, 0, s>>>(x, y, n); break;
    case fc::op::avg:  // the divide
      if constexpr (scalar_f16<D>) scalar_divide<<<g, 256, 0, s>>>(x, n, static_cast<float>(ranks));
      else if constexpr (std::is_floating_point_v<D>) scalar_divide<<<g, 256, 0, s>>>(x, n, D(1) / static_cast<D>(ranks));
      else scalar_divide<<<g, 256, 0, s>>>(x, n, static_cast<D>(ranks));
      break;
  }
}

// ---- Measuring ----
struct timing {
  double us = 0;         // device time per call (events around `iters` back-to-back calls)
  double launch_us = 0;  // host time to enqueue one call
};

template <class Launch>
timing measure(Launch&& launch, int iters, int warmup, cudaStream_t s, cudaEvent_t start, cudaEvent_t stop) {
  for (int i = 0; i < warmup; ++i) launch();
  fc::check_cuda(cudaStreamSynchronize(s), "warmup");
  timing t;
  fc::check_cuda(cudaEventRecord(start, s), "cudaEventRecord");
  const auto host0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) launch();
  t.launch_us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - host0).count() / iters;
  fc::check_cuda(cudaEventRecord(stop, s), "cudaEventRecord");
  fc::check_cuda(cudaEventSynchronize(stop), "cudaEventSynchronize");
  float ms = 0;
  fc::check_cuda(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
  t.us = 1e3 * ms / iters;
  return t;
}

// Plain values that keep sums and products finite for a while (the runs repeat in place).
template <class T>
std::vector<T> values(std::size_t n, unsigned seed) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) {
    const unsigned x = (static_cast<unsigned>(i) * 2654435761u + seed) >> 8;
    if constexpr (std::is_integral_v<T>) v[i] = static_cast<T>(x % 7 + 1);
    else v[i] = T(1.0f + static_cast<float>(x % 1000) / 4096.0f);
  }
  return v;
}

// Elements of the device's n at `device` that differ from the host loops on the same inputs.
template <class T>
long count_wrong(fc::op o, const T* a, const T* b, std::size_t n, int ranks, const T* device) {
  std::vector<T> want(a, a + n), got(n);
  if (o == fc::op::avg) fc::divide_by(want.data(), n, ranks);
  else fc::combine(o, want.data(), b, n);
  fc::check_cuda(cudaMemcpy(got.data(), device, n * sizeof(T), cudaMemcpyDeviceToHost), "download");
  long wrong = 0;
  for (std::size_t i = 0; i < n; ++i) wrong += std::memcmp(static_cast<const void*>(&want[i]), static_cast<const void*>(&got[i]), sizeof(T)) != 0;
  return wrong;
}

struct options {
  std::size_t min_bytes = 4096, max_bytes = std::size_t{256} << 20;
  double factor = 4;
  int iters = 20, warmup = 5, check = 1, ranks = 4;
};

struct buffers {
  void *a = nullptr, *b = nullptr, *c = nullptr;
  cudaStream_t s = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
};

struct verdict {
  double worst_ratio = 1e9, worst_small = 0;
  std::string ratio_where, small_where;
};

// One row: the copy of `bytes`, then flexcomm's kernel aligned and shifted, then the scalar one.
template <class T>
std::string row(fc::op o, std::size_t bytes, const options& opt, const buffers& m, verdict& v) {
  const std::size_t n = bytes / sizeof(T);
  T* a = static_cast<T*>(m.a);
  T* b = static_cast<T*>(m.b);
  const bool divide = o == fc::op::avg;
  const auto ha = values<T>(n + 1, 1), hb = values<T>(n + 1, 2);
  auto upload = [&] {
    fc::check_cuda(cudaMemcpy(a, ha.data(), (n + 1) * sizeof(T), cudaMemcpyHostToDevice), "upload");
    fc::check_cuda(cudaMemcpy(b, hb.data(), (n + 1) * sizeof(T), cudaMemcpyHostToDevice), "upload");
    fc::check_cuda(cudaDeviceSynchronize(), "upload");
  };
  // Shifted: a combine reads in + 1 (aligned differently from inout), a divide works on a + 1.
  auto ours = [&](std::size_t shift) {
    fc::check_cuda(divide ? kn::divide(a + shift, n, opt.ranks, m.s) : kn::combine(o, a, b + shift, n, m.s), "kernel");
  };
  upload();
  const timing copy = measure([&] { fc::check_cuda(cudaMemcpyAsync(m.c, m.a, n * sizeof(T), cudaMemcpyDeviceToDevice, m.s), "copy"); },
                              opt.iters, opt.warmup, m.s, m.start, m.stop);
  const timing vec = measure([&] { ours(0); }, opt.iters, opt.warmup, m.s, m.start, m.stop);
  const timing shifted = measure([&] { ours(1); }, opt.iters, opt.warmup, m.s, m.start, m.stop);
  const timing scalar = measure([&] { scalar_launch(o, a, b, n, opt.ranks, m.s); }, opt.iters, opt.warmup, m.s, m.start, m.stop);
  long wrong = -1;
  if (opt.check && bytes <= (std::size_t{16} << 20)) {
    upload();
    ours(0);
    fc::check_cuda(cudaStreamSynchronize(m.s), "check");
    wrong = count_wrong(o, ha.data(), hb.data(), n, opt.ranks, a);
    upload();
    ours(1);
    fc::check_cuda(cudaStreamSynchronize(m.s), "check");
    wrong += divide ? count_wrong(o, ha.data() + 1, hb.data(), n, opt.ranks, a + 1)
                    : count_wrong(o, ha.data(), hb.data() + 1, n, opt.ranks, a);
  }
  const double moved = static_cast<double>(n * sizeof(T)) * (divide ? 2 : 3), copied = 2.0 * static_cast<double>(n * sizeof(T));
  const double bw_copy = copied / copy.us / 1e3, bw = moved / vec.us / 1e3, bw_shift = moved / shifted.us / 1e3,
               bw_scalar = moved / scalar.us / 1e3;
  const char* op_name = divide ? "divide" : fc::name_of(o);
  std::printf("  %11zu %11zu %8s %6s | %8.2f %8.1f | %8.2f %8.1f %6.3f %7.2f | %8.2f %8.1f %6.3f | %8.2f %8.1f %6.3f %7.2f | %6ld\n",
              n * sizeof(T), n, fc::name_of(fc::dtype_of<T>), op_name, copy.us, bw_copy, vec.us, bw, bw / bw_copy,
              vec.launch_us, shifted.us, bw_shift, bw_shift / bw_copy, scalar.us, bw_scalar, bw_scalar / bw_copy,
              scalar.launch_us, wrong);
  const std::string where = fc::cat(fc::name_of(fc::dtype_of<T>), " ", op_name, " at ", bytes, " B");
  if (bytes >= (std::size_t{16} << 20) && std::min(bw, bw_shift) / bw_copy < v.worst_ratio) {
    v.worst_ratio = std::min(bw, bw_shift) / bw_copy;
    v.ratio_where = where;
  }
  if (bytes <= (std::size_t{1} << 20) && vec.us / scalar.us > v.worst_small) {
    v.worst_small = vec.us / scalar.us;
    v.small_where = where;
  }
  return fc::cat("  {\"size\": ", n * sizeof(T), ", \"count\": ", n, ", \"type\": \"", fc::name_of(fc::dtype_of<T>),
                 "\", \"op\": \"", op_name, "\", \"copy_us\": ", copy.us, ", \"vector_us\": ", vec.us,
                 ", \"shifted_us\": ", shifted.us, ", \"scalar_us\": ", scalar.us, ", \"copy_busbw\": ", bw_copy,
                 ", \"vector_busbw\": ", bw, ", \"shifted_busbw\": ", bw_shift, ", \"scalar_busbw\": ", bw_scalar,
                 ", \"vector_launch_us\": ", vec.launch_us, ", \"scalar_launch_us\": ", scalar.launch_us,
                 ", \"wrong\": ", wrong, "}");
}

void header(const options& opt) {
  cudaDeviceProp prop{};
  int device = 0;
  fc::check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  fc::check_cuda(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  std::printf("# flexcomm device_kernels: %s, %d iters, %d warmup, divide by %d\n", prop.name, opt.iters, opt.warmup, opt.ranks);
  std::printf("# %11s %11s %8s %6s | %-17s | %-33s | %-24s | %-33s |\n", "", "", "", "", "   memcpy D2D", "       vector (aligned alike)",
              "    shifted (in + 1)", "       scalar (before)");
  std::printf("# %11s %11s %8s %6s | %8s %8s | %8s %8s %6s %7s | %8s %8s %6s | %8s %8s %6s %7s | %6s\n", "size", "count", "type",
              "op", "time", "busbw", "time", "busbw", "/copy", "launch", "time", "busbw", "/copy", "time", "busbw", "/copy",
              "launch", "#wrong");
  std::printf("# %11s %11s %8s %6s | %8s %8s | %8s %8s %6s %7s | %8s %8s %6s | %8s %8s %6s %7s | %6s\n", "(B)", "(elements)", "",
              "", "(us)", "(GB/s)", "(us)", "(GB/s)", "", "(us)", "(us)", "(GB/s)", "", "(us)", "(GB/s)", "", "(us)", "");
}
}  // namespace

int main(int argc, char** argv) {
  options opt;
  std::string json;
  po::options_description desc("device_kernels: the reduction kernels against a device-to-device copy");
  desc.add_options()("help,h", "this text")("minbytes,b", benchmark_flags::bytes(&opt.min_bytes, "4K"), "smallest size")(
      "maxbytes,e", benchmark_flags::bytes(&opt.max_bytes, "256M"), "largest size")(
      "stepfactor,f", benchmark_flags::above_one(&opt.factor), "size multiplier")(
      "iters,n", counts::at_least<1>(&opt.iters), "timed iterations")(
      "warmup_iters,w", counts::at_least<0>(&opt.warmup), "warmup iterations")(
      "check,c", counts::at_least<0>(&opt.check), "compare with the host loops (sizes <= 16 MiB)")(
      "ranks,r", counts::at_least<2>(&opt.ranks), "the divide's rank count")(
      "json,J", po::value(&json)->default_value("device_kernels.json"), "JSON output");
  if (const auto status = benchmark_flags::parse(argc, argv, desc, 0)) return *status;
  if (!fc::cuda_device_present()) {
    std::puts("# no CUDA device: nothing to measure");
    return 0;
  }
  opt.min_bytes = std::max<std::size_t>(opt.min_bytes, 16);
  buffers m;
  for (void** p : {&m.a, &m.b, &m.c}) fc::check_cuda(cudaMalloc(p, opt.max_bytes + 64), "cudaMalloc");
  fc::check_cuda(cudaStreamCreateWithFlags(&m.s, cudaStreamNonBlocking), "cudaStreamCreate");
  fc::check_cuda(cudaEventCreate(&m.start), "cudaEventCreate");
  fc::check_cuda(cudaEventCreate(&m.stop), "cudaEventCreate");
  header(opt);
  std::string rows;
  verdict v;
  const fc::op ops[] = {fc::op::sum, fc::op::prod, fc::op::min, fc::op::max, fc::op::avg};  // avg: the divide
  for (std::size_t bytes = opt.min_bytes; bytes <= opt.max_bytes;
       bytes = std::max(bytes + 16, static_cast<std::size_t>(static_cast<double>(bytes) * opt.factor))) {
    for (fc::dtype t : {fc::dtype::f32, fc::dtype::bf16, fc::dtype::f16, fc::dtype::f64, fc::dtype::i32, fc::dtype::i64, fc::dtype::u8})
      for (fc::op o : ops)
        fc::visit_dtype(t, [&](auto x) { rows += fc::cat(rows.empty() ? "" : ",\n", row<decltype(x)>(o, bytes, opt, m, v)); });
  }
  std::printf("# verdict: worst busbw/copy at >= 16 MiB (vector or shifted): %.3f (%s); target >= 0.9\n", v.worst_ratio,
              v.ratio_where.c_str());
  std::printf("# verdict: worst vector/scalar time at <= 1 MiB: %.3f (%s); target <= 1\n", v.worst_small, v.small_where.c_str());
  std::ofstream(json) << "{\"benchmark\": \"device_kernels\", \"iters\": " << opt.iters << ", \"worst_ratio_16M\": "
                      << v.worst_ratio << ", \"worst_small_vs_scalar\": " << v.worst_small << ", \"rows\": [\n"
                      << rows << "\n]}\n";
  for (void* p : {m.a, m.b, m.c}) cudaFree(p);
  cudaEventDestroy(m.start);
  cudaEventDestroy(m.stop);
  cudaStreamDestroy(m.s);
  return 0;
}
